"""A torch.distributed.checkpoint job over fastckpt: ``python -m tests.ranks.dcp_job MODE URI WORLD PORT``.

Forks ``WORLD`` gloo ranks that hold an FSDP-style state (DTensors sharded on dim 0 over a CPU mesh).
Modes:

- ``save``: ``dcp.save`` to ``URI/a``, ``dcp.async_save`` to ``URI/b``, then two more through one writer that keeps
  its staging memory (``URI/b21``, ``URI/b22``), all loaded back and compared.
- ``load``: ``URI/a`` and ``URI/b`` loaded by this world size (resharded).
- ``crash``: rank 2 dies while uploading its share of ``URI/c``; ``resave``: ``URI/c`` saved and loaded.
- ``incr``: DCP and ``fastckpt.torch`` saves with ``base="latest"`` (frozen weights copied, not sent), loaded after
  their bases are deleted.
- ``tier``: each rank saves into its own node's tier (``TIER_ROOT/node-R``), the agents commit at ``URI/d``; a
  restart reads each rank's own file from its node's tier.
- ``ft``: ``fastckpt.torch`` async_save and load of each rank's own state (``URI/t``); ``ft-crash``: rank 2
  dies mid-upload of ``URI/u``.

Exit status 0 when every rank's check passed.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

import fastckpt.checkpoint.writer
import fastckpt.torch as ft
from fastckpt import open_store, parse_uri
from fastckpt.config import TransferConfig
from fastckpt.tier import Tier
from fastckpt.torch.dcp import Reader, Writer
from harness.uris import below
from tests.ranks import run_ranks

SHAPES = {"embed": (96, 40), "layer.0.w": (64, 64), "layer.0.b": (64,), "head": (40, 96)}


def full_state(seed: int) -> dict[str, torch.Tensor]:
    """The unsharded tensors of a checkpoint (the same on every rank)."""
    g = torch.Generator().manual_seed(seed)
    out = {name: torch.randn(shape, generator=g) for name, shape in SHAPES.items()}
    out["embed"] = out["embed"].to(torch.bfloat16)
    return out


def sharded(full: dict[str, torch.Tensor], mesh, step: int) -> dict:
    model = {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in full.items()}
    optim = {f"{k}.exp_avg": distribute_tensor(v * 0.5, mesh, [Shard(0)]) for k, v in full.items()}
    return {"model": model, "optim": optim, "step": step, "run": "llm"}


def check(loaded: dict, full: dict[str, torch.Tensor], step: int) -> None:
    for k, v in full.items():
        assert torch.equal(loaded["model"][k].full_tensor(), v), f"model {k} differs"
        assert torch.equal(loaded["optim"][f"{k}.exp_avg"].full_tensor(), v * 0.5), f"optim {k} differs"
    assert loaded["step"] == step and loaded["run"] == "llm", (loaded["step"], loaded["run"])


def load_into(uri: str, mesh, seed: int) -> dict:
    target = sharded({k: torch.zeros_like(v) for k, v in full_state(seed).items()}, mesh, -1)
    target["run"] = ""
    dcp.load(target, storage_reader=Reader(uri))
    return target


async def die_mid_upload(transfer, layout, key, **_):  # type: ignore[no-untyped-def]
    """Rank 2 of a ``crash`` job: starts its multipart upload, sends one part and dies."""
    mpu = await transfer.store.create_multipart(key, transfer.store.min_part_size, None, if_absent=True)
    await mpu.put_part(0, layout.pieces(0, layout.size // 2)[0])
    os._exit(9)


async def remove(uri: str) -> None:
    target = parse_uri(uri)
    async with open_store(target) as store:
        await store.delete_many([m.key async for m in store.list(target.key)])


def incremental_saves(rank: int, world: int, mesh, base: str) -> None:
    """DCP and fastckpt.torch saves with ``base="latest"``: what did not change is copied, not sent, and each
    checkpoint loads after its base is deleted."""
    cfg = TransferConfig(part_size=1 << 20, multipart_threshold=1 << 20)
    frozen = {f"w{i}": distribute_tensor(torch.randn(1024, 512, generator=torch.Generator().manual_seed(i)), mesh,
                                         [Shard(0)]) for i in range(4)}  # 1 MiB a rank each

    def state(step: int) -> dict:
        adapter = distribute_tensor(torch.full((64, 8), float(step)), mesh, [Shard(0)])
        return {"model": {**frozen, "lora": adapter}, "step": step}

    writers = []
    for step in (1, 2):
        writers.append(Writer(below(base, f"dcp-{step}"), config=cfg, base="latest"))
        dcp.save(state(step), storage_writer=writers[-1])
    torch_results = [ft.save({"w": frozen["w0"].to_local().clone(), "step": torch.tensor(step)},
                             below(base, f"ft/{step}"), config=cfg, base="latest") for step in (1, 2)]
    dist.barrier()
    if rank == 0:
        first, second = writers[0].result, writers[1].result
        assert first is not None and second is not None and first.copied == 0, (first, second)
        assert second.copied >= 4 * world * (1 << 20) and second.sent < (1 << 20), second  # the frozen weights
        assert torch_results[1].copied >= world * (1 << 20), torch_results[1]
        asyncio.run(remove(below(base, "dcp-1")))
        asyncio.run(remove(below(base, "ft/1")))
    dist.barrier()
    target = {"model": {k: distribute_tensor(torch.zeros(1024, 512), mesh, [Shard(0)]) for k in frozen}, "step": 0}
    target["model"]["lora"] = distribute_tensor(torch.zeros(64, 8), mesh, [Shard(0)])
    dcp.load(target, storage_reader=Reader(below(base, "dcp-2")))
    assert target["step"] == 2 and torch.equal(target["model"]["lora"].full_tensor(), torch.full((64, 8), 2.0))
    assert all(torch.equal(target["model"][k].full_tensor(), v.full_tensor()) for k, v in frozen.items())
    back = ft.load(below(base, "ft/2"), rank=rank, world_size=world)
    assert torch.equal(back["w"], frozen["w0"].to_local()) and int(back["step"]) == 2


def restart_from_tiers(rank: int, mesh, uri: str, tier: str) -> None:
    """A restart on the same nodes: each rank reads its own rank's file from its node's tier, what it needs of the
    other ranks' files from the bucket."""
    target = sharded({k: torch.zeros_like(v) for k, v in full_state(7).items()}, mesh, -1)
    target["run"] = ""
    reader = Reader(uri, tier=tier)
    dcp.load(target, storage_reader=reader)
    check(target, full_state(7), 70)
    own = os.path.getsize(os.path.join(Tier(tier).copy_of(uri).raw, f"rank-{rank:05d}.distcp"))
    assert reader.bytes_read["tier"] >= own, (own, reader.bytes_read)


