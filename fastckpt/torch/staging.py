"""Host memory for tensor transfers: the reused (pinned) staging area, byte views of tensors, and the
``torch.distributed`` defaults of rank, world size and barrier."""

from __future__ import annotations

import concurrent.futures
import contextlib
import threading
from collections.abc import Iterator
from typing import Any, Literal

import torch
import torch.distributed as dist

from ..checkpoint.barrier import Barrier
from ..checkpoint.barrier_torch import TorchBarrier, group_place
from ..deprecation import warn
from .format import Header

__all__ = ["Staging", "byte_view", "copy_tensors", "default_staging", "distributed_defaults", "synchronize"]


def byte_view(tensor: torch.Tensor) -> memoryview:
    """The bytes of contiguous CPU ``tensor`` (no copy)."""
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy())


def synchronize(devices: set[torch.device]) -> None:
    """Wait for the copies queued on ``devices``."""
    for device in devices:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        else:
            torch.accelerator.synchronize(device)


def copy_tensors(area: torch.Tensor, header: Header, tensors: dict[str, torch.Tensor]) -> set[torch.device]:
    """Copy the tensors ``header`` lays out into ``area`` (uint8: the file's data section); device tensors
    ``non_blocking``: returns their devices, to ``synchronize`` before the area is read."""
    devices: set[torch.device] = set()
    for name, entry in header.tensors.items():
        if entry.nbytes:
            src = tensors[name].detach()
            area[entry.start:entry.end].view(entry.dtype).view(entry.shape).copy_(src,
                                                                                 non_blocking=src.device.type != "cpu")
            if src.device.type != "cpu":
                devices.add(src.device)
    return devices


class Staging:
    """Reused host memory that ``async_save`` copies tensors into before uploading them.

    Pinned (page-locked) when CUDA is available, so device copies run asynchronously at full speed.
    ``capacity`` (bytes) caps it: a state larger than that fails clearly; without it the area grows to the
    largest state staged and keeps that size. One save at a time uses a staging area.
    """

    def __init__(self, capacity: int | None = None, *, pin: bool | None = None) -> None:
        self.capacity = capacity
        self.pin = torch.cuda.is_available() if pin is None else pin
        self._buffer: torch.Tensor | None = None
        self._lock = threading.Lock()
        self._inflight: concurrent.futures.Future[Any] | None = None

    @property
    def nbytes(self) -> int:
        """Bytes held now."""
        return 0 if self._buffer is None else self._buffer.numel()

    def buffer(self, nbytes: int) -> torch.Tensor:
        """The first ``nbytes`` of the area as a uint8 tensor (grown when needed and allowed)."""
        if self.capacity is not None and nbytes > self.capacity:
            raise ValueError(f"state of {nbytes} bytes does not fit the staging area of {self.capacity} bytes; "
                             f"raise its capacity")
        if self._buffer is None or self._buffer.numel() < nbytes:
            self._buffer = None
            self._buffer = torch.empty(max(nbytes, 1), dtype=torch.uint8, pin_memory=self.pin)
        return self._buffer[:nbytes]

    @contextlib.contextmanager
    def claim(self, if_busy: Literal["wait", "error"]) -> Iterator[None]:
        """Hold the area for one save, once the previous save that used it has finished uploading."""
        busy = "an async_save from this staging area is still uploading"
        if not self._lock.acquire(blocking=if_busy == "wait"):
            raise RuntimeError(busy)
        try:
            previous = self._inflight
            if previous is not None and not previous.done():
                if if_busy == "error":
                    raise RuntimeError(busy + " (pass if_busy='wait' to wait for it)")
                concurrent.futures.wait([previous])
            self._inflight = None
            yield
        finally:
            self._lock.release()

    def track(self, future: concurrent.futures.Future[Any]) -> None:
        """The upload now reading the area (the next ``claim`` waits for it)."""
        self._inflight = future

    def stage(self, headers: list[Header], tensors: dict[str, torch.Tensor]) -> list[memoryview]:
        """Copy ``tensors`` into the area, one file after the other as laid out by ``headers``; returns each file's
        data section."""
        sizes = [h.size - h.data_start for h in headers]
        area = self.buffer(sum(sizes))
        devices: set[torch.device] = set()
        views, at = [], 0
        for header, size in zip(headers, sizes, strict=True):
            devices |= copy_tensors(area[at:at + size], header, tensors)
            views.append(byte_view(area[at:at + size]) if size else memoryview(b""))
            at += size
        synchronize(devices)
        return views

    def close(self) -> None:
        """Free the memory (waits for an upload still reading it)."""
        with self._lock:
            if self._inflight is not None:
                concurrent.futures.wait([self._inflight])
            self._buffer = None


_defaults: dict[int, Staging] = {}
_gloo: tuple[Any, Any] | None = None
"""(the world group it was made for, the barrier on the gloo group the commits use: one object, so that tier saves
find the attempt its ranks agreed on at their first save, ``tier.save.known_attempt``)."""


_barriers: dict[int, tuple[Any, Barrier]] = {}
"""The barrier of each process group given as ``group=`` (other than the world group), by the group's id."""


def _ours(barrier: Barrier) -> bool:
    """Whether ``barrier`` is one ``distributed_defaults`` made (passed on from ``save`` to ``async_save``)."""
    return (_gloo is not None and barrier is _gloo[1]) or any(barrier is b for _, b in _barriers.values())


def default_staging(rank: int) -> Staging:
    """The process's staging area for ``rank`` (one per rank, so ranks sharing a process never wait on
    each other's uploads)."""
    return _defaults.setdefault(rank, Staging())


def distributed_defaults(rank: int | None, world_size: int | None, barrier: Barrier | None, group: Any = None
                         ) -> tuple[int, int, Barrier | None]:
    """Rank, world size and barrier of a save: those of ``group`` (a ``torch.distributed`` process group, the
    barrier on a gloo group of its own for the world group, so the commit's collectives never interleave with
    training's); else from the default group when ``torch.distributed`` is initialised and they are not given; else
    rank 0 of 1 and the default barrier."""
    global _gloo
    if group is not None:
        if barrier is not None:
            raise ValueError("a save takes group= (a torch.distributed process group) or barrier= (another kind of "
                             "barrier), not both")
        if group is not dist.group.WORLD:
            rank, world_size = group_place(group, rank, world_size)
            if id(group) not in _barriers:  # one per group: its gloo twin is made once, on first use
                _barriers[id(group)] = (group, TorchBarrier(group))
            return rank, world_size, _barriers[id(group)][1]
    elif barrier is not None and isinstance(barrier, TorchBarrier) and not _ours(barrier):
        warn("barrier=TorchBarrier(group) in a save", "pass the process group as group=", stacklevel=4)
    initialised = dist.is_available() and dist.is_initialized()
    if initialised:
        rank = dist.get_rank() if rank is None else rank
        world_size = dist.get_world_size() if world_size is None else world_size
        if barrier is None and world_size > 1 and world_size == dist.get_world_size():
            if _gloo is None or _gloo[0] is not dist.group.WORLD:  # first use, or a new process group
                _gloo = (dist.group.WORLD, TorchBarrier(dist.new_group(backend="gloo")))
            barrier = _gloo[1]
    return (0 if rank is None else rank), (1 if world_size is None else world_size), barrier
