"""Local / NFS filesystem store.

Writes go to a temporary file beside the target (parallel ``pwrite`` at part offsets), are fsynced,
then atomically renamed (or hard-linked, for create-if-absent) into place, and the directory is
fsynced. Digests and other metadata are kept in ``user.`` extended attributes where supported.
"""

from __future__ import annotations

import errno
import os
import secrets
from collections.abc import AsyncIterator

from ..config import TransferConfig
from ..errors import (
    AccessDeniedError,
    AlreadyExistsError,
    CopyUnsupportedError,
    ObjectNotFoundError,
    SourceChangedError,
    StoreError,
)
from ..fileio import read_exact, write_at
from ..integrity import META_CHANGED, hash_chunks
from ..threads import off_loop
from ..transport import Buffer
from ..uri import StorageURI, check_options
from .base import CopySource, MultipartUpload, ObjectMeta, PartInfo, PendingUpload, Store, in_prefix, read_range

__all__ = ["TMP_SUFFIX", "LocalStore", "LocalUpload", "from_uri", "partial_path", "version_of"]

TMP_SUFFIX = ".fastckpt-part"
_XATTR = "user.fastckpt."
_VERSION = "fastckpt-version"
"""The file version (``version_of``) its other extended attributes were recorded for."""


def _is_tmp(name: str) -> bool:
    return name.startswith(".") and name.endswith(TMP_SUFFIX)


def partial_path(path: str) -> str:
    """A hidden, uniquely named partial file beside ``path`` (listed as a pending upload, found by gc)."""
    head, tail = os.path.split(path)
    return os.path.join(head, f".{tail}.{secrets.token_hex(6)}{TMP_SUFFIX}")


def _translate(exc: OSError, path: str) -> Exception:
    if isinstance(exc, FileNotFoundError):
        return ObjectNotFoundError(f"{path} does not exist")
    if isinstance(exc, PermissionError):
        return AccessDeniedError(f"{path}: permission denied")
    if isinstance(exc, NotADirectoryError):
        return StoreError(f"{path}: a parent of this path is a file, not a directory")
    if isinstance(exc, IsADirectoryError):
        return StoreError(f"{path} is a directory")
    return StoreError(f"{path}: {exc.strerror or exc}")


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _set_xattrs(path: str, metadata: dict[str, str]) -> None:
    for k, v in metadata.items():
        try:
            os.setxattr(path, _XATTR + k, v.encode())
        except OSError as exc:
            if exc.errno in (errno.ENOTSUP, errno.EPERM, errno.E2BIG, errno.ENOSPC):
                return
            raise


def _get_xattrs(path: str) -> dict[str, str]:
    try:
        names = [n for n in os.listxattr(path) if n.startswith(_XATTR)]
        return {n[len(_XATTR) :]: os.getxattr(path, n).decode() for n in names}
    except OSError:
        return {}


def _record(path: str, metadata: dict[str, str]) -> None:
    """Store ``metadata`` with the file's version, once its bytes are written: a file changed in place later (its
    extended attributes stay) is another version, whose metadata ``head`` no longer reports."""
    _set_xattrs(path, {**metadata, _VERSION: version_of(os.stat(path))})


def _head_of(path: str, st: os.stat_result) -> tuple[str | None, dict[str, str]]:
    """The version and metadata ``head`` reports. No version (nothing copies from it) for a file whose metadata names
    none (written by an earlier fastckpt) or another version: a file changed in place since its digests were recorded
    keeps them, marked ``META_CHANGED``, so that a read of it fails unless its bytes still match them."""
    found = _get_xattrs(path)
    recorded, version = found.pop(_VERSION, None), version_of(st)
    if recorded is None:
        return None, found
    if recorded != version:
        return None, {**found, META_CHANGED: recorded}
    return version, found


def version_of(st: os.stat_result) -> str:
    """A file's version tag (its ETag here): inode, size and modification time."""
    return f"{st.st_ino:x}-{st.st_size:x}-{st.st_mtime_ns:x}"


def _copy_range(source: CopySource, src_path: str, fd: int, offset: int) -> None:
    """On an I/O thread: ``source`` copied inside the kernel (``copy_file_range``: a reflink where the filesystem
    shares blocks) into ``fd`` at ``offset``; SourceChangedError when the file is not that version, before or after."""
    try:
        src = os.open(src_path, os.O_RDONLY)
    except OSError as exc:
        raise _translate(exc, src_path) from exc
    try:
        if version_of(os.fstat(src)) != source.etag:
            raise SourceChangedError(f"{src_path} changed since it was read (copy source)", key=source.key)
        done = 0
        while done < source.length:
            n = os.copy_file_range(src, fd, source.length - done, source.start + done, offset + done)
            if n == 0:
                raise StoreError(f"copy of {src_path}: end of file at byte {source.start + done}", key=source.key)
            done += n
        if version_of(os.fstat(src)) != source.etag:
            raise SourceChangedError(f"{src_path} changed while it was copied", key=source.key)
    except OSError as exc:
        if exc.errno in (errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL):
            raise CopyUnsupportedError(f"copy_file_range from {src_path}: {exc}", key=source.key) from exc
        raise
    finally:
        os.close(src)


