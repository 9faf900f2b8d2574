"""Throttling adapts: a store that answers 503 SlowDown / 429 / ServerBusy gets fewer requests at once
(``stores.concurrency``), and more again once its answers are good, so a transfer through it completes at the rate
it allows instead of burning its retries."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest

import fastckpt
from fastckpt import ThrottledError, TransientStoreError
from fastckpt.stores.azure.errors import ERRORS as AZURE_ERRORS
from fastckpt.stores.classify import classify
from fastckpt.stores.concurrency import BACKOFF, AdaptiveLimit
from fastckpt.stores.s3.errors import ERRORS as S3_ERRORS
from harness.proxy import FaultProxy
from harness.uris import emulator_uri

from ..conftest import small_config

pytestmark = pytest.mark.timeout(240)

THROTTLES = {"s3": (503, "SlowDown"), "gcs": (429, "rateLimitExceeded"), "azure": (503, "ServerBusy")}
"""What each service answers a client that sends too many requests at once."""
ALLOWED = 3
"""Requests the throttling proxy serves at once."""


# ----------------------------------------------------------------------------- the limit alone


def test_throttling_answers_are_classified_as_such() -> None:
    where = {"place": "x", "bucket": "b"}
    assert type(classify(S3_ERRORS, 503, "SlowDown", **where)) is ThrottledError
    assert type(classify(S3_ERRORS, 429, "TooManyRequests", **where)) is ThrottledError
    assert type(classify(AZURE_ERRORS, 503, "ServerBusy", **where)) is ThrottledError
    assert type(classify(S3_ERRORS, 500, "InternalError", **where)) is TransientStoreError  # an error, not a signal


async def test_limit_falls_once_per_round_and_binds() -> None:
    limit = AdaptiveLimit(ceiling=1 << 16)
    rounds = [await limit.acquire() for _ in range(10)]
    assert limit.in_flight == 10  # unbounded until throttled
    for granted in rounds:  # ten answers of one round throttled: one fall, from what was in flight
        limit.throttled(granted)
    assert limit.limit == pytest.approx(10 * BACKOFF)
    for _ in rounds:
        limit.release()
    waiting = asyncio.ensure_future(_hold_many(limit, 9))
    await asyncio.sleep(0.05)
    assert limit.in_flight == int(10 * BACKOFF)  # the others wait for a slot
    waiting.cancel()
    await asyncio.gather(waiting, return_exceptions=True)


async def test_a_waiter_cancelled_after_its_wake_passes_the_slot_on() -> None:
    limit = AdaptiveLimit(ceiling=1 << 16)
    limit.throttled(await limit.acquire())  # the limit is now 1, held
    first, second = asyncio.ensure_future(limit.acquire()), asyncio.ensure_future(limit.acquire())
    await asyncio.sleep(0)
    limit.release()  # wakes the first waiter...
    first.cancel()  # ...which is cancelled before it runs
    assert await asyncio.wait_for(second, 1) == 1 and limit.in_flight == 1
    assert first.cancelled()


async def _hold_many(limit: AdaptiveLimit, n: int) -> None:
    async def one() -> None:
        await limit.acquire()
        try:
            await asyncio.sleep(10)
        finally:
            limit.release()

    await asyncio.gather(*(one() for _ in range(n)))


async def test_limit_rises_while_in_use_and_slowly_near_the_throttled_level() -> None:
    limit = AdaptiveLimit(ceiling=1 << 16)
    limit.throttled(await limit.acquire())
    limit.release()
    assert limit.limit == 1  # floor
    rises = 0
    while limit.limit < 0.9 * limit.throttled_at:  # below the throttled level: a slot per round of good answers
        await _answered(limit)
        rises += 1
    assert rises <= 2
    before = limit.limit
    for _ in range(5):
        await _answered(limit)
    assert limit.limit - before <= 5 / 10 / before + 1e-9  # near it: ten times slower
    idle = AdaptiveLimit(ceiling=1 << 16)
    idle.limit = 8.0
    await _answered(idle)  # one request in flight of eight allowed: nothing learnt about more
    assert idle.limit == 8.0


async def _answered(limit: AdaptiveLimit) -> None:
    """One request, answered well."""
    await limit.acquire()
    limit.succeeded()
    limit.release()


# ----------------------------------------------------------------------------- through a throttling server


@pytest.fixture(params=sorted(THROTTLES))
def throttling(request: pytest.FixtureRequest) -> Iterator[tuple[FaultProxy, str]]:
    """(a proxy that throttles above ``ALLOWED`` requests in flight, a fresh URI on its backend through it)."""
    backend = request.param
    upstream = {"s3": lambda: request.getfixturevalue("moto_server").endpoint,
                "gcs": lambda: request.getfixturevalue("gcs_server"),
                "azure": lambda: request.getfixturevalue("azurite").endpoint}[backend]()
    with FaultProxy(urlsplit(upstream).port) as proxy:
        uri = emulator_uri(backend, proxy.url, f"throttle-{os.urandom(4).hex()}")
        proxy.throttle(ALLOWED, *THROTTLES[backend])
        yield proxy, uri


def test_transfer_through_a_throttling_store_settles_below_its_limit(throttling: tuple[FaultProxy, str],
                                                                      tmp_path: Path) -> None:
    """64 files up and down with 8 requests wanted at once, through a server that serves 3: both complete, and
    once the concurrency has settled (the second half of the requests) at most 10% are throttled."""
    proxy, uri = throttling
    src = tmp_path / "src"
    src.mkdir()
    files = {f"f{i:02d}.bin": os.urandom(32 << 10) for i in range(64)}
    for name, data in files.items():
        (src / name).write_bytes(data)
    config = small_config(max_in_flight=8, retries=10, retry_for=60)
    fastckpt.upload(str(src), uri, config=config)
    fastckpt.download(uri, str(tmp_path / "dst"), config=config)
    assert {p.name: p.read_bytes() for p in (tmp_path / "dst").iterdir()} == files
    settled = proxy.answers[len(proxy.answers) // 2:]
    seen = "".join("T" if throttled else "." for throttled in proxy.answers)
    assert any(proxy.answers), "the server never throttled: the test proves nothing"
    assert sum(settled) <= 0.1 * len(settled), f"{sum(settled)} of the last {len(settled)} requests throttled: {seen}"
