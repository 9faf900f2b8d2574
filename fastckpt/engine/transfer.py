"""Upload and download pipelines: parts hashed and sent from pooled buffers or from their files, many in flight."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import functools
import logging
import os
import threading
from dataclasses import dataclass

from ..config import TransferConfig
from ..errors import AlreadyExistsError, IntegrityError, ObjectNotFoundError, StoreError
from ..fileio import read_exact, write_at
from ..integrity import FileDigest, combine, hash_chunks, read_and_hash
from ..stores.base import MultipartUpload, ObjectMeta, PartInfo, PendingUpload, Store
from ..stores.local import partial_path
from ..stores.retry import retrying
from ..tasks import gather_all
from ..threads import off_loop, start_io_threads
from ..transport import FileRange, SendfileUnsupported, body_size
from .journal import Journal, resumable_paths
from .plan import Plan, plan_copy, plan_download, plan_upload
from .pool import BufferPool
from .progress import Progress, ProgressCallback
from .sink import RING, RingSink, copy_and_hash, hash_file_range

log = logging.getLogger("fastckpt")
_NO_MAPPING = {errno.ENODEV, errno.EINVAL}
"""What ``mmap`` of a file raises where its filesystem cannot map it."""


@dataclass(frozen=True)
class FileResult:
    """One file moved: its key in the store, its local path and its digest."""

    key: str
    path: str
    digest: FileDigest


class Transfer:
    """A transfer session on one store: shared buffer pool, file limit, retries and progress."""

    def __init__(
        self, store: Store, config: TransferConfig | None = None, progress: ProgressCallback | None = None
    ) -> None:
        start_io_threads()
        self.config = config or TransferConfig.from_env()
        self.store = retrying(store, self.config)
        self.pool = BufferPool(self.config.part_size, self.config.max_in_flight)
        self.rings = BufferPool(RING, self.config.max_in_flight)
        """Ring buffers of the ranges being received (``engine.sink``)."""
        self.progress = Progress(progress)
        self._files = asyncio.Semaphore(self.config.max_open_files)
        self._dirs: set[str] = set()
        self._copy_slots = max(2, min(self.config.max_in_flight, os.cpu_count() or 2))
        """Ranges copied between local files at once: each keeps a core busy (more only switch between threads)."""
        self._local_copies = asyncio.Semaphore(self._copy_slots)
        self._file_parts = asyncio.Semaphore(self.config.max_in_flight)
        """Parts sent from their files at once (no buffer bounds them)."""
        self._send_files = True
        """Whether parts may be sent from their files (until a filesystem refuses a mapping or ``sendfile``)."""

    def close(self) -> None:
        """Release pooled buffers."""
        self.pool.close()
        self.rings.close()

    # ----------------------------------------------------------------------------- uploads

    async def upload_files(self, pairs: list[tuple[str, str]], *, if_absent: bool = False) -> list[FileResult]:
        """Upload ``(local path, key)`` pairs concurrently.

        With ``if_absent`` every object is created only if its key is free (AlreadyExistsError otherwise,
        nothing stored); a key that already holds an object with the same digest counts as written.
        """
        sizes = []
        for path, _ in pairs:
            try:
                sizes.append(os.stat(path).st_size)
            except FileNotFoundError:
                raise FileNotFoundError(f"source file {path} does not exist") from None
        self.progress.expect(sum(sizes))
        failed = asyncio.Event()  # set when one file failed: the others are then cancelled, not interrupted
        return await gather_all((self._upload_counted(p, k, if_absent, failed, size, sum(sizes))
                                 for (p, k), size in zip(pairs, sizes, strict=True)), failed)

    async def upload_file(self, path: str, key: str, *, if_absent: bool = False) -> FileResult:
        """Upload one file (progress total grows by its size)."""
        return (await self.upload_files([(path, key)], if_absent=if_absent))[0]

    async def _upload_counted(self, path: str, key: str, if_absent: bool, failed: asyncio.Event, size: int,
                              batch: int) -> FileResult:
        async with self._files:
            plan = plan_upload(size, self.config, self.store)
            if log.isEnabledFor(logging.DEBUG):
                log.debug("upload %s -> %s: %d bytes, %d part(s) of %d", path, self.store.uri(key), plan.size,
                          plan.count, plan.part_size)
            if not plan.multipart:
                digest = await self._upload_single(path, plan, key, if_absent)
            else:
                fd = await off_loop(_open_source, path, undo=os.close)
                try:
                    plan = plan_upload(os.fstat(fd).st_size, self.config, self.store)
                    digest = await self._upload_multipart(fd, plan, key, path, if_absent, failed, batch)
                finally:
                    os.close(fd)
        return FileResult(key, path, digest)

    async def _upload_single(self, path: str, plan: Plan, key: str, if_absent: bool) -> FileDigest:
        async with self.pool.buffer(plan.size) as buf:
            digests = await off_loop(_read_source, path, buf, plan.part_size)  # one I/O thread: open, read, hash
            digest = FileDigest(plan.size, plan.part_size, combine(digests))
            meta = digest.metadata() if self.config.digest_metadata else None
            try:
                await self.store.put(key, buf, if_absent=if_absent, metadata=meta)
            except AlreadyExistsError:
                if not await self.holds_digest(key, digest):
                    raise
        self.progress.advance(plan.size)
        return digest

    async def holds_file(self, path: str, key: str) -> FileResult | None:
        """The result of uploading ``path`` to ``key`` when ``key`` already holds exactly that file (its
        recorded digest matches the file, hashed here): a rerun need not send it again. None otherwise."""
        try:
            meta = await self.store.head(key)
        except ObjectNotFoundError:
            return None
        recorded = FileDigest.from_metadata(meta.size, meta.metadata)
        fd = os.open(path, os.O_RDONLY)
        try:
            plan = plan_upload(os.fstat(fd).st_size, self.config, self.store)
            if recorded is None or plan.size != meta.size or plan.part_size != recorded.chunk_size:
                return None
            digest = await self._hash_file(fd, plan)
        finally:
            os.close(fd)
        return FileResult(key, path, digest) if digest == recorded else None

    async def holds_digest(self, key: str, digest: FileDigest) -> bool:
        """Whether ``key`` already holds an object recorded with ``digest`` (e.g. our own create-if-absent
        write, retried after its reply was lost)."""
        try:
            meta = await self.store.head(key)
        except ObjectNotFoundError:
            return False
        return FileDigest.from_metadata(meta.size, meta.metadata) == digest

    async def _upload_multipart(self, fd: int, plan: Plan, key: str, path: str, if_absent: bool,
                                failed: asyncio.Event, batch: int) -> FileDigest:
        pre: FileDigest | None = None
        if self.config.digest_metadata and not self.store.metadata_on_complete:
            pre = await self._hash_file(fd, plan)  # the digest must go with the upload's creation
        journal, stale = await off_loop(self._upload_journal, fd, plan, key, path, if_absent, pre)
        if stale:  # left by an earlier run of this upload whose source has changed since
            await self._abort_quietly(key, stale)
        written = _written(fd)
        mpu = await self._resume(journal, key, plan, if_absent)
        if mpu is None:
            mpu = await self.start_upload(key, plan.part_size, pre.metadata() if pre else None, if_absent)
        try:
            if journal is not None and not journal.resumed:  # fresh (or the old one was gone)
                await off_loop(functools.partial(journal.start, upload_id=mpu.upload_id))
            target = mpu.local_fd()
            if target is not None and not (journal is not None and journal.resumed):  # a local file: copied
                results = await self._copy_parts(fd, plan, target, journal, batch)
            else:
                results = await gather_all(self._send_part(fd, plan, i, mpu, journal) for i in range(plan.count))
            digest = FileDigest(plan.size, plan.part_size, combine([d for _, d in results]))
            if (pre is not None and pre.digest != digest.digest) or _written(fd) != written:
                raise IntegrityError(f"{path} changed while it was being uploaded to {key}")
            meta = digest.metadata() if self.config.digest_metadata else None
            await mpu.complete([p for p, _ in results], meta)
        except AlreadyExistsError:
            await asyncio.shield(self.abort_upload(mpu, journal))
            if not await self.holds_digest(key, digest):
                raise
        except asyncio.CancelledError:
            if journal is None or failed.is_set():
                await asyncio.shield(self.abort_upload(mpu, journal))
            else:  # interrupted: kept, the same upload run again continues from the journal (or gc aborts it)
                journal.close()
            raise
        except BaseException:
            await asyncio.shield(self.abort_upload(mpu, journal))
            raise
        if journal is not None:
            await off_loop(journal.remove)
        return digest

    def _upload_journal(self, fd: int, plan: Plan, key: str, path: str, if_absent: bool,
                        pre: FileDigest | None) -> tuple[Journal | None, str | None]:
        """The journal of this upload, loaded when an earlier run of it left one (None: ``resume`` is off),
        and the id of an upload left by an earlier run of it whose source differed (to abort)."""
        if not self.config.resume:
            return None, None
        st = os.fstat(fd)
        journal = Journal.for_upload(self.config.journal_dir, self.store.uri(key), path, {
            "size": plan.size, "mtime_ns": st.st_mtime_ns, "part_size": plan.part_size, "if_absent": if_absent,
            "digest": pre.digest if pre else None})
        found = journal.load()
        stale = found.get("upload_id") if found is not None and not journal.resumed else None
        return journal, str(stale) if stale else None

    async def _resume(self, journal: Journal | None, key: str, plan: Plan, if_absent: bool
                      ) -> MultipartUpload | None:
        """The upload an earlier, killed run of this transfer left open, if the store still has it."""
        if journal is None or not journal.resumed:
            return None
        upload_id = str(journal.header.get("upload_id", ""))
        mpu = await self.store.resume_multipart(key, upload_id, plan.part_size, if_absent=if_absent)
        if mpu is None:
            journal.resumed = False
        else:
            log.info("resuming the upload of %s: %d of %d parts were stored", key, len(journal.parts), plan.count)
        return mpu

    async def _abort_quietly(self, key: str, upload_id: str) -> None:
        try:
            await self.store.abort_pending_upload(PendingUpload(key, upload_id))
        except StoreError as exc:
            log.warning("could not abort the stale upload of %s: %s", key, exc)

    async def start_upload(self, key: str, part_size: int, metadata: dict[str, str] | None, if_absent: bool
                           ) -> MultipartUpload:
        """``create_multipart``, not cut short by a cancellation: an upload the server started for a caller
        cancelled meanwhile (a sibling failed) is aborted, never left behind."""
        create = asyncio.ensure_future(self.store.create_multipart(key, part_size, metadata, if_absent=if_absent))
        try:
            return await asyncio.shield(create)
        except asyncio.CancelledError:
            await asyncio.wait([create])
            if not create.cancelled() and create.exception() is None:
                await self.abort_upload(create.result())
            raise

    async def abort_upload(self, mpu: MultipartUpload, journal: Journal | None = None) -> None:
        """Abort ``mpu``; a failure is logged (gc finds the upload later), never raised over the cause."""
        if journal is not None:
            journal.remove()
        try:
            await mpu.abort()
        except Exception as exc:
            log.warning("could not abort the multipart upload of %s: %s", mpu.key, exc)

    async def _copy_parts(self, fd: int, plan: Plan, target: int, journal: Journal | None, batch: int
                          ) -> list[tuple[PartInfo, bytes]]:
        """Copy the parts of ``plan`` from ``fd`` into the local file ``target`` in runs of parts, one per copy
        slot of the ``batch``, as a download from a local store is copied (see ``_write``)."""
        writer = threading.Lock()  # one run writes into the file at a time (see engine.sink)
        runs = plan_copy(plan.size, plan.part_size, self.config, batch=batch, slots=self._copy_slots)

        async def run(index: int) -> list[tuple[PartInfo, bytes]]:
            offset, length = runs.part(index)
            async with self._local_copies:
                digests = await off_loop(copy_and_hash, fd, offset, length, target, writer, plan.part_size)
            first = offset // plan.part_size
            if journal is not None:
                for i, digest in enumerate(digests, first):
                    journal.record(i, token="", digest=digest.hex())
            self.progress.advance(length)
            return [(PartInfo(i, plan.part(i)[1]), digest) for i, digest in enumerate(digests, first)]

        return [part for parts in await gather_all(run(i) for i in range(runs.count)) for part in parts]

    async def _send_part(self, fd: int, plan: Plan, index: int, mpu: MultipartUpload, journal: Journal | None
                         ) -> tuple[PartInfo, bytes]:
        """Part ``index``, hashed and sent: from the file where the store takes file ranges (hashed through a
        mapping, sent by the kernel: a 1 GiB S3 upload took 0.31-0.39 client CPU-s against 0.52-0.55 read into
        buffers, measured), else read into a pooled buffer, hashed and sent from it."""
        offset, length = plan.part(index)
        sent = None
        if mpu.sends_files and self._send_files:
            sent = await self._send_from_file(fd, offset, length, index, mpu, journal)
        if sent is None:
            async with self.pool.buffer(length) as buf:
                digest = await off_loop(read_and_hash, fd, offset, buf)
                sent = await self._put_part(index, buf, digest, mpu, journal), digest
        self.progress.advance(length)
        return sent

    async def _send_from_file(self, fd: int, offset: int, length: int, index: int, mpu: MultipartUpload,
                              journal: Journal | None) -> tuple[PartInfo, bytes] | None:
        """Part ``index`` hashed through a mapping and sent from the file; None (and no more parts sent this way
        in this session) where the file's filesystem cannot be mapped or sent from."""
        async with self._file_parts:
            try:
                digests = await off_loop(hash_file_range, fd, offset, length, length)
            except OSError as exc:
                if exc.errno not in _NO_MAPPING:
                    raise
                return self._from_buffers(exc)
            if not digests:
                raise EOFError(f"end of file before byte {offset + length}")
            try:
                return await self._put_part(index, FileRange(fd, offset, length), digests[0], mpu, journal), digests[0]
            except SendfileUnsupported as exc:
                return self._from_buffers(exc)

    def _from_buffers(self, cause: Exception) -> None:
        """Send every part from here on from a buffer."""
        log.info("sending parts from buffers: %s", cause)
        self._send_files = False

    @staticmethod
    async def _put_part(index: int, data: memoryview | FileRange, digest: bytes, mpu: MultipartUpload,
                        journal: Journal | None) -> PartInfo:
        """``mpu.put_part``, unless an earlier run of this upload stored the same part (``journal``)."""
        done = journal.parts.get(index) if journal is not None and journal.resumed else None
        if done is not None and done.get("digest") == digest.hex():
            info = await mpu.stored_part(index, body_size(data), done.get("token", ""), digest.hex())
            if info is not None:
                return info
        info = await mpu.put_part(index, data)
        if journal is not None:
            journal.record(index, token=info.token, digest=digest.hex())
        return info

    async def _hash_file(self, fd: int, plan: Plan) -> FileDigest:
        async def one(index: int) -> bytes:
            offset, length = plan.part(index)
            async with self.pool.buffer(length) as buf:
                return await off_loop(read_and_hash, fd, offset, buf)

        digests = await gather_all(one(i) for i in range(plan.count))
        return FileDigest(plan.size, plan.part_size, combine(digests))

    # ----------------------------------------------------------------------------- downloads

    async def download_files(self, pairs: list[tuple[str, str]], expected: dict[str, FileDigest] | None = None,
                             sizes: dict[str, int] | None = None) -> list[FileResult]:
        """Download ``(key, local path)`` pairs concurrently; digests from ``expected`` or metadata. ``sizes``
        (from a listing) let an object of one part come with its metadata in a single request."""
        expected, sizes = expected or {}, sizes or {}
        batch = sum(expected[k].size if k in expected else sizes.get(k, 0) for k, _ in pairs)
        failed = asyncio.Event()  # set when one file failed: the others are then cancelled, not interrupted
        return await gather_all((self._download(k, p, expected.get(k), sizes.get(k), failed, batch)
                                 for k, p in pairs), failed)

    async def download_file(self, key: str, path: str, expected: FileDigest | None = None) -> FileResult:
        """Download one object to ``path`` (written beside it, verified, then renamed into place)."""
        return (await self.download_files([(key, path)], {key: expected} if expected else None))[0]

    async def _download(self, key: str, path: str, expected: FileDigest | None, size: int | None,
                        failed: asyncio.Event, batch: int = 0) -> FileResult:
        async with self._files:
            size = expected.size if expected is not None else size
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
            plan = plan_download(meta.size, recorded, self.config, batch=batch)
        else:
            plan = plan_copy(meta.size, recorded, self.config, batch=batch, slots=self._copy_slots)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("download %s -> %s: %d bytes, %d part(s) of %d", self.store.uri(key), path, plan.size,
                      plan.count, plan.part_size)
        self.progress.expect(meta.size)
        chunk = recorded or plan.part_size
        if data is not None:  # in memory already: written, checked and put in place by one I/O thread
            try:
                digests = await off_loop(self._write_whole, key, path, meta, expected, plan, chunk, data)
            except OSError as exc:
                if (named := _named(exc, key, path)) is exc:
                    raise
                raise named from exc
            self.progress.advance(len(data))
            return FileResult(key, path, FileDigest(meta.size, chunk, combine(digests)))
        # creating a file waits on its directory, as long as others are made there: off the event loop
        tmp, fd, journal = await off_loop(self._partial, key, path, meta, expected, plan, chunk, undo=_close_partial)
        try:
            try:
                writer = threading.Lock()  # one pwrite at a time per file (see engine.sink)
                parts = await gather_all(self._fetch_part(key, fd, writer, plan, i, chunk, journal)
                                         for i in range(plan.count))
                digests = [d for part in parts for d in part]
                if expected is not None:
                    expected.check(digests, f"{key} (downloaded to {path})")
                if self.config.fsync:
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

    def _write_whole(self, key: str, path: str, meta: ObjectMeta, expected: FileDigest | None, plan: Plan,
                     chunk: int, data: memoryview) -> list[bytes]:
        """On an I/O thread: ``data``, all of object ``key``, hashed and written to a partial file, checked against
        ``expected``, then renamed to ``path``; its chunk digests."""
        tmp, fd, _ = self._partial(key, path, meta, expected, plan, chunk, resumable=False)
        try:
            try:
                digests = hash_chunks(data, chunk)
                if expected is not None:
                    expected.check(digests, f"{key} (downloaded to {path})")
                write_at(fd, 0, data)
                if self.config.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
        return digests

    def _partial(self, key: str, path: str, meta: ObjectMeta, expected: FileDigest | None, plan: Plan,
                 chunk: int, resumable: bool = True) -> tuple[str, int, Journal | None]:
        """On an I/O thread: the hidden partial file a download of ``key`` to ``path`` writes (open, locked;
        its directory made) and, for a multipart download with ``resume`` on, its journal (loaded when a killed
        run left one).

        The partial file's name is fixed, so a rerun finds it (a concurrent download to the same path,
        holding its lock, makes this one use a name of its own, without resume)."""
        if os.path.isdir(path):
            raise IsADirectoryError(f"destination {path} is a directory")
        parent = os.path.dirname(os.path.abspath(path))
        if parent not in self._dirs:  # many files share a directory: made (or found) once
            os.makedirs(parent, exist_ok=True)
            self._dirs.add(parent)
        tmp, journal_path = resumable_paths(path)
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            tmp = partial_path(os.path.abspath(path))
            return tmp, os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644), None
        except OSError:  # a filesystem without locks (some NFS mounts): go on unlocked
            pass
        journal = None
        if self.config.resume and resumable and plan.count > 1:
            journal = Journal(journal_path, {"uri": self.store.uri(key), "size": meta.size, "etag": meta.etag,
                                             "mtime": meta.mtime, "digest": expected.digest if expected else None,
                                             "chunk": chunk, "part_size": plan.part_size})
            journal.load()
            if journal.resumed:
                log.info("resuming the download of %s to %s: %d of %d parts are in", key, path,
                         len(journal.parts), plan.count)
            else:
                journal.start()
        if (journal is None or not journal.resumed) and os.fstat(fd).st_size:
            os.ftruncate(fd, 0)  # only a stale file: ext4 flushes a file cut to 0 bytes when it is closed
        return tmp, fd, journal

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
        async with self.rings.buffer(RING) as ring:
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
        plan = plan_download(meta.size, expected.chunk_size, self.config)
        self.progress.expect(meta.size)

        async def part(index: int) -> list[bytes]:
            offset, length = plan.part(index)
            async with self.rings.buffer(RING) as ring:
                sink = RingSink(key, None, threading.Lock(), offset, length, ring, expected.chunk_size)
                digests = await sink.receive(self.store.receive(key, offset, length, sink))
            self.progress.advance(length)
            return digests

        async with self._files:
            parts = await gather_all(part(i) for i in range(plan.count))
        expected.check([d for p in parts for d in p], key)
        return expected

    # ----------------------------------------------------------------------------- listings

    async def keys_below(self, prefix: str) -> list[tuple[str, str, int]]:
        """(key, path relative to ``prefix``, size) of every object below ``prefix``; error when none."""
        prefix = prefix.strip("/")
        found = []
        async for meta in self.store.list(prefix):
            rel = meta.key[len(prefix):].lstrip("/") if prefix else meta.key
            if not rel:
                continue
            if any(part in ("", ".", "..") for part in rel.split("/")):
                raise StoreError(f"refusing unsafe object name {meta.key!r}")
            found.append((meta.key, rel, meta.size))
        if not found:
            raise ObjectNotFoundError(f"nothing found below {prefix!r} in {self.store.name}")
        return found


