"""Objects laid out in memory: uploads sent from, and ranged reads received into, the caller's buffers.

A ``Layout`` is a byte range made of views laid end to end (a header, then tensors). A part that lies
inside one view is sent from it, or received into it, with no copy; a part spanning views is sent as its views
where the store takes ``Pieces`` (S3: gathering them into a pooled buffer cost a 0.85 GiB state 1.8 s of its 7.8 s
save over a 60 ms link, in copies and fresh pages on the event loop), else gathered into a pooled buffer, and is
received into a pooled buffer and scattered. Every chunk is hashed where it lies.
"""

from __future__ import annotations

import asyncio
import bisect
import itertools
from collections.abc import Iterable

from .. import otel, stats
from ..errors import AlreadyExistsError, IntegrityError
from ..integrity import ChunkHasher, FileDigest, combine, hash_chunks
from ..stores.base import PartInfo, Store
from ..tasks import gather_all
from ..threads import off_loop
from ..transport import Buffer
from .plan import plan_upload
from .reuse import BaseObject, same_parts
from .transfer import Transfer

__all__ = ["DIRECT_PIECE", "Layout", "hash_layout", "hash_pieces", "read_layout", "upload_layout"]


class Layout:
    """Views of any buffers (bytes, mmaps, tensors' memory) read or written as one range of bytes."""

    def __init__(self, views: Iterable[Buffer]) -> None:
        self.views = [v for v in (memoryview(b).cast("B") for b in views) if len(v)]
        self.starts: list[int] = []
        size = 0
        for v in self.views:
            self.starts.append(size)
            size += len(v)
        self.size = size

    def pieces(self, offset: int, length: int) -> list[memoryview]:
        """Views covering ``[offset, offset + length)``, in order."""
        if offset < 0 or offset + length > self.size:
            raise ValueError(f"range {offset}+{length} outside a layout of {self.size} bytes")
        out: list[memoryview] = []
        i = bisect.bisect_right(self.starts, offset) - 1
        while length > 0:
            view, start = self.views[i], offset - self.starts[i]
            take = min(length, len(view) - start)
            out.append(view[start:start + take])
            offset, length, i = offset + take, length - take, i + 1
        return out

    def gather(self, offset: int, out: memoryview) -> None:
        """Copy ``len(out)`` bytes from ``offset`` into ``out``."""
        pos = 0
        for piece in self.pieces(offset, len(out)):
            out[pos:pos + len(piece)] = piece
            pos += len(piece)

    def scatter(self, offset: int, data: memoryview) -> None:
        """Copy ``data`` into the layout at ``offset``."""
        _scatter(data, self.pieces(offset, len(data)))


def hash_pieces(pieces: list[memoryview], chunk_size: int) -> list[bytes]:
    """Chunk digests of the bytes of ``pieces`` laid end to end (their total starts at a chunk boundary)."""
    if len(pieces) == 1:
        return hash_chunks(pieces[0], chunk_size)
    hasher = ChunkHasher(chunk_size)
    for piece in pieces:
        hasher.update(piece)
    return hasher.finish()


def _scatter(data: memoryview, pieces: list[memoryview]) -> None:
    pos = 0
    for piece in pieces:
        piece[:] = data[pos:pos + len(piece)]
        pos += len(piece)


async def hash_layout(layout: Layout, chunk_size: int) -> list[bytes]:
    """Chunk digests of the whole layout, hashed on the I/O threads a part at a time."""
    spans = [(o, min(chunk_size * 8, layout.size - o)) for o in range(0, layout.size, chunk_size * 8)]
    parts = await gather_all(off_loop(hash_pieces, layout.pieces(o, n), chunk_size) for o, n in spans)
    return [d for part in parts for d in part]


async def upload_layout(transfer: Transfer, layout: Layout, key: str, *, if_absent: bool = False,
                        chunks: list[bytes] | None = None, base: BaseObject | None = None
                        ) -> tuple[FileDigest, list[bytes]]:
    """Store ``layout`` as object ``key``; returns its digest and chunk digests (``chunks``: known already,
    one per upload part). Parts are sent straight from the layout's views where they can be, and copied by the
    store from ``base`` where it holds the same bytes (``engine.reuse``); a failed multipart upload is aborted.
    With ``if_absent``, an object already at ``key`` fails the upload (AlreadyExistsError) unless it holds
    exactly these bytes."""
    with stats.stage("sending"), otel.span("fastckpt.upload_file", **{"fastckpt.key": key,
                                                                      "fastckpt.size": layout.size}):
        sent = await _upload_layout(transfer, layout, key, if_absent, chunks, base)
    stats.moved(layout.size)
    return sent


