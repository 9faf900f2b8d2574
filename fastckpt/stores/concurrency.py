"""Requests in flight per endpoint, sized to its link and lowered by its throttling: one controller per endpoint
(a store's ``location``) in the running event loop, shared by every transfer, stream and face that uses it.

**The link.** A request's time is modelled as ``latency + bytes / rate``: ``latency`` is the shortest time a small
request took (a round trip and the server's work), ``rate`` the fastest a single request's bytes moved (one
connection's ceiling). While the limit binds (requests wait for a slot), an answer that took about what the model
expects (at most ``GROW`` times) shows room on the link, and the limit grows: by one an answer, doubling each round
as TCP's slow start does, until the first answer that shows queueing; from then on by one a round. Answers that take
more than ``SHRINK`` times what the model expects show requests queueing behind each other (a full link, a busy
server, a slow disk): the limit then falls by one a round, to no less than ``MIN_LIMIT``. Between the two it holds
(a busy moment, or a new connection's handshake).
So the limit settles where adding requests stops adding throughput, whatever the round trip and the speed of one
connection. It starts at ``start_limit(config)``: a 10 Gb/s link of ``CONNECTION_RATE`` connections by default.

**Throttling** (additive increase, multiplicative decrease, as the AWS CRT's adaptive mode): a ``ThrottledError``
(503 SlowDown, 429, Azure ServerBusy) lowers the limit to ``BACKOFF`` x what was in flight (once per round of
requests: answers to requests sent before the fall do not count again); it then rises by one a round of good
answers, ten times slower near the level throttled last, so that probing for more costs few throttled answers.
"""

from __future__ import annotations

import asyncio
import math
import weakref
from collections.abc import Hashable

__all__ = [
    "BACKOFF",
    "CONNECTION_RATE",
    "DEFAULT_TARGET",
    "GROW",
    "LAN_LATENCY",
    "LATENCY_FLOOR",
    "MIN_LIMIT",
    "NEAR",
    "SHRINK",
    "SMALL",
    "AdaptiveLimit",
    "endpoint_limit",
    "start_limit",
]

BACKOFF = 0.7
"""What a throttled round leaves of the requests in flight."""
NEAR = 0.9
"""Above this share of the level throttled last, the limit rises ten times slower."""
GROW = 2.0
"""An answer within this many times the model's time shows room on the link."""
SHRINK = 3.0
"""Answers beyond this many times the model's time show requests queueing: the limit falls."""
SMALL = 64 << 10
"""Requests moving at most this many bytes measure the latency."""
LATENCY_FLOOR = 0.001
"""Answers quicker than this are no round trip (a request a backend answers without asking the network)."""
MIN_LIMIT = 8
"""The least a queueing link lowers the limit to (throttling may lower it further)."""
LAN_LATENCY = 0.005
"""Round trips shorter than this are a LAN's (or the same host's): there a few long requests fill the link, at the
least cost to the server."""
CONNECTION_RATE = 40_000_000
"""Bytes per second one connection is assumed to carry before any was measured (S3 serves 50-100 MB/s per
connection within a region, less across one)."""
DEFAULT_TARGET = 1_250_000_000
"""The link assumed when none is named: 10 Gb/s, the AWS CRT's default target."""


def start_limit(target_throughput: int, ceiling: int) -> int:
    """The requests in flight an endpoint starts with: enough for ``target_throughput`` bytes per second (0: 10 Gb/s)
    at ``CONNECTION_RATE`` each, within ``ceiling``."""
    wanted = math.ceil((target_throughput or DEFAULT_TARGET) / CONNECTION_RATE)
    return max(1, min(ceiling, max(MIN_LIMIT, wanted)))


class AdaptiveLimit:
    """How many requests one endpoint gets at once (see the module doc). One event loop uses it."""

    def __init__(self, ceiling: int, start: int | None = None, floor: int = 1) -> None:
        self.ceiling, self.floor = ceiling, floor
        self.limit = float(min(ceiling, start or ceiling))
        self.in_flight = 0
        self.peak = 0
        """The most requests that were in flight at once."""
        self.throttled_at: float | None = None
        """The level the last throttled round fell from."""
        self.latency: float | None = None
        """Seconds of the quickest small request."""
        self.rate = 0.0
        """Bytes per second of the quickest large request, its latency taken out."""
        self.slow_start = True
        self._round = 0
        self._waiters: list[asyncio.Future[None]] = []
        self._waited = False
        """Whether a request waited for a slot since the last answer: the limit binds."""

    async def acquire(self) -> int:
        """Take one of the endpoint's request slots (waiting for one); the round it was granted in."""
        while self.in_flight >= int(self.limit):
            self._waited = True
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
        self.peak = max(self.peak, self.in_flight)
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
        self.slow_start = False
        self._round += 1

    def succeeded(self, nbytes: int = 0, seconds: float = 0.0) -> None:
        """A request moving ``nbytes`` was answered in ``seconds`` without throttling (called while it holds its
        slot)."""
        slowness = self._learn(nbytes, seconds)
        binds, self._waited = self._waited or bool(self._waiters), False
        if slowness > SHRINK:
            self.slow_start = False
            if self.limit > MIN_LIMIT and binds:
                self.limit = max(float(MIN_LIMIT), self.limit - 1 / self.limit)
            return
        if self.limit >= self.ceiling or not binds:
            return  # not bound by the limit: nothing learnt about more
        if slowness > GROW:  # busy for a moment, or a new connection's handshake: hold
            return
        step = 1.0 if self.slow_start else 1 / self.limit
        if self.throttled_at is not None and self.limit >= NEAR * self.throttled_at:
            step = 1 / self.limit / 10
        self.limit = min(float(self.ceiling), self.limit + step)
        if self._waiters:
            self._wake()

    def planned(self) -> int:
        """How many requests a transfer cuts its data into (ranges of a download): twice the limit, so that a request
        that ends early leaves its slot to another until the end and the last ones are short; ``MIN_LIMIT`` where
        answers come within a LAN's round trip (``LAN_LATENCY``), where a few long requests fill the link."""
        if self.latency is not None and self.latency < LAN_LATENCY:
            return max(1, min(int(self.limit), MIN_LIMIT))
        return max(1, 2 * int(self.limit))

    def _learn(self, nbytes: int, seconds: float) -> float:
        """Fold one answer into the model; how many times the model's time it took (1.0 when it cannot tell)."""
        if seconds < LATENCY_FLOOR:
            return 1.0
        if nbytes <= SMALL:
            if self.latency is None or seconds < self.latency:
                self.latency = seconds
            return seconds / self.latency
        moving = max(seconds - (self.latency or 0.0), seconds / 10)
        self.rate = max(self.rate, nbytes / moving)
        return seconds / ((self.latency or 0.0) + nbytes / self.rate)

    def _wake(self) -> None:
        free = int(self.limit) - self.in_flight
        for waiter in self._waiters[:max(0, free)]:
            if not waiter.done():
                waiter.set_result(None)


_LIMITS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[Hashable, AdaptiveLimit]] = (
    weakref.WeakKeyDictionary())


def endpoint_limit(endpoint: Hashable, ceiling: int, start: int) -> AdaptiveLimit:
    """The limit of ``endpoint`` (a store's ``location``) in the running loop, shared by every store on it; a
    transfer allowing more than it has (``ceiling``) raises its ceiling."""
    limits = _LIMITS.setdefault(asyncio.get_running_loop(), {})
    limit = limits.get(endpoint)
    if limit is None:
        limit = limits[endpoint] = AdaptiveLimit(ceiling, start)
    limit.ceiling = max(limit.ceiling, ceiling)
    return limit
