"""Tensor-state checkpoints from memory: save and load a synthetic LLM training state, fastckpt vs the peers.

    python -m bench.state_bench --target local --params 250M --rounds 3
    python -m bench.state_bench --target s3 --params 250M --rounds 3          # JuiceFS S3 gateway on 127.0.0.1
    python -m bench.state_bench --target s3 --device cuda ...                 # state on the GPU
    python -m bench.state_bench --target s3 --link far ...                    # through an emulated cloud link

The state is a Llama-shaped model (bf16 weights) with fp32 Adam moments, 10 bytes per parameter. Each
engine saves and loads it in its own process, rounds interleaved. Measured per save: ``blocked_s`` (until
training may continue), ``commit_s`` (until the checkpoint is durable and visible), CPU seconds and peak
RSS above the state itself; per load: seconds until the tensors are in memory (and equal to what was
saved). Engines:

- ``fastckpt``: ``fastckpt.torch.async_save`` from a staging area allocated once (as a trainer reuses it),
  ``fastckpt.torch.load`` into the model's tensors.
- ``fastckpt-dcp``: ``dcp.save`` / ``dcp.load`` through ``fastckpt.torch.dcp``.
- ``torch.save``: today's way: ``torch.save`` to local disk, then ``fastckpt.upload``; ``fastckpt.download``
  then ``torch.load``.
- ``dcp``: DCP's ``FileSystemWriter`` / ``FileSystemReader`` on a local directory, with ``s5cmd cp`` to and
  from the S3 target (on a local target the directory is the target).
- ``dcp-fsspec``: DCP's fsspec writer and reader over s3fs (S3 only).
- ``s3torchconnector``: its DCP ``S3StorageWriter`` / ``S3StorageReader`` (S3 only).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import zlib
from dataclasses import asdict
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from bench.juicefs import JuiceFSGateway, delete_prefix  # noqa: E402
from bench.spec_worker import answer, run_spec, worker_flag  # noqa: E402
from bench.worker import vm_hwm_mib  # noqa: E402
from harness.link import PROFILES, LinkProcess  # noqa: E402

ENGINES = {"local": ["fastckpt", "fastckpt-dcp", "torch.save", "dcp"],
           "s3": ["fastckpt", "fastckpt-dcp", "torch.save", "dcp", "dcp-fsspec", "s3torchconnector"]}
BUCKET = "bench"
HIDDEN, INTER, VOCAB = 1024, 2816, 32000


# ----------------------------------------------------------------------------- the state


def layout(params: int) -> dict[str, tuple[int, ...]]:
    """Parameter shapes of a Llama-like model with about ``params`` parameters."""
    shapes: dict[str, tuple[int, ...]] = {"embed.weight": (VOCAB, HIDDEN), "lm_head.weight": (VOCAB, HIDDEN)}
    per_layer = 4 * HIDDEN * HIDDEN + 3 * HIDDEN * INTER + 2 * HIDDEN
    for i in range(max(1, (params - 2 * VOCAB * HIDDEN) // per_layer)):
        p = f"layers.{i}."
        for n in ("q", "k", "v", "o"):
            shapes[f"{p}attn.{n}.weight"] = (HIDDEN, HIDDEN)
        shapes[f"{p}mlp.gate.weight"] = shapes[f"{p}mlp.up.weight"] = (INTER, HIDDEN)
        shapes[f"{p}mlp.down.weight"] = (HIDDEN, INTER)
        shapes[f"{p}norm1.weight"] = shapes[f"{p}norm2.weight"] = (HIDDEN,)
    return shapes


_SOURCE: Any = None


def _values(name: str, n: int, dtype: Any, device: str) -> Any:
    """``n`` deterministic pseudo-random values for tensor ``name`` (a window of one random block: cheap)."""
    import torch

    global _SOURCE
    if _SOURCE is None:
        _SOURCE = torch.randn(1 << 24, generator=torch.Generator().manual_seed(0))
    start = zlib.crc32(name.encode()) % (len(_SOURCE) // 2)
    out = torch.empty(n, dtype=dtype, device=device)
    pos = 0
    while pos < n:
        take = min(n - pos, len(_SOURCE) - start)
        out[pos:pos + take].copy_(_SOURCE[start:start + take])
        pos, start = pos + take, 0
    return out


def make_state(params: int, device: str, zeros: bool = False) -> dict[str, Any]:
    """The training state: bf16 model, fp32 Adam moments, step and scalars (zeros: a load target)."""
    import torch

    def t(name: str, shape: tuple[int, ...], dtype: Any) -> Any:
        n = 1
        for s in shape:
            n *= s
        if zeros:
            return torch.zeros(shape, dtype=dtype, device=device)
        return _values(name, n, dtype, device).view(shape)

    shapes = layout(params)
    model = {k: t(k, s, torch.bfloat16) for k, s in shapes.items()}
    state = {i: {"step": torch.tensor(100.0), "exp_avg": t(f"{k}.m", s, torch.float32),
                 "exp_avg_sq": t(f"{k}.v", s, torch.float32).abs()} for i, (k, s) in enumerate(shapes.items())}
    return {"model": model, "optim": {"state": state, "param_groups": [{"lr": 3e-4, "params": list(state)}]},
            "step": 100}


def tensors_of(state: Any) -> dict[str, Any]:
    """The state's tensors by key path (the names fastckpt.torch stores them under)."""
    from fastckpt.torch.format import flatten

    return flatten(state)[1]


