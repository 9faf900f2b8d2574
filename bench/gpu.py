"""GPU host mode: a checkpoint that starts as tensors on the device, saved to storage.

- ``fastckpt``: device -> pinned host buffers (allocated and touched once, untimed, as a trainer reuses them) with
  ``non_blocking`` copies on a side stream, one stream sync (the training loop is blocked only until
  here), then the host bytes are written as safetensors files (zero-copy views) and uploaded with fastckpt.
- ``torch.save``: ``torch.save`` of each shard's device tensors to a local file (blocking the loop),
  then uploaded with ``pyarrow.fs.copy_files`` (Ray's default path).

``--device cpu`` runs the same code with ordinary host tensors, so the path is exercised without a GPU.
"""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import asdict
from typing import Any

from bench.engines import PEER_CHUNK, HashMeter, fastckpt_config, pyarrow_s3
from bench.generate import RandomWriter, TensorSpec, plan_checkpoint, write_safetensors

ENGINES = ("fastckpt", "torch.save")


def require_device(device: str) -> None:
    """Raise ``SystemExit`` with a clear message when ``device`` cannot be used here."""
    if device not in ("cpu", "cuda"):
        raise SystemExit(f"--device must be cpu or cuda, not {device!r}")
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise SystemExit(f"--device cuda needs a CUDA GPU, but torch {torch.__version__} sees none "
                             f"(torch.version.cuda={torch.version.cuda}); run with --device cpu on this host")


def tensor_files(size: int) -> list[tuple[str, tuple[TensorSpec, ...]]]:
    """(relative path, tensors) of the synthetic checkpoint's safetensors files."""
    return [(f.rel, f.tensors) for f in plan_checkpoint(size).files if f.tensors]


def _dtype(name: str) -> Any:
    import torch

    return {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "I64": torch.int64}[name]


def make_tensors(files: list[tuple[str, tuple[TensorSpec, ...]]], device: str, seed: int) -> dict[str, dict[str, Any]]:
    """Random tensors with the checkpoint's shapes on ``device``."""
    import torch

    rnd = RandomWriter(seed)
    out: dict[str, dict[str, Any]] = {}
    for rel, specs in files:
        group = {}
        for spec in specs:
            if device == "cuda":
                raw = torch.empty(spec.nbytes, dtype=torch.uint8, device="cuda").random_(0, 256)
            else:
                raw = torch.from_numpy(rnd.bytes(spec.nbytes))
            group[spec.name] = raw.view(_dtype(spec.dtype)).reshape(spec.shape)
        out[rel] = group
    if device == "cuda":
        torch.cuda.synchronize()
    return out


def _bytes_view(tensor: Any) -> memoryview:
    import torch

    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy())


def _remote(spec: dict[str, Any]) -> tuple[str, Any]:
    """(fastckpt URI, (pyarrow filesystem factory, path)) of the run's destination."""
    from pyarrow import fs

    if spec["target"] == "local":
        return "file://" + os.path.abspath(spec["dst"]), (fs.LocalFileSystem, spec["dst"])
    endpoint, bucket = spec["s3"]["endpoint"], spec["s3"]["bucket"]
    prefix = spec["dst"].strip("/")
    return (f"s3://{bucket}/{prefix}?endpoint_override={endpoint}",
            (lambda: pyarrow_s3(endpoint), f"{bucket}/{prefix}"))


def _check(files: list[tuple[str, tuple[TensorSpec, ...]]], tensors: dict[str, dict[str, Any]], staging: str,
           suffix: str) -> list[str]:
    """Compare the first and last tensor of every staged file with the device tensors."""
    import torch

    problems = []
    for rel, specs in files:
        path = os.path.join(staging, *rel.removesuffix(".safetensors").split("/")) + suffix
        if suffix == ".pt":
            loaded = torch.load(path, mmap=True, weights_only=True)
            get = loaded.__getitem__
        else:
            from safetensors import safe_open

            handle = safe_open(path, framework="pt")
            get = handle.get_tensor
        for spec in {specs[0], specs[-1]}:
            want = tensors[rel][spec.name].cpu()
            if not torch.equal(get(spec.name).reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8)):
                problems.append(f"{rel}: tensor {spec.name} differs from the device copy")
    return problems


def prepare(spec: dict[str, Any]) -> Any:
    """Untimed setup of one GPU-mode run (``bench.worker`` calls it for ``direction == "gpu"``)."""
    import torch

    require_device(spec["device"])
    cuda = spec["device"] == "cuda"
    files = tensor_files(spec["bytes"])
    tensors = make_tensors(files, spec["device"], spec.get("seed", 0))
    staging = spec["staging"]
    os.makedirs(staging, exist_ok=True)
    uri, (make_fs, pa_path) = _remote(spec)

    if spec["engine"] == "fastckpt":
        import fastckpt

        config = fastckpt_config(spec.get("knobs", {}))
        meter = HashMeter()
        meter.install()
        t_alloc = time.perf_counter()
        host = {rel: {name: torch.empty(t.shape, dtype=t.dtype, pin_memory=cuda) for name, t in group.items()}
                for rel, group in tensors.items()}
        for rel, group in tensors.items():  # touch every page once, as buffers reused across checkpoints are
            for name, t in group.items():
                host[rel][name].copy_(t)
        alloc_s = time.perf_counter() - t_alloc
        stream = torch.cuda.Stream() if cuda else None

        def run() -> dict[str, Any]:
            t0 = time.perf_counter()
            if cuda:
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    for rel, group in tensors.items():
                        for name, t in group.items():
                            host[rel][name].copy_(t, non_blocking=True)
                stream.synchronize()
            else:
                for rel, group in tensors.items():
                    for name, t in group.items():
                        host[rel][name].copy_(t)
            blocked = time.perf_counter() - t0
            for rel, specs in files:
                path = os.path.join(staging, *rel.split("/"))
                os.makedirs(os.path.dirname(path), exist_ok=True)
                write_safetensors(path, specs, lambda f, s, rel=rel: f.write(_bytes_view(host[rel][s.name])))
            staged = time.perf_counter() - t0
            fastckpt.upload(staging, uri, config=config)
            return {"blocked_s": blocked, "d2h_s": blocked, "staged_s": staged, "pinned_alloc_s": alloc_s,
                    "pinned": cuda, "config": asdict(config),
                    "hash_cpu_s": meter.seconds, "hash_calls": meter.calls, "hash_includes_read": meter.includes_read,
                    "check": lambda: _check(files, tensors, staging, ".safetensors")}

        return run

    if spec["engine"] == "torch.save":
        from pyarrow import fs

        def run() -> dict[str, Any]:
            t0 = time.perf_counter()
            for rel, _ in files:
                path = os.path.join(staging, *rel.removesuffix(".safetensors").split("/")) + ".pt"
                os.makedirs(os.path.dirname(path), exist_ok=True)
                torch.save(tensors[rel], path)
            blocked = time.perf_counter() - t0
            fs.copy_files(staging, pa_path, source_filesystem=fs.LocalFileSystem(), destination_filesystem=make_fs(),
                          chunk_size=PEER_CHUNK, use_threads=True)
            return {"blocked_s": blocked, "staged_s": blocked, "check": lambda: _check(files, tensors, staging, ".pt")}

        return run
    raise ValueError(f"unknown GPU-mode engine {spec['engine']!r}; choose from {ENGINES}")


def clean(*paths: str) -> None:
    """Remove local directories of a finished run."""
    for path in paths:
        shutil.rmtree(path, ignore_errors=True)
