"""fastckpt's DCP ``Writer`` / ``Reader`` as drop-ins for ``FileSystemWriter`` / ``FileSystemReader``, on gloo
ranks: ``python -m tests.ranks.dcp_drop_in MODE URI WORLD PORT``.

Modes:

- ``resave``: three saves to one path (``URI/o``), each with another shard plan (dim 0, dim 1, replicated), each
  loaded with the next plan; every save replaces the last; ``overwrite=False`` is refused; what is left is the last
  save's files only.
- ``options``: every ``FileSystemWriter`` option (one file per item, no fsync, 4 threads, ZStandard) saved and
  loaded back (``URI/z``).
- ``interop``: what fastckpt wrote read by DCP's own readers (``FileSystemReader`` locally, ``FsspecReader`` on S3),
  and a checkpoint of the stock writers read by fastckpt's ``Reader`` (only with ``allow_uncommitted=True``).
- ``crash``: ``URI/k`` saved, then saved over while rank 1 dies mid-upload; ``survivor``: ``URI/k`` loads the first.

Exit status 0 when every rank's check passed.
"""

from __future__ import annotations

import os
import sys
import tempfile
from urllib.parse import parse_qs, urlsplit

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint._extension import ZStandard
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

import fastckpt.checkpoint.writer
import fastckpt.torch as ft
from fastckpt import open_store, parse_uri
from fastckpt._loop import run_sync
from fastckpt.torch.dcp import Reader, Writer
from harness.uris import below
from tests.ranks.dcp_job import cpu_mesh, die_mid_upload, full_state, job_main

PLANS = [[Shard(0)], [Shard(1)], [Replicate()]]


def state(full: dict[str, torch.Tensor], mesh, plan: list, step: int) -> dict:
    """A model and optimizer state laid out by ``plan`` (the 1-D bias always sharded on dim 0 or replicated)."""
    def place(v: torch.Tensor) -> torch.Tensor:
        return distribute_tensor(v, mesh, plan if v.dim() > 1 or plan == [Replicate()] else [Shard(0)])

    return {"model": {k: place(v) for k, v in full.items()}, "optim": {k: place(v * 0.5) for k, v in full.items()},
            "step": step, "run": "llm"}


def empty(mesh, plan: list) -> dict:
    target = state({k: torch.zeros_like(v) for k, v in full_state(0).items()}, mesh, plan, -1)
    target["run"] = ""
    return target


def check(loaded: dict, full: dict[str, torch.Tensor], step: int) -> None:
    for k, v in full.items():
        assert torch.equal(loaded["model"][k].full_tensor(), v), f"model {k} differs"
        assert torch.equal(loaded["optim"][k].full_tensor(), v * 0.5), f"optim {k} differs"
    assert (loaded["step"], loaded["run"]) == (step, "llm"), (loaded["step"], loaded["run"])


def keys(uri: str) -> list[str]:
    """The keys below ``uri``, relative to it."""
    target = parse_uri(uri)

    async def listing() -> list[str]:
        async with open_store(target) as store:
            return sorted([m.key[len(target.key) + 1:] async for m in store.list(target.key)])

    return run_sync(listing())


def plain(uri: str) -> str:
    """``uri`` as DCP's own readers take it: a local path, or ``s3://bucket/key`` with the endpoint in the
    environment (s3fs reads ``AWS_ENDPOINT_URL``)."""
    parts = urlsplit(uri)
    if parts.scheme in ("", "file"):
        return parts.path
    endpoint = parse_qs(parts.query).get("endpoint_override")
    if endpoint:
        os.environ["AWS_ENDPOINT_URL"] = endpoint[0]
    return f"{parts.scheme}://{parts.netloc}{parts.path}"


def resave(rank: int, mesh, base: str) -> None:
    uri = below(base, "o")
    for i, plan in enumerate(PLANS):
        dcp.save(state(full_state(10 + i), mesh, plan, i), storage_writer=Writer(uri))
        check(_load(uri, mesh, PLANS[(i + 1) % len(PLANS)]), full_state(10 + i), i)
    try:
        dcp.save(state(full_state(99), mesh, PLANS[0], 99), storage_writer=Writer(uri, overwrite=False))
        raise AssertionError("overwrite=False saved over a committed checkpoint")
    except dcp.api.CheckpointException as exc:
        assert "overwrite=False" in str(exc), exc
    check(_load(uri, mesh, PLANS[0]), full_state(12), 2)
    dist.barrier()
    if rank == 0:  # the last save's files, in its folder, and the index DCP's readers open; nothing older
        left = keys(uri)
        folders = {k.split("/")[0] for k in left if k.startswith("v-")}
        assert len(folders) == 1 and all(k.startswith((".fastckpt/", ".metadata", *folders)) for k in left), left
    group_reads_of_a_replaced_checkpoint(rank, uri, base)


