"""Request concurrency that adapts to a throttling service, per endpoint (additive increase, multiplicative decrease,
as the AWS CRT's adaptive mode does): a ``ThrottledError`` (503 SlowDown, 429, Azure ServerBusy) lowers the number
of requests the endpoint gets at once, and good answers raise it again, one request at a time.

The limit only binds once throttling has set it: it starts at ``ceiling``, falls to 0.7x what was in flight when
an answer asked for less (once per round of requests: answers to requests sent before the fall do not count
again), and rises by one request per round of good answers while it is in use, ten times slower near the level
that was throttled last, so that probing for more costs few throttled answers.
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Hashable

BACKOFF = 0.7
"""What a throttled round leaves of the requests in flight."""
NEAR = 0.9
"""Above this share of the level throttled last, the limit rises ten times slower."""


class AdaptiveLimit:
    """How many requests one endpoint gets at once (see the module doc). One event loop uses it."""

    def __init__(self, ceiling: int, floor: int = 1) -> None:
        self.ceiling, self.floor = ceiling, floor
        self.limit = float(ceiling)
        self.in_flight = 0
        self.throttled_at: float | None = None
        """The level the last throttled round fell from."""
        self._round = 0
        self._waiters: list[asyncio.Future[None]] = []

    async def acquire(self) -> int:
        """Take one of the endpoint's request slots (waiting for one); the round it was granted in."""
        while self.in_flight >= int(self.limit):
            waiter = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            try:
                await waiter
            except asyncio.CancelledError:
                self._waiters.remove(waiter)
                if waiter.done() and not waiter.cancelled():
                    self._wake()  # woken for a slot, cancelled before taking it: the slot goes to the next waiter
                raise
            self._waiters.remove(waiter)
        self.in_flight += 1
        return self._round

    def release(self) -> None:
        """Give a slot back."""
        self.in_flight -= 1
        if self._waiters:
            self._wake()

    def throttled(self, granted: int) -> None:
        """A request granted in round ``granted`` was throttled (called while it holds its slot)."""
        if granted != self._round:  # this round has fallen already
            return
        self.throttled_at = min(self.limit, float(self.in_flight))
        self.limit = max(float(self.floor), self.throttled_at * BACKOFF)
        self._round += 1

    def succeeded(self) -> None:
        """A request was answered without throttling (called while it holds its slot)."""
        if self.limit >= self.ceiling or self.in_flight < int(self.limit):
            return  # not bound by the limit: nothing learnt about more
        step = 1 / self.limit
        if self.throttled_at is not None and self.limit >= NEAR * self.throttled_at:
            step /= 10
        self.limit = min(float(self.ceiling), self.limit + step)
        if self._waiters:
            self._wake()

    def _wake(self) -> None:
        free = int(self.limit) - self.in_flight
        for waiter in self._waiters[:max(0, free)]:
            if not waiter.done():
                waiter.set_result(None)


_LIMITS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[Hashable, AdaptiveLimit]] = (
    weakref.WeakKeyDictionary())


def endpoint_limit(endpoint: Hashable, ceiling: int) -> AdaptiveLimit:
    """The limit of ``endpoint`` (a store's ``location``) in the running loop, shared by every store on it."""
    limits = _LIMITS.setdefault(asyncio.get_running_loop(), {})
    if endpoint not in limits:
        limits[endpoint] = AdaptiveLimit(ceiling)
    return limits[endpoint]
