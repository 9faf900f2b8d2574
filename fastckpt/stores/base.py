"""The async store protocol every backend implements (shaped like Rust object_store's ObjectStore).

Keys are '/'-separated strings relative to the store's bucket (or, for the local store, to '/').
Backends know nothing of checkpoints, manifests or digests beyond carrying string metadata.
Backends raise the exceptions of ``fastckpt.errors``: ObjectNotFoundError, AlreadyExistsError,
AccessDeniedError, TransientStoreError (retryable) or StoreError.

What is the same for every backend is written here once: a backend that lists through a paged
service implements only ``list_page`` (one request), and ``list`` / ``list_dir`` derive from it;
retries live in one wrapper (``stores.retry.RetryingStore``), applied by ``open_store``.
"""

from __future__ import annotations

import abc
import re
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from ..errors import CopyUnsupportedError, ObjectNotFoundError
from ..transport import Buffer, BufferReceiver, FileRange, Pieces, Receiver
from ..uri import StorageURI

__all__ = ["CopySource", "ListPage", "MultipartUpload", "NamedUploadStore", "ObjectMeta", "PartInfo", "PendingUpload",
           "ReceivingStore", "Store", "in_prefix", "read_range"]


@dataclass(frozen=True)
class ObjectMeta:
    """What ``head`` and ``list`` report about one object."""

    key: str
    size: int
    mtime: float = 0.0
    etag: str | None = None
    metadata: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class ListPage:
    """One listing request's answer: objects, sub-prefixes (each ending in the delimiter), next page's token."""

    objects: list[ObjectMeta]
    prefixes: list[str]
    token: str | None = None


@dataclass(frozen=True)
class PartInfo:
    """One uploaded part: its 0-based index and whatever the backend needs to complete."""

    index: int
    size: int
    token: str = ""


@dataclass(frozen=True)
class CopySource:
    """Bytes of an existing object a server-side copy takes: ``length`` bytes of ``key`` from ``start``, of the
    object's version ``etag`` (what ``head`` reported: ETag, generation, file version). A copy of any other version
    raises SourceChangedError and copies nothing."""

    key: str
    etag: str
    start: int
    length: int


@dataclass(frozen=True)
class PendingUpload:
    """A multipart upload that was started and neither completed nor aborted."""

    key: str
    upload_id: str
    started: float = 0.0


class MultipartUpload(abc.ABC):
    """One object being written in parts. Parts may be sent concurrently and in any order.

    All parts but the last are ``part_size`` bytes (given to ``Store.create_multipart``). The object
    becomes visible only on ``complete``; ``abort`` removes every trace of it.
    """

    key: str
    upload_id: str
    stored: Mapping[int, PartInfo] = MappingProxyType({})
    """Parts an earlier process stored, by index (filled by ``Store.resume_multipart``; empty for a new upload)."""

    @abc.abstractmethod
    async def put_part(self, index: int, data: Buffer | FileRange | Pieces) -> PartInfo:
        """Upload part ``index`` (0-based); ``data`` is a ``FileRange`` only where ``sends_files``, ``Pieces`` only
        where ``sends_pieces``."""

    @abc.abstractmethod
    async def complete(self, parts: list[PartInfo], metadata: dict[str, str] | None = None) -> None:
        """Assemble ``parts`` (sorted by index) into the object; AlreadyExistsError when the upload was
        created ``if_absent`` and the key exists (the upload stays open: ``abort`` it).

        Where ``Store.metadata_on_complete``, ``metadata`` (when given) becomes the object's metadata, which
        ``head`` reports: the digest is known only now; callers pass what the upload was created with too.
        """

    @abc.abstractmethod
    async def abort(self) -> None:
        """Discard the upload and its parts. Safe to call more than once."""

    @property
    def sends_files(self) -> bool:
        """Whether ``put_part`` takes a ``FileRange`` of an open file, sent from it by the kernel (the bytes never
        pass through a buffer); False: buffers only."""
        return False

    @property
    def sends_pieces(self) -> bool:
        """Whether ``put_part`` takes ``Pieces`` (a part laid out in several buffers, sent as they lie); False: one
        buffer (the caller gathers the pieces into one)."""
        return False

    async def copy_part(self, index: int, source: CopySource) -> PartInfo:
        """Part ``index`` copied by the store from ``source`` (its bytes never reach this process); SourceChangedError
        or ObjectNotFoundError when the source is not that version any more, CopyUnsupportedError where the backend
        or its server cannot copy that range (the caller sends the bytes instead)."""
        raise CopyUnsupportedError(f"{type(self).__name__} cannot copy parts", key=self.key)

    def local_fd(self) -> int | None:
        """A file descriptor part ``index`` may be written to directly at ``index * part_size`` (an upload into a
        local file), so the engine copies parts into it without a pooled buffer; None for other stores."""
        return None

    async def stored_part(self, index: int, size: int, token: str, digest: str) -> PartInfo | None:
        """Part ``index`` as already stored by an earlier process (``Store.resume_multipart``), when it is
        ``size`` bytes and is what that process recorded: the same ``token`` (an S3 ETag, a block id ...), or,
        where the backend reads it back, the same XXH3 hex ``digest``. None: the part must be sent again."""
        part = self.stored.get(index)
        return part if part is not None and part.size == size and part.token == token else None


