"""Timing helpers shared by the single-file emulator benchmarks (gcs_emulator, azure_emulator)."""

from __future__ import annotations

import resource
import time
from collections.abc import Callable
from pathlib import Path

import xxhash

MiB = 1 << 20


def cpu_seconds() -> float:
    """User + system CPU time of this process so far."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def file_digest(path: Path) -> str:
    """XXH3-128 of a local file."""
    h = xxhash.xxh3_128()
    with open(path, "rb") as f:
        while chunk := f.read(16 * MiB):
            h.update(chunk)
    return h.hexdigest()


def timed(fn: Callable[[], object], size: int) -> dict[str, float]:
    """Run ``fn`` once; wall time, MiB/s and CPU-s/GiB."""
    cpu, start = cpu_seconds(), time.perf_counter()
    fn()
    wall, cpu = time.perf_counter() - start, cpu_seconds() - cpu
    return {"seconds": round(wall, 3), "mib_s": round(size / MiB / wall, 1),
            "cpu_s_per_gib": round(cpu / (size / (1 << 30)), 2)}


def copy_files_runs(remote: object, path: str, src: Path, out: Path, size: int, chunk_size: int = 64 * MiB
                    ) -> tuple[dict[str, float], dict[str, float]]:
    """Upload then download one file with ``pyarrow.fs.copy_files`` (Ray's path) through ``remote``."""
    import pyarrow.fs as pafs

    local = pafs.LocalFileSystem()
    up = timed(lambda: pafs.copy_files(str(src), path, source_filesystem=local, destination_filesystem=remote,
                                       chunk_size=chunk_size), size)
    down = timed(lambda: pafs.copy_files(path, str(out), source_filesystem=remote, destination_filesystem=local,
                                         chunk_size=chunk_size), size)
    return up, down
