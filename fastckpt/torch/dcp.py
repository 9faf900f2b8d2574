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

import asyncio
import contextlib
import dataclasses
import io
import os
import queue
from collections import defaultdict
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint import metadata as dcp_meta
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    SavePlan,
    SavePlanner,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from .._loop import BackgroundLoop
from ..checkpoint.attempt import attempt_from_env, new_attempt_id
from ..checkpoint.barrier import HandedBarrier
from ..checkpoint.base import BaseCheckpoint, resolve_base
from ..checkpoint.commit import CommitResult
from ..checkpoint.group import GroupCall
from ..checkpoint.manifest import RankManifest
from ..checkpoint.reader import Checkpoint, open_checkpoint_async
from ..checkpoint.writer import CheckpointWriter
from ..config import TransferConfig
from ..engine.layout import Layout, read_layout
from ..engine.open_stores import store_for
from ..engine.transfer import Transfer
from ..errors import CheckpointError, IntegrityError
from ..stores.base import Store
from ..tasks import gather_all
from ..uri import StorageURI, parse_uri
from .dcp_layout import Span, rank_file, rank_files
from .group_dcp import GroupRead
from .staging import byte_view

METADATA = ".metadata"
GROUP_BYTES = 128 << 20
"""Largest span of one file read in one go on load (ranges closer than a chunk are read together)."""
SPANS_AHEAD = 3
"""Spans read ahead of the one being handed to the planner (memory: about this many times GROUP_BYTES)."""


@dataclass(frozen=True)
class _RankPlan:
    """What the coordinator tells each rank: the attempt, its rank, the world size, and what of the base checkpoint
    the rank's file may copy from (``BaseCheckpoint`` bytes)."""

    attempt: str
    rank: int
    world_size: int
    base: bytes | None = None


@dataclass(frozen=True)
class StoredItem:
    """Where one DCP item lies: ``name`` (file in the checkpoint), byte ``offset`` and ``length``; for tensors
    their dtype and shape."""

    name: str
    offset: int
    length: int
    dtype: torch.dtype | None = None
    shape: tuple[int, ...] | None = None
    manifest: bytes | None = None
    """The writing rank's manifest, carried to the coordinator on the rank's first item (dropped before
    ``.metadata`` is written)."""


def _run(coro: Any) -> Any:
    return asyncio.run_coroutine_threadsafe(coro, BackgroundLoop.get().loop).result()


def _done(value: Any) -> Future:
    fut: Future = Future()
    fut.set_result(value)
    return fut


class _Location:
    """The checkpoint a DCP writer or reader works on: its URI, its config, and fastckpt's kept store for it."""

    uri: str | None
    config: TransferConfig | None

    def _target(self) -> StorageURI:
        if self.uri is None:
            raise ValueError(f"fastckpt.torch.dcp.{type(self).__name__} needs a checkpoint URI "
                             "(uri= or checkpoint_id=)")
        return parse_uri(self.uri)

    @contextlib.asynccontextmanager
    async def _store(self) -> AsyncIterator[tuple[StorageURI, TransferConfig, Store]]:
        """(the checkpoint's URI, the config, the open store of its location)."""
        target, cfg = self._target(), self.config or TransferConfig.from_env()
        async with store_for(target, cfg) as store:
            yield target, cfg, store