@contextlib.contextmanager
def cpu_mesh(rank: int, world: int, port: int) -> Iterator[DeviceMesh]:
    """This rank in a gloo world of ``world`` ranks meeting at 127.0.0.1:``port``, and a 1-D CPU mesh over it; the
    process group is destroyed after."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        yield init_device_mesh("cpu", (world,))
    finally:
        dist.destroy_process_group()


def rank_main(rank: int, mode: str, base: str, world: int, port: int) -> None:
    with cpu_mesh(rank, world, port) as mesh:
        if mode == "save":
            dcp.save(sharded(full_state(1), mesh, 10), storage_writer=Writer(below(base, "a")))
            dcp.async_save(sharded(full_state(2), mesh, 20), storage_writer=Writer(below(base, "b"))).result()
            check(load_into(below(base, "a"), mesh, 1), full_state(1), 10)
            check(load_into(below(base, "b"), mesh, 2), full_state(2), 20)
            writer = Writer(cache_staged_state_dict=True)
            for seed in (21, 22):  # the second save is staged into the memory the first was
                dcp.async_save(sharded(full_state(seed), mesh, seed), checkpoint_id=below(base, f"b{seed}"),
                               storage_writer=writer).result()
            writer.close()
            for seed in (21, 22):
                check(load_into(below(base, f"b{seed}"), mesh, seed), full_state(seed), seed)
        elif mode == "load":
            check(load_into(below(base, "a"), mesh, 1), full_state(1), 10)
            check(load_into(below(base, "b"), mesh, 2), full_state(2), 20)
        elif mode == "crash":
            if rank == 2:
                fastckpt.checkpoint.writer.upload_layout = die_mid_upload
            dcp.save(sharded(full_state(3), mesh, 30), storage_writer=Writer(below(base, "c")))
        elif mode == "ft":  # fastckpt.torch on every rank: the barrier is torch.distributed's, by default
            own = {"shard": full_state(5)["layer.0.w"][rank::world].clone(), "rank": rank}
            ft.async_save(own, below(base, "t"), staging=ft.Staging()).wait()
            back = ft.load(below(base, "t"), rank=rank, world_size=world)
            assert torch.equal(back["shard"], own["shard"]) and back["rank"] == rank
        elif mode == "ft-crash":
            if rank == 2:
                fastckpt.checkpoint.writer.upload_layout = die_mid_upload
            ft.save({"shard": full_state(6)["head"][rank::world].clone()}, below(base, "u"))
        elif mode == "incr":  # frozen weights, trained adapters: the second save copies the weights' parts
            incremental_saves(rank, world, mesh, base)
        elif mode == "tier":  # every rank into its own node's tier; the agents drain and commit at the URI
            tier = os.path.join(os.environ["TIER_ROOT"], f"node-{rank}")
            writer = Writer(below(base, "d"), tier=tier)
            dcp.async_save(sharded(full_state(7), mesh, 70), storage_writer=writer).result()
            if rank == 0:
                assert writer.wait_durable(timeout=120).uri == below(base, "d")
            dist.barrier()
            check(load_into(below(base, "d"), mesh, 7), full_state(7), 70)
            restart_from_tiers(rank, mesh, below(base, "d"), tier)
        elif mode == "resave":
            dcp.save(sharded(full_state(4), mesh, 40), storage_writer=Writer(below(base, "c")))
            check(load_into(below(base, "c"), mesh, 4), full_state(4), 40)
        dist.barrier()


def job_main(rank_main: Callable[[int, str, str, int, int], None], timeout: float = 240) -> int:
    """``python -m JOB MODE URI WORLD PORT``: ``rank_main(rank, MODE, URI, WORLD, PORT)`` on ``WORLD`` ranks; 0 when
    every rank passed."""
    mode, uri, world, port = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    codes = run_ranks(rank_main, world, mode, uri, world, port, timeout=timeout)
    return 0 if all(c == 0 for c in codes) else 1


if __name__ == "__main__":
    sys.exit(job_main(rank_main))
