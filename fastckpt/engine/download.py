"""The download pipeline: objects received range by range into hidden partial files (``engine.partial``), hashed as
they land, verified, then renamed into place; and re-reading an object to verify it."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading

from .. import otel, stats
from ..errors import IntegrityError, StoreError
from ..fileio import write_at
from ..integrity import FileDigest, combine, hash_chunks
from ..stores.base import ObjectMeta
from ..tasks import gather_all
from ..threads import off_loop
from .journal import Journal
from .partial import close_partial, open_partial
from .plan import Plan, plan_copy, plan_download
from .session import FileResult, TransferSession
from .sink import RingSink, copy_and_hash, hash_file_range

__all__ = ["Downloads"]

log = logging.getLogger("fastckpt")


class Downloads(TransferSession):
    """Downloads of objects to local files."""

    async def download_files(self, pairs: list[tuple[str, str]], expected: dict[str, FileDigest] | None = None,
                             sizes: dict[str, int] | None = None, metas: dict[str, ObjectMeta] | None = None
                             ) -> list[FileResult]:
        """Download ``(key, local path)`` pairs concurrently; digests from ``expected`` or metadata. ``sizes``
        (from a listing) let an object of one part come with its metadata in a single request; ``metas`` (from a
        ``head`` already made) spare the request for them."""
        expected, metas = expected or {}, metas or {}
        sizes = {**(sizes or {}), **{k: m.size for k, m in metas.items()}}
        batch = sum(expected[k].size if k in expected else sizes.get(k, 0) for k, _ in pairs)
        failed = asyncio.Event()  # set when one file failed: the others are then cancelled, not interrupted
        with stats.stage("receiving"):
            return await gather_all((self._download(k, p, expected.get(k), sizes.get(k), failed, batch, metas.get(k))
                                     for k, p in pairs), failed)

    async def download_file(self, key: str, path: str, expected: FileDigest | None = None) -> FileResult:
        """Download one object to ``path`` (written beside it, verified, then renamed into place)."""
        return (await self.download_files([(key, path)], {key: expected} if expected else None))[0]

    async def _download(self, key: str, path: str, expected: FileDigest | None, size: int | None,
                        failed: asyncio.Event, batch: int = 0, meta: ObjectMeta | None = None) -> FileResult:
        async with self._files:
            with otel.span("fastckpt.download_file", **{"fastckpt.key": key}):
                result = await self._download_one(key, path, expected, size, failed, batch, meta)
        stats.moved(result.digest.size)
        return result

    async def _download_one(self, key: str, path: str, expected: FileDigest | None, size: int | None,
                            failed: asyncio.Event, batch: int, meta: ObjectMeta | None) -> FileResult:
        """``_download``'s work: one GET with the metadata for a small object, else a HEAD and ranged reads."""
        size = expected.size if expected is not None else size
        if meta is not None and meta.size > self.config.part_size:
            return await self._write(key, path, meta, expected, failed, batch=batch)
        if (size is not None and 0 < size <= self.config.part_size
                and self.store.local_file(key) is None):  # one GET: the object and its metadata (local: a copy)
            async with self.pool.buffer(size) as buf:
                meta, n = await self.store.read_with_meta(key, buf)
                if n == meta.size:
                    return await self._write(key, path, meta, expected, failed, data=buf[:n])
        return await self._write(key, path, await self.store.head(key), expected, failed, batch=batch)

    async def _write(self, key: str, path: str, meta: ObjectMeta, expected: FileDigest | None, failed: asyncio.Event,
                     *, data: memoryview | None = None, batch: int = 0) -> FileResult:
        """Write object ``key`` (``meta``) to ``path`` through a hidden partial file, verified, then renamed into
        place: its bytes fetched part by part, or ``data`` when they are in memory already."""
        if expected is None and self.config.verify:
            expected = FileDigest.from_metadata(meta.size, meta.metadata)
        if expected is not None and expected.size != meta.size:
            raise IntegrityError(f"{key}: size is {meta.size}, its record says {expected.size}")
        recorded = expected.chunk_size if expected else None
        if self.store.local_file(key) is None:
            plan = plan_download(meta.size, recorded, self.config, batch=batch, ranges=self.planned_requests())
        else:
            plan = plan_copy(meta.size, recorded, self.config, batch=batch, slots=self._copy_slots)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("download %s -> %s: %d bytes, %d part(s) of %d", self.store.uri(key), path, plan.size,
                      plan.count, plan.part_size)
        self.progress.expect(meta.size)
        chunk = recorded or plan.part_size
        if data is not None:  # in memory already: written, checked and put in place by one I/O thread
            try:
                digests = await off_loop(self._write_whole, key, path, expected, chunk, data)
            except OSError as exc:
                if (named := _named(exc, key, path)) is exc:
                    raise
                raise named from exc
            self.progress.advance(len(data))
            return FileResult(key, path, FileDigest(meta.size, chunk, combine(digests)))
        header = None
        if self.config.resume and plan.count > 1:  # a rerun of a killed download finds its journal by this
            header = {"uri": self.store.uri(key), "size": meta.size, "etag": meta.etag, "mtime": meta.mtime,
                      "digest": expected.digest if expected else None, "chunk": chunk, "part_size": plan.part_size}
        # creating a file waits on its directory, as long as others are made there: off the event loop
        tmp, fd, journal = await off_loop(open_partial, path, self._dirs, header, undo=close_partial)
        if journal is not None and journal.resumed:
            log.info("resuming the download of %s to %s: %d of %d parts are in", key, path, len(journal.parts),
                     plan.count)
        try:
            try:
                writer = threading.Lock()  # one pwrite at a time per file (see engine.sink)
                parts = await gather_all(self._fetch_part(key, fd, writer, plan, i, chunk, journal)
                                         for i in range(plan.count))
                digests = [d for part in parts for d in part]
                if expected is not None:
                    expected.check(digests, f"{key} (downloaded to {path})")
                if self.config.download_fsync:
                    await off_loop(os.fsync, fd)
            finally:
                os.close(fd)
            await off_loop(os.replace, tmp, path)
        except BaseException as exc:
            if journal is not None and isinstance(exc, asyncio.CancelledError) and not failed.is_set():
                journal.close()  # interrupted: kept, the same download run again continues from the journal
                raise
            if journal is not None:
                journal.remove()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            if (named := _named(exc, key, path)) is exc:
                raise
            raise named from exc
        if journal is not None:
            await off_loop(journal.remove)
        return FileResult(key, path, FileDigest(meta.size, chunk, combine(digests)))

    def _write_whole(self, key: str, path: str, expected: FileDigest | None, chunk: int, data: memoryview
                     ) -> list[bytes]:
        """On an I/O thread: ``data``, all of object ``key``, hashed and written to a partial file, checked against
        ``expected``, then renamed to ``path``; its chunk digests."""
        tmp, fd, _ = open_partial(path, self._dirs, None)
        try:
            try:
                digests = hash_chunks(data, chunk)
                if expected is not None:
                    expected.check(digests, f"{key} (downloaded to {path})")
                write_at(fd, 0, data)
                if self.config.download_fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
        return digests

    async def _fetch_part(self, key: str, fd: int, writer: threading.Lock, plan: Plan, index: int, chunk: int,
                          journal: Journal | None) -> list[bytes]:
        offset, length = plan.part(index)
        done = journal.parts.get(index) if journal is not None and journal.resumed else None
        source = self.store.local_file(key)
        if source is not None and done is None:  # a local file: copied slice by slice, no pooled buffer
            try:
                async with self._local_copies:
                    digests = await off_loop(copy_and_hash, source, offset, length, fd, writer, chunk)
            except EOFError:
                raise StoreError(f"{key}: object shrank during download (it is shorter than {offset + length} "
                                 "bytes)") from None
            if journal is not None:
                journal.record(index, digests=",".join(d.hex() for d in digests))
            self.progress.advance(length)
            return digests
        if done is not None:  # in the partial file already: kept when it still hashes the same
            digests = await off_loop(hash_file_range, fd, offset, length, chunk)
            if digests is not None and ",".join(d.hex() for d in digests) == done.get("digests"):
                self.progress.advance(length)
                return digests
        async with self.pool.buffer(self.ring) as ring:
            sink = RingSink(key, fd, writer, offset, length, ring, chunk)
            digests = await sink.receive(self.store.receive(key, offset, length, sink))
        if journal is not None:
            journal.record(index, digests=",".join(d.hex() for d in digests))
        self.progress.advance(length)
        return digests

    async def verify_object(self, key: str, expected: FileDigest | None = None) -> FileDigest:
        """Re-read ``key`` and check it against ``expected`` (or its digest metadata); IntegrityError if off."""
        meta = await self.store.head(key)
        expected = expected or FileDigest.from_metadata(meta.size, meta.metadata)
        if expected is None:
            raise IntegrityError(f"{key}: no recorded digest to verify against")
        if expected.size != meta.size:
            raise IntegrityError(f"{key}: size is {meta.size}, its record says {expected.size}")
        plan = plan_download(meta.size, expected.chunk_size, self.config, ranges=self.planned_requests())
        self.progress.expect(meta.size)

        async def part(index: int) -> list[bytes]:
            offset, length = plan.part(index)
            async with self.pool.buffer(self.ring) as ring:
                sink = RingSink(key, None, threading.Lock(), offset, length, ring, expected.chunk_size)
                digests = await sink.receive(self.store.receive(key, offset, length, sink))
            self.progress.advance(length)
            return digests

        async with self._files:
            parts = await gather_all(part(i) for i in range(plan.count))
        expected.check([d for p in parts for d in p], key)
        return expected


def _named(exc: BaseException, key: str, path: str) -> BaseException:
    """A file-system error that names no file (ENOSPC from a write, say) as one naming the download it stopped;
    any other error as it is."""
    if isinstance(exc, OSError) and exc.errno and not exc.filename and not isinstance(exc, StoreError):
        return OSError(exc.errno, f"{exc.strerror} (downloading {key})", path)
    return exc