def _close_partial(opened: tuple[str, int, Journal | None]) -> None:
    """Close what ``Transfer._partial`` opened for a download cancelled meanwhile (the file stays, as an
    interrupted download's does)."""
    _, fd, journal = opened
    os.close(fd)
    if journal is not None:
        journal.close()


def _written(fd: int) -> tuple[int, int]:
    """The size and modification time of open file ``fd``: a part sent from the file is hashed a moment before
    the kernel sends it, and the object would mix two versions of a file written meanwhile."""
    st = os.fstat(fd)
    return st.st_size, st.st_mtime_ns


def _open_source(path: str) -> int:
    """``path`` opened for reading; errors that name it as the source of an upload."""
    try:
        return os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        raise FileNotFoundError(f"source file {path} does not exist") from None
    except IsADirectoryError:
        raise IsADirectoryError(f"source {path} is a directory; upload it as a directory") from None


def _read_source(path: str, buf: memoryview, chunk: int) -> list[bytes]:
    """On an I/O thread: all of file ``path`` read into ``buf`` (its size when listed) and its chunk digests."""
    fd = _open_source(path)
    try:
        if os.fstat(fd).st_size != len(buf):
            raise IntegrityError(f"{path} changed while it was being uploaded")
        read_exact(fd, 0, buf)
    finally:
        os.close(fd)
    return hash_chunks(buf, chunk) if len(buf) else []


def _named(exc: BaseException, key: str, path: str) -> BaseException:
    """A file-system error that names no file (ENOSPC from a write, say) as one naming the download it stopped;
    any other error as it is."""
    if isinstance(exc, OSError) and exc.errno and not exc.filename and not isinstance(exc, StoreError):
        return OSError(exc.errno, f"{exc.strerror} (downloading {key})", path)
    return exc
