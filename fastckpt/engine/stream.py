"""Streamed transfers on the store protocol, for callers that write or read an object piece by piece.

- ``StreamWriter`` turns writes of any size into parallel part uploads of one object. Memory is a
  per-stream ``BufferPool`` (``config.stream_memory``, at most ``max_in_flight`` buffers): the caller waits for a free
  buffer when every one is in flight. The object appears only on ``close()``; any failure aborts the
  multipart upload and is raised from the next call. Objects smaller than one part go as one put.
- ``StreamReader`` serves sequential readers from a window of parts fetched in parallel ahead of
  them, and random readers with exact ranged reads. Parts are hashed as they arrive; when every part
  of an object recording a digest has been read, the digest is checked before the last part is handed
  out (IntegrityError on mismatch).
- ``copy_object`` copies one object part by part (parallel reads and part uploads).

Digests follow ``fastckpt.integrity``: one XXH3-128 per chunk of ``part_size`` bytes, recorded when the
object is complete. A store that cannot record metadata then (``metadata_on_complete`` False: S3 with its
digest records turned off) cannot learn a streamed object's digest before its upload starts, so streamed
multipart objects carry none there; single-put objects and ``Transfer`` uploads of files always do.

Every coroutine here runs on one event loop; hashing runs off the loop.
"""

from __future__ import annotations

import asyncio
import contextlib
from contextlib import AbstractAsyncContextManager
from typing import TypeVar

from ..config import TransferConfig
from ..errors import IntegrityError, StoreError
from ..integrity import FileDigest, combine, hash_chunk, hash_chunks
from ..stores.base import MultipartUpload, ObjectMeta, PartInfo, Store
from ..stores.retry import retrying
from ..tasks import gather_all
from ..threads import off_loop
from ..transport import Buffer
from .plan import plan_download, plan_upload
from .pool import BufferPool

__all__ = ["DIGEST_KEYS", "StreamReader", "StreamWriter", "copy_object"]

T = TypeVar("T")
DIGEST_KEYS = frozenset(FileDigest(0, 1, "").metadata())
"""Metadata keys that carry fastckpt digests (never copied from one object to another)."""


class _Lease:
    """A pooled buffer held across calls (``BufferPool.buffer`` entered and exited by hand)."""

    def __init__(self, cm: AbstractAsyncContextManager[memoryview], view: memoryview) -> None:
        self._cm: AbstractAsyncContextManager[memoryview] | None = cm
        self.view = view

    @classmethod
    async def take(cls, pool: BufferPool, nbytes: int) -> _Lease:
        """Wait for a free buffer of ``nbytes``."""
        cm = pool.buffer(nbytes)
        view = await cm.__aenter__()
        return cls(cm, view)

    async def release(self, error: BaseException | None = None) -> None:
        """Return the buffer to its pool (idempotent). After a failed request (``error``) the pool
        discards it instead: a connection being torn down may still read from it."""
        cm, self._cm = self._cm, None
        if cm is not None:
            await cm.__aexit__(type(error) if error else None, error, None)


