"""Files written straight into a tier: ``async_save`` of CPU tensors (and the DCP writer's files, ``write_in_tier``)
go into files of the tier mapped into memory, whose pages are recycled save after save (``tier.spare``), so the caller
is blocked for one copy of the tensors, and the save is safe as soon as it is handed to the node agent
(``commit_staged``), before it is hashed and committed in the tier."""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import threading
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass

import torch

from ...checkpoint.barrier import Barrier
from ...checkpoint.commit import CommitResult
from ...checkpoint.manifest import FileEntry
from ...checkpoint.writer import CheckpointWriter
from ...config import TransferConfig
from ...engine.layout import Layout
from ...threads import off_loop
from ...tier import Tier, TierFullError, ensure_agent
from ...tier.directory import NO_DRAIN, Drain
from ...tier.handoff import Handoff, Held, StagedFile, hand_off, hashed_entry, part_size
from ...tier.save import commit_in_tier, known_attempt
from ...tier.spare import claim, fits, prepare
from ...uri import StorageURI
from ..format import Header
from ..staging import byte_view, copy_tensors, synchronize

__all__ = ["Staged", "commit_staged", "discard", "mapped", "prepare_spares", "stage_in_tier", "write_in_tier"]

log = logging.getLogger("fastckpt")

_maps: dict[tuple[int, int], tuple[int, mmap.mmap]] = {}
"""The tier files this process mapped, by (device, inode): a file that comes back recycled is written through the
mapping it had (its page tables filled already)."""
_lock = threading.Lock()


def mapped(path: str, size: int) -> torch.Tensor:
    """The first ``size`` bytes of file ``path`` as a uint8 tensor over a shared mapping of it."""
    fd = os.open(path, os.O_RDWR)
    st = os.fstat(fd)
    key = (st.st_dev, st.st_ino)
    with _lock:
        for k, (held_fd, _) in list(_maps.items()):  # files deleted since: their mappings go with their last tensor
            if os.fstat(held_fd).st_nlink == 0:
                os.close(_maps.pop(k)[0])
        held = _maps.get(key)
        if held is not None and len(held[1]) >= size:
            os.close(fd)
            return torch.frombuffer(held[1], dtype=torch.uint8, count=size)
        if held is not None:
            os.close(_maps.pop(key)[0])
        m = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
        _maps[key] = (fd, m)
        return torch.frombuffer(m, dtype=torch.uint8, count=size)


@dataclass
class Staged:
    """One file of the save, written into the tier under a partial name."""

    name: str
    tmp: str
    final: str
    area: torch.Tensor | None = None


def stage_in_tier(tier: Tier, copy: StorageURI, headers: list[tuple[str, Header]],
                  tensors: dict[str, torch.Tensor]) -> list[Staged] | None:
    """Write each file of ``headers`` (its header, then its tensors) into the tier's copy ``copy`` under a partial
    name, in spare files (``tier.spare``); None when there are none to take them all (the first saves into a tier:
    filling fresh pages would block the caller several times longer than a copy, so those go through the staging
    area, and ``prepare_spares`` readies files for the next). TierFullError when the save does not fit."""
    sizes = [h.size for _, h in headers]
    tier.check_room(sizes)
    if not fits(tier.root, sizes):
        return None
    staged: list[Staged] = []
    devices: set[torch.device] = set()
    try:
        for name, header in headers:
            final = "/" + copy.join(name)
            staged.append(Staged(name, claim(tier.root, final, header.size), final))
            area = staged[-1].area = mapped(staged[-1].tmp, header.size)
            area[:header.data_start].copy_(torch.frombuffer(bytearray(header.raw), dtype=torch.uint8))
            devices |= copy_tensors(area[header.data_start:], header, tensors)
        synchronize(devices)
    except BaseException:
        discard(staged)
        raise
    return staged


