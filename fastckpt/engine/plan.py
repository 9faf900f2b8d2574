"""Chunk planning: how a file of a given size is cut into parts."""

from __future__ import annotations

from dataclasses import dataclass

from ..config import TransferConfig
from ..stores.base import Store
from ..stores.concurrency import start_limit

__all__ = ["MAX_RANGE", "MiB", "Plan", "plan_copy", "plan_download", "plan_upload"]

MiB = 1 << 20
MAX_RANGE = 128 * MiB
"""Longest ranged read of a download."""


@dataclass(frozen=True)
class Plan:
    """Parts of one file: all ``part_size`` bytes except the last."""

    size: int
    part_size: int
    multipart: bool

    @property
    def count(self) -> int:
        """Number of parts (0 for an empty file)."""
        return -(-self.size // self.part_size)

    def part(self, index: int) -> tuple[int, int]:
        """(offset, length) of part ``index``."""
        offset = index * self.part_size
        return offset, min(self.part_size, self.size - offset)


def plan_upload(size: int, config: TransferConfig, store: Store) -> Plan:
    """Part size scaled up (in whole MiB) until the file fits the backend's part-count limit."""
    part = max(config.part_size, store.min_part_size)
    if size > part * store.max_parts:
        part = -(-size // store.max_parts)
        part = -(-part // MiB) * MiB
    if part > store.max_part_size:
        raise ValueError(f"{size} bytes exceed what {store.name} can store in {store.max_parts} parts")
    return Plan(size, part, size > config.multipart_threshold)


def plan_download(size: int, chunk_size: int | None, config: TransferConfig, *, batch: int = 0,
                  longest: int = MAX_RANGE, ranges: int = 0) -> Plan:
    """Read requests aligned to the recorded chunk size: ``config.range_size``, else the file, or the ``batch`` of
    files it comes down with, cut into ``ranges`` (the endpoint's ``planned_requests()``; 0: as many as requests
    start in flight), from ``part_size`` on; at most ``longest``
    (received through a small ring, a long range costs no more memory, and a server less CPU per byte; a reader
    that holds whole parts passes ``part_size``). A killed download resumes range by range."""
    chunk = chunk_size or config.part_size
    ranges = ranges or start_limit(config.target_throughput, config.max_in_flight)
    target = config.range_size or max(config.part_size, max(size, batch) // ranges)
    target = min(longest, target)
    return Plan(size, chunk * max(1, target // chunk), True)


def plan_copy(size: int, chunk_size: int | None, config: TransferConfig, *, batch: int, slots: int) -> Plan:
    """Ranges of a file copied between local files, ``slots`` at a time: the whole file when it fits in a slot's
    share of the ``batch``, else equal chunk-aligned shares (``config.range_size`` when set). Ranges of one file
    are written one at a time, so two slots on two files copy twice as fast as on one."""
    chunk = chunk_size or config.part_size
    share = config.range_size or max(config.part_size, -(-max(size, batch) // max(1, slots)))
    count = max(1, -(-size // share))
    return Plan(size, chunk * max(1, -(-size // (count * chunk))), True)
