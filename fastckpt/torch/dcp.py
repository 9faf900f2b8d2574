"""A ``torch.distributed.checkpoint`` storage plugin: ``dcp.save`` / ``async_save`` / ``load`` on any backend.

Each rank writes its items into one file, ``rank-NNNNN.distcp`` (tensor bytes raw, byte items as DCP hands
them over; in incremental saves its items of 1 MiB and more go to ``rank-NNNNN-large.distcp``), created if
absent, with its chunk digests in the rank's manifest. The ranks' manifests reach the coordinator through
DCP's own gather; in ``finish`` it writes DCP's ``.metadata`` and every manifest, then the commit marker. A
save is visible only once the marker exists: DCP's ``.metadata`` alone commits nothing, and a rank that dies
mid-save leaves an attempt that ``gc`` removes.

The reader opens committed checkpoints only. Any rank may read any part of any file (DCP reshards on
load); every chunk read is checked against its recorded digest. ``.metadata`` is read with
``torch.load(weights_only=True)``, allowing DCP's metadata classes and nothing else. With ``group=``
(``Reader(uri, group=pg)``), the metadata is read once for the group and each byte that several ranks need is read
from storage once (``group_dcp``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import io
import os
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint import metadata as dcp_meta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.staging import AsyncStager, BlockingAsyncStager, DefaultStager, StagingOptions
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from ..checkpoint.attempt import attempt_from_env, new_attempt_id
from ..checkpoint.barrier import HandedBarrier
from ..checkpoint.base import BaseCheckpoint, resolve_base
from ..checkpoint.commit import CommitResult
from ..checkpoint.manifest import RankManifest
from ..checkpoint.writer import CheckpointWriter
from ..config import TransferConfig
from ..engine.layout import Layout
from ..errors import CheckpointError
from ..stores.base import Store
from ..threads import off_loop
from ..tier import Tier, ensure_agent
from ..tier.layout import TierStore
from ..tier.save import supersede, wait_durable
from ..uri import StorageURI
from .dcp_layout import rank_file, rank_files
from .dcp_location import METADATA, StoredItem, _done, _Location, _run
from .dcp_reader import Reader
from .staging import byte_view
from .tier_staging import write_in_tier

__all__ = ["Reader", "StoredItem", "Writer"]


@dataclass(frozen=True)
class _RankPlan:
    """What the coordinator tells each rank: the attempt, its rank, the world size, and what of the base checkpoint
    the rank's file may copy from (``BaseCheckpoint`` bytes)."""

    attempt: str
    rank: int
    world_size: int
    base: bytes | None = None