def _publish(tmp: str, path: str, if_absent: bool) -> None:
    """Move the finished ``tmp`` to ``path``: a hard link when ``if_absent`` (atomic create-if-absent,
    also on NFS; FileExistsError if ``path`` exists, ``tmp`` is then left for the caller), else a rename."""
    if if_absent:
        os.link(tmp, path)
        os.unlink(tmp)
    else:
        os.replace(tmp, path)


class LocalUpload(MultipartUpload):
    """Parts ``pwrite``-n into one temporary file at ``index * part_size``."""

    def __init__(self, store: LocalStore, key: str, part_size: int, metadata: dict[str, str], if_absent: bool,
                 upload_id: str | None = None) -> None:
        self.key, self._store, self._part_size, self._metadata = key, store, part_size, metadata
        self._if_absent = if_absent
        self._path = store.path(key)
        self.upload_id = upload_id or partial_path(self._path)
        flags = os.O_RDWR if upload_id else os.O_RDWR | os.O_CREAT | os.O_EXCL
        self._fd: int | None = os.open(self.upload_id, flags, 0o644)

    def local_fd(self) -> int | None:
        return self._fd

    async def stored_part(self, index: int, size: int, token: str, digest: str) -> PartInfo | None:
        """Read part ``index`` back from the partial file: kept when its XXH3 is ``digest``."""
        fd = self._fd
        if fd is None or not size:
            return None

        def check() -> bool:
            data = os.pread(fd, size, index * self._part_size)
            return len(data) == size and hash_chunks(data, size)[0].hex() == digest

        return PartInfo(index, size) if await off_loop(check) else None

    async def copy_part(self, index: int, source: CopySource) -> PartInfo:
        fd = self._fd
        if fd is None:
            raise StoreError(f"multipart upload of {self._path} is no longer active")
        if not hasattr(os, "copy_file_range"):
            raise CopyUnsupportedError("this platform has no copy_file_range", key=self.key)
        await off_loop(_copy_range, source, self._store.path(source.key), fd, index * self._part_size)
        return PartInfo(index, source.length)

    async def put_part(self, index: int, data: Buffer) -> PartInfo:
        fd = self._fd
        if fd is None:
            raise StoreError(f"multipart upload of {self._path} is no longer active")
        await off_loop(write_at, fd, index * self._part_size, memoryview(data))
        return PartInfo(index, len(data))

    async def complete(self, parts: list[PartInfo], metadata: dict[str, str] | None = None) -> None:
        fd = self._fd
        if fd is None:
            raise StoreError(f"multipart upload of {self._path} is no longer active")
        size = sum(p.size for p in parts)
        if [p.index for p in parts] != list(range(len(parts))):
            raise StoreError(f"multipart upload of {self._path}: parts are not 0..n-1")
        self._fd = None

        def finish() -> None:
            try:
                os.ftruncate(fd, size)
                if self._store.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            _record(self.upload_id, metadata or self._metadata)
            _publish(self.upload_id, self._path, self._if_absent)
            if self._store.fsync:
                _fsync_dir(os.path.dirname(self._path))

        try:
            await off_loop(finish)
        except FileExistsError as exc:
            await self.abort()
            raise AlreadyExistsError(f"{self._path} already exists") from exc
        except OSError as exc:
            await self.abort()
            raise _translate(exc, self._path) from exc

    async def abort(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)
        try:
            os.unlink(self.upload_id)
        except FileNotFoundError:
            pass