class Writer(_Location, StorageWriter):
    """``StorageWriter`` for ``dcp.save`` / ``dcp.async_save`` to the fastckpt checkpoint ``uri`` (any backend).

    ``attempt`` names the run (default: from the environment, else drawn by the coordinator). ``base`` (a committed
    checkpoint's URI, or ``"latest"``) makes each save incremental: the coordinator reads the base once and each rank
    has the store copy the parts of its file that hold the same bytes as the base's file of that rank.
    """

    def __init__(self, uri: str | os.PathLike[str] | None = None, *, attempt: str | None = None,
                 config: TransferConfig | None = None, base: str | None = None) -> None:
        super().__init__()
        self.uri = os.fspath(uri) if uri is not None else None
        self.attempt, self.config, self.base = attempt, config, base
        self.result: CommitResult | None = None
        """On the coordinator, once a save is committed: its totals (bytes ``sent`` and ``copied``)."""
        self._planned: str | None = None
        """The attempt the coordinator drew for the current save."""

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id is not None:
            self.uri = os.fspath(checkpoint_id)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if kwargs.get("use_collectives") is False:
            raise ValueError("fastckpt.torch.dcp.Writer commits through DCP's collectives: use_collectives=False "
                             "is not supported")

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        self._target()
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        attempt = self._planned = self.attempt or attempt_from_env() or new_attempt_id()
        bases = _run(self._bases(len(plans))) if self.base is not None else [None] * len(plans)
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
        manifest = _run(self._write(where, files))
        done = [s for s in stored if s is not None]
        if done:
            done[0] = dataclasses.replace(done[0], manifest=manifest)
        return _done([WriteResult(index=i.index, size_in_bytes=s.length, storage_data=s)
                      for i, s in zip(plan.items, done, strict=True)])

    async def _write(self, where: _RankPlan, files: list[tuple[str, Layout]]) -> bytes:
        async with self._store() as (target, cfg, store):
            base = BaseCheckpoint.decode(where.base, f"base of {target.raw}") if where.base else None
            writer = CheckpointWriter(target, rank=where.rank, world_size=where.world_size, attempt=where.attempt,
                                      config=cfg, barrier=HandedBarrier({}), store=store, base=base)
            await writer.__aenter__()
            try:
                for name, layout in files:
                    if layout.size:
                        await writer.put_layout(name, layout)
            except BaseException as exc:
                with contextlib.suppress(Exception):  # the upload's own error is what the caller sees
                    await writer.hand_off(exc)
                raise
            return await writer.hand_off()

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
                                      barrier=HandedBarrier(handed), store=store)
            async with writer:
                if own is not None:
                    writer.record_written(own.files, own.copied)
                await writer.put_layout(METADATA, Layout([metadata]))
        self.result = writer.result

    def storage_meta(self) -> dcp_meta.StorageMeta | None:
        return dcp_meta.StorageMeta(checkpoint_id=self.uri)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        try:
            return parse_uri(os.fspath(checkpoint_id)).backend != "delegate"
        except ValueError:
            return False


