"""The one retry layer (stores.retry): which requests are retried, how often, and what is raised at the end."""

from __future__ import annotations

import pytest

from fastckpt import StoreError, TransientStoreError, open_store
from fastckpt.stores.base import ListPage, Store
from fastckpt.stores.memory import MemoryStore
from fastckpt.stores.retry import RetryingStore, retrying
from harness.faults import FaultInjectingStore

from ..conftest import small_config


class PagedMemory(MemoryStore):
    """A memory bucket listed in pages of two keys, whose listing requests fail while ``fail`` > 0."""

    def __init__(self, bucket: str) -> None:
        super().__init__(bucket)
        self.fail = 0
        self.requests = 0

    async def list_page(self, prefix: str, delimiter: str | None = None, token: str | None = None) -> ListPage:
        self.requests += 1
        if self.fail:
            self.fail -= 1
            raise TransientStoreError(f"injected: listing of {prefix}")
        keys = sorted(k for k in self._b.objects if k.startswith(prefix) and k > (token or ""))
        objects = [await self.head(k) for k in keys[:2]]
        return ListPage(objects, [], keys[1] if len(keys) > 2 else None)

    list = Store.list  # the listing derived from list_page, not MemoryStore's own


async def test_every_operation_is_retried_until_it_succeeds() -> None:
    faulty = FaultInjectingStore(MemoryStore("retry-ops"), error_rate=0.5, seed=3)
    store = RetryingStore(faulty, small_config(retries=20))
    await store.put("a/x", b"1")
    assert await store.get_range("a/x", 0, 10) == b"1"
    assert (await store.head("a/x")).size == 1
    mpu = await store.create_multipart("a/big", 4)
    parts = [await mpu.put_part(0, b"abcd"), await mpu.put_part(1, b"e")]
    await mpu.complete(parts)
    assert [m.key async for m in store.list("a")] == ["a/big", "a/x"]
    assert (await store.list_dir("a"))[0][0].key == "a/big"
    await store.delete_many(["a/x", "a/big"])
    assert faulty.injected > 0


async def test_a_persistent_fault_gives_up_with_the_request_named() -> None:
    faulty = FaultInjectingStore(MemoryStore("retry-give-up"), error_rate=1.0)
    store = RetryingStore(faulty, small_config(retries=3))
    with pytest.raises(TransientStoreError, match=r"head of k \(faulty-memory\): failed after 4 attempts"):
        await store.head("k")
    assert faulty.calls == 4


async def test_a_non_retryable_error_fails_at_once() -> None:
    faulty = FaultInjectingStore(MemoryStore("retry-fatal"), fail_after=0)
    store = RetryingStore(faulty, small_config(retries=5))
    with pytest.raises(StoreError, match="injected permanent failure") as info:
        await store.put("k", b"x")
    assert not info.value.retryable and faulty.calls == 1


async def test_paged_listings_are_retried_page_by_page() -> None:
    inner = PagedMemory("retry-paged")
    for i in range(5):
        await inner.put(f"p/{i}", b"x")
    store = RetryingStore(inner, small_config())
    assert store.paged
    seen = []
    async for meta in store.list("p"):
        seen.append(meta.key)
        inner.fail = 1  # the next page's first request fails; only that request is sent again
    assert seen == [f"p/{i}" for i in range(5)]
    assert inner.requests == 3 + 2


async def test_non_paged_listing_is_retried_only_before_its_first_object() -> None:
    faulty = FaultInjectingStore(MemoryStore("retry-list"), fail_after=1, permanent=TransientStoreError("flaky"),
                                 ops={"list"})
    await faulty.inner.put("d/a", b"x")
    store = RetryingStore(faulty, small_config(retries=2))
    assert [m.key async for m in store.list("d")] == ["d/a"]  # the first list request is let through
    with pytest.raises(TransientStoreError, match="flaky"):
        [m async for m in store.list("d")]  # every later one fails: 1 + 2 retries, then raised
    assert faulty.calls == 1 + 3


def test_wrapped_once() -> None:
    store = open_store("memory://retry-once/x", config=small_config())
    assert isinstance(store, RetryingStore)
    assert retrying(store, small_config()) is store
    assert not isinstance(open_store("memory://retry-once/x", retry=False), RetryingStore)