def state_bytes(state: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors_of(state).values())


def check_loaded(loaded: Any, params: int, device: str) -> list[str]:
    """Problems with a loaded state: a sample of its tensors compared exactly with what was saved."""
    import torch

    expected = make_state(params, "cpu")
    problems = []
    got, want = tensors_of(loaded), tensors_of(expected)
    if got.keys() != want.keys():
        return [f"{len(got)} tensors loaded, {len(want)} saved, or under other names"]
    names = list(want)
    for name in dict.fromkeys([names[0], names[1], names[len(names) // 2], names[-1]]):
        if not torch.equal(got[name].cpu(), want[name]):
            problems.append(f"tensor {name} differs")
    if loaded.get("step") != 100:
        problems.append(f"step is {loaded.get('step')!r}")
    return problems


# ----------------------------------------------------------------------------- engines (in the worker)


def s3_env(endpoint: str) -> dict[str, str]:
    from bench.juicefs import ACCESS_KEY, SECRET_KEY

    return {"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY, "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_REGION": "us-east-1", "AWS_REQUEST_CHECKSUM_CALCULATION": "when_required",
            "AWS_RESPONSE_CHECKSUM_VALIDATION": "when_required", "FSSPEC_S3_ENDPOINT_URL": endpoint,
            "FASTCKPT_S3_IF_ABSENT": "best-effort"}  # the gateway ignores If-None-Match (bench/juicefs.py)


def s3fs_with_md5(endpoint: str) -> None:
    """Make fsspec's cached s3fs instance for the gateway send Content-MD5 on DeleteObjects (the gateway
    requires it; s3fs only sends the newer checksums), so DCP's fsspec writer can rename its metadata file."""
    import base64
    import hashlib

    import s3fs

    fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": endpoint})
    fs.connect()

    def add_md5(params: dict[str, Any], **_: Any) -> None:
        body = params.get("body") or b""
        params["headers"]["Content-MD5"] = base64.b64encode(hashlib.md5(body).digest()).decode()

    fs.s3.meta.events.register("before-call.s3.DeleteObjects", add_md5)


def fastckpt_uri(spec: dict[str, Any], file: str = "") -> str:
    """URI of the checkpoint (or of ``file`` in it) in the target."""
    name = f"{spec['name']}/{file}" if file else spec["name"]
    if spec["target"] == "local":
        return os.path.join(spec["root"], name)
    return f"s3://{BUCKET}/{name}?endpoint_override={spec['endpoint']}"


def s5cmd(spec: dict[str, Any], src: str, dst: str) -> None:
    from bench.engines import S5CMD_ARGS, s5cmd_path

    subprocess.run([s5cmd_path(), "--endpoint-url", spec["endpoint"], "cp", *S5CMD_ARGS, src, dst],
                   check=True, capture_output=True)


def s3tc_fs(spec: dict[str, Any]) -> Any:
    """s3torchconnector's filesystem pointed at the gateway (its DCP classes take no endpoint themselves)."""
    from s3torchconnector import S3ClientConfig
    from s3torchconnector._s3client import S3Client
    from s3torchconnector.dcp.s3_file_system import S3FileSystem

    client = S3Client("us-east-1", endpoint=spec["endpoint"], s3client_config=S3ClientConfig(force_path_style=True))
    return S3FileSystem("us-east-1", s3_client=client)


def save(spec: dict[str, Any], state: Any) -> dict[str, float]:
    """Save ``state`` with ``spec["engine"]``: blocked and committed seconds."""
    import torch
    import torch.distributed.checkpoint as dcp

    engine, scratch = spec["engine"], spec["scratch"]
    started = time.perf_counter()
    if engine == "fastckpt":
        import fastckpt.torch as ft

        handle = ft.async_save(state, fastckpt_uri(spec), staging=spec["_staging"])
        blocked = time.perf_counter() - started
        handle.wait()
    elif engine == "fastckpt-dcp":
        from fastckpt.torch.dcp import Writer

        dcp.save(state, storage_writer=Writer(fastckpt_uri(spec)))
        blocked = time.perf_counter() - started
    elif engine == "torch.save":
        import fastckpt

        path = os.path.join(scratch, "state.pt")
        torch.save(state, path)
        blocked = time.perf_counter() - started
        fastckpt.upload(path, fastckpt_uri(spec, "state.pt"))
    elif engine == "dcp":
        local = os.path.join(spec["root"], spec["name"]) if spec["target"] == "local" else os.path.join(scratch, "d")
        dcp.save(state, storage_writer=dcp.FileSystemWriter(local))
        blocked = time.perf_counter() - started
        if spec["target"] == "s3":
            s5cmd(spec, local + "/", f"s3://{BUCKET}/{spec['name']}/")
    elif engine == "dcp-fsspec":
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

        s3fs_with_md5(spec["endpoint"])
        dcp.save(state, storage_writer=FsspecWriter(f"s3://{BUCKET}/{spec['name']}",
                                                     client_kwargs={"endpoint_url": spec["endpoint"]}))
        blocked = time.perf_counter() - started
    elif engine == "s3torchconnector":
        from s3torchconnector.dcp import S3StorageWriter

        writer = S3StorageWriter("us-east-1", f"s3://{BUCKET}/{spec['name']}")
        writer.fs = s3tc_fs(spec)
        dcp.save(state, storage_writer=writer)
        blocked = time.perf_counter() - started
    else:
        raise SystemExit(f"unknown engine {engine!r}")
    return {"blocked_s": blocked, "commit_s": time.perf_counter() - started}


def load(spec: dict[str, Any], target: Any) -> tuple[Any, float]:
    """Load the state saved under ``spec["name"]``: (state, seconds)."""
    import torch
    import torch.distributed.checkpoint as dcp

    engine, scratch = spec["engine"], spec["scratch"]
    started = time.perf_counter()
    if engine == "fastckpt":
        import fastckpt.torch as ft

        target = ft.load(fastckpt_uri(spec), state_dict=target)
    elif engine == "fastckpt-dcp":
        from fastckpt.torch.dcp import Reader

        dcp.load(target, storage_reader=Reader(fastckpt_uri(spec)))
    elif engine == "torch.save":
        import fastckpt

        path = os.path.join(scratch, "state.pt")
        fastckpt.download(fastckpt_uri(spec, "state.pt"), path)
        target = torch.load(path, map_location=spec["device"])
    elif engine == "dcp":
        local = os.path.join(spec["root"], spec["name"]) if spec["target"] == "local" else os.path.join(scratch, "d")
        if spec["target"] == "s3":
            s5cmd(spec, f"s3://{BUCKET}/{spec['name']}/*", local + "/")
        dcp.load(target, storage_reader=dcp.FileSystemReader(local))
    elif engine == "dcp-fsspec":
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

        dcp.load(target, storage_reader=FsspecReader(f"s3://{BUCKET}/{spec['name']}",
                                                      client_kwargs={"endpoint_url": spec["endpoint"]}))
    elif engine == "s3torchconnector":
        from s3torchconnector.dcp import S3StorageReader

        reader = S3StorageReader("us-east-1", f"s3://{BUCKET}/{spec['name']}")
        reader.fs = s3tc_fs(spec)
        dcp.load(target, storage_reader=reader)
    return target, time.perf_counter() - started


def warm_imports(spec: dict[str, Any]) -> None:
    """Import what the engine uses before the clock starts (a trainer has imported it long before it saves)."""
    import importlib

    modules = {"fastckpt": ["fastckpt.torch"], "fastckpt-dcp": ["fastckpt.torch.dcp"],
               "torch.save": ["fastckpt"], "dcp": ["torch.distributed.checkpoint"],
               "dcp-fsspec": ["torch.distributed.checkpoint._fsspec_filesystem", "s3fs"],
               "s3torchconnector": ["s3torchconnector.dcp"]}[spec["engine"]]
    if spec["target"] == "s3" and spec["engine"].startswith(("fastckpt", "torch.save")):
        modules.append("fastckpt.stores.s3")
    for name in ["torch.distributed.checkpoint", *modules]:
        importlib.import_module(name)


def worker(spec: dict[str, Any]) -> dict[str, Any]:
    """One save or load in this process; the state is built and the engine imported before the clock starts."""
    import resource

    import torch

    warm_imports(spec)

    torch.set_num_threads(max(1, os.cpu_count() or 1))
    state = make_state(spec["params"], spec["device"], zeros=spec["op"] == "load")
    if spec["engine"] == "fastckpt" and spec["op"] == "save":
        import fastckpt.torch as ft

        staging = ft.Staging()
        staging.buffer(state_bytes(state)).fill_(0)  # allocated and touched once, as a trainer reuses it
        spec["_staging"] = staging
    base_rss = vm_hwm_mib()
    cpu0 = resource.getrusage(resource.RUSAGE_SELF)
    out: dict[str, Any] = {"state_gib": state_bytes(state) / (1 << 30)}
    loaded = None
    if spec["op"] == "save":
        out.update(save(spec, state))
    else:
        loaded, out["load_s"] = load(spec, state)
    cpu1 = resource.getrusage(resource.RUSAGE_SELF)
    out["cpu_s"] = cpu1.ru_utime + cpu1.ru_stime - cpu0.ru_utime - cpu0.ru_stime
    out["extra_rss_mib"] = vm_hwm_mib() - base_rss
    if loaded is not None:
        out["problems"] = check_loaded(loaded, spec["params"], spec["device"])
    if spec["engine"] == "fastckpt" and spec["op"] == "save":
        out["copy_s"] = bare_copy_s(state, spec["_staging"])
    return out


def bare_copy_s(state: Any, staging: Any) -> float:
    """The floor of blocked time: ``copy_`` of every tensor into the (warm, pinned) staging memory."""
    import torch

    area = staging.buffer(state_bytes(state))
    started = time.perf_counter()
    pos, devices = 0, set()
    for t in tensors_of(state).values():
        n = t.numel() * t.element_size()
        area[pos:pos + n].view(t.dtype).view(t.shape).copy_(t, non_blocking=t.device.type != "cpu")
        devices.add(t.device)
        pos += n
    for d in devices:
        if d.type == "cuda":
            torch.cuda.synchronize(d)
    return time.perf_counter() - started


# ----------------------------------------------------------------------------- the driver


def timed_worker(spec: dict[str, Any], env: dict[str, str], gateway: JuiceFSGateway | None,
                 link: str | None = None) -> dict[str, Any]:
    """``run_spec``, plus the CPU seconds the S3 server spent meanwhile (it shares the host's cores); with
    ``link``, through a fresh emulated link of that profile (its request count recorded)."""
    before = gateway.cpu_seconds() if gateway is not None else 0.0
    if link and gateway is not None:
        with LinkProcess(int(gateway.endpoint.rsplit(":", 1)[1]), link) as emulator:
            out = run_spec("bench.state_bench", {**spec, "endpoint": emulator.url}, {**env, **s3_env(emulator.url)})
        out["requests"] = emulator.stats.get("requests")
    else:
        out = run_spec("bench.state_bench", spec, env)
    if gateway is not None:
        out["server_cpu_s"] = gateway.cpu_seconds() - before
    return out


def clear(spec: dict[str, Any], gateway: JuiceFSGateway | None) -> None:
    shutil.rmtree(os.path.join(spec["root"], spec["name"]), ignore_errors=True)
    shutil.rmtree(spec["scratch"], ignore_errors=True)
    os.makedirs(spec["scratch"], exist_ok=True)
    if gateway is not None:
        delete_prefix(gateway.client(), BUCKET, spec["name"])
    os.sync()  # no engine pays for writing back what the one before it left in the page cache


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", choices=("local", "s3"), default="local")
    ap.add_argument("--params", default="250M", help="model parameters (10 bytes of state each), e.g. 250M, 1G")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--engines", default=None, help="comma-separated subset of " + ", ".join(ENGINES["s3"]))
    ap.add_argument("--link", choices=sorted(PROFILES), default=None,
                    help="every save and load through the link emulator with this profile (harness/link.py; s3 only)")
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    worker_flag(ap)
    args = ap.parse_args(argv)
    if args.worker:
        return answer(args.worker, worker)
    if args.device == "cuda":
        from bench.gpu import require_device

        require_device("cuda")
    engines = args.engines.split(",") if args.engines else ENGINES[args.target]
    unknown = set(engines) - set(ENGINES[args.target])
    if unknown:
        raise SystemExit(f"engines {sorted(unknown)} do not run on target {args.target}")
    params = {"K": 1000, "M": 10**6, "G": 10**9}.get(args.params[-1:], 1) * int(float(args.params.rstrip("KMG")))
    work = args.workdir or tempfile.mkdtemp(prefix="fastckpt-state-bench-")
    gateway = JuiceFSGateway(os.path.join(work, "juicefs")).start() if args.target == "s3" else None
    env = s3_env(gateway.endpoint) if gateway is not None else {}
    runs: list[dict[str, Any]] = []
    try:
        for rnd in range(args.rounds):
            for engine in engines:
                spec = {"engine": engine, "target": args.target, "params": params, "device": args.device,
                        "root": os.path.join(work, "store"), "scratch": os.path.join(work, "scratch"),
                        "name": f"ckpt-{engine.replace('.', '-')}", "endpoint": gateway.endpoint if gateway else ""}
                clear(spec, gateway)
                saved = timed_worker({**spec, "op": "save"}, env, gateway, args.link)
                loaded = timed_worker({**spec, "op": "load"}, env, gateway, args.link) if "error" not in saved \
                    else {"error": "not saved"}
                runs.append({"round": rnd, "engine": engine, "save": saved, "load": loaded})
                print(f"round {rnd} {engine:18s} save {fmt(saved, 'blocked_s')} / {fmt(saved, 'commit_s')}  "
                      f"load {fmt(loaded, 'load_s')}", flush=True)
    finally:
        if gateway is not None:
            gateway.stop()
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)
    table = summarize(runs, engines)
    print(table)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"target": args.target, "params": params, "device": args.device, "runs": runs,
                       "link": args.link and asdict(PROFILES[args.link])}, f, indent=1)
    return 0 if all("error" not in r["save"] and "error" not in r["load"] and not r["load"].get("problems")
                    for r in runs) else 1


