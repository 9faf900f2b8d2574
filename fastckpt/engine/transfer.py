"""Upload and download pipelines: parts read, hashed and sent from pooled buffers, many in flight."""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
from dataclasses import dataclass

from ..config import TransferConfig
from ..errors import AlreadyExistsError, IntegrityError, ObjectNotFoundError, StoreError
from ..integrity import FileDigest, combine, hash_chunks, read_and_hash, read_exact, write_at
from ..stores.base import MultipartUpload, PartInfo, Store
from ..stores.retry import retrying
from .io import off_loop, start_io_threads
from .plan import Plan, plan_download, plan_upload
from .pool import BufferPool
from .progress import Progress, ProgressCallback
from .tasks import gather_all

log = logging.getLogger("fastckpt")


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
        self.progress = Progress(progress)
        self._files = asyncio.Semaphore(self.config.max_open_files)

    def close(self) -> None:
        """Release pooled buffers."""
        self.pool.close()

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
        return await gather_all(self._upload_counted(p, k, if_absent) for p, k in pairs)

    async def upload_file(self, path: str, key: str, *, if_absent: bool = False) -> FileResult:
        """Upload one file (progress total grows by its size)."""
        return (await self.upload_files([(path, key)], if_absent=if_absent))[0]

    async def _upload_counted(self, path: str, key: str, if_absent: bool) -> FileResult:
        async with self._files:
            try:
                fd = os.open(path, os.O_RDONLY)
            except FileNotFoundError:
                raise FileNotFoundError(f"source file {path} does not exist") from None
            except IsADirectoryError:
                raise IsADirectoryError(f"source {path} is a directory; upload it as a directory") from None
            try:
                plan = plan_upload(os.fstat(fd).st_size, self.config, self.store)
                log.debug("upload %s -> %s: %d bytes, %d part(s) of %d", path, self.store.uri(key), plan.size,
                          plan.count, plan.part_size)
                if plan.multipart:
                    digest = await self._upload_multipart(fd, plan, key, path, if_absent)
                else:
                    digest = await self._upload_single(fd, plan, key, if_absent)
            finally:
                os.close(fd)
        return FileResult(key, path, digest)

    async def _upload_single(self, fd: int, plan: Plan, key: str, if_absent: bool) -> FileDigest:
        async with self.pool.buffer(plan.size) as buf:
            await off_loop(read_exact, fd, 0, buf)
            digests = await off_loop(hash_chunks, buf, plan.part_size) if plan.size else []
            digest = FileDigest(plan.size, plan.part_size, combine(digests))
            meta = digest.metadata() if self.config.digest_metadata else None
            try:
                await self.store.put(key, buf, if_absent=if_absent, metadata=meta)
            except AlreadyExistsError:
                if not await self._holds(key, digest):
                    raise
        self.progress.advance(plan.size)
        return digest

    async def _holds(self, key: str, digest: FileDigest) -> bool:
        """Whether ``key`` already holds an object recorded with ``digest`` (e.g. our own create-if-absent
        write, retried after its reply was lost)."""
        try:
            meta = await self.store.head(key)
        except ObjectNotFoundError:
            return False
        return FileDigest.from_metadata(meta.size, meta.metadata) == digest

    async def _upload_multipart(self, fd: int, plan: Plan, key: str, path: str, if_absent: bool) -> FileDigest:
        pre: FileDigest | None = None
        if self.config.digest_metadata and not self.store.metadata_on_complete:
            pre = await self._hash_file(fd, plan)
        mpu: MultipartUpload = await self.store.create_multipart(
            key, plan.part_size, pre.metadata() if pre else None, if_absent=if_absent)
        try:
            results = await gather_all(self._send_part(fd, plan, i, mpu) for i in range(plan.count))
            digest = FileDigest(plan.size, plan.part_size, combine([d for _, d in results]))
            if pre is not None and pre.digest != digest.digest:
                raise IntegrityError(f"{path} changed while it was being uploaded to {key}")
            meta = digest.metadata() if self.config.digest_metadata else None
            await mpu.complete([p for p, _ in results], meta)
        except AlreadyExistsError:
            await asyncio.shield(self._abort(mpu))
            if not await self._holds(key, digest):
                raise
        except BaseException:
            await asyncio.shield(self._abort(mpu))
            raise
        return digest

    async def _abort(self, mpu: MultipartUpload) -> None:
        """Abort ``mpu``; a failure is logged (gc finds the upload later), never raised over the cause."""
        try:
            await mpu.abort()
        except Exception as exc:
            log.warning("could not abort the multipart upload of %s: %s", mpu.key, exc)

    async def _send_part(self, fd: int, plan: Plan, index: int, mpu: MultipartUpload) -> tuple[PartInfo, bytes]:
        offset, length = plan.part(index)
        async with self.pool.buffer(length) as buf:
            digest = await off_loop(read_and_hash, fd, offset, buf)
            info = await mpu.put_part(index, buf)
        self.progress.advance(length)
        return info, digest

    async def _hash_file(self, fd: int, plan: Plan) -> FileDigest:
        async def one(index: int) -> bytes:
            offset, length = plan.part(index)
            async with self.pool.buffer(length) as buf:
                return await off_loop(read_and_hash, fd, offset, buf)

        digests = await gather_all(one(i) for i in range(plan.count))
        return FileDigest(plan.size, plan.part_size, combine(digests))

    # ----------------------------------------------------------------------------- downloads

    async def download_files(self, pairs: list[tuple[str, str]], expected: dict[str, FileDigest] | None = None
                             ) -> list[FileResult]:
        """Download ``(key, local path)`` pairs concurrently; digests from ``expected`` or metadata."""
        expected = expected or {}
        return await gather_all(self._download(k, p, expected.get(k)) for k, p in pairs)

    async def download_file(self, key: str, path: str, expected: FileDigest | None = None) -> FileResult:
        """Download one object to ``path`` (written beside it, verified, then renamed into place)."""
        return (await self.download_files([(key, path)], {key: expected} if expected else None))[0]

    async def _download(self, key: str, path: str, expected: FileDigest | None) -> FileResult:
        async with self._files:
            meta = await self.store.head(key)
            if expected is None and self.config.verify:
                expected = FileDigest.from_metadata(meta.size, meta.metadata)
            if expected is not None and expected.size != meta.size:
                raise IntegrityError(f"{key}: size is {meta.size}, its record says {expected.size}")
            plan = plan_download(meta.size, expected.chunk_size if expected else None, self.config)
            log.debug("download %s -> %s: %d bytes, %d part(s) of %d", self.store.uri(key), path, plan.size,
                      plan.count, plan.part_size)
            self.progress.expect(meta.size)
            if os.path.isdir(path):
                raise IsADirectoryError(f"destination {path} is a directory")
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            tmp = os.path.join(os.path.dirname(os.path.abspath(path)),
                               f".{os.path.basename(path)}.{secrets.token_hex(6)}.fastckpt-part")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                try:
                    chunk = expected.chunk_size if expected else plan.part_size
                    parts = await gather_all(self._fetch_part(key, fd, plan, i, chunk) for i in range(plan.count))
                    digests = [d for part in parts for d in part]
                    if expected is not None:
                        expected.check(digests, f"{key} (downloaded to {path})")
                    if self.config.fsync:
                        await off_loop(os.fsync, fd)
                finally:
                    os.close(fd)
                os.replace(tmp, path)
            except BaseException as exc:
                try:
                    os.unlink(tmp)
                except FileNotFoundError:
                    pass
                if isinstance(exc, OSError) and exc.errno and not exc.filename and not isinstance(exc, StoreError):
                    raise OSError(exc.errno, f"{exc.strerror} (downloading {key})", path) from exc  # e.g. ENOSPC
                raise
        return FileResult(key, path, FileDigest(meta.size, chunk, combine(digests)))

    async def _fetch_part(self, key: str, fd: int, plan: Plan, index: int, chunk: int) -> list[bytes]:
        offset, length = plan.part(index)
        async with self.pool.buffer(length) as buf:
            n = await self.store.read_into(key, offset, buf)
            if n != length:
                raise StoreError(f"{key}: object shrank during download (got {n} of {length} bytes at {offset})")
            digests = await off_loop(_hash_and_write, fd, offset, buf, chunk)
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
            async with self.pool.buffer(length) as buf:
                n = await self.store.read_into(key, offset, buf)
                if n != length:
                    raise IntegrityError(f"{key}: object is shorter than recorded ({offset + n} < {meta.size})")
                digests = await off_loop(hash_chunks, buf, expected.chunk_size)
            self.progress.advance(length)
            return digests

        async with self._files:
            parts = await gather_all(part(i) for i in range(plan.count))
        expected.check([d for p in parts for d in p], key)
        return expected

    # ----------------------------------------------------------------------------- listings

    async def keys_below(self, prefix: str) -> list[tuple[str, str]]:
        """(key, path relative to ``prefix``) of every object below ``prefix``; error when none."""
        prefix = prefix.strip("/")
        found = []
        async for meta in self.store.list(prefix):
            rel = meta.key[len(prefix):].lstrip("/") if prefix else meta.key
            if not rel:
                continue
            if any(part in ("", ".", "..") for part in rel.split("/")):
                raise StoreError(f"refusing unsafe object name {meta.key!r}")
            found.append((meta.key, rel))
        if not found:
            raise ObjectNotFoundError(f"nothing found below {prefix!r} in {self.store.name}")
        return found


def _hash_and_write(fd: int, offset: int, buf: memoryview, chunk: int) -> list[bytes]:
    digests = hash_chunks(buf, chunk)
    write_at(fd, offset, buf)
    return digests
