"""Checkpoint tiers: saves into a node's memory tier drained by the node agent, against today's ``async_save`` and
DCP's ``async_save``; restores from the tier, from the durable store, after the trainer was killed.

    python -m bench.tier_bench --gib 2 --ranks 2 --saves 5 --rounds 2 --kills 20

The durable store is the JuiceFS S3 gateway on 127.0.0.1; nodes are simulated by one tier directory per rank below
``--tier-root`` (``/dev/shm`` by default) and the agent each rank's save starts there. The state (``--gib`` in all,
split over ``--ranks`` gloo processes) is bf16 tensors of 64 MiB. Each save job saves ``--saves`` times back to back
(one job per engine and round, rounds interleaved) and reports per rank and save: seconds training was blocked, until
safe in the tier (``wait()``), until committed in the durable store, against a bare ``copy_()`` of the same tensors into
memory allocated once, timed just before each save (all ranks copying at once, as they save at once). Engines:
``fastckpt-tier`` (``async_save(..., tier=)``), ``fastckpt`` (``async_save`` to S3), ``dcp-async`` (``dcp.async_save``
through ``fastckpt.torch.dcp.Writer``), ``fastckpt-tier-peer`` (``async_save(..., tier=, replicas=1)``: each rank's copy
also sent to the other node's tier), ``dcp-async-cached`` (``dcp-async`` with one
``Writer(cache_staged_state_dict=True)`` for every save of the job), ``dcp-tier`` (``dcp.async_save`` through one
``Writer(tier=, cache_staged_state_dict=True)``, committed on the coordinator's node, durable once ``wait_durable()``
returned there).

Restores (each rank in its own process, the page cache written back and dropped first: cold): (b) a restart on the
same node (``load(..., tier=)``, served by the tier), (c) a node whose tier was wiped (the same call, served by the
durable store), today's ``load`` from S3 and ``dcp.load`` through fastckpt's ``Reader``; after ``fastckpt-tier-peer``
saves, node 0's tier wiped and ``restore_tier`` + ``load(..., tier=)`` (rank 0's copy from node 1's tier); after
``dcp-tier`` saves, ``dcp.load`` through ``Reader(uri, tier=)`` (each rank's file from its node's tier). (a)
``--kills`` times: a save job whose ranks save once, then again and SIGKILL themselves as soon as ``wait()`` returned
(the second save, into the tier's recycled files, is handed to the agent before it is committed in the tier); the
checkpoint must then be committed by the agents and load bit-exact from the durable store (lost otherwise), and the
restore from the tier is timed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from bench.juicefs import JuiceFSGateway, delete_prefix  # noqa: E402
from bench.state_bench import BUCKET, s3_env  # noqa: E402

ENGINES = ["fastckpt-tier", "fastckpt", "dcp-async", "fastckpt-tier-peer", "dcp-tier", "dcp-async-cached"]
TENSOR = 64 << 20


def make_state(rank: int, nbytes: int, step: int) -> dict[str, Any]:
    """Rank ``rank``'s state: bf16 tensors of ``TENSOR`` bytes (random finite values, seeded; named by rank, so that
    DCP saves each rank's, not rank 0's alone), and the step."""
    import torch

    g = torch.Generator().manual_seed(rank)
    count = max(1, nbytes // TENSOR)
    model = {f"rank{rank}.layers.{i}.weight": torch.randint(0, 256, (TENSOR,), dtype=torch.uint8, generator=g)
             .view(torch.int16).bitwise_and_(0x3FFF).view(torch.bfloat16).view(4096, TENSOR // 8192)
             for i in range(count)}  # finite values (no NaN bit patterns)
    return {"model": model, "step": step}


def advance(state: dict[str, Any], step: int) -> None:
    """A training step: one element of every tensor changes."""
    for t in state["model"].values():
        t.view(-1)[step % t.numel()] += 1
    state["step"] = step


def fingerprint(state: dict[str, Any]) -> str:
    import xxhash

    from fastckpt.torch.staging import byte_view

    h = xxhash.xxh3_128()
    for name in sorted(state["model"]):
        h.update(name.encode())
        h.update(byte_view(state["model"][name].contiguous()))
    h.update(str(state["step"]).encode())
    return h.hexdigest()


def uri_of(spec: dict[str, Any], name: str) -> str:
    return f"s3://{BUCKET}/{name}?endpoint_override={spec['endpoint']}"


def settle() -> None:
    """Write back and drop the page cache (root only; the tier, in tmpfs, stays)."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3")
    except OSError:
        pass


