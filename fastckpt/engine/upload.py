"""The upload pipeline: files hashed part by part and sent from their files or from pooled buffers, many parts in
flight, journaled so that a killed upload continues where it stopped."""

from __future__ import annotations

import asyncio
import errno
import functools
import logging
import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass

from .. import otel, stats
from ..errors import AlreadyExistsError, IntegrityError, ObjectNotFoundError, StoreError
from ..fileio import read_exact
from ..integrity import FileDigest, combine, hash_chunks, read_and_hash
from ..stores.base import MultipartUpload, PartInfo, PendingUpload
from ..tasks import gather_all
from ..threads import off_loop
from ..transport import FileRange, SendfileUnsupported, body_size
from .journal import Journal
from .plan import Plan, plan_copy, plan_upload
from .reuse import BaseObject, same_parts
from .session import FileResult, TransferSession
from .sink import copy_and_hash, hash_file_range

__all__ = ["SNAPSHOT_READS", "SourceChanged", "Uploads"]

log = logging.getLogger("fastckpt")
SNAPSHOT_READS = 3
"""Reads of a file that keeps being rewritten or cut short before a snapshot upload gives up on it."""
_NO_MAPPING = {errno.ENODEV, errno.EINVAL}
"""What ``mmap`` of a file raises where its filesystem cannot map it."""


class SourceChanged(IntegrityError):
    """A file being uploaded was rewritten or cut short while it was read."""


