"""The store barrier: ranks meet through the checkpoint's own storage, in groups under leaders, so that the
requests per rank stay flat as the world grows and the root reads one object per group."""

from __future__ import annotations

import asyncio
import random
import time
from collections import OrderedDict

from ..errors import ObjectNotFoundError
from ..tasks import gather_bounded
from ..uri import join_key
from .barrier import Barrier, BarrierTimeoutError, Rendezvous, describe_missing
from .documents import read_small
from .manifest import decode_group, encode_group, group_key, rank_key

__all__ = ["BROADCAST_NAME", "FIRST_POLL_TRIPS", "TRIPS_KEPT", "StoreBarrier", "default_barrier"]

BROADCAST_NAME = "broadcast.json"
TRIPS_KEPT = 1 << 16
"""Round trips remembered at most (ranks of this process awaiting their broadcast)."""
FIRST_POLL_TRIPS = 6
"""A rank's first look for the outcome comes this many of its own write's round trips after it handed in its payload:
the leaders' reads, their group objects, the root's reads, checks and marker lie between."""


class _Backoff:
    """Poll delays: growing by ``factor`` with jitter, capped, never past the deadline."""

    def __init__(self, first: float, cap: float, timeout: float, factor: float = 1.5) -> None:
        self.delay, self.cap, self.factor = first, cap, factor
        self.deadline = time.monotonic() + timeout

    def expired(self) -> bool:
        return time.monotonic() >= self.deadline

    async def sleep(self) -> None:
        left = self.deadline - time.monotonic()
        await asyncio.sleep(max(0.0, min(self.delay * random.uniform(0.8, 1.2), left)))
        self.delay = min(self.delay * self.factor, self.cap)


