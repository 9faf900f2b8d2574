"""``fastckpt demo``: write a synthetic sharded checkpoint, upload it, download it back, verify it."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass

from .checkpoint import SyncCheckpointWriter, download_checkpoint, verify
from .checkpoint.attempt import new_attempt_id
from .config import TransferConfig
from .engine.progress import ProgressCallback

__all__ = ["DemoResult", "make_checkpoint", "run_demo", "write_random"]

_BLOCK = 8 << 20


def write_random(path: str, size: int) -> None:
    """Write ``size`` pseudo-random (incompressible) bytes to ``path``."""
    seed = os.urandom(_BLOCK)
    with open(path, "wb") as f:
        left, i = size, 0
        while left > 0:
            n = min(left, _BLOCK)
            block = seed if i % 2 == 0 else os.urandom(min(n, _BLOCK))
            f.write(memoryview(block)[:n])
            left -= n
            i += 1


def make_checkpoint(root: str, size: int, shards: int = 4) -> dict[str, int]:
    """A sharded checkpoint of about ``size`` bytes: model shards, an optimizer shard, small JSON files."""
    files: dict[str, int] = {}
    model = size * 2 // 3
    for i in range(shards):
        files[f"model-{i + 1:05d}-of-{shards:05d}.safetensors"] = model // shards
    files["optim/rank_00.pt"] = size - model - 4096
    os.makedirs(os.path.join(root, "optim"), exist_ok=True)
    for rel, n in files.items():
        write_random(os.path.join(root, rel), n)
    meta = {"config.json": {"model_type": "llama", "hidden_size": 4096}, "trainer_state.json": {"step": 1000}}
    for rel, body in meta.items():
        with open(os.path.join(root, rel), "w") as f:
            json.dump(body, f)
        files[rel] = os.path.getsize(os.path.join(root, rel))
    return files


@dataclass(frozen=True)
class DemoResult:
    """Sizes and timings of one demo run."""

    files: int
    bytes: int
    upload_s: float
    download_s: float
    verified: bool
    store: str

    def summary(self) -> dict[str, object]:
        """JSON-friendly summary with throughputs in MiB/s."""
        mib = self.bytes / (1 << 20)
        return {"files": self.files, "bytes": self.bytes, "store": self.store, "verified": self.verified,
                "upload_s": round(self.upload_s, 3), "download_s": round(self.download_s, 3),
                "upload_mib_s": round(mib / self.upload_s, 1), "download_mib_s": round(mib / self.download_s, 1)}


def run_demo(size: int, workdir: str | None = None, config: TransferConfig | None = None,
             progress: Callable[[str], ProgressCallback | None] | None = None) -> DemoResult:
    """Generate, commit as a checkpoint to a local directory store, download back and verify; clean up."""
    base = tempfile.mkdtemp(prefix="fastckpt-demo-", dir=workdir)
    try:
        src, restored = os.path.join(base, "checkpoint"), os.path.join(base, "restored")
        store = "file://" + os.path.join(base, "store", "experiments", "checkpoint_000001")
        files = make_checkpoint(src, size)
        t0 = time.perf_counter()
        with SyncCheckpointWriter(store, attempt=new_attempt_id(), config=config,
                                  progress=progress("upload") if progress else None) as ckpt:
            up = ckpt.put_dir(src)
        t1 = time.perf_counter()
        down = download_checkpoint(store, restored, config=config,
                                   progress=progress("download") if progress else None)
        t2 = time.perf_counter()
        sent = {os.path.relpath(r.path, src): r.digest for r in up}
        got = {os.path.relpath(r.path, restored): r.digest for r in down}
        ok = sent == got and len(got) == len(files) and verify(store, config=config).ok
        return DemoResult(len(files), sum(files.values()), t1 - t0, t2 - t1, ok, store)
    finally:
        shutil.rmtree(base, ignore_errors=True)
