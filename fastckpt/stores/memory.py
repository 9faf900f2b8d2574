"""In-memory store: a real backend for unit tests and single-process use (``memory://bucket/p``).

Buckets are process-global by name, so two stores opened on ``memory://b`` see the same objects.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from ..config import TransferConfig
from ..errors import AlreadyExistsError, ObjectNotFoundError, SourceChangedError, StoreError
from ..integrity import hash_chunks
from ..transport import Buffer
from ..uri import StorageURI, check_options
from .base import CopySource, MultipartUpload, ObjectMeta, PartInfo, PendingUpload, Store, in_prefix

__all__ = ["MemoryStore", "MemoryUpload", "from_uri"]


@dataclass
class _Object:
    data: bytes
    metadata: dict[str, str]
    mtime: float
    version: str = field(default_factory=lambda: f"v{next(_versions)}")


@dataclass
class _Bucket:
    objects: dict[str, _Object] = field(default_factory=dict)
    pending: dict[str, MemoryUpload] = field(default_factory=dict)


_BUCKETS: dict[str, _Bucket] = {}
_ids = itertools.count(1)
_versions = itertools.count(1)


class MemoryUpload(MultipartUpload):
    """Parts held in a dict until completion."""

    def __init__(self, bucket: _Bucket, key: str, part_size: int, metadata: dict[str, str], if_absent: bool) -> None:
        self.key, self.upload_id, self._if_absent = key, f"mem-{next(_ids)}", if_absent
        self._bucket, self._part_size, self._metadata = bucket, part_size, metadata
        self._parts: dict[int, bytes] = {}
        self.started = time.time()
        bucket.pending[self.upload_id] = self

    async def put_part(self, index: int, data: Buffer) -> PartInfo:
        if self.upload_id not in self._bucket.pending:
            raise StoreError(f"multipart upload of {self.key!r} is no longer active")
        self._parts[index] = bytes(data)
        return PartInfo(index, len(data))

    async def copy_part(self, index: int, source: CopySource) -> PartInfo:
        if self.upload_id not in self._bucket.pending:
            raise StoreError(f"multipart upload of {self.key!r} is no longer active")
        self._parts[index] = _source_bytes(self._bucket, source)
        return PartInfo(index, source.length)

    async def stored_part(self, index: int, size: int, token: str, digest: str) -> PartInfo | None:
        data = self._parts.get(index)
        if data is None or len(data) != size or not size or hash_chunks(data, size)[0].hex() != digest:
            return None
        return PartInfo(index, size)

    async def complete(self, parts: list[PartInfo], metadata: dict[str, str] | None = None) -> None:
        if self.upload_id not in self._bucket.pending:
            raise StoreError(f"multipart upload of {self.key!r} is no longer active")
        if self._if_absent and self.key in self._bucket.objects:
            raise AlreadyExistsError(f"memory://{self.key} already exists")
        del self._bucket.pending[self.upload_id]
        indexes = [p.index for p in parts]
        if indexes != list(range(len(parts))) or any(i not in self._parts for i in indexes):
            raise StoreError(f"multipart upload of {self.key!r}: parts {indexes} are not 0..n-1 as uploaded")
        data = b"".join(self._parts[i] for i in indexes)
        self._bucket.objects[self.key] = _Object(data, dict(metadata or self._metadata), time.time())

    async def abort(self) -> None:
        self._bucket.pending.pop(self.upload_id, None)
        self._parts.clear()


def _source_bytes(bucket: _Bucket, source: CopySource) -> bytes:
    """The bytes ``source`` names, of the version it names."""
    obj = bucket.objects.get(source.key)
    if obj is None:
        raise ObjectNotFoundError(f"memory://{source.key} (copy source) does not exist", key=source.key)
    if obj.version != source.etag:
        raise SourceChangedError(f"memory://{source.key} is version {obj.version}, not {source.etag}",
                                 key=source.key)
    if source.start + source.length > len(obj.data):
        raise StoreError(f"copy of memory://{source.key}: {source.start}+{source.length} is beyond its "
                         f"{len(obj.data)} bytes", key=source.key)
    return obj.data[source.start:source.start + source.length]


class MemoryStore(Store):
    """Objects in a process-global dict keyed by bucket name."""

    name = "memory"
    scheme = "memory"
    remote = False

    def __init__(self, bucket: str = "default") -> None:
        self.bucket = bucket
        self._b = _BUCKETS.setdefault(bucket, _Bucket())

    def _get(self, key: str) -> _Object:
        try:
            return self._b.objects[key]
        except KeyError:
            raise ObjectNotFoundError(f"memory://{self.bucket}/{key} does not exist") from None

    async def head(self, key: str) -> ObjectMeta:
        obj = self._get(key)
        return ObjectMeta(key, len(obj.data), obj.mtime, obj.version, dict(obj.metadata))

    async def get_range(self, key: str, start: int, length: int) -> bytes:
        await asyncio.sleep(0)
        return self._get(key).data[start : start + length]

    async def put(
        self, key: str, data: Buffer, *, if_absent: bool = False, metadata: dict[str, str] | None = None
    ) -> None:
        if if_absent and key in self._b.objects:
            raise AlreadyExistsError(f"memory://{self.bucket}/{key} already exists")
        self._b.objects[key] = _Object(bytes(data), dict(metadata or {}), time.time())

    async def copy(self, key: str, source: CopySource, *, if_absent: bool = False,
                   metadata: dict[str, str] | None = None) -> None:
        data = _source_bytes(self._b, source)
        await self.put(key, data, if_absent=if_absent, metadata=metadata)

    async def list(self, prefix: str = "") -> AsyncIterator[ObjectMeta]:
        for key in sorted(self._b.objects):
            if in_prefix(key, prefix):
                obj = self._b.objects.get(key)
                if obj is not None:
                    yield ObjectMeta(key, len(obj.data), obj.mtime, obj.version, dict(obj.metadata))

    async def delete(self, key: str) -> None:
        self._b.objects.pop(key, None)

    async def create_multipart(
        self, key: str, part_size: int, metadata: dict[str, str] | None = None, *, if_absent: bool = False
    ) -> MultipartUpload:
        return MemoryUpload(self._b, key, part_size, dict(metadata or {}), if_absent)

    async def resume_multipart(self, key: str, upload_id: str, part_size: int, *,
                               if_absent: bool = False) -> MultipartUpload | None:
        upload = self._b.pending.get(upload_id)
        return upload if upload is not None and upload.key == key else None

    async def list_pending_uploads(self, prefix: str = "") -> list[PendingUpload]:
        return [PendingUpload(u.key, u.upload_id, u.started) for u in self._b.pending.values()
                if in_prefix(u.key, prefix)]

    async def abort_pending_upload(self, upload: PendingUpload) -> None:
        pending = self._b.pending.get(upload.upload_id)
        if pending is not None:
            await pending.abort()


def from_uri(uri: StorageURI, config: TransferConfig) -> MemoryStore:
    """In-memory bucket named by the URI's host (``memory://bucket/prefix``); no URI options."""
    check_options(uri, frozenset())
    return MemoryStore(uri.bucket or "default")
