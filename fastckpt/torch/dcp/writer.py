"""The DCP storage writer (``Writer``): each rank's items into its file(s) in DCP's own format, the coordinator's
``.metadata``, fastckpt's index and the commit; saves into a tier; the stock ``FileSystemWriter`` arguments."""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
import os
import pickle
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint import metadata as dcp_meta
from torch.distributed.checkpoint._extension import StreamTransformExtension
from torch.distributed.checkpoint.filesystem import (
    CURRENT_DCP_VERSION,
    SerializationFormat,
    _StorageInfo,
    _StorageWriterTransforms,
)
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.staging import AsyncStager, BlockingAsyncStager, DefaultStager, StagingOptions
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from ... import stats
from ...checkpoint.attempt import attempt_from_env, new_attempt_id
from ...checkpoint.barrier import HandedBarrier
from ...checkpoint.base import BaseCheckpoint, resolve_base
from ...checkpoint.commit import CommitResult
from ...checkpoint.manifest import RankManifest, check_metrics, generation_root, marker_key
from ...checkpoint.retention import Retention, retain_beside
from ...checkpoint.writer import CheckpointWriter
from ...config import TransferConfig
from ...engine.layout import Layout
from ...errors import CheckpointError
from ...stores.base import Store
from ...threads import off_loop
from ...tier import Tier, ensure_agent
from ...tier.directory import Drain, TierStore
from ...tier.save import supersede, wait_durable
from ...uri import StorageURI
from ..staging import byte_view
from ..tiered.staging import write_in_tier
from .files import rank_files
from .format import INDEX, Encoded, encode, encode_index, exact
from .location import METADATA, StoredItem, _done, _Location, _run, storage_query

__all__ = ["Writer"]


@dataclass(frozen=True)
class _RankPlan:
    """What the coordinator tells each rank: the attempt, its rank, the world size, the folder of the files
    (``overwrite``: the attempt's own), and what of the base checkpoint the rank's file may copy from
    (``BaseCheckpoint`` bytes)."""

    attempt: str
    rank: int
    world_size: int
    base: bytes | None = None
    root: str = ""


