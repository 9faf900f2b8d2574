"""A multi-rank job for the checkpoint tests: ``python -m tests.ranks.job SPEC.json``.

The launcher forks ``world_size`` rank processes (real, separate processes; fork keeps start-up cheap
on a loaded machine) and waits for them. Each rank writes the checkpoints the spec lists, one after
another, through its barrier, and records what happened in ``{out}/rank-NNNNN.json``.

Spec keys: uri (base URI; checkpoint i is ``{uri}/{name}``), world_size, barrier (store | torch),
timeout (barrier seconds), port (torch rendezvous), workdir, out, checkpoints (list of {name, attempt,
contributors, extra: ranks that also write a big file, dup}), pause ({rank, at, checkpoint} with at
in mid-upload, before-manifest, after-manifest: the rank stops there, writes ``{out}/paused.json``
with its pid and sleeps until killed).
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
import random
import sys
import traceback
from datetime import timedelta

from fastckpt import CheckpointWriter, TransferConfig, open_store, parse_uri
from fastckpt.checkpoint import StoreBarrier
from harness.faults import FaultInjectingStore

SMALL_FILE = 3000
BIG_FILE = 6 << 20  # multipart on every backend (S3's smallest part is 5 MiB)


def content(checkpoint: str, attempt: str, rank: int, index: int, size: int = SMALL_FILE) -> bytes:
    """The bytes rank ``rank`` writes as its file ``index`` (distinct per checkpoint and attempt)."""
    return random.Random(f"{checkpoint}/{attempt}/{rank}/{index}").randbytes(size)


def file_names(rank: int, dup: bool = False) -> list[str]:
    """Names of the files a contributing rank writes (``dup``: rank's first file clashes with rank 0's)."""
    first = "model-00000.safetensors" if dup else f"model-{rank:05d}.safetensors"
    return [first, f"optim/rank_{rank:02d}.pt"]


def save(path: str, data: bytes) -> None:
    """Write a local file."""
    with open(path, "wb") as f:
        f.write(data)


def config() -> TransferConfig:
    """Small parts so that the big file goes multipart."""
    return TransferConfig(part_size=256 << 10, multipart_threshold=256 << 10, max_in_flight=4, retries=3,
                          retry_for=0, backoff_base=0.01, backoff_max=0.05)


class PausingStore(FaultInjectingStore):
    """A real store that stops this rank at one point of the protocol (for kill -9 tests)."""

    def __init__(self, inner, rank: int, at: str | None, signal: str) -> None:
        super().__init__(inner)
        self.rank, self.at, self.signal = rank, at, signal
        self.manifest_suffix = f"/rank-{rank:05d}.json"

    async def pause(self) -> None:
        save(self.signal + ".tmp", json.dumps({"pid": os.getpid(), "rank": self.rank, "at": self.at}).encode())
        os.replace(self.signal + ".tmp", self.signal)
        await asyncio.sleep(3600)

    async def fault(self, op: str, key: str) -> None:
        await super().fault(op, key)
        if op == "complete" and self.at == "mid-upload":  # every part sent, the object not yet complete
            await self.pause()

    async def put(self, key, data, *, if_absent=False, metadata=None) -> None:
        manifest = "/.fastckpt/" in key and key.endswith(self.manifest_suffix)
        if manifest and self.at == "before-manifest":
            await self.pause()
        await super().put(key, data, if_absent=if_absent, metadata=metadata)
        if manifest and self.at == "after-manifest":
            await self.pause()


async def write_one(spec: dict, ck: dict, rank: int, barrier, store) -> dict:
    """Write checkpoint ``ck`` as ``rank``; the outcome as a dict."""
    work = os.path.join(spec["workdir"], f"rank-{rank}", ck["name"])
    uri = parse_uri(spec["uri"])
    target = uri.with_key(uri.join(ck["name"]))
    written = []
    try:
        async with CheckpointWriter(target, rank=rank, world_size=spec["world_size"], barrier=barrier,
                                    attempt=ck.get("attempt"), config=config(), store=store) as writer:
            if rank in ck["contributors"]:
                first, second = file_names(rank, ck.get("dup", False))
                os.makedirs(os.path.join(work, "dir"), exist_ok=True)
                save(os.path.join(work, "first"), content(ck["name"], writer.attempt, rank, 0))
                await writer.put_file(os.path.join(work, "first"), first)
                save(os.path.join(work, "dir", second.split("/")[1]), content(ck["name"], writer.attempt, rank, 1))
                await writer.put_dir(os.path.join(work, "dir"), "optim")
                written = [first, second]
            if rank in ck.get("extra", []):
                save(os.path.join(work, "extra"), content(ck["name"], writer.attempt, rank, 2, BIG_FILE))
                await writer.put_file(os.path.join(work, "extra"), f"scratch/rank-{rank}.bin")
                written.append(f"scratch/rank-{rank}.bin")
        result = writer.result
        return {"ok": True, "attempt": writer.attempt, "written": written,
                "files": result.files if result else None}
    except Exception as exc:
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()}


def run_rank(spec: dict, rank: int) -> None:
    """Body of one rank process."""
    barrier = None
    if spec["barrier"] == "torch":
        import torch.distributed as dist

        from fastckpt.checkpoint.barrier_torch import TorchBarrier

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{spec['port']}", rank=rank,
                                world_size=spec["world_size"], timeout=timedelta(seconds=60))
        barrier = TorchBarrier(timeout=spec["timeout"])
    else:
        # groups of 4: two leaders in a world of 8, so the grouped barrier runs across processes
        barrier = StoreBarrier(timeout=spec["timeout"], poll_interval=0.02, max_poll_interval=0.2, group_size=4)
    pause = spec.get("pause") or {}
    outcome: dict = {"rank": rank, "checkpoints": {}}

    async def main() -> None:
        inner = open_store(spec["uri"], config=config())
        for ck in spec["checkpoints"]:
            at = pause.get("at") if pause.get("rank") == rank and pause.get("checkpoint") == ck["name"] else None
            store = PausingStore(inner, rank, at, os.path.join(spec["out"], "paused.json"))
            outcome["checkpoints"][ck["name"]] = await write_one(spec, ck, rank, barrier, store)
            outcome["requests"] = outcome.get("requests", 0) + store.calls
        await inner.close()

    asyncio.run(main())
    with open(os.path.join(spec["out"], f"rank-{rank:05d}.json"), "w") as f:
        json.dump(outcome, f)


def main(path: str) -> int:
    """Fork the ranks, wait for them; exit status 0 when every rank exited normally."""
    with open(path) as f:
        spec = json.load(f)
    if spec["barrier"] == "torch":
        import torch.distributed  # noqa: F401 - imported once, before the fork
    os.makedirs(spec["out"], exist_ok=True)
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=run_rank, args=(spec, r), name=f"rank-{r}") for r in range(spec["world_size"])]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    codes = {p.name: p.exitcode for p in procs}
    with open(os.path.join(spec["out"], "exitcodes.json"), "w") as f:
        json.dump(codes, f)
    return 0 if all(c == 0 for c in codes.values()) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
