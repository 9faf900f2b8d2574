"""Fault soak: transfers and 4-rank checkpoints through the wire-level fault proxy (``harness.proxy``).

    python -m bench.faults_bench [--runs 20] [--rate 0.05] [--out bench/results/faults.json]

Starts moto (S3), fake-gcs-server (GCS) and Azurite (Azure) on 127.0.0.1, each behind a fault proxy, and
prints one row per scenario: runs, completed and verified, failed cleanly, bytes lost or corrupted (a
transfer that "succeeded" with wrong bytes, or a committed checkpoint that does not verify: must be 0),
the longest time to finish or fail, and for a SIGKILLed upload run again, the most bytes it sent twice
(at most the parts that were in flight at the kill).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from urllib.parse import urlsplit

import fastckpt
from fastckpt import CheckpointError, StoreError
from harness import azure, gcs, s3
from harness.proxy import Fault, FaultProxy
from harness.uris import emulator_uri

MiB = 1 << 20
CONFIG = dict(part_size=5 * MiB, multipart_threshold=5 * MiB, max_in_flight=4, retries=4, retry_for=0,
              backoff_base=0.05, backoff_max=0.5, stall_timeout=2.0, min_rate=1 << 30, fsync=False)
FAULTS = {
    "reset mid-body (up)": ("up", Fault("reset_request", after=256 << 10)),
    "reset mid-body (down)": ("down", Fault("reset_response", after=256 << 10)),
    "short body (down)": ("down", Fault("truncate_response", after=128 << 10)),
    "stall > deadline (up)": ("up", Fault("stall", after=256 << 10, seconds=5)),
    "stall > deadline (down)": ("down", Fault("stall_response", after=256 << 10, seconds=5)),
    "503 SlowDown burst": ("up", Fault("status")),
    "connections refused": ("up", Fault("refuse")),
}


@dataclass
class Row:
    scenario: str
    runs: int = 0
    verified: int = 0
    failed_cleanly: int = 0
    bytes_lost: int = 0
    max_seconds: float = 0.0
    resent: int | None = None
    """Most bytes a resumed run sent twice (None: no resume in this scenario)."""

    def add(self, ok: bool | None, seconds: float, lost: int = 0, resent: int | None = None) -> None:
        """``ok``: True completed and verified, False failed cleanly, None completed with wrong bytes."""
        if resent is not None:
            self.resent = max(self.resent or 0, resent)
        self.runs += 1
        self.verified += ok is True
        self.failed_cleanly += ok is False
        self.bytes_lost += lost
        self.max_seconds = max(self.max_seconds, seconds)


def below(uri: str, name: str) -> str:
    path, _, query = uri.partition("?")
    return f"{path}/{name}?{query}"


async def timed(op: Callable[[], Awaitable[object]]) -> tuple[BaseException | None, float]:
    started = time.monotonic()
    try:
        await op()
        return None, time.monotonic() - started
    except (StoreError, CheckpointError, OSError) as exc:
        return exc, time.monotonic() - started


async def transfer_run(backend: str, upstream: str, proxy: FaultProxy, work: Path, direction: str,
                       fault: Fault | None, times: int | None = 2) -> tuple[bool | None, float, int]:
    """Upload then download a 3.5-part file, ``fault`` ``times`` on the ``direction`` leg (None: on every
    connection); (ok, seconds, bytes lost)."""
    config = fastckpt.TransferConfig(**CONFIG)
    data = os.urandom(17 * MiB + 4321)
    src, out = work / "src.bin", work / "out.bin"
    src.write_bytes(data)
    out.unlink(missing_ok=True)
    prefix = f"soak-{os.urandom(4).hex()}"
    via, direct = emulator_uri(backend, proxy.url, prefix), emulator_uri(backend, upstream, prefix)
    skip = 1 if fault and fault.kind == "refuse" else 0
    proxy.arm(fault if direction == "up" else None, times=times, skip=skip)
    error, up_s = await timed(lambda: fastckpt.upload_async(src, below(via, "f"), config=config))
    if error is not None:
        return False, up_s, 0
    proxy.arm(fault if direction == "down" else None, times=times, skip=skip)
    error, down_s = await timed(lambda: fastckpt.download_async(below(via if direction == "down" else direct, "f"),
                                                                out, config=config))
    if error is not None:
        return (False if not out.exists() else None), up_s + down_s, 0
    got = out.read_bytes()
    return (True, up_s + down_s, 0) if got == data else (None, up_s + down_s, len(data))


def kill_when_stalled(command: list[str], env: dict[str, str], proxy: FaultProxy) -> None:
    """Run ``command`` until the proxy stalls it, then SIGKILL it."""
    seen = proxy.triggered.count("stall")
    child = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    while proxy.triggered.count("stall") == seen and child.poll() is None:
        time.sleep(0.05)
    time.sleep(0.3)
    child.kill()
    child.wait()


async def killed_upload_run(backend: str, upstream: str, proxy: FaultProxy, work: Path
                            ) -> tuple[bool | None, float, int, int]:
    """``fastckpt cp`` of 8 parts (2 in flight) SIGKILLed once ~4 parts went up, then run again: (ok,
    seconds of the rerun, bytes lost, bytes sent beyond the file's size by the two runs together)."""
    size = 40 * MiB - 1000
    src = work / "killed.bin"
    src.write_bytes(os.urandom(size))
    state = work / f"state-{os.urandom(4).hex()}"
    env = {**os.environ, "FASTCKPT_STATE_DIR": str(state), "FASTCKPT_MULTIPART_THRESHOLD": "5MiB"}
    via = below(emulator_uri(backend, proxy.url, f"soak-{os.urandom(4).hex()}"), "f")
    command = [sys.executable, "-m", "fastckpt.cli", "cp", str(src), via, "--part-size", "5MiB", "--concurrency", "2"]
    start = proxy.moved["up"]
    proxy.arm(Fault("stall", after=start + 22 * MiB, seconds=600, across=True), times=None)
    await asyncio.to_thread(kill_when_stalled, command, env, proxy)
    proxy.arm(None)
    started = time.monotonic()
    rerun = await asyncio.to_thread(subprocess.run, command, env=env, capture_output=True)
    seconds, sent = time.monotonic() - started, proxy.moved["up"] - start  # both runs, headers included
    if rerun.returncode:
        return False, seconds, 0, 0
    out = work / "killed.out"
    await fastckpt.download_async(via, out, config=fastckpt.TransferConfig(**CONFIG))
    same = out.read_bytes() == src.read_bytes()
    return (True if same else None), seconds, 0 if same else size, max(0, sent - size)


async def checkpoint_run(backend: str, upstream: str, proxy: FaultProxy, work: Path) -> tuple[bool | None, float, int]:
    """4 ranks, each a 6 MiB file and a small one, through the faulty proxy; then list + verify directly."""
    config = fastckpt.TransferConfig(**CONFIG)
    prefix = f"soak-{os.urandom(4).hex()}"
    via, direct = emulator_uri(backend, proxy.url, prefix), emulator_uri(backend, upstream, prefix)
    barrier = fastckpt.InProcessBarrier(timeout=60)
    sizes = 0

    async def rank(r: int) -> None:
        nonlocal sizes
        async with fastckpt.CheckpointWriter(below(via, "step-1"), rank=r, world_size=4, barrier=barrier,
                                             attempt="a1", config=config) as writer:
            for name, size in ((f"model-{r}.bin", 6 * MiB + r), (f"rng-{r}.json", 1000 + r)):
                path = work / f"{prefix}-{name}"
                path.write_bytes(os.urandom(size))
                sizes += size
                await writer.put_file(path, name)

    started = time.monotonic()
    results = await asyncio.gather(*(rank(r) for r in range(4)), return_exceptions=True)
    seconds = time.monotonic() - started
    states = [i.state for i in await fastckpt.list_checkpoints_async(direct, config=config)]
    if any(isinstance(res, BaseException) for res in results):
        return (False if "committed" not in states else None), seconds, 0
    report = await fastckpt.verify_async(below(direct, "step-1"), config=config)
    return (True, seconds, 0) if report.ok and states == ["committed"] else (None, seconds, sizes)


def random_faults(rate: float, seed: int) -> Callable[[int], Fault | None]:
    """A rule faulting ``rate`` of the connections with one of the non-stalling faults, at random."""
    rng = random.Random(seed)
    kinds = [fault for _, fault in FAULTS.values() if not fault.kind.startswith("stall")]
    return lambda n: rng.choice(kinds) if rng.random() < rate else None


async def soak(backends: dict[str, str], runs: int, rate: float, work: Path) -> list[Row]:
    rows: list[Row] = []
    for backend, upstream in backends.items():
        with FaultProxy(urlsplit(upstream).port) as proxy:
            for name, (direction, fault) in FAULTS.items():
                row = Row(f"{backend}: {name}")
                for _ in range(max(1, runs // 4)):
                    row.add(*await transfer_run(backend, upstream, proxy, work, direction, fault))
                rows.append(row)
            row = Row(f"{backend}: SIGKILL mid-upload, same command again (2 parts in flight)")
            for _ in range(3):
                row.add(*await killed_upload_run(backend, upstream, proxy, work))
            rows.append(row)
            row = Row(f"{backend}: persistent reset (must fail)")
            row.add(*await transfer_run(backend, upstream, proxy, work, "up", Fault("reset_request"), times=None))
            rows.append(row)
        if backend in ("s3", "azure"):
            with FaultProxy(urlsplit(upstream).port, random_faults(rate, seed=runs)) as proxy:
                row = Row(f"{backend}: 4-rank checkpoint, {rate:.0%} of connections faulted")
                for _ in range(runs):
                    row.add(*await checkpoint_run(backend, upstream, proxy, work))
                rows.append(row)
        print(f"{backend} done", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20, help="checkpoint runs per backend (transfers: runs/4)")
    parser.add_argument("--rate", type=float, default=0.05, help="share of connections faulted at random")
    parser.add_argument("--out", default="bench/results/faults.json")
    args = parser.parse_args()
    for name, value in s3.CREDENTIALS.items():
        os.environ[name] = value
    with tempfile.TemporaryDirectory(prefix="fastckpt-faults-") as tmp:
        work = Path(tmp)
        moto, fake_gcs, azurite = s3.start_moto(), gcs.start_fake_gcs(), azure.start_azurite(str(work))
        os.environ["FASTCKPT_GCS_IF_ABSENT"] = "best-effort"  # fake-gcs-server ignores it on compose
        try:
            moto.create_bucket(s3.BUCKET)
            azurite.create_container(azure.CONTAINER)
            rows = asyncio.run(soak({"s3": moto.endpoint, "gcs": fake_gcs.url, "azure": azurite.endpoint},
                                    args.runs, args.rate, work))
        finally:
            s3.stop_moto(moto)
            gcs.stop_fake_gcs(fake_gcs)
            azure.stop_azurite(azurite)
    print("| scenario | runs | completed + verified | failed cleanly | bytes lost or corrupted | max s "
          "| bytes re-sent after resume |\n|---|---|---|---|---|---|---|")
    for r in rows:
        resent = "-" if r.resent is None else f"{r.resent / MiB:.1f} MiB (parts of 5 MiB)"
        print(f"| {r.scenario} | {r.runs} | {r.verified} | {r.failed_cleanly} | {r.bytes_lost} | "
              f"{r.max_seconds:.1f} | {resent} |")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps([asdict(r) for r in rows], indent=1))


if __name__ == "__main__":
    main()