def prepare_spares(tier: Tier, files: list[tuple[str, int]], copy: StorageURI | None = None) -> None:
    """Spare files for the next save of ``files`` (name, size), mapped here with their pages filled, so that the
    next save copies into memory as warm as a staging area's; skipped where the tier has no room for them. ``copy``:
    the tier's copy that holds ``files`` now (written through the staging area), mapped here too, since its files
    come back as spare files once it is dropped."""
    if copy is not None:
        for name, size in files:
            with contextlib.suppress(FileNotFoundError):
                mapped("/" + copy.join(name), size)
    try:
        tier.check_room([size for _, size in files])
    except TierFullError:
        return
    for name, size in files:
        path = prepare(tier.root, name, size)
        if path is not None:
            mapped(path, size)


async def write_in_tier(tier: Tier, copy: StorageURI, name: str, layout: Layout, config: TransferConfig) -> FileEntry:
    """File ``name`` of the tier's copy ``copy`` written from ``layout`` (a DCP rank's file) as ``stage_in_tier``
    writes a tensor file: into a spare file when one is large enough (mapped here and kept mapped for its next turn),
    else a new one; then hashed and published under its name. Its manifest entry."""
    staged = Staged(name, await off_loop(claim, tier.root, "/" + copy.join(name), layout.size), "/" + copy.join(name))
    try:
        view = byte_view(await off_loop(mapped, staged.tmp, layout.size))
        await off_loop(layout.gather, 0, view)
        entry = await hashed_entry(name, view, part_size(len(view), config))
        await off_loop(os.replace, staged.tmp, staged.final)
    finally:
        discard([staged])
    return entry


def discard(staged: list[Staged]) -> None:
    """Remove the partial files not published."""
    for s in staged:
        with contextlib.suppress(FileNotFoundError):
            os.remove(s.tmp)


async def commit_staged(tier: Tier, durable: StorageURI, staged: list[Staged], rank: int, world_size: int,
                        barrier: Barrier | None, attempt: str | None, config: TransferConfig,
                        after: Callable[[], Awaitable[None]] | None = None,
                        safe: Callable[[CommitResult], None] | None = None, drain: Drain = NO_DRAIN,
                        metrics: Mapping[str, float] | None = None) -> CommitResult:
    """Hash the staged files, publish them under their names and commit them in the tier with the other ranks
    (``commit_in_tier``); then ``after()`` (the replicas).

    ``safe``: called as soon as the save is handed to the node agent (``tier.handoff``), before the hashing, with
    this rank's share (its files and bytes; the commit time is the hand-off's). The agent finishes the save if this
    process dies, or if its commit here fails (a rank died meanwhile); the files are then left to it. Only once the
    attempt is known (``known_attempt``): else ``safe`` is not called. ``drain``, ``metrics``: as
    ``commit_in_tier`` takes them."""
    sizes = [0 if s.area is None else s.area.numel() for s in staged]
    parts = [part_size(size, config) for size in sizes]
    held: Held | None = None
    try:
        if safe is not None and (attempt := known_attempt(attempt, world_size, barrier)) is not None:
            copy = tier.copy_of(durable)
            record = Handoff(durable.uri(), "/" + copy.key, attempt, rank, world_size, tier.keep,
                             tuple(StagedFile(s.name, s.tmp, s.final, size, part)
                                   for s, size, part in zip(staged, sizes, parts, strict=True)), drain)
            held = await off_loop(hand_off, tier, record)
            await off_loop(ensure_agent, tier)
            safe(CommitResult(copy.raw, attempt, world_size, len(staged), sum(sizes), time.time()))
        entries = []
        for s, part in zip(staged, parts, strict=True):
            assert s.area is not None
            entries.append(await hashed_entry(s.name, byte_view(s.area), part))

        async def write(writer: CheckpointWriter) -> None:
            for s in staged:
                await off_loop(os.replace, s.tmp, s.final)
            writer.record_written(tuple(entries))

        result = await commit_in_tier(tier, durable, write, rank, world_size, barrier, attempt, config, drain,
                                      metrics)
        if held is not None:
            held.done()
        if after is not None:
            await after()
        return result
    except BaseException as exc:
        if held is not None:
            log.warning("rank %d: committing %s in tier %s failed (%s); its node agent finishes it", rank,
                        durable.raw, tier.root, exc)
            held.release()
        raise
    finally:
        for s in staged:
            s.area = None
        if held is None:  # else published, or the agent's
            discard(staged)
