"""The ``torch.distributed.checkpoint`` storage reader (``fastckpt.torch.dcp.Reader``): committed checkpoints (and,
when allowed, ones the stock ``FileSystemWriter`` wrote), any rank reading any part of any file (DCP reshards on
load), every chunk read checked against its recorded digest. ``.metadata`` is unpickled allowing DCP's metadata
classes and nothing else (``format.load_metadata``)."""

from __future__ import annotations

import asyncio
import contextlib
import io
import logging
import os
import queue
from collections import defaultdict
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import torch
from torch.distributed.checkpoint import metadata as dcp_meta
from torch.distributed.checkpoint._extension import ExtensionRegistry
from torch.distributed.checkpoint.filesystem import _StorageReaderTransforms
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from ... import stats
from ..._loop import BackgroundLoop
from ...checkpoint.catalog import UNCOMMITTED, CheckpointInfo, checkpoint_name
from ...checkpoint.group import GroupCall
from ...checkpoint.manifest import marker_key
from ...checkpoint.reader import Checkpoint, open_checkpoint_async
from ...config import TransferConfig
from ...engine.layout import Layout, read_layout
from ...engine.transfer import Transfer
from ...errors import CheckpointError, IntegrityError, ObjectNotFoundError
from ...integrity import FileDigest
from ...stores.base import Store
from ...tasks import gather_all
from ...threads import off_loop
from ...tier import Tier, held_files, tier_checkpoint
from ...tier.directory import TierStore
from ...tier.nearest import tier_or_group
from ...uri import StorageURI
from .files import Span
from .format import INDEX, decode_bytes, decode_index, decode_tensor, load_metadata, stored_items
from .group_read import GroupRead
from .location import METADATA, StoredItem, _done, _Location, _run, storage_query

__all__ = ["GROUP_BYTES", "SPANS_AHEAD", "Reader"]

GROUP_BYTES = 128 << 20
"""Largest span of one file read in one go on load (ranges closer than a chunk are read together)."""
SPANS_AHEAD = 3
"""Spans read ahead of the one being handed to the planner (memory: about this many times GROUP_BYTES)."""
log = logging.getLogger("fastckpt")



