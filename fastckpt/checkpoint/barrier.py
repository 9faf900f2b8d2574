"""Rank barriers: how the ranks of one attempt meet before the commit.

One interface, two collective steps, rank 0 as the root:

- ``gather(rv, tag, payload)``: every rank hands in a payload (its manifest); the root gets them all
  (index = rank), the other ranks return None at once.
- ``broadcast(rv, tag, payload)``: the root announces a payload (the commit outcome); every rank
  returns it.

Implementations here: ``InProcessBarrier`` (ranks as tasks or threads of one process) and ``HandedBarrier``;
``barrier_store.StoreBarrier`` (the default: through the checkpoint's own storage), ``barrier_torch.TorchBarrier``
and ``barrier_ray.RayBarrier`` live in their own modules (torch and ray stay optional).
"""

from __future__ import annotations

import abc
import asyncio
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import cast

from ..config import TransferConfig
from ..errors import CheckpointError
from ..stores.base import Store
from ..tasks import gather_all
from .manifest import rank_key

__all__ = ["Barrier", "BarrierError", "BarrierTimeoutError", "HandedBarrier", "InProcessBarrier", "Rendezvous",
           "describe_missing"]


class BarrierError(CheckpointError):
    """The ranks could not meet (a rank died, the transport failed)."""


class BarrierTimeoutError(BarrierError):
    """Not every rank reached the barrier in time; ``missing`` lists the ranks that never arrived."""

    def __init__(self, message: str, missing: list[int]) -> None:
        super().__init__(message)
        self.missing = missing


def describe_missing(missing: list[int], world_size: int) -> str:
    """'ranks 3, 7 of 8 never arrived' (abbreviated when there are many)."""
    shown = ", ".join(map(str, missing[:32])) + (f", ... ({len(missing)} in all)" if len(missing) > 32 else "")
    return f"rank{'s' if len(missing) != 1 else ''} {shown} of {world_size} never arrived"


@dataclass(frozen=True)
class Rendezvous:
    """Where and as whom a rank meets the others: the checkpoint's metadata prefix in ``store``."""

    store: Store
    prefix: str
    rank: int
    world_size: int
    config: TransferConfig = field(default_factory=TransferConfig)
    writer: Callable[[str, bytes], Awaitable[None]] | None = None
    """How this rank's payloads are written to the store (the checkpoint writer's guarded write); a plain
    put when None."""

    async def write(self, key: str, data: bytes) -> None:
        """Write this rank's payload ``data`` to ``key``."""
        if self.writer is not None:
            await self.writer(key, data)
        else:
            await self.store.put(key, data)


class Barrier(abc.ABC):
    """All ranks of one attempt meet here; rank 0 is the root.

    ``timeout`` bounds how long the root waits for the last rank (from its own arrival); the other
    ranks wait up to twice as long for the root's broadcast, since the root may arrive after them.
    """

    stores_payloads: bool = False
    """Whether ``gather`` itself writes each payload to ``rank_key(prefix, tag, rank)`` in the store."""
    fresh: bool = True
    """Whether a broadcast can never be one left over by an earlier, dead run (then ranks may agree
    on an attempt id through it)."""
    reports_failures: bool = True
    """Whether a rank's failure is handed to the others through ``gather`` (else the caller's own channel does).
    """

    def __init__(self, timeout: float = 1800.0) -> None:
        if timeout <= 0:
            raise ValueError(f"barrier timeout must be positive, got {timeout}")
        self.timeout = timeout

    @abc.abstractmethod
    async def gather(self, rv: Rendezvous, tag: str, payload: bytes) -> list[bytes] | None:
        """Hand in ``payload``; the root returns every rank's payload in rank order, others None.

        BarrierTimeoutError naming the missing ranks when not all arrive within ``timeout``.
        """

    @abc.abstractmethod
    async def broadcast(self, rv: Rendezvous, tag: str, payload: bytes | None) -> bytes:
        """The root sends ``payload``; every rank returns it."""

    async def announce_failure(self, rv: Rendezvous, tag: str, payload: bytes) -> None:
        """Root, after its ``gather`` failed: tell the ranks waiting in ``broadcast`` (best effort).

        The default broadcasts ``payload``; a barrier whose failed gather already failed every rank
        (a collective) does nothing.
        """
        await self.broadcast(rv, tag, payload)

    def group_size_for(self, world_size: int) -> int:
        """Ranks per group object that ``gather`` stores for a world of ``world_size`` (0: none)."""
        return 0

    def check_world(self, rv: Rendezvous) -> None:
        """Raise when ``rv``'s rank / world size cannot work with this barrier (hook for subclasses)."""
        if not 0 <= rv.rank < rv.world_size:
            raise ValueError(f"rank {rv.rank} is outside world size {rv.world_size}")