class Uploads(TransferSession):
    """Uploads of local files.

    A file is taken as it is when it is opened: its size then is what is sent, and the digest recorded is that of
    the bytes sent. What a change to the file during its upload does depends on ``snapshot``, for one part and many
    alike. Strict (the default, what checkpoint saves use): any change (size or modification time) fails the
    upload with ``IntegrityError`` naming the file. Snapshot (plain copies: ``fastckpt cp``, the filesystem
    facades, what Ray Tune syncs from a live experiment directory): a file that grew meanwhile is no error (its
    first bytes, checked, are what was sent); one rewritten or cut short is read again, up to ``SNAPSHOT_READS``
    times, then fails naming it; one gone by the time it is opened (a temporary file renamed into place) is not
    part of the snapshot and is left out of the results.
    """

    async def upload_files(self, pairs: list[tuple[str, str]], *, if_absent: bool = False,
                           bases: Mapping[str, BaseObject] | None = None, snapshot: bool = False
                           ) -> list[FileResult]:
        """Upload ``(local path, key)`` pairs concurrently.

        With ``if_absent`` every object is created only if its key is free (AlreadyExistsError otherwise,
        nothing stored); a key that already holds an object with the same digest counts as written. ``bases``
        (by key): objects of an earlier checkpoint whose unchanged bytes the store copies (``engine.reuse``).
        ``snapshot``: files that change while they are sent are taken as the class says.
        """
        bases = bases or {}
        sizes = []
        for path, _ in pairs:
            try:
                sizes.append(os.stat(path).st_size)
            except FileNotFoundError:
                if not snapshot:
                    raise FileNotFoundError(f"source file {path} does not exist") from None
                sizes.append(0)  # gone: left out when it cannot be opened either
        self.progress.expect(sum(sizes))
        failed = asyncio.Event()  # set when one file failed: the others are then cancelled, not interrupted
        with stats.stage("sending"):
            results = await gather_all((self._upload_counted(p, k, if_absent, failed, size, sum(sizes),
                                                             bases.get(k), snapshot)
                                        for (p, k), size in zip(pairs, sizes, strict=True)), failed)
        return [r for r in results if r is not None]

    async def upload_file(self, path: str, key: str, *, if_absent: bool = False) -> FileResult:
        """Upload one file (progress total grows by its size)."""
        return (await self.upload_files([(path, key)], if_absent=if_absent))[0]

    async def _upload_counted(self, path: str, key: str, if_absent: bool, failed: asyncio.Event, size: int,
                              batch: int, base: BaseObject | None, snapshot: bool) -> FileResult | None:
        """The upload of ``path``; None when a snapshot finds it gone."""
        async with self._files:
            with otel.span("fastckpt.upload_file", **{"fastckpt.key": key, "fastckpt.size": size}):
                return await self._upload_one(path, key, if_absent, failed, size, batch, base, snapshot)

    async def _upload_one(self, path: str, key: str, if_absent: bool, failed: asyncio.Event, size: int,
                          batch: int, base: BaseObject | None, snapshot: bool) -> FileResult | None:
        """``_upload_counted``'s work: the file read again while a snapshot finds it changing."""
        for read in range(1, SNAPSHOT_READS + 1):
            try:
                taken = await self._upload_opened(path, key, if_absent, failed, size, batch, base, snapshot)
                if taken is None:
                    return None
                digest, chunks = taken
                break
            except SourceChanged as exc:
                if not snapshot:
                    raise
                if read == SNAPSHOT_READS:
                    raise SourceChanged(f"{exc}, at each of {read} reads") from None
                log.info("%s; reading it again", exc)
        stats.moved(digest.size)
        return FileResult(key, path, digest, tuple(chunks), self.reuse.copied.get(key, 0))

    async def _upload_opened(self, path: str, key: str, if_absent: bool, failed: asyncio.Event, size: int,
                             batch: int, base: BaseObject | None, snapshot: bool
                             ) -> tuple[FileDigest, list[bytes]] | None:
        """Open ``path``, then upload it as it is now (its size when listed was ``size``); None when a snapshot finds
        it gone (removed or renamed since it was listed: a live directory's temporary files)."""
        try:
            fd = await off_loop(_open_source, path, undo=os.close)
        except FileNotFoundError:
            if not snapshot:
                raise
            log.info("%s is gone (removed or renamed since it was listed): not uploaded", path)
            self.progress.expect(-size)
            return None
        try:
            opened = _written(fd)
            if opened[0] != size:
                self.progress.expect(opened[0] - size)
            plan = plan_upload(opened[0], self.config, self.store)
            if log.isEnabledFor(logging.DEBUG):
                log.debug("upload %s -> %s: %d bytes, %d part(s) of %d", path, self.store.uri(key), plan.size,
                          plan.count, plan.part_size)
            source = _Source(fd, path, key, opened, snapshot)
            if not plan.multipart and base is None:
                return await self._upload_single(source, plan, if_absent)
            return await self._upload_reusing(source, plan, if_absent, failed, batch, base)
        except EOFError as exc:  # a read or a send of the file found it shorter than when it was opened
            raise SourceChanged(f"{path} was cut short while it was being uploaded to {key}: {exc}") from exc
        finally:
            os.close(fd)

    async def _check_source(self, source: _Source, plan: Plan, digest: FileDigest) -> None:
        """Raise ``SourceChanged`` when ``source`` changed since it was opened in a way its mode does not accept
        (``digest``: of what was taken from it)."""
        now = _written(source.fd)
        if now == source.opened:
            return
        if not source.snapshot:
            raise SourceChanged(f"{source.path} changed while it was being uploaded to {source.key}")
        if now[0] < plan.size:
            raise SourceChanged(f"{source.path} was cut short while it was being uploaded to {source.key}")
        if await self._hash_file(source.fd, plan) != digest:  # grew: were its first bytes rewritten too?
            raise SourceChanged(f"{source.path} was rewritten while it was being uploaded to {source.key}")

    async def _upload_reusing(self, source: _Source, plan: Plan, if_absent: bool, failed: asyncio.Event, batch: int,
                              base: BaseObject | None) -> tuple[FileDigest, list[bytes]]:
        """A file uploaded with what the store can copy from ``base`` copied: it is hashed first, copied whole when
        it equals the base, else sent with the parts that equal the base's copied."""
        chunks = None
        if base is not None:
            chunks = await gather_all(self._hash_part(source.fd, plan, i) for i in range(plan.count))
            digest = FileDigest(plan.size, plan.part_size, combine(chunks))
            base = same_parts(base, digest, chunks)
            if await self.copied_whole(source.key, base, digest, if_absent):
                await self._check_source(source, plan, digest)
                return digest, chunks
            if not plan.multipart:
                return await self._upload_single(source, plan, if_absent)
        return await self._upload_multipart(source, plan, if_absent, failed, batch, base, chunks)

    async def _upload_single(self, source: _Source, plan: Plan, if_absent: bool) -> tuple[FileDigest, list[bytes]]:
        async with self.pool.buffer(plan.size) as buf:
            digests = await off_loop(_read_and_hash, source.fd, buf, plan.part_size)
            digest = FileDigest(plan.size, plan.part_size, combine(digests))
            await self._check_source(source, plan, digest)
            meta = digest.metadata() if self.config.digest_metadata else None
            try:
                await self.store.put(source.key, buf, if_absent=if_absent, metadata=meta)
            except AlreadyExistsError:
                if not await self.holds_digest(source.key, digest):
                    raise
        self.progress.advance(plan.size)
        return digest, digests

    async def copied_whole(self, key: str, base: BaseObject, digest: FileDigest, if_absent: bool) -> bool:
        """Whether ``key`` was written as the store's copy of ``base`` (``engine.reuse``; an object already there
        holding exactly ``digest`` counts, as for an upload)."""
        meta = digest.metadata() if self.config.digest_metadata else None
        try:
            copied = await self.reuse.copy_whole(key, base, digest, if_absent=if_absent, metadata=meta)
        except AlreadyExistsError:
            if not await self.holds_digest(key, digest):
                raise
            return True
        if copied:
            self.progress.advance(digest.size)
        return copied

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

    async def _upload_multipart(self, source: _Source, plan: Plan, if_absent: bool, failed: asyncio.Event, batch: int,
                                base: BaseObject | None = None, chunks: list[bytes] | None = None
                                ) -> tuple[FileDigest, list[bytes]]:
        fd, key = source.fd, source.key
        pre: FileDigest | None = None
        if self.config.digest_metadata and not self.store.metadata_on_complete:  # the digest goes with the creation
            pre = await self._hash_file(fd, plan) if chunks is None else \
                FileDigest(plan.size, plan.part_size, combine(chunks))
        journal, stale = await off_loop(self._upload_journal, fd, plan, key, source.path, if_absent, pre)
        if stale:  # left by an earlier run of this upload whose source has changed since
            await self._abort_quietly(key, stale)
        mpu = await self._resume(journal, key, plan, if_absent)
        if mpu is None:
            mpu = await self.start_upload(key, plan.part_size, pre.metadata() if pre else None, if_absent)
        try:
            if journal is not None and not journal.resumed:  # fresh (or the old one was gone)
                await off_loop(functools.partial(journal.start, upload_id=mpu.upload_id))
            target = mpu.local_fd()
            if target is not None and base is None and not (journal is not None and journal.resumed):
                results = await self._copy_parts(fd, plan, target, journal, batch)  # a local file: copied
            else:
                results = await gather_all(self._send_part(fd, plan, i, mpu, journal, base, chunks)
                                           for i in range(plan.count))
            digest = FileDigest(plan.size, plan.part_size, combine([d for _, d in results]))
            if pre is not None and pre.digest != digest.digest:  # what the upload was created with is not what was sent
                raise SourceChanged(f"{source.path} {'was rewritten' if source.snapshot else 'changed'} while it was "
                                    f"being uploaded to {key}")
            await self._check_source(source, plan, digest)
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
        return digest, [d for _, d in results]

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

    async def _send_part(self, fd: int, plan: Plan, index: int, mpu: MultipartUpload, journal: Journal | None,
                         base: BaseObject | None = None, chunks: list[bytes] | None = None) -> tuple[PartInfo, bytes]:
        """Part ``index``, copied by the store where ``base`` holds the same chunk (``chunks``: the file's, hashed
        already), else hashed and sent: from the file where the store takes file ranges (hashed through a
        mapping, sent by the kernel: a 1 GiB S3 upload took 0.31-0.39 client CPU-s against 0.52-0.55 read into
        buffers, measured), else read into a pooled buffer, hashed and sent from it."""
        offset, length = plan.part(index)
        sent = None
        if base is not None and chunks is not None:
            info = await self.reuse.copy_part(mpu, base, index, offset, length, chunks[index], plan.part_size)
            if info is not None:
                if journal is not None:
                    journal.record(index, token=info.token, digest=chunks[index].hex())
                sent = info, chunks[index]
        if sent is None and mpu.sends_files and self._send_files:
            sent = await self._send_from_file(fd, offset, length, index, mpu, journal)
        if sent is None:
            async with self.pool.buffer(length) as buf:
                digest = await off_loop(read_and_hash, fd, offset, buf)
                sent = await self._put_part(index, buf, digest, mpu, journal), digest
        self.progress.advance(length)
        return sent

    async def _send_from_file(self, fd: int, offset: int, length: int, index: int, mpu: MultipartUpload,
                              journal: Journal | None) -> tuple[PartInfo, bytes] | None:
        """Part ``index`` sent from the file while it is hashed through a mapping (the hash is off the critical path:
        what it covers is checked against the file's size and modification time before the upload completes); None
        (and no more parts sent this way in this session) where the file's filesystem cannot be mapped or sent from.
        A part an earlier run of this upload may have stored is hashed first, to compare."""
        async with self._file_parts:
            if journal is not None and journal.resumed and index in journal.parts:
                try:
                    digest = await self._hash_range(fd, offset, length)
                    return await self._put_part(index, FileRange(fd, offset, length), digest, mpu, journal), digest
                except (OSError, SendfileUnsupported) as exc:
                    return self._fallen_back(exc)
            hashing = asyncio.ensure_future(self._hash_range(fd, offset, length))
            try:
                info = await mpu.put_part(index, FileRange(fd, offset, length))
            except BaseException as exc:
                await asyncio.gather(hashing, return_exceptions=True)
                if isinstance(exc, SendfileUnsupported):
                    return self._fallen_back(exc)
                raise
            try:
                digest = await hashing
            except OSError as exc:
                self._fallen_back(exc)
                async with self.pool.buffer(length) as buf:  # sent already: its digest from a read
                    digest = await off_loop(read_and_hash, fd, offset, buf)
            if journal is not None:
                journal.record(index, token=info.token, digest=digest.hex())
            return info, digest

    async def _hash_range(self, fd: int, offset: int, length: int) -> bytes:
        """The digest of ``length`` bytes at ``offset`` of ``fd``, hashed through a mapping (EOFError if shorter)."""
        digests = await off_loop(hash_file_range, fd, offset, length, length)
        if not digests:
            raise EOFError(f"end of file before byte {offset + length}")
        return digests[0]

    def _fallen_back(self, exc: OSError | SendfileUnsupported) -> None:
        """Send every part from here on from a buffer where ``exc`` says the file cannot be mapped or sent from;
        raise anything else."""
        if isinstance(exc, OSError) and exc.errno not in _NO_MAPPING:
            raise exc
        self._from_buffers(exc)

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

    async def _hash_part(self, fd: int, plan: Plan, index: int) -> bytes:
        offset, length = plan.part(index)
        async with self.pool.buffer(length) as buf:
            return await off_loop(read_and_hash, fd, offset, buf)

    async def _hash_file(self, fd: int, plan: Plan) -> FileDigest:
        digests = await gather_all(self._hash_part(fd, plan, i) for i in range(plan.count))
        return FileDigest(plan.size, plan.part_size, combine(digests))


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


def _read_and_hash(fd: int, buf: memoryview, chunk: int) -> list[bytes]:
    """On an I/O thread: the first ``len(buf)`` bytes of open file ``fd`` read into ``buf``, and their chunk digests
    (EOFError when the file is shorter now)."""
    read_exact(fd, 0, buf)
    return hash_chunks(buf, chunk) if len(buf) else []


@dataclass(frozen=True)
class _Source:
    """A file being uploaded: open as ``fd``, its (size, mtime) when opened, and how a change to it is taken."""

    fd: int
    path: str
    key: str
    opened: tuple[int, int]
    snapshot: bool