class Store(abc.ABC):
    """An object store. Create with the backend's constructor, use inside the event loop that will
    drive it, and ``await close()`` at the end (or ``async with``)."""

    name: str = "store"
    min_part_size: int = 1
    """Smallest size of a non-final part."""
    max_part_size: int = 5 << 30
    max_parts: int = 10_000
    metadata_on_complete: bool = True
    """Whether ``MultipartUpload.complete`` records metadata; False: only what the upload was created with
    stands (the engine then hashes a file before its upload starts)."""
    remote: bool = True
    """Whether its requests cross a network to a service: they then share the endpoint's adaptive request limit
    (``stores.concurrency``); a store in this process or on its filesystem has no link to size itself to."""

    scheme: str = ""
    """The URI scheme ``uri`` writes."""
    bucket: str = ""
    options: object = None
    """The backend's typed options (a frozen dataclass with a ``query()`` of URI options), or None."""

    @property
    def location(self) -> tuple[object, ...]:
        """What makes two stores the same: backend, bucket and options (``open_store(s.uri()).location``
        equals ``s.location``)."""
        return (self.name, self.bucket, self.options)

    def uri(self, key: str = "") -> str:
        """A URI that ``open_store`` opens as this store, its key naming ``key``."""
        query = self.options.query() if self.options is not None else {}  # type: ignore[attr-defined]
        return StorageURI("", self.scheme, self.name, self.bucket, key.strip("/"), query).uri()

    async def __aenter__(self) -> Store:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:  # noqa: B027 - nothing to release by default
        """Release clients and connections."""

    def learned(self) -> dict[str, Any]:
        """What this store found out about its location with requests of its own (S3: the bucket's region), for
        ``assume`` in another process that opens the same location; empty by default."""
        return {}

    def assume(self, learned: dict[str, Any]) -> None:  # noqa: B027 - nothing to learn by default
        """Take what a store of the same location ``learned`` in another process (the root of a group read), so
        that this one does not ask again; what does not match this location is ignored."""

    @abc.abstractmethod
    async def head(self, key: str) -> ObjectMeta:
        """Metadata of ``key``; ObjectNotFoundError when absent."""

    async def exists(self, key: str) -> bool:
        """Whether object ``key`` exists."""
        try:
            await self.head(key)
        except ObjectNotFoundError:
            return False
        return True

    @abc.abstractmethod
    async def get_range(self, key: str, start: int, length: int) -> bytes:
        """``length`` bytes of ``key`` from ``start`` (fewer only at the end of the object)."""

    async def read_into(self, key: str, start: int, buf: memoryview) -> int:
        """Fill ``buf`` from ``key`` at ``start``; returns bytes read. Backends may avoid the copy."""
        data = await self.get_range(key, start, len(buf))
        buf[: len(data)] = data
        return len(data)

    def local_file(self, key: str) -> str | None:
        """A path this process reads object ``key`` from directly, when the store's objects are local files
        (the engine then copies it slice by slice, without a pooled buffer); None for other stores."""
        return None

    async def read_with_meta(self, key: str, buf: memoryview) -> tuple[ObjectMeta, int]:
        """The object's metadata and as much of it as ``buf`` holds, from its start (the byte count); one request
        where the backend answers a read with the object's metadata (a whole small file, no HEAD first)."""
        meta = await self.head(key)
        if not 0 < meta.size <= len(buf):
            return meta, 0
        return meta, await self.read_into(key, 0, buf[:meta.size])

    async def receive(self, key: str, start: int, length: int, into: Receiver) -> int:
        """Receive ``length`` bytes of ``key`` from ``start`` into ``into`` as they arrive (waiting while it has no
        room); the bytes received, fewer only at the end of the object. After a failure ``into.count`` says how
        many landed: a retry asks for the rest. By default, one ``read_into`` per stretch of room."""
        got = 0
        while got < length:
            view = into.free()
            if not len(view):
                await into.room()
                continue
            want = min(len(view), length - got)
            n = await self.read_into(key, start + got, view[:want])
            into.landed(n)
            got += n
            if n < want:
                break
        return got

    @abc.abstractmethod
    async def put(
        self, key: str, data: Buffer, *, if_absent: bool = False, metadata: dict[str, str] | None = None
    ) -> None:
        """Write ``key`` whole. With ``if_absent`` raise AlreadyExistsError if it exists."""

    async def list_page(self, prefix: str, delimiter: str | None = None, token: str | None = None) -> ListPage:
        """One listing request: keys starting with the plain string ``prefix`` (grouped into sub-prefixes at
        ``delimiter`` when given), from the page ``token`` names. Paged backends implement this alone."""
        raise NotImplementedError(f"{type(self).__name__} does not list in pages")

    @property
    def paged(self) -> bool:
        """Whether ``list`` and ``list_dir`` are derived from ``list_page``."""
        return type(self).list_page is not Store.list_page

    def is_hidden(self, key: str) -> bool:
        """Whether ``key`` is the backend's own bookkeeping (e.g. temporary parts), never listed."""
        return False

    async def _pages(self, prefix: str, delimiter: str | None = None) -> AsyncIterator[ListPage]:
        token = None
        while True:
            page = await self.list_page(prefix, delimiter, token)
            yield page
            if not page.token:
                return
            token = page.token

    def _listed(self, meta: ObjectMeta) -> bool:
        """Listings skip '/'-terminated directory markers and hidden keys."""
        return not meta.key.endswith("/") and not self.is_hidden(meta.key)

    async def list(self, prefix: str = "") -> AsyncIterator[ObjectMeta]:
        """All objects whose key equals ``prefix`` or starts with ``prefix`` + '/', recursively.

        Derived from ``list_page``: the object named exactly ``prefix`` first, then the pages below it.
        Non-paged backends override this.
        """
        base = prefix.strip("/")
        if base and not self.is_hidden(base):
            try:
                yield await self.head(base)
            except ObjectNotFoundError:
                pass
        async for page in self._pages(base + "/" if base else ""):
            for meta in page.objects:
                if self._listed(meta):
                    yield meta

    async def list_dir(self, prefix: str = "") -> tuple[list[ObjectMeta], list[str]]:
        """Objects directly below ``prefix`` and the names of its sub-'directories' (full keys)."""
        base = prefix.strip("/")
        objects: list[ObjectMeta] = []
        if self.paged:
            found: list[str] = []
            async for page in self._pages(base + "/" if base else "", "/"):
                objects += [m for m in page.objects if self._listed(m)]
                found += [p.rstrip("/") for p in page.prefixes if not self.is_hidden(p)]
            return objects, found
        dirs: dict[str, None] = {}
        async for meta in self.list(base):
            rest = meta.key[len(base) + 1 :] if base else meta.key
            if "/" in rest:
                dirs[(base + "/" if base else "") + rest.split("/", 1)[0]] = None
            elif meta.key != base:
                objects.append(meta)
        return objects, list(dirs)

    @abc.abstractmethod
    async def delete(self, key: str) -> None:
        """Remove ``key``; no error when it is already absent."""

    async def delete_many(self, keys: list[str]) -> None:
        """Remove all ``keys``."""
        for key in keys:
            await self.delete(key)

    async def delete_listed(self, metas: list[ObjectMeta]) -> None:
        """Remove the objects a listing (or ``head``) reported; what it said of them may spare a backend work (S3: the
        records of objects no multipart upload wrote). By default ``delete_many`` of their keys."""
        await self.delete_many([m.key for m in metas])

    async def copy(self, key: str, source: CopySource, *, if_absent: bool = False,
                   metadata: dict[str, str] | None = None) -> None:
        """Write ``key`` whole as a copy the store makes of ``source`` (its whole object), with ``metadata``; errors
        as ``MultipartUpload.copy_part``, and AlreadyExistsError as ``put``. By default one upload whose parts are
        copied (``copy_part``); a backend with a one-request copy overrides this."""
        if source.length <= 0:
            raise CopyUnsupportedError(f"copy of {source.key}: an empty object is written, not copied", key=key)
        part = max(self.min_part_size, -(-source.length // self.max_parts), min(source.length, self.max_part_size))
        mpu = await self.create_multipart(key, part, metadata, if_absent=if_absent)
        try:
            parts = [await mpu.copy_part(i, CopySource(source.key, source.etag, source.start + o,
                                                       min(part, source.length - o)))
                     for i, o in enumerate(range(0, source.length, part))]
            await mpu.complete(parts, metadata)
        except BaseException:
            await mpu.abort()
            raise

    @abc.abstractmethod
    async def create_multipart(
        self, key: str, part_size: int, metadata: dict[str, str] | None = None, *, if_absent: bool = False
    ) -> MultipartUpload:
        """Start a multipart upload of ``key`` whose parts (but the last) are ``part_size`` bytes.

        With ``if_absent``, ``complete`` raises AlreadyExistsError (and stores nothing) when ``key``
        exists by then: the object is created atomically only if absent, as ``put(if_absent=True)``.
        """

    async def resume_multipart(self, key: str, upload_id: str, part_size: int, *,
                               if_absent: bool = False) -> MultipartUpload | None:
        """Reopen upload ``upload_id`` of ``key``, started by ``create_multipart`` (e.g. in a process that
        was killed), with what it already holds (see ``MultipartUpload.stored_part``); None when it is gone
        or the backend cannot resume."""
        return None

    async def list_pending_uploads(self, prefix: str = "") -> list[PendingUpload]:
        """Multipart uploads under ``prefix`` never completed or aborted (for gc)."""
        return []

    async def abort_pending_upload(self, upload: PendingUpload) -> None:  # noqa: B027 - none by default
        """Abort an upload found by ``list_pending_uploads``."""

    async def list_orphans(self, prefix: str = "", before: float = 0.0) -> list[str]:
        """Hidden keys under ``prefix`` last written before the time ``before`` that belong to no object any
        more (for gc; ``delete_many`` removes them)."""
        return []


class ReceivingStore(Store):
    """A store whose reads are ``receive`` requests (the HTTP data path): ``get_range`` and ``read_into``
    derive from it."""

    @abc.abstractmethod
    async def receive(self, key: str, start: int, length: int, into: Receiver) -> int:
        """See ``Store.receive``; ``length`` may be 0."""

    async def read_into(self, key: str, start: int, buf: memoryview) -> int:
        return await self.receive(key, start, buf.nbytes, BufferReceiver(buf))

    async def get_range(self, key: str, start: int, length: int) -> bytes:
        if length <= 0:
            await self.head(key)
            return b""
        return await read_range(self, key, start, length)


class NamedUploadStore(ReceivingStore):
    """A store whose multipart uploads take no request to start (GCS's composite uploads, Azure's staged blocks): an
    upload names itself (``upload_type(store, key, metadata, if_absent, upload_id=None)``, a random id matching
    ``upload_ids``), and a resumed upload finds the parts stored under that id (``find_parts``)."""

    upload_type: Callable[..., MultipartUpload]
    upload_ids: re.Pattern[str]

    async def create_multipart(
        self, key: str, part_size: int, metadata: dict[str, str] | None = None, *, if_absent: bool = False
    ) -> MultipartUpload:
        return self.upload_type(self, key, dict(metadata or {}), if_absent)

    async def resume_multipart(self, key: str, upload_id: str, part_size: int, *,
                               if_absent: bool = False) -> MultipartUpload | None:
        if not self.upload_ids.fullmatch(upload_id):
            return None
        upload = self.upload_type(self, key, {}, if_absent, upload_id)
        await self.find_parts(upload)
        return upload

    @abc.abstractmethod
    async def find_parts(self, upload: Any) -> None:
        """Fill ``upload.stored`` with the parts stored under its id."""


async def read_range(store: Store, key: str, start: int, length: int) -> bytes:
    """``get_range`` of a store that reads through ``read_into``: ``length`` bytes of ``key`` from ``start``
    (fewer at the end of the object)."""
    buf = bytearray(max(0, length))
    with memoryview(buf) as view:
        n = await store.read_into(key, start, view)
    return bytes(buf[:n]) if n < len(buf) else bytes(buf)


def in_prefix(key: str, prefix: str) -> bool:
    """Whether ``key`` lies at or below the '/'-separated ``prefix``."""
    prefix = prefix.strip("/")
    return not prefix or key == prefix or key.startswith(prefix + "/")