class Writer(_Location, StorageWriter, AsyncStager):
    """``StorageWriter`` for ``dcp.save`` / ``dcp.async_save`` to the fastckpt checkpoint ``path`` (any backend): takes
    ``FileSystemWriter``'s arguments.

    - ``single_file_per_rank``: one file per rank (default), else one per item. ``sync_files=False``: local stores
      do not fsync (as ``TransferConfig(fsync=False)``). ``thread_count``, when given, caps the requests in flight
      (``TransferConfig.max_in_flight``; by default fastckpt sizes them to the link). ``per_thread_copy_ahead`` has no
      meaning here: tensors are sent from their own memory, nothing is copied ahead.
    - ``overwrite`` (DCP's default: True): a save to a path that holds a committed checkpoint replaces it atomically
      (see the module); False: CheckpointError. Saves into a ``tier`` commit each step to a URI of its own and
      do not overwrite.
    - ``_extensions`` (``StreamTransformExtension``: ``ZStandard``, your own): applied to every item and recorded in
      ``.metadata`` as DCP records them; the digests cover the stored (transformed) bytes. ``serialization_format``:
      ``TORCH_SAVE`` only (what the stock readers read).
    - ``cache_staged_state_dict``: ``dcp.async_save`` stages into host memory kept for the next save (``stage``).

    ``attempt`` names the run (default: from the environment, else drawn by the coordinator). ``base`` (a committed
    checkpoint's URI, or ``"latest"``) makes each save incremental: the coordinator reads the base once and each rank
    has the store copy the parts of its file that hold the same bytes as the base's file of that rank. ``tier`` (this
    node's tier directory): each rank's file goes into its node's tier and the save commits there, on the
    coordinator's node (the ``fastckpt.tier`` agents drain it to ``path``: ``wait_durable``; with ``base``, each agent
    resolves the base in the durable store as it drains, and has the store copy the unchanged bytes). One save at a
    time per writer, as with DCP's own. ``uri=`` is the same as ``path``. ``metrics`` (name: number): recorded in
    the commit marker. ``retention`` (a ``fastckpt.Retention``): once a save is committed at ``path``, the
    coordinator (with ``tier``: the agent) removes the checkpoints beside it that the policy does not keep.
    """

    _synchronize_after_execute = False
    """``stage`` returns once the copy is done: there is nothing for DCP to synchronize."""

    def __init__(self, path: str | os.PathLike[str] | None = None, single_file_per_rank: bool = True,
                 sync_files: bool = True, thread_count: int | None = None, per_thread_copy_ahead: int = 10_000_000,
                 cache_staged_state_dict: bool = False, overwrite: bool | None = None,
                 _extensions: Sequence[StreamTransformExtension] | None = None,
                 serialization_format: SerializationFormat = SerializationFormat.TORCH_SAVE, *,
                 uri: str | os.PathLike[str] | None = None, attempt: str | None = None,
                 config: TransferConfig | None = None, base: str | None = None,
                 tier: str | os.PathLike[str] | Tier | None = None, metrics: Mapping[str, float] | None = None,
                 retention: Retention | None = None, **storage_options: Any) -> None:
        super().__init__()
        if path is not None and uri is not None:
            raise ValueError("give the checkpoint as path or as uri=, not both")
        self.storage_options = storage_query(storage_options)
        if serialization_format != SerializationFormat.TORCH_SAVE:
            raise ValueError(f"serialization_format={serialization_format}: fastckpt writes DCP's TORCH_SAVE format "
                             "(what FileSystemReader reads)")
        if thread_count is not None and thread_count < 1:
            raise ValueError(f"thread_count={thread_count}: need at least 1")
        self.tier = tier if tier is None or isinstance(tier, Tier) else Tier(tier)
        if overwrite and self.tier is not None:
            raise ValueError("a save into a tier commits each step to a URI of its own: overwrite=True is not "
                             "supported with tier=")
        where = path if path is not None else uri
        self.uri = os.fspath(where) if where is not None else None
        self.attempt, self.base = attempt, base
        self.metrics, self.retention = check_metrics(metrics or {}), retention
        self.config = _with_stock_options(config, sync_files, thread_count)
        self.single_file_per_rank, self.per_thread_copy_ahead = single_file_per_rank, per_thread_copy_ahead
        self.overwrite = self.tier is None if overwrite is None else overwrite
        self.transforms = _StorageWriterTransforms(_extensions)
        self.cache_staged_state_dict = cache_staged_state_dict
        self._stager: DefaultStager | None = None
        self._cache_in_use = False
        """A save staged into the cache has not written its data yet."""
        self.result: CommitResult | None = None
        """On the coordinator, once a save is committed: its totals (bytes ``sent`` and ``copied``)."""
        self._planned: _RankPlan | None = None
        """The coordinator's plan of the current save (its own rank's)."""

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id is not None:
            self.uri = os.fspath(checkpoint_id)

    @property
    def checkpoint_id(self) -> str | None:
        """The checkpoint the next save writes (``FileSystemWriter``'s property)."""
        return self.uri

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
        attempt = self.attempt or attempt_from_env() or new_attempt_id()
        committed = self.tier is None and _run(self._committed())
        if committed and not self.overwrite:
            raise CheckpointError(f"checkpoint {self.uri} already exists and overwrite=False (as FileSystemWriter "
                                  "refuses it); overwrite=True replaces it atomically")
        bases = _run(self._bases(len(plans))) if self.base is not None and self.tier is None else [None] * len(plans)
        root = generation_root(attempt) if committed else ""  # a first save lies at the top, as the stock writer's
        ranked = [_RankPlan(attempt, i, len(plans), bases[i], root) for i in range(len(plans))]
        self._planned = ranked[0]
        return [dataclasses.replace(p, storage_data=r) for p, r in zip(plans, ranked, strict=True)]

    async def _committed(self) -> bool:
        """Whether a checkpoint is committed at the path."""
        async with self._store() as (target, _, store):
            return await store.exists(marker_key(target.key))

    async def _bases(self, world_size: int) -> list[bytes | None]:
        """Each rank's share of the base checkpoint (its own files' entries), read once here."""
        assert self.base is not None
        async with self._store() as (target, _, store):
            found = await resolve_base(store, target, self.base, overwrite=self.overwrite)
        if found is None:
            return [None] * world_size
        return [BaseCheckpoint(found.uri, found.key, {n: e for n, e in found.files.items() if _rank_of(n) == r},
                               found.root).encode()
                for r in range(world_size)]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future:
        where: _RankPlan = plan.storage_data
        resolved = [d if i.type == WriteItemType.BYTE_IO else exact(d)
                    for i, d in ((i, planner.resolve_data(i)) for i in plan.items)]

        def one(k: int) -> Encoded:
            item, data = plan.items[k], resolved[k]
            return encode(item, data, self.transforms, None if item.type == WriteItemType.BYTE_IO else byte_view(data))

        if self.transforms.extensions and len(plan.items) > 1:  # compressors release the GIL: items side by side
            with concurrent.futures.ThreadPoolExecutor(min(len(plan.items), os.cpu_count() or 1)) as pool:
                encoded = list(pool.map(one, range(len(plan.items))))
        else:
            encoded = [one(k) for k in range(len(plan.items))]
        stored: list[StoredItem | None] = [None] * len(encoded)
        files = []
        layout = rank_files(where.rank, [e.size for e in encoded], self.base is not None, self.single_file_per_rank)
        for name, indexes in layout:
            offset = 0
            for i in indexes:
                e = encoded[i]
                raw = None if e.raw is None else (offset + e.raw[0], e.raw[1])
                stored[i] = StoredItem(name, offset, e.size, descriptors=None if e.descriptors is None
                                       else tuple(e.descriptors), encoded=True, raw=raw)
                offset += e.size
            files.append((name, Layout([p for i in indexes for p in encoded[i].pieces])))
        try:
            manifest = _run(self._write(where, files))
        finally:
            self._cache_in_use = False  # the staged tensors are read no more
        done = [s for s in stored if s is not None]
        if done:
            done[0] = dataclasses.replace(done[0], manifest=manifest)
        return _done([WriteResult(index=i.index, size_in_bytes=s.length, storage_data=s)
                      for i, s in zip(plan.items, done, strict=True)])

    @stats.summarized("dcp_write")
    async def _write(self, where: _RankPlan, files: list[tuple[str, Layout]]) -> bytes:
        async with self._store() as (target, cfg, store):
            base = BaseCheckpoint.decode(where.base, f"base of {target.raw}") if where.base else None
            if self.tier is not None:
                await off_loop(supersede, self.tier, self._where()[0])
                await off_loop(self.tier.check_room, [layout.size for _, layout in files])
            writer = CheckpointWriter(target, rank=where.rank, world_size=where.world_size, attempt=where.attempt,
                                      config=cfg, barrier=HandedBarrier({}), store=store, base=base,
                                      per_node=self.tier is not None, overwrite=bool(where.root))
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
                                             drain=Drain(self.base, self.retention)))
            await off_loop(ensure_agent, self.tier)

    def finish(self, metadata: dcp_meta.Metadata, results: list[list[WriteResult]]) -> None:
        """Coordinator: DCP's ``.metadata`` (``_StorageInfo`` for every item, as ``FileSystemWriter`` writes it) and
        fastckpt's index, then the commit."""
        plan = self._planned
        if plan is None:
            raise CheckpointError(f"DCP save to {self.uri}: finish() without this writer's global plan")
        manifests: dict[int, RankManifest] = {}
        storage: dict[dcp_meta.MetadataIndex, _StorageInfo] = {}
        index: dict[str, list[tuple[int, int, int]]] = {}
        for rank, rank_results in enumerate(results):
            for r in rank_results:
                item: StoredItem = r.storage_data
                if item.manifest is not None:
                    manifests[rank] = RankManifest.decode(item.manifest, f"manifest of rank {rank}")
                path = f"{plan.root}/{item.name}" if plan.root else item.name
                storage[r.index] = _StorageInfo(path, item.offset, item.length,
                                                list(item.descriptors) if item.descriptors else None)
                if item.raw is not None:
                    index.setdefault(path, []).append((item.offset, *item.raw))
        metadata.version = CURRENT_DCP_VERSION
        metadata.storage_data = storage
        metadata.storage_meta = self.storage_meta()
        _run(self._commit(pickle.dumps(metadata), encode_index(index), manifests, len(results), plan))

    @stats.summarized("dcp_commit")
    async def _commit(self, metadata: bytes, index: bytes, manifests: dict[int, RankManifest], world_size: int,
                      plan: _RankPlan) -> None:
        """Coordinator: write ``.metadata`` and the index, then commit every rank's manifest (ranks without items
        wrote none); with a folder of its own (``overwrite``), ``.metadata`` is published at the top as well."""
        attempt = plan.attempt
        if any(m.attempt != attempt for m in manifests.values()):
            raise CheckpointError(f"DCP save to {self.uri}: the ranks' manifests are not of attempt {attempt!r}")
        own = manifests.pop(0, None)
        handed = {r: manifests.get(r, RankManifest(attempt, r, world_size, root=plan.root)).encode()
                  for r in range(1, world_size)}
        async with self._store() as (target, cfg, store):
            writer = CheckpointWriter(target, rank=0, world_size=world_size, attempt=attempt, config=cfg,
                                      barrier=HandedBarrier(handed), store=store, per_node=self.tier is not None,
                                      overwrite=bool(plan.root), metrics=dict(self.metrics))
            async with writer:
                if own is not None:
                    writer.record_written(own.files, own.copied)
                await writer.put_layout(METADATA, Layout([metadata]))
                await writer.put_layout(INDEX, Layout([index]))
                if plan.root:
                    writer.publish(METADATA, metadata)
            if self.tier is None:
                await retain_beside(store, target, self.retention)
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


def _with_stock_options(config: TransferConfig | None, sync_files: bool, thread_count: int | None
                        ) -> TransferConfig | None:
    """``config`` with ``FileSystemWriter``'s ``sync_files=False`` and ``thread_count`` applied."""
    changes: dict[str, Any] = {}
    if not sync_files:
        changes["fsync"] = False
    if thread_count is not None:
        changes["max_in_flight"] = thread_count
    if not changes:
        return config
    return dataclasses.replace(config or TransferConfig.from_env(), **changes)


def _rank_of(name: str) -> int | None:
    """The rank whose file ``name`` is (``rank-NNNNN...``), else None."""
    head = name.split(".", 1)[0]
    return int(head[5:10]) if head.startswith("rank-") and head[5:10].isdigit() else None

