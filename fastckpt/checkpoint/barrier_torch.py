"""Barrier through ``torch.distributed`` (an initialised process group; gloo or nccl).

The collectives run on a gloo group (the given one when it is gloo, else a gloo group over the same
ranks, created on first use by every rank), in a worker thread so the event loop keeps running. A
``monitored_barrier`` comes first, so a timeout names the ranks that never arrived.
"""

from __future__ import annotations

import asyncio
import re
import threading
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from .barrier import Barrier, BarrierError, BarrierTimeoutError, Rendezvous, describe_missing

__all__ = ["TorchBarrier", "gloo_group", "group_place"]

_MISSING_RE = re.compile(r"Ranks? ([\d, ]+?) failed to pass monitoredBarrier")


def gloo_group(group: Any) -> Any:
    """``group`` (None: the default group) when it is a gloo group, else a gloo group over the same ranks (creating
    one is a collective over the whole world): CPU bytes and objects travel on gloo."""
    if dist.get_backend(group) == "gloo":
        return group
    ranks = dist.get_process_group_ranks(group) if group is not None else None
    return dist.new_group(ranks=ranks, backend="gloo")


def group_place(group: Any, rank: int | None, world_size: int | None) -> tuple[int, int]:
    """This process's rank in ``group`` and the group's size, where not given."""
    return (dist.get_rank(group) if rank is None else rank,
            dist.get_world_size(group) if world_size is None else world_size)


class TorchBarrier(Barrier):
    """Ranks meet through ``torch.distributed``; rank r of the writer must be rank r of ``group``.

    ``group`` defaults to the default (world) group. With a non-gloo subgroup, pass a gloo group
    instead: creating one is a collective over the whole world.
    """

    def __init__(self, group: Any = None, timeout: float = 1800.0) -> None:
        super().__init__(timeout)
        self.group = group
        self._gloo: Any = None
        self._lock = threading.Lock()

    def check_world(self, rv: Rendezvous) -> None:
        super().check_world(rv)
        if not dist.is_available() or not dist.is_initialized():
            raise BarrierError("TorchBarrier needs torch.distributed.init_process_group() to have been called")
        rank, size = dist.get_rank(self.group), dist.get_world_size(self.group)
        if (rank, size) != (rv.rank, rv.world_size):
            raise ValueError(f"writer is rank {rv.rank} of {rv.world_size}, but torch.distributed says rank "
                             f"{rank} of {size}")

    def _group(self) -> Any:
        with self._lock:
            if self._gloo is None:
                self._gloo = gloo_group(self.group)
            return self._gloo

    def gloo(self) -> Any:
        """The gloo group the barrier's collectives run on (made on first use)."""
        return self._group()

    def _root(self, group: Any) -> int:
        return dist.get_global_rank(group, 0) if group is not None else 0

    def _arrive(self, group: Any, rv: Rendezvous) -> None:
        try:
            dist.monitored_barrier(group, timeout=timedelta(seconds=self.timeout), wait_all_ranks=True)
        except RuntimeError as exc:
            text = str(exc)
            match = _MISSING_RE.search(text)
            if match:
                missing = sorted(int(r) for r in match[1].replace(" ", "").split(",") if r)
                raise BarrierTimeoutError(f"torch.distributed barrier: {describe_missing(missing, rv.world_size)} "
                                          f"within {self.timeout:g}s", missing) from exc
            raise BarrierError(f"torch.distributed barrier failed on rank {rv.rank}: {text}") from exc

    def _gather(self, rv: Rendezvous, payload: bytes) -> list[bytes] | None:
        group = self._group()
        self._arrive(group, rv)
        out: list[Any] | None = [None] * rv.world_size if rv.rank == 0 else None
        try:
            dist.gather_object(payload, out, dst=self._root(group), group=group)
        except RuntimeError as exc:
            raise BarrierError(f"torch.distributed gather failed on rank {rv.rank}: {exc}") from exc
        return out

    def _broadcast(self, rv: Rendezvous, payload: bytes | None) -> bytes:
        group = self._group()
        objects = [payload]
        try:
            dist.broadcast_object_list(objects, src=self._root(group), group=group)
        except RuntimeError as exc:
            raise BarrierError(f"torch.distributed broadcast failed on rank {rv.rank}: {exc}") from exc
        if objects[0] is None:
            raise BarrierError("torch.distributed broadcast: rank 0 sent nothing")
        return objects[0]

    async def gather(self, rv: Rendezvous, tag: str, payload: bytes) -> list[bytes] | None:
        return await asyncio.to_thread(self._gather, rv, payload)

    async def broadcast(self, rv: Rendezvous, tag: str, payload: bytes | None) -> bytes:
        if rv.rank == 0 and payload is None:
            raise ValueError("the root must broadcast a payload")
        return await asyncio.to_thread(self._broadcast, rv, payload)

    async def announce_failure(self, rv: Rendezvous, tag: str, payload: bytes) -> None:
        """Nothing to do: a failed collective has already failed every rank."""