class StreamWriter:
    """Writes one object from a stream of bytes of unknown length.

    Async callers use ``write``; a caller on another thread can fill buffers itself (no copy on the
    loop): ``reserve()`` returns the free tail of the current part buffer, ``commit(n)`` records that
    ``n`` bytes were written into it.
    """

    def __init__(self, store: Store, key: str, config: TransferConfig,
                 metadata: dict[str, str] | None = None) -> None:
        self.store, self.key, self.config = retrying(store, config), key, config
        self.metadata = dict(metadata or {})
        self.part_size = plan_upload(0, config, store).part_size
        self.pool = BufferPool(self.part_size, config.stream_memory, max(1, config.max_in_flight))
        self.size = 0
        self.digest: FileDigest | None = None
        self.state = "open"
        """open, closed (object written) or aborted."""
        self._lease: _Lease | None = None
        self._fill = 0
        self._index = 0
        self._create: asyncio.Task[MultipartUpload] | None = None
        self._parts: list[asyncio.Task[tuple[PartInfo, bytes]]] = []
        self._error: BaseException | None = None
        self._what = f"streamed upload to {key}"

    # ----------------------------------------------------------------------------- writing

    async def reserve(self) -> memoryview:
        """The free tail of the current part buffer (waits for a pool buffer when none is held)."""
        await self._check()
        if self._lease is None:
            self._lease = await _Lease.take(self.pool, self.part_size)
            self._fill = 0
            await self._check()
        return self._lease.view[self._fill:]

    async def commit(self, nbytes: int) -> None:
        """Record ``nbytes`` written at the start of the last ``reserve()``d region."""
        await self._check()
        if self._lease is None or nbytes < 0 or self._fill + nbytes > self.part_size:
            raise ValueError(f"{self._what}: commit of {nbytes} bytes does not match the reserved buffer")
        self._fill += nbytes
        self.size += nbytes
        if self._fill == self.part_size:
            self._ship()

    async def write(self, data: Buffer) -> int:
        """Append ``data`` (copied into pooled part buffers on the loop)."""
        view = memoryview(data).cast("B")
        total = len(view)
        while view:
            free = await self.reserve()
            n = min(len(free), len(view))
            free[:n] = view[:n]
            await self.commit(n)
            view = view[n:]
        return total

    def _ship(self) -> None:
        """Start uploading the current buffer as the next part."""
        lease, nbytes, index = self._lease, self._fill, self._index
        assert lease is not None
        if index >= self.store.max_parts:  # the lease stays held; abort releases it
            self._error = StoreError(f"{self._what}: more than {self.store.max_parts} parts of {self.part_size} "
                                     f"bytes; raise part_size to stream objects this large")
            return
        self._lease, self._fill = None, 0
        self._index += 1
        if self._create is None:
            meta = dict(self.metadata)
            self._create = asyncio.ensure_future(self.store.create_multipart(self.key, self.part_size, meta))
            self._create.add_done_callback(_retrieve)  # its error reaches the caller through the parts
        task = asyncio.ensure_future(self._send(index, lease, nbytes))
        task.add_done_callback(self._part_done)
        self._parts.append(task)

    async def _send(self, index: int, lease: _Lease, nbytes: int) -> tuple[PartInfo, bytes]:
        try:
            assert self._create is not None
            mpu = await asyncio.shield(self._create)  # cancelling a part must not cancel the creation
            view = lease.view[:nbytes]
            hashing = asyncio.ensure_future(off_loop(hash_chunk, view))
            try:
                info = await mpu.put_part(index, view)
            finally:
                await asyncio.wait([hashing])  # a thread reads the buffer: keep it until the hash is done
            result = info, hashing.result()
        except BaseException as exc:
            await lease.release(exc)
            raise
        await lease.release()
        return result

    def _part_done(self, task: asyncio.Task[tuple[PartInfo, bytes]]) -> None:
        if not task.cancelled() and task.exception() is not None and self._error is None:
            self._error = task.exception()

    async def _check(self) -> None:
        """Raise the first failure (after aborting), or if the stream is no longer open."""
        if self._error is not None:
            error = self._error
            await self.abort()
            raise error
        if self.state != "open":
            raise ValueError(f"{self._what} is {self.state}")

    # ----------------------------------------------------------------------------- ending

    async def close(self) -> FileDigest:
        """Upload what is left and make the object visible; abort and raise on any failure."""
        if self.state == "closed" and self.digest is not None:
            return self.digest
        await self._check()
        try:
            if self._index == 0:
                digest = await self._put_whole()
            else:
                if self._fill:
                    self._ship()
                elif self._lease is not None:
                    await self._lease.release()
                    self._lease = None
                # wait for every part, failed or not: cancelling a request in flight could leave a part
                # on the server after the abort
                settled = await asyncio.gather(*self._parts, return_exceptions=True)
                for outcome in settled:
                    if isinstance(outcome, BaseException):
                        raise outcome
                results = [r for r in settled if not isinstance(r, BaseException)]
                assert self._create is not None
                mpu = self._create.result()
                digest = FileDigest(self.size, self.part_size, combine([d for _, d in results]))
                meta = {**self.metadata, **self._digest_meta(digest)}
                await mpu.complete([p for p, _ in results], meta)
        except BaseException:
            await asyncio.shield(self.abort())
            raise
        self.state, self.digest = "closed", digest
        self.pool.close()
        return digest

    async def _put_whole(self) -> FileDigest:
        lease, self._lease = self._lease, None
        try:
            view = lease.view[: self._fill] if lease is not None else memoryview(b"")
            digests = await off_loop(hash_chunks, view, self.part_size) if len(view) else []
            digest = FileDigest(len(view), self.part_size, combine(digests))
            meta = {**self.metadata, **self._digest_meta(digest)}
            await self.store.put(self.key, view, metadata=meta)
        except BaseException as exc:
            if lease is not None:
                await lease.release(exc)
            raise
        if lease is not None:
            await lease.release()
        return digest

    def _digest_meta(self, digest: FileDigest) -> dict[str, str]:
        return digest.metadata() if self.config.digest_metadata else {}

    async def abort(self) -> None:
        """Discard everything written; the object is not created. Safe to call more than once."""
        if self.state != "open":
            return
        self.state = "aborted"
        # Let parts in flight settle rather than cancel them: a request cancelled here may still
        # complete on the server after the abort below and leave a part behind.
        await asyncio.gather(*self._parts, return_exceptions=True)
        if self._lease is not None:
            await self._lease.release()
            self._lease = None
        if self._create is not None:
            await asyncio.wait([self._create])  # never leave an upload the server created behind
            if not self._create.cancelled() and self._create.exception() is None:
                mpu = self._create.result()
                with contextlib.suppress(Exception):
                    await mpu.abort()
        self.pool.close()


