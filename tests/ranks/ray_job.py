"""Ranks as Ray tasks meeting through ``RayBarrier``: ``python -m tests.ranks.ray_job BASE_URI WORKDIR``.

Runs three checkpoints with 4 ranks (each a Ray task in a worker process) and prints one JSON line
with every rank's outcome: ``ok`` (ranks 1 and 3 contribute), ``fail`` (rank 2 raises inside its
block), ``absent`` (rank 3 is never started; short barrier timeout).
"""

from __future__ import annotations

import json
import os
import sys

import ray

WORLD = 4


@ray.remote(num_cpus=0)
def rank_task(uri: str, rank: int, barrier, workdir: str, contributors: list[int], fail: int | None) -> dict:
    """One rank: write its file (if it contributes) through the sync writer; report what happened."""
    from fastckpt import SyncCheckpointWriter, TransferConfig

    try:
        with SyncCheckpointWriter(uri, rank=rank, world_size=WORLD, barrier=barrier,
                                  config=TransferConfig(part_size=256 << 10, retries=2, retry_for=0)) as writer:
            if rank in contributors:
                path = os.path.join(workdir, f"{os.path.basename(uri)}-{rank}.bin")
                with open(path, "wb") as f:
                    f.write(f"{writer.attempt}/{rank}".encode() * 100)
                writer.put_file(path, f"shard-{rank}.bin")
            if rank == fail:
                raise ValueError(f"rank {rank} broke")
        return {"ok": True, "attempt": writer.attempt, "files": writer.result.files, "pid": os.getpid()}
    except Exception as exc:
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}", "pid": os.getpid()}


def main(base: str, workdir: str) -> None:
    from fastckpt.checkpoint.barrier_ray import RayBarrier

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    out = {"driver_pid": os.getpid()}
    cases = {"ok": ([1, 3], None, range(WORLD), 60.0), "fail": ([0, 1], 2, range(WORLD), 60.0),
             "absent": ([0], None, range(WORLD - 1), 2.0)}
    for name, (contributors, fail, ranks, timeout) in cases.items():
        barrier = RayBarrier.create(timeout=timeout)
        refs = [rank_task.remote(f"{base}/{name}", r, barrier, workdir, contributors, fail) for r in ranks]
        out[name] = ray.get(refs, timeout=120)
    ray.shutdown()
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
