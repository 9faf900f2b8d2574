"""Store wrappers for tests and benchmarks: fault injection (latency, error rate, fail after N calls)."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator

from fastckpt.errors import StoreError, TransientStoreError
from fastckpt.stores.base import MultipartUpload, ObjectMeta, PartInfo, PendingUpload, Store
from fastckpt.transport import Buffer, FileRange, Pieces


class FaultInjectingStore(Store):
    """Wraps a store; before each data request it may sleep and may raise.

    ``error_rate``: probability that a request raises ``TransientStoreError`` (retryable).
    ``fail_after``: after this many requests every further request raises ``permanent`` (a
    non-retryable StoreError unless another exception is given). ``ops`` limits which operations are
    affected (names: head, get_range, put, list, delete, create_multipart, put_part, complete).
    ``corrupt_reads``: flip the first byte of every ``get_range`` result.
    """

    def __init__(
        self,
        inner: Store,
        *,
        latency: float = 0.0,
        error_rate: float = 0.0,
        fail_after: int | None = None,
        permanent: Exception | None = None,
        ops: set[str] | None = None,
        seed: int | None = 0,
    ) -> None:
        self.inner = inner
        self.name = f"faulty-{inner.name}"
        self.min_part_size, self.max_part_size = inner.min_part_size, inner.max_part_size
        self.max_parts, self.metadata_on_complete = inner.max_parts, inner.metadata_on_complete
        self.remote = inner.remote
        self.latency, self.error_rate, self.fail_after = latency, error_rate, fail_after
        self.permanent = permanent
        self.ops = ops
        self.calls = 0
        self.injected = 0
        self._rng = random.Random(seed)

    async def fault(self, op: str, key: str) -> None:
        """Count a request and apply the configured faults to it."""
        if self.ops is not None and op not in self.ops:
            return
        self.calls += 1
        if self.latency:
            await asyncio.sleep(self.latency)
        if self.fail_after is not None and self.calls > self.fail_after:
            self.injected += 1
            raise self.permanent or StoreError(f"injected permanent failure: {op} {key}")
        if self.error_rate and self._rng.random() < self.error_rate:
            self.injected += 1
            raise TransientStoreError(f"injected transient failure: {op} {key}")

    @property
    def location(self) -> tuple[object, ...]:
        return self.inner.location

    def uri(self, key: str = "") -> str:
        return self.inner.uri(key)

    async def close(self) -> None:
        await self.inner.close()

    async def head(self, key: str) -> ObjectMeta:
        await self.fault("head", key)
        return await self.inner.head(key)

    async def get_range(self, key: str, start: int, length: int) -> bytes:
        await self.fault("get_range", key)
        return await self.inner.get_range(key, start, length)

    async def read_into(self, key: str, start: int, buf: memoryview) -> int:
        await self.fault("get_range", key)
        return await self.inner.read_into(key, start, buf)

    async def put(
        self, key: str, data: Buffer, *, if_absent: bool = False, metadata: dict[str, str] | None = None
    ) -> None:
        await self.fault("put", key)
        await self.inner.put(key, data, if_absent=if_absent, metadata=metadata)

    async def list(self, prefix: str = "") -> AsyncIterator[ObjectMeta]:
        await self.fault("list", prefix)
        async for meta in self.inner.list(prefix):
            yield meta

    async def list_dir(self, prefix: str = "") -> tuple[list[ObjectMeta], list[str]]:
        await self.fault("list", prefix)
        return await self.inner.list_dir(prefix)

    async def delete(self, key: str) -> None:
        await self.fault("delete", key)
        await self.inner.delete(key)

    async def create_multipart(
        self, key: str, part_size: int, metadata: dict[str, str] | None = None, *, if_absent: bool = False
    ) -> MultipartUpload:
        await self.fault("create_multipart", key)
        return _FaultyUpload(self, await self.inner.create_multipart(key, part_size, metadata, if_absent=if_absent))

    async def resume_multipart(self, key: str, upload_id: str, part_size: int, *,
                               if_absent: bool = False) -> MultipartUpload | None:
        await self.fault("create_multipart", key)
        upload = await self.inner.resume_multipart(key, upload_id, part_size, if_absent=if_absent)
        return None if upload is None else _FaultyUpload(self, upload)

    async def list_pending_uploads(self, prefix: str = "") -> list[PendingUpload]:
        return await self.inner.list_pending_uploads(prefix)

    async def abort_pending_upload(self, upload: PendingUpload) -> None:
        await self.inner.abort_pending_upload(upload)

    async def list_orphans(self, prefix: str = "", older_than: float = 0.0) -> list[str]:
        return await self.inner.list_orphans(prefix, older_than)


class _FaultyUpload(MultipartUpload):
    def __init__(self, store: FaultInjectingStore, inner: MultipartUpload) -> None:
        self._store, self._inner = store, inner
        self.key, self.upload_id = inner.key, inner.upload_id

    async def put_part(self, index: int, data: Buffer | FileRange | Pieces) -> PartInfo:
        await self._store.fault("put_part", self.key)
        return await self._inner.put_part(index, data)

    async def complete(self, parts: list[PartInfo], metadata: dict[str, str] | None = None) -> None:
        await self._store.fault("complete", self.key)
        await self._inner.complete(parts, metadata)

    async def abort(self) -> None:
        await self._inner.abort()

    @property
    def sends_files(self) -> bool:
        return self._inner.sends_files

    @property
    def sends_pieces(self) -> bool:
        return self._inner.sends_pieces

    async def stored_part(self, index: int, size: int, token: str, digest: str) -> PartInfo | None:
        return await self._inner.stored_part(index, size, token, digest)