class Reader(_Location, StorageReader):
    """``StorageReader`` for ``dcp.load`` from the committed fastckpt checkpoint ``path`` (any backend): takes
    ``FileSystemReader``'s arguments (``_extension_registry``: the extensions a checkpoint's items were written
    through, DCP's defaults when None)."""

    def __init__(self, path: str | os.PathLike[str] | None = None,
                 _extension_registry: ExtensionRegistry | None = None, *, uri: str | os.PathLike[str] | None = None,
                 config: TransferConfig | None = None, group: Any = None,
                 tier: str | os.PathLike[str] | Tier | None = None, allow_uncommitted: bool = False,
                 **storage_options: Any) -> None:
        """``allow_uncommitted``: also read a checkpoint without fastckpt's commit marker (one the stock
        ``FileSystemWriter`` wrote): its items are checked against their files' sizes only, not against digests.
        ``uri=`` is the same as ``path``.

        ``group``: a ``torch.distributed`` process group whose ranks all load (usually DCP's own, e.g.
        ``dist.group.WORLD``); the checkpoint's metadata is then read once for the group, and each byte that
        several of its ranks need is read from storage once and sent to the others over the group. ``tier`` (this
        node's tier directory, not with ``group``): read each file from the tier's copy where it holds it (a DCP
        rank's node holds its own rank's files; every chunk checked against the same digests), the others from
        ``uri``; the manifests from the tier where the checkpoint is committed there."""
        super().__init__()
        tier_or_group("Reader", tier, group)
        if path is not None and uri is not None:
            raise ValueError("give the checkpoint as path or as uri=, not both")
        self.storage_options = storage_query(storage_options)
        where = path if path is not None else uri
        self.uri = os.fspath(where) if where is not None else None
        self.config, self.group, self.allow_uncommitted = config, group, allow_uncommitted
        self.transforms = _StorageReaderTransforms(_extension_registry)
        self._index: dict[tuple[str, int], tuple[int, int]] = {}
        self.tier = tier if tier is None or isinstance(tier, Tier) else Tier(tier)
        self._ckpt: Checkpoint | None = None
        self._storage: dict[dcp_meta.MetadataIndex, StoredItem] = {}
        self._local: set[str] = set()
        """The checkpoint's files this node's tier holds (read from there)."""
        self.bytes_read = {"tier": 0, "uri": 0}
        """Bytes the last load read from this node's tier and from ``uri`` (whole chunks, ``.metadata`` included)."""

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id is not None:
            self.uri = os.fspath(checkpoint_id)
        self._ckpt, self._local, self.bytes_read = None, set(), {"tier": 0, "uri": 0}

    @property
    def checkpoint_id(self) -> str | None:
        """The checkpoint the next load reads (``FileSystemReader``'s property)."""
        return self.uri

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_meta.Metadata:
        if self.group is None:
            self._ckpt, raw, index = _run(self._metadata())
        elif "rank" in kwargs:  # DCP asks for rank-local metadata after the shared read failed on every rank
            raise CheckpointError(f"{self.uri}: a fastckpt checkpoint has no rank-local DCP metadata")
        else:
            self._ckpt, raw, index = _run(self._shared_metadata())
        self._index = decode_index(index, f"{self.uri}/{INDEX}") if index is not None else {}
        return load_metadata(raw, f"{self.uri}/{METADATA}")

    async def _metadata(self) -> tuple[Checkpoint, bytes, bytes | None]:
        """The checkpoint (its manifests checked against the marker: this node's tier's when committed there, else the
        URI's; when allowed and there is no marker, the files as listed), DCP's metadata bytes and fastckpt's index
        (None when it has none), read verified; which of its files this node's tier holds (``_sources``)."""
        target, cfg = self._where()
        ckpt = None if self.tier is None else await tier_checkpoint(target, self.tier, None, config=cfg)
        if ckpt is None:
            async with self._store() as (_, _, store):
                ckpt = await self._open(store, target, cfg)
        self._ckpt = ckpt
        if self.tier is not None:
            self._local = await off_loop(held_files, ckpt.files, self.tier.copy_of(target))
        if METADATA not in ckpt.files:
            raise CheckpointError(f"{self.uri} is a fastckpt checkpoint, but not one written by dcp.save")
        index = self._whole(INDEX) if INDEX in ckpt.files else asyncio.sleep(0, None)
        metadata, found = await asyncio.gather(self._whole(METADATA), index)
        return ckpt, metadata, found

    async def _open(self, store: Store, target: StorageURI, cfg: TransferConfig) -> Checkpoint:
        """The committed checkpoint at ``target``; without a marker, when allowed, its files as listed. (Not allowed:
        one read of the marker, whose absence is a CheckpointError naming ``allow_uncommitted=True``.)"""
        if not self.allow_uncommitted or await store.exists(marker_key(target.key)):
            return await open_checkpoint_async(target, config=cfg, store=store)
        if self.group is not None:
            raise CheckpointError(f"{self.uri} has no commit marker: Reader(group=) reads committed checkpoints "
                                  "only (their chunk digests are what the group checks)")
        sizes = {m.key[len(target.key):].lstrip("/"): m.size async for m in store.list(target.key)}
        files: dict[str, FileDigest | None] = {n: FileDigest(size, cfg.part_size, "") for n, size in sizes.items()}
        info = CheckpointInfo(checkpoint_name(target.key), target.uri(), UNCOMMITTED, None, None, len(files), 0, None)
        return Checkpoint(info, target.key, files)

    async def _whole(self, name: str) -> bytes:
        """File ``name`` of the checkpoint, whole (verified when it has chunk digests)."""
        span = Span(name, 0, self._digest(name).size, [])
        layout = span.layout()
        async with self._sources() as read_span:
            await read_span(span, layout)
        return bytes(layout.pieces(0, span.end)[0]) if span.end else b""

    async def _shared_metadata(self) -> tuple[Checkpoint, bytes, bytes | None]:
        """``_metadata`` read by group rank 0 and handed to the others; its failure raised on every rank."""
        call = await GroupCall.of(self.group, f"DCP load of {self.uri} by its process group")
        async with self._store() as (_, _, store):
            return await call.from_root(self._metadata, store)

    def set_up_storage_reader(self, metadata: dcp_meta.Metadata, is_coordinator: bool, *args: Any,
                              **kwargs: Any) -> None:
        assert self._ckpt is not None
        self._storage = stored_items(metadata, self._index, self._ckpt.root, self._ckpt.files,
                                     str(self.uri))

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future:
        """Spans of the files are read on fastckpt's loop (a few ahead) and handed to the planner here, in order
        of arrival; memory stays at a few spans whatever the plan's size. Whole stored tensors are received
        straight into contiguous CPU destinations. With ``group=``, see ``group_read``."""
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
        """``read_data`` on every rank of the group at once (``group_read.GroupRead.run``)."""
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
            self._deliver(req, self._decode(req, data), planner)

    def _decode(self, req: Any, data: memoryview) -> io.BytesIO | torch.Tensor:
        """Item ``req``'s stored bytes as what the planner takes: a byte item's stream, or the stored tensor."""
        item = self._storage[req.storage_index]
        if req.type == LoadItemType.BYTE_IO:
            return decode_bytes(data, item.descriptors, self.transforms, req)
        if item.encoded:
            return decode_tensor(data, item.descriptors, self.transforms, req, str(self.uri))
        if item.dtype is None or item.shape is None:
            raise CheckpointError(f"{self.uri}: item {req.storage_index} is not a stored tensor")
        return torch.frombuffer(data, dtype=item.dtype).reshape(item.shape) if len(data) else \
            torch.empty(item.shape, dtype=item.dtype)

    def _deliver(self, req: Any, decoded: io.BytesIO | torch.Tensor, planner: LoadPlanner) -> None:
        if isinstance(decoded, io.BytesIO):
            planner.load_bytes(req, decoded)
            return
        tensor = decoded
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
        if req.type == LoadItemType.BYTE_IO or item.encoded or item.shape is None or not length:
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

    @stats.summarized("dcp_read")
    async def _read(self, spans: list[Span], arrived: queue.Queue[Any], slots: asyncio.Semaphore) -> None:
        """Read ``spans`` (each once a slot is free), every chunk checked against its recorded digest; each
        span, or the first failure, goes to ``arrived``."""
        try:
            async with self._sources() as read_span:

                async def one(span: Span) -> None:
                    await slots.acquire()
                    layout = span.layout()
                    await read_span(span, layout)
                    arrived.put((span, layout))

                await gather_all(one(span) for span in spans)
        except BaseException as exc:
            arrived.put(exc)
            raise

    @contextlib.asynccontextmanager
    async def _sources(self) -> AsyncIterator[Callable[[Span, Layout], Awaitable[None]]]:
        """How a span is read: from this node's tier where it holds the span's file (a DCP rank's node holds its own
        rank's files), else from the URI, whose store is opened once a span needs it. A read or check that fails in
        the tier (a copy dropped or recycled meanwhile) is done again from the URI, and the tier is not asked for
        that file again."""
        target, cfg = self._where()
        copy = None if self.tier is None else self.tier.copy_of(target)
        opened: list[Transfer] = []
        opening = asyncio.Lock()
        async with contextlib.AsyncExitStack() as stack:
            local = Transfer(TierStore(), cfg)
            stack.callback(local.close)

            async def durable() -> Transfer:
                async with opening:
                    if not opened:
                        _, _, store = await stack.enter_async_context(self._store())
                        opened.append(Transfer(store, cfg))
                        stack.callback(opened[0].close)
                return opened[0]

            async def read_span(span: Span, layout: Layout) -> None:
                if copy is not None and span.name in self._local:
                    try:
                        await self._read_span(local, copy.join(span.name), span, layout)
                        self.bytes_read["tier"] += span.end - span.start
                        return
                    except (IntegrityError, ObjectNotFoundError, OSError) as exc:
                        self._local.discard(span.name)
                        log.info("%s: reading %s from the URI, not from tier %s: %s", self.uri, span.name,
                                 copy.raw, exc)
                assert self._ckpt is not None  # (a tier's checkpoint names its copy: the key is the URI's here)
                await self._read_span(await durable(), target.join(self._ckpt.root, span.name), span, layout)
                self.bytes_read["uri"] += span.end - span.start

            yield read_span

    async def _read_span(self, transfer: Transfer, key: str, span: Span, layout: Layout) -> None:
        """``span`` of the file at ``key`` in ``transfer``'s store into ``layout``, each chunk checked."""
        assert self._ckpt is not None
        digest, chunks = self._digest(span.name), self._ckpt.chunks.get(span.name)
        committed = self._ckpt.info.state != UNCOMMITTED
        if chunks is None and committed:
            raise CheckpointError(f"{self.uri}: {span.name} has no chunk digests recorded; not written by this plugin")
        got = await read_layout(transfer, key, span.start, layout, digest.chunk_size)
        if chunks is None:  # a checkpoint the stock writer wrote (allow_uncommitted): sizes checked only
            return
        for i, d in enumerate(got, span.start // digest.chunk_size):
            if d.hex() != chunks[i]:
                raise IntegrityError(f"{self.uri}/{span.name}: chunk {i} does not match its recorded digest")

