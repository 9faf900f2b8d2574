"""Native accelerator vs pure Python: hashing throughput, upload throughput and CPU, event-loop stalls.

    python bench/hash_bench.py                      # 4 GiB upload, 64 MiB hash buffers
    python bench/hash_bench.py --size 1GiB --rounds 2

1. Hashing throughput with 1 and 2 threads: ``fastckpt._native.xxh3_128`` vs ``xxhash.xxh3_128_digest``,
   and the fused read+hash of a file in the page cache vs ``os.preadv`` + ``xxhash`` (the fallback);
   and the event-loop lag while two threads hash (a hash call that holds the GIL stalls the loop).
2. End-to-end upload of one file (in the page cache) to a local store, each run in a subprocess with
   ``FASTCKPT_NATIVE=0`` or ``1``: throughput, CPU seconds per GiB (user + system, all threads), and the
   longest event-loop stall seen by a probe task that sleeps 1 ms in a loop on the upload's loop.

The table is printed and the results are written as JSON to ``--out`` (default bench/results/).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from types import ModuleType
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import xxhash  # noqa: E402

from fastckpt import fileio, native  # noqa: E402
from fastckpt.config import parse_size  # noqa: E402

GiB = 1 << 30


# ----------------------------------------------------------------------------- hashing throughput


def throughput(fn: Callable[[int], object], nbytes: int, threads: int, seconds: float) -> float:
    """GB/s of ``threads`` threads each calling ``fn(thread index)`` (``nbytes`` per call) for ``seconds``."""
    counts = [0] * threads
    barrier = threading.Barrier(threads + 1)
    stop = [0.0]

    def worker(i: int) -> None:
        barrier.wait()
        while time.perf_counter() < stop[0]:
            fn(i)
            counts[i] += 1

    pool = [threading.Thread(target=worker, args=(i,)) for i in range(threads)]
    for t in pool:
        t.start()
    start = time.perf_counter()
    stop[0] = start + seconds
    barrier.wait()
    for t in pool:
        t.join()
    return sum(counts) * nbytes / (time.perf_counter() - start) / 1e9


def hash_rows(buf_size: int, seconds: float, rounds: int, workdir: str) -> list[dict[str, Any]]:
    native = _native_module()
    bufs = [os.urandom(buf_size) for _ in range(2)]
    path = os.path.join(workdir, "hash-src.bin")
    with open(path, "wb") as f:
        f.write(bufs[0] * 4)
    fds = [os.open(path, os.O_RDONLY) for _ in range(2)]
    outs = [bytearray(buf_size) for _ in range(2)]
    offsets = [[0], [0]]

    def file_call(read_and_hash: Callable[[int, int, Any], bytes]) -> Callable[[int], object]:
        def call(i: int) -> object:
            offsets[i][0] = (offsets[i][0] + buf_size) % (4 * buf_size)
            return read_and_hash(fds[i], offsets[i][0], outs[i])
        return call

    def py_read_and_hash(fd: int, offset: int, buf: Any) -> bytes:
        fileio.read_exact(fd, offset, memoryview(buf))
        return xxhash.xxh3_128_digest(buf)

    cases: list[tuple[str, str, Callable[[int], object]]] = [
        ("hash", "xxhash package", lambda i: xxhash.xxh3_128_digest(bufs[i])),
        ("read+hash", "preadv + xxhash", file_call(py_read_and_hash)),
    ]
    if native is not None:
        cases += [("hash", "native", lambda i: native.xxh3_128(bufs[i])),
                  ("read+hash", "native", file_call(native.read_and_hash))]
    rows = []
    try:
        for op, impl, fn in sorted(cases, key=lambda c: c[:2]):
            for threads in (1, 2):
                runs = [throughput(fn, buf_size, threads, seconds) for _ in range(rounds)]
                rows.append({"op": op, "impl": impl, "threads": threads, "buffer": buf_size,
                             "gbps": max(runs), "gbps_runs": runs})
    finally:
        for fd in fds:
            os.close(fd)
        os.unlink(path)
    return rows


def stall_rows(buf_size: int, seconds: float) -> list[dict[str, Any]]:
    """Loop lag seen by a 1 ms probe while two threads hash ``buf_size`` buffers (nothing: host noise)."""
    native = _native_module()
    buf = os.urandom(buf_size)
    impls: dict[str, Callable[[bytes], object] | None] = {"nothing": None, "xxhash package": xxhash.xxh3_128_digest}
    if native is not None:
        impls["native"] = native.xxh3_128
    rows = []
    for impl, fn in impls.items():
        stop = threading.Event()

        def worker(fn: Callable[[bytes], object] | None = fn, stop: threading.Event = stop) -> None:
            while not stop.is_set():
                if fn is None:
                    time.sleep(0.01)
                else:
                    fn(buf)

        async def probe() -> list[float]:
            lags, end = [], time.perf_counter() + seconds
            while time.perf_counter() < end:
                t = time.perf_counter()
                await asyncio.sleep(0.001)
                lags.append(time.perf_counter() - t - 0.001)
            return lags

        pool = [threading.Thread(target=worker) for _ in range(2)]
        for t in pool:
            t.start()
        try:
            lags = asyncio.run(probe())
        finally:
            stop.set()
            for t in pool:
                t.join()
        rows.append({"impl": impl, "buffer": buf_size, "max_stall_ms": max(lags) * 1e3,
                     "p99_stall_ms": statistics.quantiles(lags, n=100)[98] * 1e3, "probes": len(lags)})
    return rows


def _native_module() -> ModuleType | None:
    try:
        from fastckpt import _native  # type: ignore[attr-defined]
    except ImportError:
        return None
    return _native


# ----------------------------------------------------------------------------- uploads (subprocess side)


async def _probed(src: str | None, dst: str, part_size: int, fsync: bool, idle_s: float) -> dict[str, Any]:
    """Upload ``src`` (or, without one, sleep ``idle_s`` as a baseline) while a probe measures loop lag."""
    from fastckpt import TransferConfig
    from fastckpt.api import upload_async

    config = TransferConfig.from_env(part_size=part_size, multipart_threshold=part_size, fsync=fsync)
    done = asyncio.Event()
    lags: list[float] = []

    async def probe() -> None:
        while not done.is_set():
            t = time.perf_counter()
            await asyncio.sleep(0.001)
            lags.append(time.perf_counter() - t - 0.001)

    probe_task = asyncio.create_task(probe())
    await asyncio.sleep(0.01)
    lags.clear()  # only stalls during the measured window
    ru0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    if src is None:
        await asyncio.sleep(idle_s)
        digest = None
    else:
        digest = (await upload_async(src, f"file://{dst}", config=config))[0].digest.digest
    wall, ru1 = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF)
    done.set()
    await probe_task
    p99 = statistics.quantiles(lags, n=100)[98] if len(lags) >= 100 else max(lags, default=0.0)
    return {"native": native.NATIVE, "wall_s": wall,
            "cpu_s": (ru1.ru_utime - ru0.ru_utime) + (ru1.ru_stime - ru0.ru_stime),
            "max_stall_ms": max(lags, default=0.0) * 1e3, "p99_stall_ms": p99 * 1e3, "probes": len(lags),
            "digest": digest}


def worker_main(args: argparse.Namespace) -> None:
    from fastckpt._loop import new_loop

    loop = new_loop()
    try:
        out = loop.run_until_complete(_probed(args.src, args.dst, args.part_size, args.fsync, args.idle))
    finally:
        loop.close()
    print(json.dumps(out))


def _run_worker(flag: str, extra: list[str]) -> dict[str, Any]:
    env = {**os.environ, "FASTCKPT_NATIVE": flag, "PYTHONPATH": ROOT}
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", *extra], env=env,
                          capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"worker failed (FASTCKPT_NATIVE={flag}):\n{proc.stderr}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ----------------------------------------------------------------------------- uploads (parent side)


def upload_rows(size: int, part_size: int, rounds: int, fsync: bool, workdir: str) -> list[dict[str, Any]]:
    src = os.path.join(workdir, "upload-src.bin")
    block = os.urandom(64 << 20)
    with open(src, "wb") as f:
        for written in range(0, size, len(block)):
            f.write(block[: min(len(block), size - written)])
        os.fsync(f.fileno())  # no writeback of the source during the runs
    with open(src, "rb") as f:  # into the page cache
        while f.read(64 << 20):
            pass
    runs: dict[str, list[dict[str, Any]]] = {"0": [], "1": []}
    idle = []
    try:
        for r in range(rounds):
            for flag in ("0", "1") if r % 2 == 0 else ("1", "0"):  # interleaved, so drift hits both alike
                dst = os.path.join(workdir, f"store-{flag}", "obj")
                try:
                    runs[flag].append(_run_worker(flag, ["--src", src, "--dst", dst, "--part-size", str(part_size)]
                                                  + (["--fsync"] if fsync else [])))
                finally:
                    shutil.rmtree(os.path.dirname(dst), ignore_errors=True)
            idle.append(_run_worker("0", ["--dst", "", "--idle", str(runs["0"][-1]["wall_s"])]))
    finally:
        os.unlink(src)
    digests = {r["digest"] for rs in runs.values() for r in rs}
    if len(digests) != 1:
        raise RuntimeError(f"native on/off uploads disagree on the digest: {digests}")
    rows = []
    for flag, rs in runs.items():
        if flag == "1" and not rs[0]["native"]:
            continue  # module not built: both runs were pure Python
        gib = size / GiB
        rows.append({"native": flag == "1", "size": size, "part_size": part_size, "fsync": fsync,
                     "gbps": max(size / r["wall_s"] / 1e9 for r in rs),
                     "cpu_s_per_gib": min(r["cpu_s"] for r in rs) / gib,
                     "max_stall_ms": max(r["max_stall_ms"] for r in rs),
                     "p99_stall_ms": max(r["p99_stall_ms"] for r in rs), "runs": rs})
    rows.append({"native": None, "size": 0, "part_size": part_size, "fsync": fsync, "gbps": 0.0,
                 "cpu_s_per_gib": 0.0, "max_stall_ms": max(r["max_stall_ms"] for r in idle),
                 "p99_stall_ms": max(r["p99_stall_ms"] for r in idle), "runs": idle})
    return rows


# ----------------------------------------------------------------------------- report


def print_tables(result: dict[str, Any]) -> None:
    native = result["native"]
    print(f"{result['cpus']} CPUs; xxhash package {result['xxhash_package']}; native accelerator: "
          + (f"xxHash {native['xxhash']}, dispatch={native['dispatch']}" if native["native"] else native["status"]))
    print(f"\nhashing, {result['hash'][0]['buffer'] >> 20} MiB buffers (GB/s, best of {result['rounds']})")
    print(f"{'operation':<10} {'implementation':<16} {'1 thread':>9} {'2 threads':>10}")
    by_key: dict[tuple[str, str], dict[int, float]] = {}
    for row in result["hash"]:
        by_key.setdefault((row["op"], row["impl"]), {})[row["threads"]] = row["gbps"]
    for (op, impl), speeds in by_key.items():
        print(f"{op:<10} {impl:<16} {speeds[1]:>9.1f} {speeds[2]:>10.1f}")
    print("\nevent-loop lag while two threads hash those buffers (1 ms sleep probe)")
    print(f"{'hashing':<16} {'max ms':>8} {'p99 ms':>8}")
    for row in result["hash_stall"]:
        print(f"{row['impl']:<16} {row['max_stall_ms']:>8.2f} {row['p99_stall_ms']:>8.2f}")
    if not result["upload"]:
        return
    first = result["upload"][0]
    print(f"\nupload of {first['size'] / GiB:g} GiB (page cache) to a local store, {first['part_size'] >> 20} MiB "
          f"parts, fsync={first['fsync']}")
    print(f"{'native':<7} {'GB/s':>6} {'CPU-s/GiB':>10} {'max stall ms':>13} {'p99 stall ms':>13}")
    for row in result["upload"]:
        if row["native"] is None:
            print(f"{'idle':<7} {'-':>6} {'-':>10} {row['max_stall_ms']:>13.2f} {row['p99_stall_ms']:>13.2f}"
                  "   (probe alone, no upload: the host's own noise)")
            continue
        print(f"{'on' if row['native'] else 'off':<7} {row['gbps']:>6.2f} {row['cpu_s_per_gib']:>10.3f} "
              f"{row['max_stall_ms']:>13.2f} {row['p99_stall_ms']:>13.2f}")
    print(f"load average before / after: {result['loadavg'][0]} / {result['loadavg'][1]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="4GiB", help="upload size (default 4GiB)")
    parser.add_argument("--part-size", default="32MiB", help="upload part size (default 32MiB)")
    parser.add_argument("--buffer", default="64MiB", help="hash buffer size (default 64MiB)")
    parser.add_argument("--seconds", type=float, default=1.5, help="duration of each hashing measurement")
    parser.add_argument("--rounds", type=int, default=3, help="repetitions of each measurement")
    parser.add_argument("--fsync", action="store_true", help="fsync uploaded files (measures the disk)")
    parser.add_argument("--skip-upload", action="store_true", help="hashing throughput only")
    parser.add_argument("--workdir", default=None, help="scratch directory (default: a temporary one)")
    parser.add_argument("--out", default=os.path.join(ROOT, "bench", "results"), help="directory for the JSON")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--src", help=argparse.SUPPRESS)
    parser.add_argument("--dst", help=argparse.SUPPRESS)
    parser.add_argument("--idle", type=float, default=0.0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.part_size = parse_size(args.part_size)
    if args.worker:
        worker_main(args)
        return

    workdir = tempfile.mkdtemp(prefix="fastckpt-hash-bench-", dir=args.workdir)
    load_before = os.getloadavg()
    try:
        result: dict[str, Any] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "host": platform.node(), "cpus": os.cpu_count(),
            "python": platform.python_version(), "xxhash_package": xxhash.VERSION, "native": native.native_info(),
            "rounds": args.rounds,
            "hash": hash_rows(parse_size(args.buffer), args.seconds, args.rounds, workdir),
            "hash_stall": stall_rows(parse_size(args.buffer), max(args.seconds, 1.0)),
            "upload": [] if args.skip_upload else upload_rows(parse_size(args.size), args.part_size, args.rounds,
                                                              args.fsync, workdir),
        }
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    result["loadavg"] = [load_before, os.getloadavg()]
    print_tables(result)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"hash_bench-{time.strftime('%Y%m%d-%H%M%S')}.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=2)
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
