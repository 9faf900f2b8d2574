"""Retries in one place: a store wrapper that sends a request again when it failed in a retryable way.

Each request of the store protocol is retried, with exponential backoff and full jitter, while it fails
with a retryable error (``StoreError.retryable``: 5xx, throttling, resets, timeouts; and connection
errors), at least ``config.retries`` times and for at least ``config.retry_for`` seconds (an outage of a
minute or two passes unnoticed); then a TransientStoreError names the request and the attempts. A request
moving data also has a deadline (``within_deadline``): one that stalls mid-body is cancelled and retried.
Anything else propagates at once. ``open_store`` applies the wrapper, and ``retrying`` gives one to a
store handed in by a caller, so the layers above never retry by themselves.

The policy per operation:

- reads (``head``, ``get_range``, ``read_into``; ``receive``, whose retry asks only for the bytes that had
  not landed), ``list_page``, deletes, puts, part uploads, creating and aborting multipart uploads, listing
  and aborting pending uploads: idempotent, retried (a retried ``create_multipart`` may leave an orphan
  upload behind, which ``gc`` aborts).
- a non-paged ``list`` (local, memory, wrappers): retried only until it has yielded its first object;
  paged backends list through ``list_page``, so every page is retried on its own.
- create-if-absent ``put`` and ``complete``: retried as well, which is safe here because a retry whose
  first attempt did land is recognised: the backend finds its own completed upload, or the retry raises
  AlreadyExistsError and every caller of create-if-absent then compares what is stored with what it
  wrote (the engine by digest, the commit by content) before calling it a conflict.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import random
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from .. import stats
from ..config import TransferConfig
from ..errors import ThrottledError, TransientStoreError
from ..transport import Buffer, FileRange, Pieces, Receiver, body_size
from .base import CopySource, ListPage, MultipartUpload, ObjectMeta, PartInfo, PendingUpload, Store
from .classify import EndpointUnreachableError
from .concurrency import AdaptiveLimit, endpoint_limit, start_limit

__all__ = ["UNBOUNDED", "RetryingStore", "backoff", "is_retryable", "retrying", "with_retries", "within_deadline"]

T = TypeVar("T")
log = logging.getLogger("fastckpt")
UNBOUNDED = 1 << 16
"""The request limit of a store that is not ``remote``: no bound (the engine's own limits hold)."""
_HOLDING: contextvars.ContextVar[frozenset[AdaptiveLimit]] = contextvars.ContextVar("holding", default=frozenset())
"""The endpoint limits whose slot the running request holds (a store wrapped twice takes one slot a request)."""


def backoff(config: TransferConfig, attempt: int) -> float:
    """Seconds to wait before retry number ``attempt + 1``: exponential, capped, with full jitter."""
    return random.uniform(0, min(config.backoff_max, config.backoff_base * 2**attempt))


def is_retryable(exc: BaseException) -> bool:
    """Whether a retry may fix what raised ``exc``."""
    return bool(getattr(exc, "retryable", False)) or isinstance(exc, (ConnectionError, asyncio.TimeoutError))


async def with_retries(op: Callable[[], Awaitable[T]], config: TransferConfig, what: str) -> T:
    """Run ``op()``; on a retryable error sleep (jittered exponential backoff) and run it again, until
    both ``config.retries`` attempts and ``config.retry_for`` seconds are spent."""
    attempt, started = 0, time.monotonic()
    while True:
        try:
            return await op()
        except Exception as exc:
            if not is_retryable(exc):
                raise
            elapsed = time.monotonic() - started
            budget = 0 if isinstance(exc, EndpointUnreachableError) else config.retry_for
            if attempt >= config.retries and elapsed >= budget:
                raise TransientStoreError(f"{what}: failed after {attempt + 1} attempts in {elapsed:.0f} s: {exc}",
                                          key=getattr(exc, "key", None), backend=getattr(exc, "backend", None),
                                          status=getattr(exc, "status", None)) from exc
            delay = backoff(config, attempt)
            log.debug("retrying %s in %.2fs after %s", what, delay, exc)
            stats.retried(exc)
            attempt += 1
            await asyncio.sleep(delay)


async def within_deadline(op: Callable[[], Awaitable[T]], config: TransferConfig, size: int, what: str) -> T:
    """``op()`` (a request moving ``size`` bytes), cancelled when it runs past ``config.stall_timeout`` +
    ``size / config.min_rate`` seconds; that raises a (retryable) TransientStoreError."""
    if not config.min_rate:
        return await op()
    limit = config.stall_timeout + size / config.min_rate
    try:
        if sys.version_info >= (3, 11):  # no extra task per request
            async with asyncio.timeout(limit):
                return await op()
        return await asyncio.wait_for(op(), limit)
    except asyncio.TimeoutError as exc:
        raise TransientStoreError(f"{what}: stalled, not done after {limit:.0f} s ({size} bytes)") from exc


class RetryingStore(Store):
    """``inner`` with every request retried per the module's policy; other attributes are ``inner``'s."""

    def __init__(self, inner: Store, config: TransferConfig) -> None:
        self.inner, self.config = inner, config
        self.name, self.scheme, self.bucket, self.options = inner.name, inner.scheme, inner.bucket, inner.options
        self.min_part_size, self.max_part_size = inner.min_part_size, inner.max_part_size
        self.max_parts, self.metadata_on_complete = inner.max_parts, inner.metadata_on_complete
        self.remote = inner.remote
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_limit: AdaptiveLimit | None = None

    def _limit(self) -> AdaptiveLimit:
        """This endpoint's request limit in the running loop (looked up once per loop)."""
        loop = asyncio.get_running_loop()
        if self._loop is not loop or self._loop_limit is None:
            config = self.config
            ceiling = config.max_in_flight if self.remote else UNBOUNDED  # else the engine's own limits hold
            self._loop, self._loop_limit = loop, endpoint_limit(
                self.location, ceiling, start_limit(config.target_throughput, ceiling) if self.remote else ceiling)
        return self._loop_limit

    def planned_requests(self) -> int:
        """How many requests to cut a transfer on this endpoint into (``AdaptiveLimit.planned``)."""
        return self._limit().planned()

    def __getattr__(self, name: str) -> Any:  # backend specifics (bucket, endpoint, client ...)
        inner = self.__dict__.get("inner")
        if inner is None:
            raise AttributeError(name)
        return getattr(inner, name)

    def __repr__(self) -> str:
        return repr(self.inner)

    def learned(self) -> dict[str, Any]:
        return self.inner.learned()

    def assume(self, learned: dict[str, Any]) -> None:
        self.inner.assume(learned)

    @property
    def location(self) -> tuple[object, ...]:
        return self.inner.location

    def uri(self, key: str = "") -> str:
        return self.inner.uri(key)

    async def retry(self, what: str, op: Callable[[], Awaitable[T]], nbytes: int = 0) -> T:
        """``op()`` (a request moving ``nbytes``) retried per the module's policy, each attempt holding a request slot
        of this endpoint's adaptive limit (``stores.concurrency``), which learns from the time of its answer."""
        limit = self._limit()

        async def attempt() -> T:
            if limit in _HOLDING.get():  # a wrapper of this store holds the request's slot already
                return await op()
            granted = await limit.acquire()
            holding = _HOLDING.set(_HOLDING.get() | {limit})
            started = time.monotonic()
            try:
                result = await op()
            except ThrottledError:
                before = limit.limit
                limit.throttled(granted)
                stats.throttled(before, limit.limit)
                raise
            else:
                limit.succeeded(nbytes, time.monotonic() - started)
            finally:
                _HOLDING.reset(holding)
                limit.release()
            return result

        return await with_retries(attempt, self.config, f"{what} ({self.name})")

    @property
    def paged(self) -> bool:
        return self.inner.paged

    def is_hidden(self, key: str) -> bool:
        return self.inner.is_hidden(key)

    async def close(self) -> None:
        await self.inner.close()

    async def head(self, key: str) -> ObjectMeta:
        return await self.retry(f"head of {key}", lambda: self.inner.head(key))

    async def retry_data(self, what: str, size: int, op: Callable[[], Awaitable[T]]) -> T:
        """A request moving ``size`` bytes: each attempt under its deadline (``within_deadline``)."""
        return await self.retry(what, lambda: within_deadline(op, self.config, size, what), size)

    async def get_range(self, key: str, start: int, length: int) -> bytes:
        return await self.retry_data(f"read of {key}", length, lambda: self.inner.get_range(key, start, length))

    async def read_into(self, key: str, start: int, buf: memoryview) -> int:
        return await self.retry_data(f"read of {key}", buf.nbytes, lambda: self.inner.read_into(key, start, buf))

    def local_file(self, key: str) -> str | None:
        return self.inner.local_file(key)

    async def read_with_meta(self, key: str, buf: memoryview) -> tuple[ObjectMeta, int]:
        return await self.retry_data(f"read of {key}", buf.nbytes, lambda: self.inner.read_with_meta(key, buf))

    async def receive(self, key: str, start: int, length: int, into: Receiver) -> int:
        """Each retry asks for what has not landed in ``into`` yet."""
        first = into.count

        async def rest() -> int:
            got = into.count - first
            return got + await self.inner.receive(key, start + got, length - got, into)

        return await self.retry_data(f"read of {key}", length, rest)

    async def put(
        self, key: str, data: Buffer, *, if_absent: bool = False, metadata: dict[str, str] | None = None
    ) -> None:
        await self.retry_data(f"write of {key}", memoryview(data).nbytes,
                              lambda: self.inner.put(key, data, if_absent=if_absent, metadata=metadata))

    async def list_page(self, prefix: str, delimiter: str | None = None, token: str | None = None) -> ListPage:
        return await self.retry(f"listing of {prefix}", lambda: self.inner.list_page(prefix, delimiter, token))

    async def list(self, prefix: str = "") -> AsyncIterator[ObjectMeta]:
        if self.paged:
            async for meta in super().list(prefix):
                yield meta
            return
        items: AsyncIterator[ObjectMeta] | None = None

        async def first() -> ObjectMeta:  # a fresh listing each try, until one yields its first object
            nonlocal items
            items = self.inner.list(prefix).__aiter__()
            return await items.__anext__()

        try:
            meta = await self.retry(f"listing of {prefix}", first)
        except StopAsyncIteration:
            return
        yield meta
        assert items is not None
        async for meta in items:
            yield meta

    async def list_dir(self, prefix: str = "") -> tuple[list[ObjectMeta], list[str]]:
        if self.paged:
            return await super().list_dir(prefix)
        return await self.retry(f"listing of {prefix}", lambda: self.inner.list_dir(prefix))

    async def delete(self, key: str) -> None:
        await self.retry(f"delete of {key}", lambda: self.inner.delete(key))

    async def delete_many(self, keys: list[str]) -> None:
        await self.retry(f"delete of {len(keys)} objects", lambda: self.inner.delete_many(keys))

    async def delete_listed(self, metas: list[ObjectMeta]) -> None:
        await self.retry(f"delete of {len(metas)} objects", lambda: self.inner.delete_listed(metas))

    async def copy(self, key: str, source: CopySource, *, if_absent: bool = False,
                   metadata: dict[str, str] | None = None) -> None:
        await self.retry(f"copy of {source.key} to {key}", lambda: self.inner.copy(
            key, source, if_absent=if_absent, metadata=metadata))

    async def create_multipart(
        self, key: str, part_size: int, metadata: dict[str, str] | None = None, *, if_absent: bool = False
    ) -> MultipartUpload:
        upload = await self.retry(f"start of upload of {key}", lambda: self.inner.create_multipart(
            key, part_size, metadata, if_absent=if_absent))
        return _RetryingUpload(self, upload)

    async def resume_multipart(self, key: str, upload_id: str, part_size: int, *,
                               if_absent: bool = False) -> MultipartUpload | None:
        upload = await self.retry(f"resume of upload of {key}", lambda: self.inner.resume_multipart(
            key, upload_id, part_size, if_absent=if_absent))
        return None if upload is None else _RetryingUpload(self, upload)

    async def list_pending_uploads(self, prefix: str = "") -> list[PendingUpload]:
        return await self.retry(f"listing of uploads below {prefix}", lambda: self.inner.list_pending_uploads(prefix))

    async def abort_pending_upload(self, upload: PendingUpload) -> None:
        await self.retry(f"abort of upload of {upload.key}", lambda: self.inner.abort_pending_upload(upload))

    async def list_orphans(self, prefix: str = "", before: float = 0.0) -> list[str]:
        return await self.retry(f"listing of orphans below {prefix!r}",
                                lambda: self.inner.list_orphans(prefix, before))


class _RetryingUpload(MultipartUpload):
    def __init__(self, store: RetryingStore, inner: MultipartUpload) -> None:
        self._store, self._inner = store, inner
        self.key, self.upload_id = inner.key, inner.upload_id

    async def put_part(self, index: int, data: Buffer | FileRange | Pieces) -> PartInfo:
        return await self._store.retry_data(f"upload of {self.key} (part {index})", body_size(data),
                                            lambda: self._inner.put_part(index, data))

    async def copy_part(self, index: int, source: CopySource) -> PartInfo:
        return await self._store.retry(f"copy of {source.key} into {self.key} (part {index})",
                                       lambda: self._inner.copy_part(index, source))

    async def complete(self, parts: list[PartInfo], metadata: dict[str, str] | None = None) -> None:
        await self._store.retry(f"completion of {self.key}", lambda: self._inner.complete(parts, metadata))

    async def abort(self) -> None:
        await self._store.retry(f"abort of upload of {self.key}", self._inner.abort)

    @property
    def sends_files(self) -> bool:
        return self._inner.sends_files

    @property
    def sends_pieces(self) -> bool:
        return self._inner.sends_pieces

    def local_fd(self) -> int | None:
        return self._inner.local_fd()

    async def stored_part(self, index: int, size: int, token: str, digest: str) -> PartInfo | None:
        return await self._store.retry(f"check of stored part {index} of {self.key}",
                                       lambda: self._inner.stored_part(index, size, token, digest))


def retrying(store: Store, config: TransferConfig) -> RetryingStore:
    """``store`` with retries: itself when it already is a RetryingStore, else wrapped in one."""
    return store if isinstance(store, RetryingStore) else RetryingStore(store, config)