class StreamReader:
    """Reads one object: whole parts (sequential readers, prefetched) or exact ranges (random readers)."""

    def __init__(self, store: Store, meta: ObjectMeta, config: TransferConfig, *, verify: bool | None = None) -> None:
        self.store, self.key, self.config = retrying(store, config), meta.key, config
        self.size = meta.size
        check = config.verify if verify is None else verify
        self.expected = FileDigest.from_metadata(meta.size, meta.metadata) if check else None
        plan = plan_download(meta.size, self.expected.chunk_size if self.expected else None, config,
                             longest=config.part_size)
        self.part_size, self.count = plan.part_size, plan.count
        self.chunk_size = self.expected.chunk_size if self.expected else plan.part_size
        self.window = max(1, min(config.max_in_flight, config.stream_memory // self.part_size - 1))
        self.pool = BufferPool(self.part_size, (self.window + 1) * self.part_size, self.window + 1)
        self._parts: dict[int, asyncio.Task[_Lease]] = {}
        self._digests: dict[int, list[bytes]] = {}
        self._closed = False
        self._last = -2
        self._ramp = 0

    def part_span(self, index: int) -> tuple[int, int]:
        """(offset, length) of part ``index``."""
        offset = index * self.part_size
        return offset, max(0, min(self.part_size, self.size - offset))

    async def part(self, index: int, wanted: int = 1) -> memoryview:
        """Part ``index`` whole; ``wanted``: how many parts from ``index`` on the caller is about to read.

        Parts are fetched ahead, in parallel: all the ``wanted`` ones, and a window that doubles with
        each part read in order (up to what ``config.stream_memory`` holds), so a small read costs one part. The view is
        valid until the next ``part``/``close`` call (parts outside the window are released). When every
        part was read, the digest is checked before the last part is handed out."""
        if self._closed:
            raise ValueError(f"reader of {self.key} is closed")
        if not 0 <= index < self.count:
            raise ValueError(f"{self.key}: part {index} out of range (0..{self.count - 1})")
        if index == self._last + 1:
            self._ramp = min(self.window, max(1, 2 * self._ramp))
        elif index != self._last:
            self._ramp = 0
        self._last = index
        last = min(self.count, index + 1 + min(self.window, max(wanted - 1, self._ramp)))
        for old in [i for i in self._parts if not index <= i < last]:
            await self._drop(old)
        for ahead in range(index, last):
            if ahead not in self._parts:
                self._parts[ahead] = asyncio.ensure_future(self._fetch(ahead))
                self._parts[ahead].add_done_callback(_retrieve)  # a part fetched ahead may never be read
        lease = await self._parts[index]
        if index == self.count - 1 and self.expected is not None and len(self._digests) == self.count:
            self.expected.check([d for i in range(self.count) for d in self._digests[i]],
                                f"{self.key} (read through a stream)")
        return lease.view

    async def _fetch(self, index: int) -> _Lease:
        offset, length = self.part_span(index)
        lease = await _Lease.take(self.pool, length)
        try:
            n = await self.store.read_into(self.key, offset, lease.view)
            if n != length:
                raise IntegrityError(f"{self.key}: object changed while being read ({n} of {length} bytes "
                                     f"at {offset})")
            if self.expected is not None:
                self._digests[index] = await off_loop(hash_chunks, lease.view, self.chunk_size)
        except BaseException as exc:
            await lease.release(exc)
            raise
        return lease

    async def _drop(self, index: int) -> None:
        task = self._parts.pop(index)
        task.cancel()
        with contextlib.suppress(BaseException):
            await task
        if not task.cancelled() and task.exception() is None:
            await task.result().release()

    async def read_range(self, start: int, length: int) -> bytes | bytearray:
        """Exactly ``length`` bytes from ``start`` (fewer at the end), large ranges in parallel pieces."""
        length = max(0, min(length, self.size - start))
        if length <= self.part_size:
            return await self.store.get_range(self.key, start, length)
        out = bytearray(length)
        view = memoryview(out)

        async def piece(offset: int) -> None:
            n = min(self.part_size, length - offset)
            got = await self.store.read_into(self.key, start + offset, view[offset:offset + n])
            if got != n:
                raise IntegrityError(f"{self.key}: object changed while being read")

        await gather_all(piece(o) for o in range(0, length, self.part_size))
        view.release()
        return out

    async def close(self) -> None:
        """Stop prefetching and release every buffer."""
        if self._closed:
            return
        self._closed = True
        for index in list(self._parts):
            await self._drop(index)
        self.pool.close()


async def copy_object(src: Store, src_key: str, dst: Store, dst_key: str, config: TransferConfig) -> FileDigest:
    """Copy one object, parts read ahead and uploaded in parallel. User metadata is kept; the source
    digest (if recorded) is checked on the way and the copy gets its own."""
    src = retrying(src, config)
    meta = await src.head(src_key)
    user = {k: v for k, v in meta.metadata.items() if k.lower() not in DIGEST_KEYS}
    reader = StreamReader(src, meta, config)
    writer = StreamWriter(dst, dst_key, config, user)
    try:
        for index in range(reader.count):
            await writer.write(await reader.part(index, reader.count - index))
        return await writer.close()
    except BaseException:
        await writer.abort()
        raise
    finally:
        await reader.close()


def _retrieve(task: asyncio.Future[object]) -> None:
    """Mark a task's exception as seen (it is raised where the task is awaited, if ever)."""
    if not task.cancelled():
        task.exception()