class _Slot:
    """One gather or broadcast in progress inside one process."""

    def __init__(self) -> None:
        self.values: dict[int, bytes] = {}
        self.result: bytes | None = None
        self.done = False
        self.readers = 0
        self.waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = []


class HandedBarrier(Barrier):
    """The root's side of a commit whose other ranks handed their manifests over another channel (the DCP
    plugin: through ``torch.distributed.checkpoint``'s own gather) and left (``CheckpointWriter.hand_off``).

    ``payloads`` maps each other rank to its manifest; the root stores them beside its own and commits.
    A rank that only hands off never calls the barrier, so it may hold no payloads.
    """

    stores_payloads = True
    reports_failures = False

    def __init__(self, payloads: dict[int, bytes]) -> None:
        super().__init__()
        self.payloads = payloads

    async def gather(self, rv: Rendezvous, tag: str, payload: bytes) -> list[bytes] | None:
        if rv.rank != 0:
            raise BarrierError(f"rank {rv.rank} hands its manifest over; only rank 0 gathers through a HandedBarrier")
        missing = [r for r in range(1, rv.world_size) if r not in self.payloads]
        if missing:
            raise BarrierTimeoutError(f"{describe_missing(missing, rv.world_size)}: no manifest was handed over",
                                      missing)
        got = [payload, *(self.payloads[r] for r in range(1, rv.world_size))]
        await gather_all(rv.write(rank_key(rv.prefix, tag, r), p) for r, p in enumerate(got))
        return got

    async def broadcast(self, rv: Rendezvous, tag: str, payload: bytes | None) -> bytes:
        assert payload is not None
        return payload


class InProcessBarrier(Barrier):
    """Barrier for ranks running in one process (asyncio tasks, or threads with their own loops).

    Share one instance between the ranks' writers.
    """

    def __init__(self, timeout: float = 600.0) -> None:
        super().__init__(timeout)
        self._lock = threading.Lock()
        self._slots: dict[tuple[str, str, str], _Slot] = {}

    def _slot(self, key: tuple[str, str, str]) -> _Slot:
        return self._slots.setdefault(key, _Slot())

    @staticmethod
    def _wake(slot: _Slot) -> None:
        slot.done = True
        for loop, fut in slot.waiters:
            loop.call_soon_threadsafe(lambda f=fut: f.done() or f.set_result(None))

    async def _wait(self, slot: _Slot, timeout: float) -> bool:
        """Wait until ``slot`` is done; False on timeout."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        with self._lock:
            if slot.done:
                return True
            slot.waiters.append((loop, fut))
        try:
            await asyncio.wait_for(fut, timeout)
            return True
        except asyncio.TimeoutError:
            return False
        finally:
            with self._lock:
                slot.waiters.remove((loop, fut))

    async def gather(self, rv: Rendezvous, tag: str, payload: bytes) -> list[bytes] | None:
        key = (rv.prefix, tag, "gather")
        with self._lock:
            slot = self._slot(key)
            slot.values[rv.rank] = payload
            if len(slot.values) == rv.world_size:
                self._wake(slot)
        if rv.rank != 0:
            return None
        arrived = await self._wait(slot, self.timeout)
        with self._lock:
            self._slots.pop(key, None)
            if not arrived:
                missing = [r for r in range(rv.world_size) if r not in slot.values]
                raise BarrierTimeoutError(
                    f"in-process barrier {tag!r}: {describe_missing(missing, rv.world_size)} "
                    f"within {self.timeout:g}s", missing)
            return [slot.values[r] for r in range(rv.world_size)]

    async def broadcast(self, rv: Rendezvous, tag: str, payload: bytes | None) -> bytes:
        key = (rv.prefix, tag, "broadcast")
        with self._lock:
            slot = self._slot(key)
            if rv.rank == 0:
                if payload is None:
                    raise ValueError("the root must broadcast a payload")
                slot.result = payload
                if rv.world_size == 1:
                    self._slots.pop(key, None)
                self._wake(slot)
                return payload
        if not await self._wait(slot, 2 * self.timeout):
            raise BarrierTimeoutError(f"in-process barrier {tag!r}: rank 0 announced nothing within "
                                      f"{2 * self.timeout:g}s", [0])
        with self._lock:
            slot.readers += 1
            if slot.readers == rv.world_size - 1:
                self._slots.pop(key, None)
            return cast(bytes, slot.result)