# ----------------------------------------------------------------------------- one rank


def rank_worker(spec: dict[str, Any], rank: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    import fastckpt.torch as ft
    from fastckpt.torch.dcp import Reader, Writer

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(spec["port"]))
    dist.init_process_group("gloo", rank=rank, world_size=spec["ranks"])
    torch.set_num_threads(1)
    tier, engine = spec["tiers"][rank], spec["engine"]
    state = make_state(rank, spec["bytes"] // spec["ranks"], 0)
    out: dict[str, Any] = {"rank": rank}
    if spec["mode"] == "save":
        flat = [t for t in state["model"].values()]
        area = torch.empty(sum(t.numel() for t in flat), dtype=torch.bfloat16)
        area.fill_(0)

        def bare_copy() -> float:
            t0, at = time.perf_counter(), 0
            for t in flat:
                area[at:at + t.numel()].view(t.shape).copy_(t)
                at += t.numel()
            return time.perf_counter() - t0

        staging = ft.Staging()
        if engine == "fastckpt":  # allocated once, as a trainer reuses it (tier saves use it for their first save)
            staging.buffer(spec["bytes"] // spec["ranks"] + (16 << 20)).fill_(0)
        saves = []
        kept = Writer(tier=tier if engine == "dcp-tier" else None, cache_staged_state_dict=True)
        for step in range(1, spec["saves"] + 1):
            advance(state, step)
            uri = uri_of(spec, f"{spec['name']}/step-{step}")
            dist.barrier()
            bare = bare_copy()  # the reference: every rank at once, as in the save
            dist.barrier()
            t0 = time.perf_counter()
            if engine in ("fastckpt-tier", "fastckpt-tier-peer"):
                h = ft.async_save(state, uri, tier=tier, staging=staging, replicas=int(engine.endswith("peer")))
                blocked = time.perf_counter() - t0
                h.wait()
                safe = time.perf_counter() - t0
                h.wait(durable=True)
            elif engine == "fastckpt":
                h = ft.async_save(state, uri, staging=staging)
                blocked = time.perf_counter() - t0
                h.wait()
                safe = None
            else:  # dcp-async, dcp-async-cached, dcp-tier
                writer = Writer(uri) if engine == "dcp-async" else kept
                future = dcp.async_save(state, checkpoint_id=uri, storage_writer=writer)
                blocked = time.perf_counter() - t0
                future.result()
                safe = time.perf_counter() - t0 if writer.tier is not None else None
                if writer.tier is not None:
                    if rank == 0:
                        writer.wait_durable(timeout=600)
                    dist.barrier()
            saves.append({"blocked_s": blocked, "safe_s": safe, "durable_s": time.perf_counter() - t0,
                          "bare_copy_s": bare})
        out["saves"] = saves
        out["fingerprint"] = fingerprint(state)
    elif spec["mode"] == "kill":  # after a first save, as a trainer's later saves: into the tier's recycled files
        from fastckpt.tier.spare import spare_files

        ft.async_save(state, uri_of(spec, spec["name"] + "-first"), tier=tier).wait(durable=True)
        while not spare_files(tier):
            time.sleep(0.05)
        advance(state, spec["step"])
        out["fingerprint"] = fingerprint(state)
        with open(os.path.join(spec["out"], f"rank-{rank}.json"), "w") as f:
            json.dump(out, f)
        ft.async_save(state, uri_of(spec, spec["name"]), tier=tier).wait()
        os.kill(os.getpid(), signal.SIGKILL)
    else:  # load
        for step in range(1, spec["step"] + 1):
            advance(state, step)
        want = fingerprint(state)
        into = {"model": {k: torch.zeros_like(v) for k, v in state["model"].items()}, "step": -1}
        del state
        uri = uri_of(spec, spec["name"])
        t0 = time.perf_counter()
        if engine in ("dcp", "dcp-tier"):
            reader = Reader(uri, tier=tier if engine == "dcp-tier" else None)
            dcp.load(into, storage_reader=reader)
            out["bytes_read"] = reader.bytes_read
        elif engine == "restore":
            out["received"] = ft.restore_tier(uri, tier)
            into = ft.load(uri, rank=rank, state_dict=into, tier=tier)
        else:
            into = ft.load(uri, rank=rank, state_dict=into, tier=tier if engine == "tier" else None)
        out["load_s"] = time.perf_counter() - t0
        out["ok"] = fingerprint(into) == want
    dist.destroy_process_group()
    return out


def run_job(spec: dict[str, Any], env: dict[str, str]) -> list[dict[str, Any]]:
    """``spec`` run by ``--ranks`` processes; their records (a rank that died records nothing)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tempfile.mkdtemp(prefix="tier-bench-out-")
    spec = {**spec, "port": port, "out": out}
    procs = [subprocess.Popen([sys.executable, "-m", "bench.tier_bench", "--rank-worker", json.dumps(spec), str(r)],
                              cwd=REPO, env={**os.environ, **env}) for r in range(spec["ranks"])]
    for p in procs:
        p.wait(timeout=1800)
    records = []
    for r in range(spec["ranks"]):
        path = os.path.join(out, f"rank-{r}.json")
        if os.path.exists(path):
            with open(path) as f:
                records.append(json.load(f))
    shutil.rmtree(out, ignore_errors=True)
    return records


def committed(client: Any, name: str) -> bool:
    try:
        client.head_object(Bucket=BUCKET, Key=f"{name}/.fastckpt/COMMITTED")
        return True
    except Exception:
        return False


def wait_committed(client: Any, name: str, timeout: float = 300.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if committed(client, name):
            return True
        time.sleep(0.2)
    return False


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=2.0)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--saves", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--kills", type=int, default=20)
    ap.add_argument("--engines", default=",".join(ENGINES))
    ap.add_argument("--tier-root", default="/dev/shm")
    ap.add_argument("--out", default=None)
    ap.add_argument("--rank-worker", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.rank_worker:
        spec = json.loads(args.rank_worker[0])
        record = rank_worker(spec, int(args.rank_worker[1]))
        with open(os.path.join(spec["out"], f"rank-{args.rank_worker[1]}.json"), "w") as f:
            json.dump(record, f)
        return 0
    work = tempfile.mkdtemp(prefix="fastckpt-tier-bench-")
    tier_root = tempfile.mkdtemp(prefix="fastckpt-tiers-", dir=args.tier_root)
    tiers = [os.path.join(tier_root, f"node-{r}") for r in range(args.ranks)]
    gateway = JuiceFSGateway(os.path.join(work, "juicefs")).start()
    env = s3_env(gateway.endpoint)
    client = gateway.client()
    base = {"ranks": args.ranks, "bytes": int(args.gib * (1 << 30)), "endpoint": gateway.endpoint, "tiers": tiers}
    saves: list[dict[str, Any]] = []
    loads: list[dict[str, Any]] = []
    kills: list[dict[str, Any]] = []
    try:
        for rnd in range(args.rounds):
            for engine in args.engines.split(","):
                name = f"save-{engine}-{rnd}"
                records = run_job({**base, "mode": "save", "engine": engine, "saves": args.saves, "name": name},
                                  env)
                saves += [{"engine": engine, "round": rnd, **r} for r in records]
                print(f"round {rnd} {engine:14s} " + " ".join(
                    f"{s['durable_s']:.2f}s" for r in records for s in r.get("saves", [])), flush=True)
                if engine == "fastckpt-tier":
                    last = f"{name}/step-{args.saves}"
                    for how, eng in (("tier (same node)", "tier"), ("S3 (today's load)", "fastckpt")):
                        settle()
                        loads += [{"how": how, **r} for r in run_job(
                            {**base, "mode": "load", "engine": eng, "name": last, "step": args.saves}, env)]
                    for t in tiers:
                        shutil.rmtree(t, ignore_errors=True)
                    settle()
                    loads += [{"how": "wiped tier (durable)", **r} for r in run_job(
                        {**base, "mode": "load", "engine": "tier", "name": last, "step": args.saves}, env)]
                if engine == "fastckpt-tier-peer":
                    shutil.rmtree(tiers[0], ignore_errors=True)
                    settle()
                    loads += [{"how": "wiped node, peer replica (restore_tier + load)", **r} for r in run_job(
                        {**base, "mode": "load", "engine": "restore", "name": f"{name}/step-{args.saves}",
                         "step": args.saves}, env)]
                if engine == "dcp-async":
                    settle()
                    loads += [{"how": "DCP Reader (S3)", **r} for r in run_job(
                        {**base, "mode": "load", "engine": "dcp", "name": f"{name}/step-{args.saves}",
                         "step": args.saves}, env)]
                if engine == "dcp-tier":
                    settle()
                    loads += [{"how": "DCP Reader(tier=), same nodes", **r} for r in run_job(
                        {**base, "mode": "load", "engine": "dcp-tier", "name": f"{name}/step-{args.saves}",
                         "step": args.saves}, env)]
                delete_prefix(client, BUCKET, name)
        for i in range(args.kills):
            name = f"kill-{i}"
            records = run_job({**base, "mode": "kill", "engine": "fastckpt-tier", "name": name, "step": 1}, env)
            durable = wait_committed(client, name)
            settle()
            restored = run_job({**base, "mode": "load", "engine": "tier", "name": name, "step": 1}, env)
            for t in tiers:
                shutil.rmtree(t, ignore_errors=True)
            from_durable = run_job({**base, "mode": "load", "engine": "fastckpt", "name": name, "step": 1}, env)
            lost = not durable or len(records) < args.ranks or not all(r.get("ok") for r in from_durable)
            kills.append({"run": i, "lost": lost, "restore_s": [r["load_s"] for r in restored],
                          "restored_ok": all(r.get("ok") for r in restored)})
            print(f"kill {i}: {'LOST' if lost else 'kept'}", flush=True)
            delete_prefix(client, BUCKET, name)
    finally:
        gateway.stop()
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(tier_root, ignore_errors=True)
    print(summarize(saves, loads, kills, args))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "saves": saves, "loads": loads, "kills": kills}, f, indent=1)
    return 0 if all(not k["lost"] for k in kills) and all(r.get("ok", True) for r in loads) else 1


def summarize(saves: list[dict[str, Any]], loads: list[dict[str, Any]], kills: list[dict[str, Any]],
              args: argparse.Namespace) -> str:
    """Markdown tables of medians (saves after the first of every job; every rank)."""
    def med(vals: list[float]) -> float:
        return statistics.median(vals) if vals else float("nan")

    lines = [f"{args.gib:g} GiB over {args.ranks} ranks, saves back to back (unsettled), restores cold.", "",
             "| engine | blocked s | bare copy_() s | blocked / copy | safe in tier s | safe / blocked | "
             "committed in S3 s |", "|---|---|---|---|---|---|---|"]
    for engine in args.engines.split(","):
        rows = [r for r in saves if r["engine"] == engine and "saves" in r]
        later = [s for r in rows for s in r["saves"][1:]]
        blocked, copy = med([s["blocked_s"] for s in later]), med([s["bare_copy_s"] for s in later])
        safe = med([s["safe_s"] for s in later if s["safe_s"] is not None])
        lines.append(f"| {engine} | {blocked:.3f} | {copy:.3f} | {blocked / copy:.2f}x | "
                     + (f"{safe:.3f} | {safe / blocked:.2f}x" if safe == safe else "- | -")
                     + f" | {med([s['durable_s'] for s in later]):.2f} |")
    lines += ["", "| restore | seconds (median over ranks and runs) | bit-exact |", "|---|---|---|"]
    ref = med([r["load_s"] for r in loads if r["how"] == "S3 (today's load)"])
    for how in dict.fromkeys(r["how"] for r in loads):
        rows = [r for r in loads if r["how"] == how]
        t = med([r["load_s"] for r in rows])
        lines.append(f"| {how} | {t:.3f} ({ref / t:.1f}x today's) | {all(r['ok'] for r in rows)} |")
    if kills:
        restore = med([s for k in kills for s in k["restore_s"]])
        lines.append(f"| after SIGKILL of the trainer (tier, same node) | {restore:.3f} ({ref / restore:.1f}x today's) "
                     f"| {all(k['restored_ok'] for k in kills)} |")
        lines += ["", f"Trainer SIGKILLed right after `wait()` returned: {sum(k['lost'] for k in kills)} of "
                  f"{len(kills)} checkpoints lost."]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
