"""Collectives over a ``torch.distributed`` process group as fastckpt's group-wide reads use them: on the group's
gloo twin, on a worker thread (the event loop keeps running), a broken group raised as a CheckpointError, and the
first rank's failure raised on every rank; and the one way bytes move between ranks (``send_span``, ``recv_span``,
``broadcast_span``: ``CHUNK`` bytes at a time through one buffer), which every group read (``group_download``,
``torch.group_load``, ``torch.dcp.group_read``) uses."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from ..errors import CheckpointError
from ..stores.base import Store
from .barrier_torch import gloo_group

__all__ = ["CHUNK", "STORE_LEARNED", "Buffer", "GroupCall", "Piece", "broadcast_span", "chunk_buffer", "recv_span",
           "send_span"]

T = TypeVar("T")
CHUNK = 16 << 20
"""Bytes sent between ranks at once: each rank holds one such buffer (``chunk_buffer``), whatever the size of what
they share."""
STORE_LEARNED = "store learned"
"""The key of a shared plan under which rank 0's store tells what it learned of its location."""


Buffer = tuple[memoryview, torch.Tensor]
"""One ``CHUNK``-byte buffer, as a view to read and write and as the tensor the collectives send and receive."""
Piece = Callable[[int, memoryview], None]
"""What fills (or takes) the bytes at an offset: the view is as long as the piece."""


def chunk_buffer() -> Buffer:
    """A fresh ``Buffer``."""
    buf = bytearray(CHUNK)
    return memoryview(buf), torch.frombuffer(buf, dtype=torch.uint8)


def send_span(call: GroupCall, peer: int, start: int, length: int, fill: Piece, buffer: Buffer) -> None:
    """Send the ``length`` bytes at ``start`` to group rank ``peer``, each piece filled by ``fill(offset, view)``."""
    view, tensor = buffer
    for pos in range(0, length, CHUNK):
        piece = view[:min(CHUNK, length - pos)]
        fill(start + pos, piece)
        dist.send(tensor[:len(piece)], dst=call.global_rank(peer), group=call.gloo)


def recv_span(call: GroupCall, owner: int, start: int, length: int, take: Piece, buffer: Buffer) -> None:
    """Receive the ``length`` bytes at ``start`` from group rank ``owner``, each piece handed to ``take(offset,
    view)``."""
    view, tensor = buffer
    for pos in range(0, length, CHUNK):
        piece = view[:min(CHUNK, length - pos)]
        dist.recv(tensor[:len(piece)], src=call.global_rank(owner), group=call.gloo)
        take(start + pos, piece)


def broadcast_span(call: GroupCall, owner: int, length: int, fill: Piece, take: Piece, buffer: Buffer) -> None:
    """``length`` bytes from group rank ``owner`` to every other rank: ``fill(offset, view)`` on the owner before each
    piece goes, ``take(offset, view)`` on the others once it came."""
    view, tensor = buffer
    for offset in range(0, length, CHUNK):
        piece = view[:min(CHUNK, length - offset)]
        if call.rank == owner:
            fill(offset, piece)
        dist.broadcast(tensor[:len(piece)], src=call.global_rank(owner), group=call.gloo)
        if call.rank != owner:
            take(offset, piece)


class GroupCall:
    """One group-wide operation (``what``, named in its errors) by every rank of a gloo group."""

    def __init__(self, gloo: Any, what: str) -> None:
        self.gloo, self.what = gloo, what
        self.rank, self.size = dist.get_rank(gloo), dist.get_world_size(gloo)

    @classmethod
    async def of(cls, group: Any, what: str) -> GroupCall:
        """The call on ``group``'s gloo twin (``barrier_torch.gloo_group``)."""
        return cls(await asyncio.to_thread(gloo_group, group), what)

    def global_rank(self, rank: int) -> int:
        """The world rank of group rank ``rank``."""
        return dist.get_global_rank(self.gloo, rank)

    async def run(self, collectives: Callable[[], T]) -> T:
        """``collectives()`` (blocking) on a worker thread; a rank that died or timed out as a CheckpointError."""
        try:
            return await asyncio.to_thread(collectives)
        except RuntimeError as exc:
            raise CheckpointError(f"{self.what} failed: rank {self.rank} lost the process group "
                                  f"({' '.join(str(exc).split())[:300]})") from exc

    async def share(self, value: T) -> T:
        """Rank 0's ``value``, on every rank."""
        box = [value]
        await self.run(lambda: dist.broadcast_object_list(box, src=self.global_rank(0), group=self.gloo))
        return box[0]

    async def from_root(self, make: Callable[[], Awaitable[T]], store: Store) -> T:
        """``make()``, run on rank 0, on every rank, with what rank 0's ``store`` learned of its location
        (``Store.learned``: the other ranks' stores take it, rather than each asking the store again); a failure of
        ``make()`` raised on every rank, in the same words."""
        plan: dict[str, Any] = {}
        if self.rank == 0:
            try:
                plan = {"value": await make(), STORE_LEARNED: store.learned()}
            except Exception as exc:  # every rank raises it, once they have it
                plan = {"error": f"{type(exc).__name__}: {exc}", STORE_LEARNED: store.learned()}
        shared = await self.share(plan)
        if self.rank:
            store.assume(shared.get(STORE_LEARNED) or {})
        self.raise_first([shared.get("error")])
        return shared["value"]

    async def gather(self, value: T) -> list[T]:
        """Every rank's ``value``, by rank, on every rank."""
        values: list[Any] = [None] * self.size
        await self.run(lambda: dist.all_gather_object(values, value, group=self.gloo))
        return values

    async def agree(self, error: str | None) -> None:
        """Every rank tells how its part went; the first failure is raised on every rank, in the same words."""
        self.raise_first(await self.gather(error))

    def raise_first(self, errors: Sequence[str | None]) -> None:
        """The first failure among ``errors`` (by rank, the same list on every rank: gathered or shared), raised."""
        failed = next(((r, e) for r, e in enumerate(errors) if e), None)
        if failed is not None:
            raise CheckpointError(f"{self.what} failed on rank {failed[0]}: {failed[1]}")
