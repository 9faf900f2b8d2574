"""Commit latency and storage requests per commit of the checkpoint protocol, by number of ranks.

    python bench/commit_bench.py                          # sim 8/64/1024, processes 8/64
    python bench/commit_bench.py --sim-ranks 8 64 --proc-ranks 8 --latency 0.02 --repeat 3

Every rank first writes one small file; once all have (synchronised outside the protocol), the clock
starts and each rank leaves its ``CheckpointWriter`` block: manifest, barrier, commit marker, outcome.
Latency is from that start until the last rank has returned; requests are all storage requests of
all ranks in that phase, plus the marker check each rank makes on entering (``enter``).

Modes:
- ``sim-store`` / ``sim-inprocess``: ranks are tasks of this process over one in-memory bucket, each
  rank behind its own ``FaultInjectingStore(latency=L)`` (every request takes L seconds), with the
  store barrier, or for reference the in-process barrier (no storage round trips in the barrier).
- ``proc-store`` / ``proc-torch``: ranks are forked processes over a local directory behind the same
  latency wrapper, with the store barrier or the torch.distributed (gloo) barrier.

The table is printed and the results are written as JSON to ``--out`` (default bench/results/).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from datetime import timedelta
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from fastckpt import CheckpointWriter, TransferConfig, open_store  # noqa: E402
from fastckpt.checkpoint import InProcessBarrier, StoreBarrier  # noqa: E402
from fastckpt.stores.base import Store  # noqa: E402
from harness.faults import FaultInjectingStore  # noqa: E402

CONFIG = TransferConfig(part_size=1 << 20, multipart_threshold=8 << 20, max_in_flight=2, retries=3,
                        retry_for=0)
FILE_SIZE = 1024


class CountingStore(FaultInjectingStore):
    """Latency on every request, and a count of requests by operation."""

    def __init__(self, inner: Store, latency: float) -> None:
        super().__init__(inner, latency=latency)
        self.counts: Counter[str] = Counter()

    async def fault(self, op: str, key: str) -> None:
        self.counts[op] += 1
        await super().fault(op, key)

    async def close(self) -> None:
        """The inner store is shared; its owner closes it."""


async def one_rank(uri: str, rank: int, world: int, barrier: Any, store: CountingStore, src: str,
                   all_written: Any, attempt: str) -> dict[str, Any]:
    """Write one file, wait for ``all_written()``, then commit; timings and request counts."""
    async with CheckpointWriter(uri, rank=rank, world_size=world, barrier=barrier, attempt=attempt,
                                config=CONFIG, store=store) as writer:
        await writer.put_file(src, f"shard-{rank:05d}.bin")
        enter = store.counts["head"]  # the marker check on entering (the only head before the commit)
        await all_written()
        before = Counter(store.counts)
        start = time.time()
    end = time.time()
    commit = store.counts - before
    return {"start": start, "end": end, "enter": enter, "commit": dict(commit)}


def summarise(mode: str, world: int, latency: float, ranks: list[dict[str, Any]]) -> dict[str, Any]:
    ops: Counter[str] = Counter()
    for r in ranks:
        ops.update(r["commit"])
    return {"mode": mode, "ranks": world, "latency_s": latency,
            "commit_s": max(r["end"] for r in ranks) - min(r["start"] for r in ranks),
            "requests": sum(ops.values()), "enter_requests": sum(r["enter"] for r in ranks),
            "root_requests": sum(ranks[0]["commit"].values()), "by_op": dict(ops)}


# ----------------------------------------------------------------------------- simulated (one process)


async def simulate(mode: str, world: int, latency: float, run: int) -> dict[str, Any]:
    bucket = f"commit-bench-{os.getpid()}-{mode}-{world}-{run}"
    uri = f"memory://{bucket}/ckpt"
    inner = open_store(uri, CONFIG, retry=False)  # each rank's writer retries, as in a real job: one layer
    barrier = StoreBarrier(timeout=600) if mode == "sim-store" else InProcessBarrier(timeout=600)
    with tempfile.NamedTemporaryFile() as f:
        f.write(os.urandom(FILE_SIZE))
        f.flush()
        written = 0
        everyone = asyncio.Event()

        async def all_written() -> None:
            nonlocal written
            written += 1
            if written == world:
                everyone.set()
            await everyone.wait()

        results = await asyncio.gather(*(
            one_rank(uri, r, world, barrier, CountingStore(inner, latency), f.name, all_written, f"run{run}")
            for r in range(world)))
    await inner.delete_many([m.key async for m in inner.list()])  # the next run starts from an empty bucket
    return summarise(mode, world, latency, list(results))


# ----------------------------------------------------------------------------- processes


def _proc_rank(mode: str, world: int, rank: int, latency: float, base: str, port: int, sync: Any,
               out: str, run: int) -> None:
    barrier: Any
    if mode == "proc-torch":
        import torch.distributed as dist

        from fastckpt.checkpoint.barrier_torch import TorchBarrier

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=600))
        barrier = TorchBarrier(timeout=600)
    else:
        barrier = StoreBarrier(timeout=600)
    src = os.path.join(base, f"src-{rank}")
    with open(src, "wb") as f:
        f.write(os.urandom(FILE_SIZE))

    async def main() -> dict[str, Any]:
        inner = open_store(f"file://{base}/store", CONFIG, retry=False)
        try:
            return await one_rank(f"file://{base}/store/ckpt", rank, world, barrier, CountingStore(inner, latency),
                                  src, lambda: asyncio.to_thread(sync.wait), f"run{run}")
        finally:
            await inner.close()

    result = asyncio.run(main())
    with open(os.path.join(out, f"{rank}.json"), "w") as f:
        json.dump(result, f)


def processes(mode: str, world: int, latency: float, run: int) -> dict[str, Any]:
    """Run the ranks from a fresh launcher process: forking this one, whose I/O threads are already
    running, would leave the children without them."""
    spec = json.dumps({"mode": mode, "world": world, "latency": latency, "run": run})
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--launch", spec], capture_output=True,
                          text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{mode} with {world} ranks failed: {proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def launch(mode: str, world: int, latency: float, run: int) -> dict[str, Any]:
    """Fork ``world`` rank processes and summarise their measurements."""
    if mode == "proc-torch":
        import torch.distributed  # noqa: F401 - imported once, before the fork
    base = tempfile.mkdtemp(prefix="commit-bench-")
    try:
        out = os.path.join(base, "out")
        os.makedirs(out)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        ctx = multiprocessing.get_context("fork")
        sync = ctx.Barrier(world)
        procs = [ctx.Process(target=_proc_rank, args=(mode, world, r, latency, base, port, sync, out, run))
                 for r in range(world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        if any(p.exitcode != 0 for p in procs):
            raise RuntimeError(f"{mode} with {world} ranks: exit codes {[p.exitcode for p in procs]}")
        ranks = []
        for r in range(world):
            with open(os.path.join(out, f"{r}.json")) as f:
                ranks.append(json.load(f))
        return summarise(mode, world, latency, ranks)
    finally:
        shutil.rmtree(base, ignore_errors=True)


def measure(mode: str, world: int, latency: float, repeat: int) -> dict[str, Any]:
    """Median of ``repeat`` runs (by commit latency)."""
    runs = []
    for run in range(repeat):
        if mode.startswith("sim"):
            runs.append(asyncio.run(simulate(mode, world, latency, run)))
        else:
            runs.append(processes(mode, world, latency, run))
    best = sorted(runs, key=lambda r: r["commit_s"])[len(runs) // 2]
    return {**best, "commit_s_runs": [r["commit_s"] for r in runs], "commit_s_median": statistics.median(
        r["commit_s"] for r in runs)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sim-ranks", type=int, nargs="*", default=[8, 64, 1024])
    parser.add_argument("--proc-ranks", type=int, nargs="*", default=[8, 64])
    parser.add_argument("--modes", nargs="*", default=["sim-store", "sim-inprocess", "proc-store", "proc-torch"])
    parser.add_argument("--latency", type=float, default=0.02, help="seconds added to every storage request")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--out", default=os.path.join(ROOT, "bench", "results"), help="directory for the JSON")
    parser.add_argument("--launch", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.launch:
        print(json.dumps(launch(**json.loads(args.launch))))
        return

    rows = []
    print(f"{'mode':<14}{'ranks':>6}{'commit s':>10}{'requests':>10}{'per rank':>10}{'root':>7}{'enter':>7}")
    for mode in args.modes:
        for world in args.sim_ranks if mode.startswith("sim") else args.proc_ranks:
            row = measure(mode, world, args.latency, args.repeat)
            rows.append(row)
            print(f"{mode:<14}{world:>6}{row['commit_s_median']:>10.3f}{row['requests']:>10}"
                  f"{row['requests'] / world:>10.2f}{row['root_requests']:>7}{row['enter_requests']:>7}", flush=True)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "commit_bench.json")
    with open(path, "w") as f:
        json.dump({"host": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version(),
                   "latency_s": args.latency, "file_size": FILE_SIZE, "results": rows}, f, indent=1)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