async def _upload_layout(transfer: Transfer, layout: Layout, key: str, if_absent: bool, chunks: list[bytes] | None,
                         base: BaseObject | None) -> tuple[FileDigest, list[bytes]]:
    store, config = transfer.store, transfer.config
    plan = plan_upload(layout.size, config, store)
    chunks = chunks if chunks is not None else await hash_layout(layout, plan.part_size)
    digest = FileDigest(layout.size, plan.part_size, combine(chunks))
    meta = digest.metadata() if config.digest_metadata else None
    base = same_parts(base, digest, chunks)
    if base is not None and await transfer.copied_whole(key, base, digest, if_absent):
        return digest, chunks
    if not plan.multipart:
        pieces = layout.pieces(0, layout.size)
        data: Buffer = pieces[0] if len(pieces) == 1 else b"".join(pieces)
        try:
            await store.put(key, data, if_absent=if_absent, metadata=meta)
        except AlreadyExistsError:
            if not await transfer.holds_digest(key, digest):
                raise
        transfer.progress.advance(layout.size)
        return digest, chunks
    early = None if store.metadata_on_complete else meta  # otherwise it goes with the completion
    mpu = await transfer.start_upload(key, plan.part_size, early, if_absent)
    # parts written into one local file go one at a time: concurrent writers only spin on its inode lock
    slots = asyncio.Semaphore(1 if mpu.local_fd() is not None else max(1, config.max_in_flight))

    async def send(index: int) -> PartInfo:
        offset, length = plan.part(index)
        pieces = layout.pieces(offset, length)
        async with slots:
            copied = None if base is None else await transfer.reuse.copy_part(
                mpu, base, index, offset, length, chunks[index], plan.part_size)
            if copied is not None:
                info = copied
            elif len(pieces) == 1:
                info = await mpu.put_part(index, pieces[0])
            elif mpu.sends_pieces:  # sent as the views lie: no copy into a pooled buffer
                info = await mpu.put_part(index, tuple(pieces))
            else:
                async with transfer.pool.buffer(length) as buf:
                    layout.gather(offset, buf)
                    info = await mpu.put_part(index, buf)
        transfer.progress.advance(length)
        return info

    try:
        infos = await gather_all(send(i) for i in range(plan.count))
        await mpu.complete(infos, meta)
    except AlreadyExistsError:
        await asyncio.shield(transfer.abort_upload(mpu))
        if not await transfer.holds_digest(key, digest):
            raise
    except BaseException:
        await asyncio.shield(transfer.abort_upload(mpu))
        raise
    return digest, chunks


DIRECT_PIECE = 1 << 20
"""Views a read across several views receives straight into (smaller ones go through a buffer)."""


async def read_layout(transfer: Transfer, key: str, start: int, layout: Layout, chunk_size: int) -> list[bytes]:
    """Read ``layout.size`` bytes of ``key`` from ``start`` (a chunk boundary) into ``layout``; returns the
    chunk digests of what was read. A part lying inside one view is received straight into it; a part across views
    is received straight into each view of at least ``DIRECT_PIECE`` bytes (one ranged read each), the smaller ones
    between them through a buffer (``_read_across``)."""
    if start % chunk_size:
        raise ValueError(f"read of {key} at {start}: not a multiple of the chunk size {chunk_size}")
    part = chunk_size * max(1, transfer.config.part_size // chunk_size)
    store, slots = transfer.store, asyncio.Semaphore(max(1, transfer.config.max_in_flight))

    async def one(offset: int) -> list[bytes]:
        length = min(part, layout.size - offset)
        pieces = layout.pieces(offset, length)
        async with slots:
            if len(pieces) == 1:
                await _read_exact(store, key, start + offset, pieces[0])
                digests = await off_loop(hash_chunks, pieces[0], chunk_size)
            elif any(len(p) >= DIRECT_PIECE for p in pieces):
                await _read_across(store, key, start + offset, pieces)
                digests = await off_loop(hash_pieces, pieces, chunk_size)
            else:
                async with transfer.pool.buffer(length) as buf:
                    await _read_exact(store, key, start + offset, buf)
                    digests = await off_loop(_hash_and_scatter, buf, pieces, chunk_size)
        transfer.progress.advance(length)
        return digests

    with stats.stage("receiving"):
        parts = await gather_all(one(o) for o in range(0, layout.size, part))
    stats.moved(layout.size, files=0)
    return [d for p in parts for d in p]


async def _read_exact(store: Store, key: str, offset: int, buf: memoryview) -> None:
    n = await store.read_into(key, offset, buf)
    if n != len(buf):
        raise IntegrityError(f"{key}: {n} of {len(buf)} bytes at offset {offset} (object shorter than recorded)")


async def _read_across(store: Store, key: str, offset: int, pieces: list[memoryview]) -> None:
    """The bytes of ``key`` from ``offset`` into ``pieces`` laid end to end: each piece of at least ``DIRECT_PIECE``
    bytes read straight into it, each run of smaller ones into one buffer and copied to them."""
    runs: list[list[memoryview]] = []
    for piece in pieces:
        if len(piece) >= DIRECT_PIECE or not runs or len(runs[-1][-1]) >= DIRECT_PIECE:
            runs.append([piece])
        else:
            runs[-1].append(piece)

    async def one(at: int, run: list[memoryview]) -> None:
        if len(run) == 1:
            await _read_exact(store, key, at, run[0])
            return
        buf = memoryview(bytearray(sum(len(p) for p in run)))
        await _read_exact(store, key, at, buf)
        _scatter(buf, run)

    starts = list(itertools.accumulate((sum(len(p) for p in run) for run in runs[:-1]), initial=offset))
    await gather_all(one(at, run) for at, run in zip(starts, runs, strict=True))


def _hash_and_scatter(buf: memoryview, pieces: list[memoryview], chunk_size: int) -> list[bytes]:
    digests = hash_chunks(buf, chunk_size)
    _scatter(buf, pieces)
    return digests