def group_reads_of_a_replaced_checkpoint(rank: int, uri: str, base: str) -> None:
    """``fastckpt.torch.save(overwrite=True)`` and the group paths (``load(group=)``, ``download_checkpoint(group=)``)
    on checkpoints whose files lie in a folder of their own."""
    own = below(base, "t")
    for step in (1, 2):
        ft.save({"w": torch.full((256,), float(step + rank)), "step": step}, own, overwrite=step > 1)
    back = ft.load(own, rank=rank, world_size=dist.get_world_size(), group=dist.group.WORLD)
    assert torch.equal(back["w"], torch.full((256,), float(2 + rank))) and back["step"] == 2
    with tempfile.TemporaryDirectory() as out:
        fastckpt.download_checkpoint(uri, out, group=dist.group.WORLD)
        assert sorted(os.listdir(out)) == [".metadata", ".metadata.fastckpt", "rank-00000.distcp",
                                           "rank-00001.distcp"], os.listdir(out)


def _load(uri: str, mesh, plan: list, **options: object) -> dict:
    target = empty(mesh, plan)
    dcp.load(target, storage_reader=Reader(uri, **options))
    return target


def options(rank: int, mesh, base: str) -> None:
    uri = below(base, "z")
    writer = Writer(uri, single_file_per_rank=False, sync_files=False, thread_count=4, per_thread_copy_ahead=0,
                    overwrite=True, _extensions=[ZStandard()])
    dcp.save(state(full_state(20), mesh, PLANS[0], 20), storage_writer=writer)
    check(_load(uri, mesh, PLANS[1]), full_state(20), 20)
    dist.barrier()
    if rank == 0:
        names = [k for k in keys(uri) if k.endswith(".distcp")]
        assert len(names) > dist.get_world_size(), names  # one file per item


def interop(rank: int, mesh, base: str) -> None:
    ours, theirs = below(base, "ours"), below(base, "theirs")
    dcp.save(state(full_state(30), mesh, PLANS[0], 30), storage_writer=Writer(ours))
    dcp.save(state(full_state(31), mesh, PLANS[0], 31), storage_writer=Writer(ours))  # in a folder of its own now
    local = urlsplit(base).scheme in ("", "file")
    stock_reader = FileSystemReader(plain(ours)) if local else FsspecReader(plain(ours))
    target = empty(mesh, PLANS[1])
    dcp.load(target, storage_reader=stock_reader)
    check(target, full_state(31), 31)

    stock_writer = FileSystemWriter(plain(theirs)) if local else FsspecWriter(plain(theirs))
    dcp.save(state(full_state(32), mesh, PLANS[0], 32), storage_writer=stock_writer)
    try:
        _load(theirs, mesh, PLANS[1])
        raise AssertionError("a checkpoint without a commit marker was read")
    except dcp.api.CheckpointException as exc:
        assert "allow_uncommitted=True" in str(exc), exc
    check(_load(theirs, mesh, PLANS[1], allow_uncommitted=True), full_state(32), 32)


def crash(rank: int, mesh, base: str) -> None:
    uri = below(base, "k")
    dcp.save(state(full_state(40), mesh, PLANS[0], 40), storage_writer=Writer(uri))
    dist.barrier()
    if rank == 1:
        fastckpt.checkpoint.writer.upload_layout = die_mid_upload
    dcp.save(state(full_state(41), mesh, PLANS[1], 41), storage_writer=Writer(uri))


def rank_main(rank: int, mode: str, base: str, world: int, port: int) -> None:
    with cpu_mesh(rank, world, port) as mesh:
        if mode == "survivor":
            check(_load(below(base, "k"), mesh, PLANS[2]), full_state(40), 40)
        else:
            {"resave": resave, "options": options, "interop": interop, "crash": crash}[mode](rank, mesh, base)
        dist.barrier()


if __name__ == "__main__":
    sys.exit(job_main(rank_main, timeout=150))