class Reader(_Location, StorageReader):
    """``StorageReader`` for ``dcp.load`` from the committed fastckpt checkpoint ``uri`` (any backend)."""

    def __init__(self, uri: str | os.PathLike[str] | None = None, *, config: TransferConfig | None = None,
                 group: Any = None) -> None:
        """``group``: a ``torch.distributed`` process group whose ranks all load (usually DCP's own, e.g.
        ``dist.group.WORLD``); the checkpoint's metadata is then read once for the group, and each byte that
        several of its ranks need is read from storage once and sent to the others over the group."""
        super().__init__()
        self.uri = os.fspath(uri) if uri is not None else None
        self.config, self.group = config, group
        self._ckpt: Checkpoint | None = None
        self._storage: dict[dcp_meta.MetadataIndex, StoredItem] = {}

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id is not None:
            self.uri = os.fspath(checkpoint_id)
        self._ckpt = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_meta.Metadata:
        if self.group is None:
            self._ckpt, raw = _run(self._metadata())
        elif "rank" in kwargs:  # DCP asks for rank-local metadata after the shared read failed on every rank
            raise CheckpointError(f"{self.uri}: a fastckpt checkpoint has no rank-local DCP metadata")
        else:
            self._ckpt, raw = _run(self._shared_metadata())
        with torch.serialization.safe_globals(_SAFE):
            metadata = torch.load(io.BytesIO(raw), weights_only=True)
        if not isinstance(metadata, dcp_meta.Metadata):
            raise CheckpointError(f"{self.uri}/{METADATA} does not hold DCP metadata")
        return metadata

    async def _metadata(self) -> tuple[Checkpoint, bytes]:
        """The checkpoint (its manifests checked against the marker) and DCP's metadata bytes, verified."""
        async with self._store() as (target, cfg, store):
            self._ckpt = ckpt = await open_checkpoint_async(target, config=cfg, store=store)
            if METADATA not in ckpt.files:
                raise CheckpointError(f"{self.uri} is a fastckpt checkpoint, but not one written by dcp.save")
            span = Span(METADATA, 0, self._digest(METADATA).size, [])
            layout = span.layout()
            transfer = Transfer(store, cfg)
            try:
                await self._read_span(transfer, span, layout)
            finally:
                transfer.close()
        return ckpt, bytes(layout.pieces(0, span.end)[0])

    async def _shared_metadata(self) -> tuple[Checkpoint, bytes]:
        """``_metadata`` read by group rank 0 and handed to the others; its failure raised on every rank."""
        call = await GroupCall.of(self.group, f"DCP load of {self.uri} by its process group")
        shared: dict[str, Any] = {}
        if call.rank == 0:
            try:
                ckpt, raw = await self._metadata()
                shared = {"checkpoint": ckpt, "metadata": raw}
            except Exception as exc:
                shared = {"error": f"{type(exc).__name__}: {exc}"}
        shared = await call.share(shared)
        call.raise_first([shared.get("error")])
        return shared["checkpoint"], shared["metadata"]

    def set_up_storage_reader(self, metadata: dcp_meta.Metadata, is_coordinator: bool, *args: Any,
                              **kwargs: Any) -> None:
        self._storage = metadata.storage_data

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future:
        """Spans of the files are read on fastckpt's loop (a few ahead) and handed to the planner here, in order
        of arrival; memory stays at a few spans whatever the plan's size. Whole stored tensors are received
        straight into contiguous CPU destinations. With ``group=``, see ``group_dcp``."""
        if self.group is not None:
            self._read_in_group(plan, planner)
            return _done(None)
        spans = self._spans(plan.items, planner)
        arrived: queue.Queue[tuple[Span, Layout] | BaseException] = queue.Queue()
        loop = BackgroundLoop.get().loop
        slots = asyncio.Semaphore(SPANS_AHEAD)  # taken on the loop, given back from here
        reading = asyncio.run_coroutine_threadsafe(self._read(spans, arrived, slots), loop)
        try:
            for _ in spans:
                got = arrived.get()
                if isinstance(got, BaseException):
                    raise got
                self._hand_over(*got, planner)
                loop.call_soon_threadsafe(slots.release)
        finally:
            reading.cancel()
        return _done(None)

    def _read_in_group(self, plan: LoadPlan, planner: LoadPlanner) -> None:
        """``read_data`` on every rank of the group at once (``group_dcp.GroupRead.run``)."""
        assert self._ckpt is not None
        ckpt = self._ckpt
        call = _run(GroupCall.of(self.group, f"DCP load of {self.uri} by its process group"))
        sizes = {n: d.chunk_size for n, d in ckpt.files.items() if d is not None}
        read = GroupRead(call, self._spans(plan.items, planner), ckpt.chunks, sizes, ckpt.file_key, str(self.uri))
        read.run(self._store, lambda span, layout: self._hand_over(span, layout, planner))

    def _hand_over(self, span: Span, layout: Layout, planner: LoadPlanner) -> None:
        """The items of ``span``, whose bytes are in ``layout``, to the planner."""
        for i, (req, offset, length) in enumerate(span.items):
            if i in span.direct:
                planner.commit_tensor(req, span.direct[i])
                continue
            pieces = layout.pieces(offset - span.start, length)
            data = pieces[0] if len(pieces) == 1 else memoryview(bytearray(length))
            if len(pieces) != 1:
                layout.gather(offset - span.start, data)
            self._deliver(req, data, planner)

    def _deliver(self, req: Any, data: memoryview, planner: LoadPlanner) -> None:
        item = self._storage[req.storage_index]
        if req.type == LoadItemType.BYTE_IO:
            planner.load_bytes(req, io.BytesIO(data))
            return
        if item.dtype is None or item.shape is None:
            raise CheckpointError(f"{self.uri}: item {req.storage_index} is not a stored tensor")
        tensor = torch.frombuffer(data, dtype=item.dtype).reshape(item.shape) if len(data) else \
            torch.empty(item.shape, dtype=item.dtype)
        for dim, (start, length) in enumerate(zip(req.storage_offsets, req.lengths, strict=True)):
            tensor = tensor.narrow(dim, start, length)
        target = planner.resolve_tensor(req).detach()
        if target.size() != tensor.size():
            raise CheckpointError(f"{self.uri}: {req.storage_index} is {list(tensor.size())}, "
                                  f"the destination {list(target.size())}")
        target.copy_(tensor)
        planner.commit_tensor(req, target)

    def _spans(self, reqs: list[Any], planner: LoadPlanner) -> list[Span]:
        """The requests' byte ranges grouped into chunk-aligned spans of one file (ranges closer than a chunk
        together, up to ``GROUP_BYTES`` a span), with the destinations that can receive their bytes directly."""
        by_file: dict[str, list[tuple[Any, int, int]]] = defaultdict(list)
        for req in reqs:
            item = self._storage[req.storage_index]
            by_file[item.name].append((req, item.offset, item.length))
        spans: list[Span] = []
        for name, items in by_file.items():
            digest = self._digest(name)
            cs = digest.chunk_size
            span: Span | None = None
            for req, offset, length in sorted(items, key=lambda i: i[1]):
                end = min(digest.size, -(-(offset + length) // cs) * cs)
                if span is None or offset // cs * cs > span.end or end - span.start > GROUP_BYTES:
                    span = Span(name, offset // cs * cs, end, [])
                    spans.append(span)
                span.end = max(span.end, end)
                target = self._direct_target(req, length, planner)
                if target is not None:
                    span.direct[len(span.items)] = target
                span.items.append((req, offset, length))
        return spans

    def _direct_target(self, req: Any, length: int, planner: LoadPlanner) -> torch.Tensor | None:
        """The destination of ``req`` when it takes a whole stored tensor into contiguous CPU memory."""
        item = self._storage[req.storage_index]
        if req.type == LoadItemType.BYTE_IO or item.shape is None or not length:
            return None
        if any(req.storage_offsets) or tuple(req.lengths) != tuple(item.shape):
            return None
        target = planner.resolve_tensor(req).detach()
        if target.device.type != "cpu" or target.dtype != item.dtype or not target.is_contiguous() \
                or tuple(target.shape) != tuple(item.shape):
            return None
        return target

    def _digest(self, name: str) -> Any:
        assert self._ckpt is not None
        digest = self._ckpt.files.get(name)
        if digest is None:
            raise CheckpointError(f"{self.uri}: file {name} is not in the checkpoint's manifests")
        return digest

    async def _read(self, spans: list[Span], arrived: queue.Queue[Any], slots: asyncio.Semaphore) -> None:
        """Read ``spans`` (each once a slot is free), every chunk checked against its recorded digest; each
        span, or the first failure, goes to ``arrived``."""
        try:
            async with self._store() as (_, cfg, store):
                transfer = Transfer(store, cfg)

                async def one(span: Span) -> None:
                    await slots.acquire()
                    layout = span.layout()
                    await self._read_span(transfer, span, layout)
                    arrived.put((span, layout))

                try:
                    await gather_all(one(span) for span in spans)
                finally:
                    transfer.close()
        except BaseException as exc:
            arrived.put(exc)
            raise

    async def _read_span(self, transfer: Transfer, span: Span, layout: Layout) -> None:
        assert self._ckpt is not None
        digest, chunks = self._digest(span.name), self._ckpt.chunks.get(span.name)
        if chunks is None:
            raise CheckpointError(f"{self.uri}: {span.name} has no chunk digests recorded; not written by this plugin")
        got = await read_layout(transfer, self._ckpt.file_key(span.name), span.start, layout, digest.chunk_size)
        for i, d in enumerate(got, span.start // digest.chunk_size):
            if d.hex() != chunks[i]:
                raise IntegrityError(f"{self.uri}/{span.name}: chunk {i} does not match its recorded digest")

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return Writer.validate_checkpoint_id(checkpoint_id)


_SAFE = [dcp_meta.Metadata, dcp_meta.TensorStorageMetadata, dcp_meta.BytesStorageMetadata,
         dcp_meta.ChunkStorageMetadata, dcp_meta.TensorProperties, dcp_meta.MetadataIndex, dcp_meta.StorageMeta,
         dcp_meta._MEM_FORMAT_ENCODING,
         StoredItem]