class StoreBarrier(Barrier):
    """Barrier through the checkpoint's storage: needs nothing but the store all ranks write to.

    Each rank writes its payload to ``{prefix}/{tag}/rank-NNNNN.json`` (for the commit that is the rank manifest
    itself). Ranks meet in groups of ``group_size``: the first rank of each group (its leader) reads its members'
    payloads and, when there is more than one group, stores them as one object ``{prefix}/{tag}/group-NNNNN.json``;
    the root (rank 0, leader of the first group) reads the group objects. It announces the outcome in
    ``{prefix}/{tag}/broadcast.json``, which the other ranks poll. So a rank costs about three requests whatever
    the world size (its write, its leader's read, its read of the outcome), and the root one per group.

    It cannot tell a dead run's objects from the current run's, so ranks must agree on the attempt id beforehand
    (``attempt=`` or the environment).
    """

    stores_payloads = True
    fresh = False

    def __init__(self, timeout: float = 1800.0, poll_interval: float = 0.05, max_poll_interval: float = 1.0,
                 read_concurrency: int = 64, group_size: int = 16) -> None:
        super().__init__(timeout)
        if group_size < 2:
            raise ValueError(f"store barrier group size must be at least 2, got {group_size}")
        self.poll_interval, self.max_poll_interval = poll_interval, max_poll_interval
        self.read_concurrency, self.group_size = read_concurrency, group_size
        self._trip: OrderedDict[tuple[str, str, int], float] = OrderedDict()
        """Each rank's write round trip, from its ``gather`` to its ``broadcast`` (bounded: a rank that fails after
        its ``gather`` never comes to the ``broadcast``)."""

    def group_size_for(self, world_size: int) -> int:
        return self.group_size if world_size > self.group_size else 0

    async def gather(self, rv: Rendezvous, tag: str, payload: bytes) -> list[bytes] | None:
        start = time.monotonic()
        await rv.write(rank_key(rv.prefix, tag, rv.rank), payload)
        self._trip[(rv.prefix, tag, rv.rank)] = time.monotonic() - start
        if len(self._trip) > TRIPS_KEPT:
            self._trip.popitem(last=False)
        if rv.rank % self.group_size:
            return None
        grouped = self.group_size_for(rv.world_size)
        members = range(rv.rank, min(rv.rank + self.group_size, rv.world_size))
        got = await self._collect(rv, {r: rank_key(rv.prefix, tag, r) for r in members[1:]}, self.timeout)
        got[rv.rank] = payload
        if grouped:
            group = encode_group(tag, rv.rank, [got.get(r) for r in members])
            await rv.write(group_key(rv.prefix, tag, rv.rank), group)
        if rv.rank:
            return None
        if grouped:
            await self._read_groups(rv, tag, got)
        missing = [r for r in range(rv.world_size) if r not in got]
        if missing:
            raise BarrierTimeoutError(
                f"store barrier at {join_key(rv.prefix, tag)}: {describe_missing(missing, rv.world_size)} "
                f"within {self.timeout:g}s", missing)
        return [got[r] for r in range(rv.world_size)]

    async def _read_groups(self, rv: Rendezvous, tag: str, got: dict[int, bytes]) -> None:
        """Root: add the payloads of every other group to ``got``. A leader reports a missing member up to
        ``timeout`` after its own arrival, so the root waits a quarter longer; for a group whose object is still
        absent then (its leader died), the payloads its members wrote are read one by one."""
        firsts = range(self.group_size, rv.world_size, self.group_size)
        keys = {f: group_key(rv.prefix, tag, f) for f in firsts}
        for first, data in (await self._collect(rv, keys, 1.25 * self.timeout)).items():
            payloads = decode_group(data, keys[first], tag, first)
            got.update({first + i: p for i, p in enumerate(payloads) if p is not None})
        orphans = [r for f in firsts if f not in got for r in range(f, min(f + self.group_size, rv.world_size))]
        if orphans:
            got.update(await self._collect(rv, {r: rank_key(rv.prefix, tag, r) for r in orphans}, 0))

    async def _collect(self, rv: Rendezvous, keys: dict[int, str], timeout: float) -> dict[int, bytes]:
        """The objects ``keys`` (by index) that appear within ``timeout``. Each round looks for the first one still
        missing and, once it is there, reads all that are missing: a late rank costs one read per round, not one
        per missing object."""
        got: dict[int, bytes] = {}
        backoff = _Backoff(self.poll_interval, self.max_poll_interval, timeout)
        while todo := [i for i in keys if i not in got]:
            last = backoff.expired()
            first = await self._read(rv, keys[todo[0]])
            if first is not None or last:  # the others are read once more before giving up
                found = await gather_bounded([self._read(rv, keys[i]) for i in todo[1:]], self.read_concurrency)
                got.update({i: data for i, data in zip(todo, [first, *found], strict=True) if data is not None})
                if last:
                    break
                continue
            await backoff.sleep()
        return got

    @staticmethod
    async def _read(rv: Rendezvous, key: str) -> bytes | None:
        try:
            return await read_small(rv.store, key)
        except ObjectNotFoundError:
            return None

    async def broadcast(self, rv: Rendezvous, tag: str, payload: bytes | None) -> bytes:
        key = join_key(rv.prefix, tag, BROADCAST_NAME)
        trip = self._trip.pop((rv.prefix, tag, rv.rank), 0.0)
        if rv.rank == 0:
            if payload is None:
                raise ValueError("the root must broadcast a payload")
            await rv.store.put(key, payload)
            return payload
        first = min(max(self.poll_interval, FIRST_POLL_TRIPS * trip), self.max_poll_interval)
        backoff = _Backoff(first, self.max_poll_interval, 2 * self.timeout)
        while True:
            await backoff.sleep()
            found = await self._read(rv, key)
            if found is not None:
                return found
            if backoff.expired():
                raise BarrierTimeoutError(
                    f"store barrier at {join_key(rv.prefix, tag)}: rank 0 announced no outcome within "
                    f"{2 * self.timeout:g}s (rank 0 may have died, or ranks never arrived)", [0])


def default_barrier() -> Barrier:
    """The barrier used when none is given: through the store."""
    return StoreBarrier()