class LocalStore(Store):
    """Files below ``root`` (``/`` for URIs); keys are paths relative to it."""

    name = "local"
    max_parts = 1 << 31
    remote = False

    def __init__(self, root: str = "/", *, fsync: bool = True) -> None:
        self.root = os.path.abspath(root)
        self.fsync = fsync

    @property
    def location(self) -> tuple[object, ...]:
        return (self.name, self.root)

    def uri(self, key: str = "") -> str:
        """The path of ``key`` (a plain path is a local-store URI)."""
        return self.path(key)

    def path(self, key: str) -> str:
        """Filesystem path of ``key``."""
        return os.path.join(self.root, key.strip("/"))

    def local_file(self, key: str) -> str | None:
        return self.path(key)

    def key(self, path: str) -> str:
        """Key of a filesystem path below the root."""
        return os.path.relpath(path, self.root).replace(os.sep, "/")

    async def head(self, key: str) -> ObjectMeta:
        path = self.path(key)
        try:
            st = os.stat(path)
        except OSError as exc:
            raise _translate(exc, path) from exc
        if not os.path.isfile(path):
            raise ObjectNotFoundError(f"{path} is not a file")
        return ObjectMeta(key, st.st_size, st.st_mtime, *_head_of(path, st))

    async def get_range(self, key: str, start: int, length: int) -> bytes:
        return await read_range(self, key, start, length)

    async def read_into(self, key: str, start: int, buf: memoryview) -> int:
        path = self.path(key)

        def read() -> int:
            fd = os.open(path, os.O_RDONLY)
            try:
                size = os.fstat(fd).st_size
                n = max(0, min(len(buf), size - start))
                read_exact(fd, start, buf[:n])
                return n
            finally:
                os.close(fd)

        try:
            return await off_loop(read)
        except OSError as exc:
            raise _translate(exc, path) from exc

    async def put(
        self, key: str, data: Buffer, *, if_absent: bool = False, metadata: dict[str, str] | None = None
    ) -> None:
        path = self.path(key)

        def write() -> None:
            if if_absent and os.path.lexists(path):
                raise FileExistsError(errno.EEXIST, "exists", path)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            tmp = partial_path(path)
            try:
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
                try:
                    write_at(fd, 0, memoryview(data))
                    if self.fsync:
                        os.fsync(fd)
                finally:
                    os.close(fd)
                _record(tmp, metadata or {})
                _publish(tmp, path, if_absent)
            except BaseException:
                if os.path.exists(tmp):
                    os.unlink(tmp)
                raise
            if self.fsync:
                _fsync_dir(os.path.dirname(path))

        try:
            await off_loop(write)
        except FileExistsError as exc:
            raise AlreadyExistsError(f"{path} already exists") from exc
        except OSError as exc:
            raise _translate(exc, path) from exc

    async def list(self, prefix: str = "") -> AsyncIterator[ObjectMeta]:
        top = self.path(prefix)
        entries = await off_loop(self._walk, top)
        for path, st in entries:
            yield ObjectMeta(self.key(path), st.st_size, st.st_mtime, version_of(st))

    @staticmethod
    def _walk(top: str) -> list[tuple[str, os.stat_result]]:
        if os.path.isfile(top):
            return [(top, os.stat(top))]
        out: list[tuple[str, os.stat_result]] = []
        for dirpath, dirnames, filenames in os.walk(top):
            dirnames.sort()
            for name in sorted(filenames):
                if not _is_tmp(name):
                    path = os.path.join(dirpath, name)
                    try:
                        out.append((path, os.stat(path)))
                    except FileNotFoundError:
                        continue
        return out

    async def list_dir(self, prefix: str = "") -> tuple[list[ObjectMeta], list[str]]:
        top = self.path(prefix)

        def scan() -> tuple[list[ObjectMeta], list[str]]:
            objects, dirs = [], []
            try:
                it = sorted(os.scandir(top), key=lambda e: e.name)
            except (FileNotFoundError, NotADirectoryError):
                return [], []
            for entry in it:
                if entry.is_dir():
                    dirs.append(self.key(entry.path))
                elif not _is_tmp(entry.name):
                    st = entry.stat()
                    objects.append(ObjectMeta(self.key(entry.path), st.st_size, st.st_mtime, version_of(st)))
            return objects, dirs

        return await off_loop(scan)

    async def delete(self, key: str) -> None:
        path = self.path(key)
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise _translate(exc, path) from exc

    async def create_multipart(
        self, key: str, part_size: int, metadata: dict[str, str] | None = None, *, if_absent: bool = False
    ) -> MultipartUpload:
        path = self.path(key)
        try:
            await off_loop(lambda: os.makedirs(os.path.dirname(path), exist_ok=True))
            return LocalUpload(self, key, part_size, dict(metadata or {}), if_absent)
        except OSError as exc:
            raise _translate(exc, path) from exc

    async def resume_multipart(self, key: str, upload_id: str, part_size: int, *,
                               if_absent: bool = False) -> MultipartUpload | None:
        """Reopen the partial file ``upload_id`` (hidden, beside the target) when it is still there."""
        path = self.path(key)
        head, name = os.path.split(upload_id)
        if head != os.path.dirname(path) or not (_is_tmp(name) and name.startswith(f".{os.path.basename(path)}.")):
            return None
        try:
            return LocalUpload(self, key, part_size, {}, if_absent, upload_id)
        except FileNotFoundError:
            return None

    async def list_pending_uploads(self, prefix: str = "") -> list[PendingUpload]:
        def scan() -> list[PendingUpload]:
            found = []
            top = self.path(prefix)  # an upload of the object ``prefix`` itself lies beside it
            for dirpath, _dirs, files in os.walk(top if os.path.isdir(top) else os.path.dirname(top)):
                for name in files:
                    if not _is_tmp(name):
                        continue
                    target = os.path.join(dirpath, name[1:].rsplit(".", 2)[0])
                    if in_prefix(self.key(target), prefix):
                        tmp = os.path.join(dirpath, name)
                        try:
                            found.append(PendingUpload(self.key(target), tmp, os.stat(tmp).st_mtime))
                        except FileNotFoundError:
                            continue
            return found

        return await off_loop(scan)

    async def abort_pending_upload(self, upload: PendingUpload) -> None:
        try:
            os.unlink(upload.upload_id)
        except FileNotFoundError:
            pass


def from_uri(uri: StorageURI, config: TransferConfig) -> LocalStore:
    """Local store rooted at '/' (keys are absolute paths without the leading slash); no URI options."""
    check_options(uri, frozenset())
    return LocalStore("/", fsync=config.store_fsync)