def fmt(result: dict[str, Any], key: str) -> str:
    if "error" in result:
        return "ERROR " + result["error"].strip().splitlines()[-1][:160]
    return f"{result[key]:.2f}s"


def summarize(runs: list[dict[str, Any]], engines: list[str]) -> str:
    """Markdown table of medians, with each peer's time as a multiple of fastckpt's."""
    def med(engine: str, op: str, key: str) -> float | None:
        vals = [r[op][key] for r in runs if r["engine"] == engine and key in r[op] and not r[op].get("problems")]
        return statistics.median(vals) if vals else None

    ref = {k: med("fastckpt", op, k) for op, k in (("save", "blocked_s"), ("save", "commit_s"), ("load", "load_s"))}
    lines = ["| engine | blocked s | save until committed s | load s | save CPU s (+ server) | load CPU s (+ server) "
             "| save extra RSS MiB | load extra RSS MiB |", "|---|---|---|---|---|---|---|---|"]
    for e in engines:
        cells = []
        for op, key in (("save", "blocked_s"), ("save", "commit_s"), ("load", "load_s")):
            v = med(e, op, key)
            r = ref[key]
            cells.append("error" if v is None else f"{v:.2f}" + (f" ({v / r:.2f}x)" if r and e != "fastckpt" else ""))
        for op, key in (("save", "cpu_s"), ("load", "cpu_s")):
            v, server = med(e, op, key), med(e, op, "server_cpu_s")
            cells.append("error" if v is None else f"{v:.1f}" + (f" + {server:.1f}" if server is not None else ""))
        for op, key in (("save", "extra_rss_mib"), ("load", "extra_rss_mib")):
            v = med(e, op, key)
            cells.append("error" if v is None else f"{v:.0f}")
        lines.append(f"| {e} | " + " | ".join(cells) + " |")
    copy = med("fastckpt", "save", "copy_s")
    if copy:
        lines.append(f"\nbare tensor.copy_() into the staging memory: {copy:.2f} s; fastckpt blocked "
                     f"{(ref['blocked_s'] or 0) / copy:.2f}x of it. Ratios in brackets: the peer's time / fastckpt's. "
                     "Extra RSS: peak above the process once its state (and fastckpt's staging) exists.")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
