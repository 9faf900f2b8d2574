"""The ``torch.distributed.checkpoint`` storage reader (``fastckpt.torch.dcp.Reader``): committed checkpoints only,
any rank reading any part of any file (DCP reshards on load), every chunk read checked against its recorded digest.
``.metadata`` is read with ``torch.load(weights_only=True)``, allowing DCP's metadata classes and nothing else."""

from __future__ import annotations

import asyncio
import io
import os
import queue
from collections import defaultdict
from typing import Any

import torch
from torch.distributed.checkpoint import metadata as dcp_meta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from .._loop import BackgroundLoop
from ..checkpoint.group import GroupCall
from ..checkpoint.reader import Checkpoint, open_checkpoint_async
from ..config import TransferConfig
from ..engine.layout import Layout, read_layout
from ..engine.transfer import Transfer
from ..errors import CheckpointError, IntegrityError
from ..tasks import gather_all
from ..tier import Tier, nearest_copy
from .dcp_layout import Span
from .dcp_location import METADATA, StoredItem, _done, _Location, _run
from .group_dcp import GroupRead

GROUP_BYTES = 128 << 20
"""Largest span of one file read in one go on load (ranges closer than a chunk are read together)."""
SPANS_AHEAD = 3
"""Spans read ahead of the one being handed to the planner (memory: about this many times GROUP_BYTES)."""



class Reader(_Location, StorageReader):
    """``StorageReader`` for ``dcp.load`` from the committed fastckpt checkpoint ``uri`` (any backend)."""

    def __init__(self, uri: str | os.PathLike[str] | None = None, *, config: TransferConfig | None = None,
                 group: Any = None, tier: str | os.PathLike[str] | Tier | None = None) -> None:
        """``group``: a ``torch.distributed`` process group whose ranks all load (usually DCP's own, e.g.
        ``dist.group.WORLD``); the checkpoint's metadata is then read once for the group, and each byte that
        several of its ranks need is read from storage once and sent to the others over the group. ``tier`` (this
        node's tier directory, not with ``group``): read the tier's copy when it holds every file of the committed
        checkpoint (verified against the same digests), else ``uri``."""
        super().__init__()
        if tier is not None and group is not None:
            raise ValueError("Reader takes tier= or group=, not both (each node's tier holds its own ranks' files)")
        self.uri = os.fspath(uri) if uri is not None else None
        self.config, self.group = config, group
        self.tier = tier if tier is None or isinstance(tier, Tier) else Tier(tier)
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
        near = None if self.tier is None else await nearest_copy(self._target(), self.tier, None, self.config)
        self._in_tier = near is not None
        async with self._store() as (target, cfg, store):
            self._ckpt = ckpt = near or await open_checkpoint_async(target, config=cfg, store=store)
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



_SAFE = [dcp_meta.Metadata, dcp_meta.TensorStorageMetadata, dcp_meta.BytesStorageMetadata,
         dcp_meta.ChunkStorageMetadata, dcp_meta.TensorProperties, dcp_meta.MetadataIndex, dcp_meta.StorageMeta,
         dcp_meta._MEM_FORMAT_ENCODING,
         StoredItem]