class Writer(_Location, StorageWriter, AsyncStager):
    """``StorageWriter`` for ``dcp.save`` / ``dcp.async_save`` to the fastckpt checkpoint ``uri`` (any backend).

    ``attempt`` names the run (default: from the environment, else drawn by the coordinator). ``base`` (a committed
    checkpoint's URI, or ``"latest"``) makes each save incremental: the coordinator reads the base once and each rank
    has the store copy the parts of its file that hold the same bytes as the base's file of that rank. ``tier`` (this
    node's tier directory): each rank's file goes into its node's tier and the save commits there, on the
    coordinator's node (the ``fastckpt.tier`` agents drain it to ``uri``: ``wait_durable``; with ``base``, each agent
    resolves the base in the durable store as it drains, and has the store copy the unchanged bytes).
    ``cache_staged_state_dict`` (as on DCP's ``FileSystemWriter``): ``dcp.async_save`` stages into host memory kept
    for the next save through this writer (``stage``; with DCP's default thread-based ``async_save``: a process-based
    one writes in another process, so each save stages afresh). One save at a time per writer, as with DCP's own.
    """

    _synchronize_after_execute = False
    """``stage`` returns once the copy is done: there is nothing for DCP to synchronize."""

    def __init__(self, uri: str | os.PathLike[str] | None = None, *, attempt: str | None = None,
                 config: TransferConfig | None = None, base: str | None = None,
                 tier: str | os.PathLike[str] | Tier | None = None, cache_staged_state_dict: bool = False) -> None:
        super().__init__()
        self.uri = os.fspath(uri) if uri is not None else None
        self.attempt, self.config, self.base = attempt, config, base
        self.cache_staged_state_dict = cache_staged_state_dict
        self._stager: DefaultStager | None = None
        self._cache_in_use = False
        """A save staged into the cache has not written its data yet."""
        self.tier = tier if tier is None or isinstance(tier, Tier) else Tier(tier)
        self.result: CommitResult | None = None
        """On the coordinator, once a save is committed: its totals (bytes ``sent`` and ``copied``)."""
        self._planned: str | None = None
        """The attempt the coordinator drew for the current save."""

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id is not None:
            self.uri = os.fspath(checkpoint_id)

    @contextlib.asynccontextmanager
    async def _store(self) -> AsyncIterator[tuple[StorageURI, TransferConfig, Store]]:
        """As ``_Location._store``; a save into a tier works on this node's copy of the checkpoint there."""
        if self.tier is None:
            async with super()._store() as found:
                yield found
            return
        target, cfg = self._where()
        yield self.tier.copy_of(target), cfg, TierStore()

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """``dcp.async_save``'s copy of ``state_dict`` in host memory. Without ``cache_staged_state_dict``, fresh
        memory each save, as DCP's default stager. With it, memory kept from the last save (pinned where CUDA is
        available) and refilled: filling fresh pages made the copy 4.5x slower (1 GiB: 0.45 s against 0.10 s, this
        host), and that copy is the time training is blocked. A save staged while the previous one from this writer
        has not written its data yet (or failed before it did) gets fresh memory, never the memory being written."""
        if not self.cache_staged_state_dict or self._cache_in_use:
            return BlockingAsyncStager().stage(state_dict)
        if self._stager is None:
            cuda = torch.cuda.is_available()
            self._stager = DefaultStager(StagingOptions(cuda, False, False, cuda))
        self._cache_in_use = True
        return self._stager.stage(state_dict)

    def __getstate__(self) -> dict[str, Any]:
        """Without the kept staging memory (``dcp.async_save(..., async_checkpointer_type=PROCESS)`` sends the writer
        to the process that writes; staging stays in this one)."""
        return {**self.__dict__, "_stager": None}

    def synchronize_staging(self) -> None:
        """Nothing to wait for (``stage`` returns once its copy is done)."""

    def close(self) -> None:
        """Free the staging memory kept for the next save."""
        if self._stager is not None:
            self._stager.close()
            self._stager = None

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if kwargs.get("use_collectives") is False:
            raise ValueError("fastckpt.torch.dcp.Writer commits through DCP's collectives: use_collectives=False "
                             "is not supported")

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        self._target()
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        attempt = self._planned = self.attempt or attempt_from_env() or new_attempt_id()
        bases = _run(self._bases(len(plans))) if self.base is not None and self.tier is None else [None] * len(plans)
        return [dataclasses.replace(p, storage_data=_RankPlan(attempt, i, len(plans), bases[i]))
                for i, p in enumerate(plans)]

    async def _bases(self, world_size: int) -> list[bytes | None]:
        """Each rank's share of the base checkpoint (its own file's entry), read once here."""
        assert self.base is not None
        async with self._store() as (target, _, store):
            found = await resolve_base(store, target, self.base)
        if found is None:
            return [None] * world_size
        return [BaseCheckpoint(found.uri, found.key, {n: e for n, e in found.files.items()
                                                      if n in (rank_file(r), rank_file(r, "large"))}).encode()
                for r in range(world_size)]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future:
        where: _RankPlan = plan.storage_data
        items: list[tuple[memoryview, torch.dtype | None, tuple[int, ...] | None]] = []
        for item in plan.items:
            data = planner.resolve_data(item)
            if item.type == WriteItemType.BYTE_IO:
                items.append((memoryview(data.getbuffer()).cast("B"), None, None))
            else:
                tensor = data.detach().to("cpu").contiguous()
                items.append((byte_view(tensor), tensor.dtype, tuple(tensor.shape)))
        stored: list[StoredItem | None] = [None] * len(items)
        files = []
        for name, indexes in rank_files(where.rank, [len(v) for v, _, _ in items], self.base is not None):
            offset = 0
            for i in indexes:
                view, dtype, shape = items[i]
                stored[i] = StoredItem(name, offset, len(view), dtype, shape)
                offset += len(view)
            files.append((name, Layout([items[i][0] for i in indexes])))
        try:
            manifest = _run(self._write(where, files))
        finally:
            self._cache_in_use = False  # the staged tensors are read no more
        done = [s for s in stored if s is not None]
        if done:
            done[0] = dataclasses.replace(done[0], manifest=manifest)
        return _done([WriteResult(index=i.index, size_in_bytes=s.length, storage_data=s)
                      for i, s in zip(plan.items, done, strict=True)])

    async def _write(self, where: _RankPlan, files: list[tuple[str, Layout]]) -> bytes:
        async with self._store() as (target, cfg, store):
            base = BaseCheckpoint.decode(where.base, f"base of {target.raw}") if where.base else None
            if self.tier is not None:
                await off_loop(supersede, self.tier, self._where()[0])
                await off_loop(self.tier.check_room, [layout.size for _, layout in files])
            writer = CheckpointWriter(target, rank=where.rank, world_size=where.world_size, attempt=where.attempt,
                                      config=cfg, barrier=HandedBarrier({}), store=store, base=base,
                                      per_node=self.tier is not None)
            await writer.__aenter__()
            try:
                for name, layout in files:
                    if layout.size and self.tier is not None:
                        writer.record_written((await write_in_tier(self.tier, target, name, layout, cfg),))
                    elif layout.size:
                        await writer.put_layout(name, layout)
            except BaseException as exc:
                with contextlib.suppress(Exception):  # the upload's own error is what the caller sees
                    await writer.hand_off(exc)
                raise
            manifest = await writer.hand_off()
        if where.rank != 0:  # the coordinator's rank is queued once it committed
            await self._queue(where.attempt, where.rank)
        return manifest

    async def _queue(self, attempt: str, rank: int) -> None:
        """Saves into a tier: queue rank ``rank``'s copy for the node agent (started if none runs)."""
        if self.tier is not None:
            await off_loop(functools.partial(self.tier.enqueue, self._target(), attempt, rank, time.time(),
                                             base=self.base))
            await off_loop(ensure_agent, self.tier)

    def finish(self, metadata: dcp_meta.Metadata, results: list[list[WriteResult]]) -> None:
        manifests: dict[int, RankManifest] = {}
        storage: dict[dcp_meta.MetadataIndex, StoredItem] = {}
        for rank, rank_results in enumerate(results):
            for r in rank_results:
                item: StoredItem = r.storage_data
                if item.manifest is not None:
                    manifests[rank] = RankManifest.decode(item.manifest, f"manifest of rank {rank}")
                storage[r.index] = dataclasses.replace(item, manifest=None)
        metadata.storage_data = storage
        buf = io.BytesIO()
        torch.save(metadata, buf)
        _run(self._commit(buf.getvalue(), manifests, len(results)))

    async def _commit(self, metadata: bytes, manifests: dict[int, RankManifest], world_size: int) -> None:
        """Coordinator: write ``.metadata``, then commit every rank's manifest (ranks without items wrote none)."""
        attempt = self._planned
        if attempt is None or any(m.attempt != attempt for m in manifests.values()):
            raise CheckpointError(f"DCP save to {self.uri}: the ranks' manifests are not of attempt {attempt!r}")
        own = manifests.pop(0, None)
        handed = {r: manifests.get(r, RankManifest(attempt, r, world_size)).encode() for r in range(1, world_size)}
        async with self._store() as (target, cfg, store):
            writer = CheckpointWriter(target, rank=0, world_size=world_size, attempt=attempt, config=cfg,
                                      barrier=HandedBarrier(handed), store=store, per_node=self.tier is not None)
            async with writer:
                if own is not None:
                    writer.record_written(own.files, own.copied)
                await writer.put_layout(METADATA, Layout([metadata]))
        self.result = writer.result
        await self._queue(attempt, 0)

    def wait_durable(self, timeout: float | None = None) -> CommitResult:
        """Saves into a tier, on the coordinator: wait until the agents committed the last save at ``uri`` (see
        ``SaveHandle.wait``); its result there."""
        if self.tier is None or self.result is None:
            raise CheckpointError("wait_durable: no save into a tier was committed by this writer (coordinator)")
        return _run(wait_durable(self.tier, self._target(), self.result, 0, timeout))

    def storage_meta(self) -> dcp_meta.StorageMeta | None:
        return dcp_meta.StorageMeta(checkpoint_id=self.uri)
