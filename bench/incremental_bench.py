"""Incremental checkpoints: a fine-tune saved again and again, with ``base="latest"`` against without and the peers.

    python -m bench.incremental_bench --target local --root /mnt/xfs --saves 5 --rounds 2
    python -m bench.incremental_bench --target s3 --saves 5 --rounds 2          # JuiceFS S3 gateway on 127.0.0.1

States (``--states``): ``lora``, a frozen bf16 base (``--base-gib``, 1 GiB by default) with fp32 LoRA adapters and
their Adam moments (about 2% of it) that change every save; ``full``, the same tensors all changing every save. Each
engine runs in its own process, which saves the state ``--saves`` times (rounds interleave the engines) and reports
per save: seconds until committed, seconds the caller was blocked, client CPU seconds, bytes sent by the client and
bytes copied in the store; the first save of a run (nothing to compare with) is left out of the medians. Before each
save, outside the clock, the page cache is written back and dropped (``--cache cold``: the same start for every save
and engine; needs root), only written back (``warm``), or left as it is (``unsettled``: saves back to back). Afterwards
each checkpoint but the first is loaded and compared bit for bit after the one before it (its base) was deleted.

Engines: ``fastckpt`` (``fastckpt.torch.async_save``, no base), ``fastckpt-base`` (the same with ``base="latest"``),
``fastckpt-save`` and ``fastckpt-save-base`` (``fastckpt.torch.save``: CPU tensors sent from their memory, no
staging copy), ``fastckpt-dcp`` and ``fastckpt-dcp-base`` (``dcp.save`` through ``fastckpt.torch.dcp.Writer``,
without and with ``base="latest"``), ``dcp``
(``FileSystemWriter``, then ``s5cmd cp`` to S3), ``s3torchconnector`` (its DCP writer; S3 only).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from bench.juicefs import JuiceFSGateway, delete_prefix  # noqa: E402
from bench.spec_worker import answer, run_spec, worker_flag  # noqa: E402
from bench.state_bench import BUCKET, fastckpt_uri, s3_env, s3tc_fs, s5cmd  # noqa: E402

ENGINES = {"local": ["fastckpt", "fastckpt-base", "fastckpt-save", "fastckpt-save-base", "fastckpt-dcp",
                     "fastckpt-dcp-base", "dcp"],
           "s3": ["fastckpt", "fastckpt-base", "fastckpt-save", "fastckpt-save-base", "fastckpt-dcp",
                  "fastckpt-dcp-base", "dcp", "s3torchconnector"]}
HIDDEN, RANK = 2048, 4


def make_state(kind: str, base_gib: float) -> dict[str, Any]:
    """The frozen base (deterministic) and the trained tensors of step 0."""
    import torch

    g = torch.Generator().manual_seed(0)
    layers = max(1, round(base_gib * (1 << 30) / (HIDDEN * HIDDEN * 2)))
    model = {f"layers.{i}.proj.weight": torch.randn(HIDDEN, HIDDEN, generator=g).to(torch.bfloat16)
             for i in range(layers)}
    for name in list(model):
        model[name.replace("weight", "lora_A")] = torch.zeros(RANK, HIDDEN)
        model[name.replace("weight", "lora_B")] = torch.zeros(HIDDEN, RANK)
    trained = [n for n in model if "lora" in n]
    optim = {n: {"exp_avg": torch.zeros_like(model[n]), "exp_avg_sq": torch.zeros_like(model[n]),
                 "step": torch.tensor(0.0)} for n in trained}
    return {"model": model, "optim": {"state": optim, "param_groups": [{"lr": 1e-4, "params": trained}]},
            "step": 0, "kind": kind}


def advance(state: dict[str, Any], step: int) -> None:
    """One step of training: the adapters and their moments change (``full``: every tensor)."""
    import torch

    g = torch.Generator().manual_seed(step)
    for name, t in state["model"].items():
        if "lora" in name:
            t.copy_(torch.randn(t.shape, generator=g))
        elif state["kind"] == "full":
            t.add_(torch.full((1,), 2.0 ** -6, dtype=t.dtype))
    for moments in state["optim"]["state"].values():
        for name in ("exp_avg", "exp_avg_sq"):
            moments[name].copy_(torch.rand(moments[name].shape, generator=g))
        moments["step"].fill_(step)
    state["step"] = step


def fingerprint(state: Any) -> dict[str, str]:
    import xxhash

    from fastckpt.torch.format import flatten
    from fastckpt.torch.staging import byte_view

    return {n: xxhash.xxh3_64_hexdigest(byte_view(t.contiguous())) for n, t in flatten(state)[1].items()}


def save(spec: dict[str, Any], state: Any, name: str, staging: Any) -> dict[str, float]:
    """One save of ``state`` as checkpoint ``name``: seconds blocked and until committed, bytes sent and copied."""
    import torch.distributed.checkpoint as dcp

    engine, total = spec["engine"], sum(t.numel() * t.element_size() for t in _tensors(state).values())
    where = {**spec, "name": f"{spec['name']}/{name}"}
    started = time.perf_counter()
    if engine in ("fastckpt", "fastckpt-base"):
        import fastckpt.torch as ft

        handle = ft.async_save(state, fastckpt_uri(where), staging=staging,
                               base="latest" if engine == "fastckpt-base" else None)
        blocked = time.perf_counter() - started
        result = handle.wait()
        sent, copied = result.sent, result.copied
    elif engine in ("fastckpt-save", "fastckpt-save-base"):
        import fastckpt.torch as ft

        result = ft.save(state, fastckpt_uri(where), base="latest" if engine.endswith("-base") else None)
        blocked = time.perf_counter() - started
        sent, copied = result.sent, result.copied
    elif engine in ("fastckpt-dcp", "fastckpt-dcp-base"):
        from fastckpt.torch.dcp import Writer

        writer = Writer(fastckpt_uri(where), base="latest" if engine.endswith("-base") else None)
        dcp.save(state, storage_writer=writer)
        blocked = time.perf_counter() - started
        assert writer.result is not None
        sent, copied = writer.result.sent, writer.result.copied
    elif engine == "dcp":
        local = os.path.join(spec["root"], where["name"]) if spec["target"] == "local" else \
            os.path.join(spec["scratch"], name)
        dcp.save(state, storage_writer=dcp.FileSystemWriter(local))
        blocked = time.perf_counter() - started
        if spec["target"] == "s3":
            s5cmd(spec, local + "/", f"s3://{BUCKET}/{where['name']}/")
            shutil.rmtree(local)
        sent, copied = total, 0
    elif engine == "s3torchconnector":
        from s3torchconnector.dcp import S3StorageWriter

        writer = S3StorageWriter("us-east-1", f"s3://{BUCKET}/{where['name']}")
        writer.fs = s3tc_fs(spec)
        dcp.save(state, storage_writer=writer)
        blocked = time.perf_counter() - started
        sent, copied = total, 0
    else:
        raise SystemExit(f"unknown engine {engine!r}")
    return {"blocked_s": blocked, "commit_s": time.perf_counter() - started, "sent": sent, "copied": copied}


def _tensors(state: Any) -> dict[str, Any]:
    from fastckpt.torch.format import flatten

    return flatten(state)[1]


def check_after_base_deleted(spec: dict[str, Any], prints: list[dict[str, str]]) -> list[str]:
    """fastckpt engines: each checkpoint after the first, loaded once the one before it is deleted."""
    import asyncio

    import torch.distributed.checkpoint as dcp

    import fastckpt.torch as ft
    from fastckpt import open_store, parse_uri
    from fastckpt.torch.dcp import Reader

    async def remove(uri: str) -> None:
        target = parse_uri(uri)
        async with open_store(target) as store:
            await store.delete_many([m.key async for m in store.list(target.key)])

    problems = []
    for i in range(1, len(prints)):
        asyncio.run(remove(fastckpt_uri({**spec, "name": f"{spec['name']}/step-{i}"})))
        uri = fastckpt_uri({**spec, "name": f"{spec['name']}/step-{i + 1}"})
        if spec["engine"].startswith("fastckpt-dcp"):
            loaded = make_state(spec["state"], spec["base_gib"])
            dcp.load(loaded, storage_reader=Reader(uri))
        else:
            loaded = ft.load(uri)
        if fingerprint(loaded) != prints[i]:
            problems.append(f"step-{i + 1} differs from what was saved")
    return problems


def settle(cache: str) -> None:
    """The page cache before a save: written back (``warm``), and dropped too (``cold``: root only)."""
    if cache in ("warm", "cold"):
        os.sync()
    if cache == "cold":
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3")


def worker(spec: dict[str, Any]) -> dict[str, Any]:
    import resource

    import torch

    import fastckpt.torch as ft

    torch.set_num_threads(max(1, os.cpu_count() or 1))
    state = make_state(spec["state"], spec["base_gib"])
    staging = ft.Staging()
    if spec["engine"].startswith("fastckpt"):
        staging.buffer(sum(t.numel() * t.element_size() for t in _tensors(state).values()) + (64 << 20)).fill_(0)
    saves, prints = [], []
    for step in range(1, spec["saves"] + 1):
        advance(state, step)
        settle(spec["cache"])
        cpu0 = resource.getrusage(resource.RUSAGE_SELF)
        out = save(spec, state, f"step-{step}", staging)
        cpu1 = resource.getrusage(resource.RUSAGE_SELF)
        out["cpu_s"] = cpu1.ru_utime + cpu1.ru_stime - cpu0.ru_utime - cpu0.ru_stime
        saves.append(out)
        prints.append(fingerprint(state))
    problems = check_after_base_deleted(spec, prints) if spec["engine"].startswith("fastckpt") else []
    changed = sum(t.numel() * t.element_size() for n, t in _tensors(state).items()
                  if spec["state"] == "full" or not n.endswith(".weight"))
    return {"saves": saves, "problems": problems, "changed_bytes": changed}


def run_worker(spec: dict[str, Any], env: dict[str, str], gateway: JuiceFSGateway | None) -> dict[str, Any]:
    before = gateway.cpu_seconds() if gateway is not None else 0.0
    result = run_spec("bench.incremental_bench", spec, env, timeout=3600)
    if gateway is not None:
        result["server_cpu_s"] = gateway.cpu_seconds() - before
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", choices=("local", "s3"), default="local")
    ap.add_argument("--root", default=None, help="local target: the directory the checkpoints go to")
    ap.add_argument("--states", default="lora,full")
    ap.add_argument("--base-gib", type=float, default=1.0)
    ap.add_argument("--saves", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--engines", default=None)
    ap.add_argument("--cache", choices=("cold", "warm", "unsettled"), default="cold",
                    help="before each save: written back and dropped (cold, the default), written back (warm), or "
                         "nothing (unsettled: saves back to back)")
    ap.add_argument("--out", default=None)
    worker_flag(ap)
    args = ap.parse_args(argv)
    if args.worker:
        return answer(args.worker, worker)
    engines = args.engines.split(",") if args.engines else ENGINES[args.target]
    work = tempfile.mkdtemp(prefix="fastckpt-incr-bench-")
    root = args.root or os.path.join(work, "store")
    gateway = JuiceFSGateway(os.path.join(work, "juicefs")).start() if args.target == "s3" else None
    env = s3_env(gateway.endpoint) if gateway is not None else {}
    runs = []
    try:
        for rnd in range(args.rounds):
            for kind in args.states.split(","):
                for engine in engines:
                    spec = {"engine": engine, "target": args.target, "state": kind, "base_gib": args.base_gib,
                            "saves": args.saves, "cache": args.cache, "root": root,
                            "scratch": os.path.join(work, "scratch"),
                            "name": f"run-{engine}-{kind}-{rnd}", "endpoint": gateway.endpoint if gateway else ""}
                    os.makedirs(spec["scratch"], exist_ok=True)
                    os.sync()
                    result = run_worker(spec, env, gateway)
                    runs.append({"round": rnd, "state": kind, "engine": engine, **result})
                    shutil.rmtree(os.path.join(root, spec["name"]), ignore_errors=True)
                    if gateway is not None:
                        delete_prefix(gateway.client(), BUCKET, spec["name"])
                    print(f"round {rnd} {kind:4s} {engine:18s} " + (result.get("error", "")[-300:] or
                          " ".join(f"{s['commit_s']:.2f}s" for s in result["saves"])), flush=True)
    finally:
        if gateway is not None:
            gateway.stop()
        shutil.rmtree(work, ignore_errors=True)
    print(summarize(runs, engines, args.states.split(",")))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"target": args.target, "root": root, "base_gib": args.base_gib, "cache": args.cache,
                       "runs": runs}, f, indent=1)
    return 0 if all("error" not in r and not r["problems"] for r in runs) else 1


def summarize(runs: list[dict[str, Any]], engines: list[str], kinds: list[str]) -> str:
    """Markdown table of medians over the saves after the first of every run."""
    lines = ["| state | engine | sent MiB | copied in store MiB | blocked s | save until committed s | client CPU s "
             "| server CPU s / run | loads bit-exact after base deleted |", "|---|---|---|---|---|---|---|---|---|"]
    def med(engine: str, kind: str, key: str) -> float | None:
        vals = [s[key] for r in runs if r["engine"] == engine and r["state"] == kind and "saves" in r
                for s in r["saves"][1:]]
        return statistics.median(vals) if vals else None

    for kind in kinds:
        ref = med("fastckpt", kind, "commit_s")
        for e in engines:
            done = [r for r in runs if r["engine"] == e and r["state"] == kind and "saves" in r]
            commit = med(e, kind, "commit_s")
            if commit is None:
                lines.append(f"| {kind} | {e} | error | | | | | | |")
                continue
            server = [r["server_cpu_s"] for r in done if "server_cpu_s" in r]
            ok = "yes" if all(not r["problems"] for r in done) and e.startswith("fastckpt") else \
                ("no" if e.startswith("fastckpt") else "n/a")
            sent, copied, cpu = (med(e, kind, k) or 0.0 for k in ("sent", "copied", "cpu_s"))
            lines.append(f"| {kind} | {e} | {sent / 2**20:.1f} | {copied / 2**20:.1f} | "
                         f"{med(e, kind, 'blocked_s'):.2f} | {commit:.2f}" + (f" ({ref / commit:.2f}x)" if ref else "")
                         + f" | {cpu:.2f} | " + (f"{statistics.median(server):.1f}" if server else "-") + f" | {ok} |")
        changed = [r["changed_bytes"] for r in runs if r["state"] == kind and "changed_bytes" in r]
        if changed:
            lines.append(f"| {kind} | (changed bytes per save) | {changed[0] / 2**20:.1f} | | | | | | |")
    lines.append("\nMedians over saves 2..N of every run (save 1 has no base). (Nx): fastckpt without base / the "
                 "engine's time until committed.")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
