"""Barrier through a Ray actor: ranks are Ray tasks or actors (e.g. Ray Train workers).

Create it on the driver (``RayBarrier.create()``) and pass it to the workers: the actor belongs to the
driver, so it outlives any worker that dies, and the barrier object pickles with its actor handle.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import ray

from .barrier import Barrier, BarrierTimeoutError, Rendezvous, describe_missing

__all__ = ["RayBarrier"]


@ray.remote(num_cpus=0)
class _BarrierActor:
    """Payloads by key, with waiters woken when a gather completes or a broadcast arrives."""

    def __init__(self) -> None:
        self.gathers: dict[str, dict[int, bytes]] = {}
        self.casts: dict[str, tuple[bytes, int]] = {}
        self.events: dict[str, asyncio.Event] = {}

    def _event(self, key: str) -> asyncio.Event:
        return self.events.setdefault(key, asyncio.Event())

    async def gather(self, key: str, rank: int, world_size: int, payload: bytes, timeout: float) -> dict:
        got = self.gathers.setdefault(key, {})
        got[rank] = payload
        event = self._event("g:" + key)
        if len(got) == world_size:
            event.set()
        if rank != 0:
            return {}
        try:
            await asyncio.wait_for(event.wait(), timeout)
        except asyncio.TimeoutError:
            return {"missing": [r for r in range(world_size) if r not in got]}
        finally:
            self.gathers.pop(key, None)
            self.events.pop("g:" + key, None)
        return {"payloads": [got[r] for r in range(world_size)]}

    async def broadcast(self, key: str, rank: int, world_size: int, payload: bytes | None, timeout: float) -> dict:
        event = self._event("b:" + key)
        if rank == 0:
            self.casts[key] = (payload or b"", world_size - 1)
            event.set()
        else:
            try:
                await asyncio.wait_for(event.wait(), timeout)
            except asyncio.TimeoutError:
                return {"timeout": True}
        value, readers = self.casts[key]
        if rank != 0:
            readers -= 1
        if readers <= 0:
            self.casts.pop(key, None)
            self.events.pop("b:" + key, None)
        else:
            self.casts[key] = (value, readers)
        return {"payload": value}


class RayBarrier(Barrier):
    """Ranks meet in one Ray actor. Build with ``RayBarrier.create()`` on the driver."""

    def __init__(self, actor: Any, timeout: float = 1800.0) -> None:
        super().__init__(timeout)
        self.actor = actor

    @classmethod
    def create(cls, timeout: float = 1800.0, name: str | None = None) -> RayBarrier:
        """A barrier with a new actor owned by the caller (named ``name`` if given)."""
        options: dict[str, Any] = {"name": name} if name else {}
        return cls(_BarrierActor.options(**options).remote(), timeout)

    async def gather(self, rv: Rendezvous, tag: str, payload: bytes) -> list[bytes] | None:
        start = time.monotonic()
        out = await self.actor.gather.remote(f"{rv.prefix}|{tag}", rv.rank, rv.world_size, payload, self.timeout)
        if "missing" in out:
            raise BarrierTimeoutError(f"Ray barrier {tag!r}: {describe_missing(out['missing'], rv.world_size)} "
                                      f"within {time.monotonic() - start:.0f}s", out["missing"])
        return out.get("payloads")

    async def broadcast(self, rv: Rendezvous, tag: str, payload: bytes | None) -> bytes:
        if rv.rank == 0 and payload is None:
            raise ValueError("the root must broadcast a payload")
        out = await self.actor.broadcast.remote(f"{rv.prefix}|{tag}", rv.rank, rv.world_size, payload,
                                                2 * self.timeout)
        if "timeout" in out:
            raise BarrierTimeoutError(f"Ray barrier {tag!r}: rank 0 announced nothing within {2 * self.timeout:g}s",
                                      [0])
        return out["payload"]
