"""DCP loads shared over a process group (``Reader(uri, group=pg)``): each byte range that several ranks need is read
from storage by one of them and sent to the others.

Every rank cuts its load plan into chunk-aligned spans as the reader does alone; the spans of all ranks are gathered,
and each file is cut at every rank's span boundaries into segments, each needed by a fixed set of ranks (and at
``SEGMENT`` bytes, so that a long shared range is fetched by several of them). A segment is fetched by the rank of
its set with the fewest bytes to fetch so far, checked there against the manifest's chunk digests, and sent to the
others of its set over the group's gloo twin, in one order every rank follows (none waits on one that waits on it);
receivers check every chunk again. Segments go in batches of about ``BATCH`` bytes, and a rank hands a span to the
planner as soon as all of its segments are in: memory stays near a batch plus the spans being filled, whatever the
checkpoint's size. A failure on any rank fails every rank with the same error.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import xxhash

from ..checkpoint.group import CHUNK, GroupCall
from ..engine.layout import Layout, read_layout
from ..engine.transfer import Transfer
from ..errors import CheckpointError, IntegrityError
from ..stores.base import Store
from ..tasks import gather_all

SEGMENT = 64 << 20
"""Longest segment: a range shared by several ranks is fetched by several of them, this much each at most."""
BATCH = 256 << 20
"""Bytes of segments fetched and exchanged in one round."""

Span = tuple[str, int, int]
"""(file name, start, end) of a chunk-aligned range of one file."""


@dataclass(frozen=True)
class Segment:
    """``[start, end)`` of file ``name``, needed by ``needers`` (group ranks), fetched from storage by ``owner``."""

    name: str
    start: int
    end: int
    needers: tuple[int, ...]
    owner: int


def segments(spans: list[list[Span]], chunk_sizes: dict[str, int]) -> list[Segment]:
    """Every rank's ``spans`` (by rank) cut into segments at all their boundaries, in file order, each owned by the
    rank among its needers with the fewest bytes owned so far (the lowest rank on a tie)."""
    events: dict[str, list[tuple[int, int, int]]] = defaultdict(list)  # name -> (position, +1 / -1, rank)
    for rank, mine in enumerate(spans):
        for name, start, end in mine:
            if end > start:
                events[name] += [(start, 1, rank), (end, -1, rank)]
    owned: Counter[int] = Counter()
    out: list[Segment] = []
    for name in sorted(events):
        chunk = chunk_sizes[name]
        active: Counter[int] = Counter()
        points = sorted(events[name])
        for i, (pos, delta, rank) in enumerate(points):
            active[rank] += delta
            nxt = points[i + 1][0] if i + 1 < len(points) else pos
            needers = tuple(sorted(r for r, n in active.items() if n > 0))
            if nxt <= pos or not needers:
                continue
            length = nxt - pos
            pieces = max(len(needers), -(-length // SEGMENT))  # one per needer at least, SEGMENT bytes at most
            step = -(-length // (pieces * chunk)) * chunk  # whole chunks
            for lo in range(pos, nxt, step):
                hi = min(nxt, lo + step)
                owner = min(needers, key=lambda r: (owned[r], r))
                owned[owner] += hi - lo
                out.append(Segment(name, lo, hi, needers, owner))
    return out


def batches(segs: list[Segment]) -> list[list[Segment]]:
    """``segs`` in order, in runs of about ``BATCH`` bytes."""
    out: list[list[Segment]] = [[]]
    size = 0
    for seg in segs:
        if size >= BATCH:
            out.append([])
            size = 0
        out[-1].append(seg)
        size += seg.end - seg.start
    return out


@dataclass
class Filling:
    """One of this rank's spans being assembled from segments; complete when ``missing`` reaches 0."""

    span: Any
    buf: bytearray = field(init=False)
    missing: int = field(init=False)

    def __post_init__(self) -> None:
        self.buf = bytearray(self.span.end - self.span.start)
        self.missing = len(self.buf)


class GroupRead:
    """One ``read_data`` of a ``Reader`` with ``group=``: run by every rank of the group at once."""

    def __init__(self, call: GroupCall, spans: list[Any], chunks: dict[str, tuple[str, ...]],
                 chunk_sizes: dict[str, int], file_key: Callable[[str], str], what: str) -> None:
        self.call, self.spans, self.chunks, self.sizes = call, spans, chunks, chunk_sizes
        self.file_key, self.what = file_key, what
        self.by_name: dict[str, list[int]] = defaultdict(list)
        for i, span in enumerate(spans):
            self.by_name[span.name].append(i)
        self.filling: dict[int, Filling] = {}

    async def plan(self) -> list[list[Segment]]:
        """Every rank's spans gathered and cut into batches of segments (the same on every rank)."""
        everyone = await self.call.gather([(s.name, s.start, s.end) for s in self.spans])
        return batches(segments([[tuple(s) for s in mine] for mine in everyone], self.sizes))

    async def fetch(self, store: Store, config: Any, batch: list[Segment]) -> dict[Segment, bytearray]:
        """The segments of ``batch`` this rank owns, read from storage and checked against their chunk digests."""
        mine = {seg: bytearray(seg.end - seg.start) for seg in batch if seg.owner == self.call.rank}
        transfer = Transfer(store, config)

        async def one(seg: Segment) -> None:
            got = await read_layout(transfer, self.file_key(seg.name), seg.start, Layout([mine[seg]]),
                                    self.sizes[seg.name])
            self.check(seg, [d.hex() for d in got], "read from storage")

        try:
            await gather_all(one(seg) for seg in mine)
        finally:
            transfer.close()
        return mine

    def check(self, seg: Segment, found: list[str], how: str) -> None:
        """IntegrityError unless ``found`` are the recorded digests of the chunks of ``seg``."""
        first, recorded = seg.start // self.sizes[seg.name], self.chunks.get(seg.name)
        if recorded is None:
            raise CheckpointError(f"{self.what}/{seg.name} has no chunk digests recorded; not written by this plugin")
        if found != list(recorded[first:first + len(found)]):
            raise IntegrityError(f"{self.what}/{seg.name}: bytes {seg.start}-{seg.end} {how} by rank {self.call.rank} "
                                 "do not match their recorded chunk digests")

    def exchange(self, batch: list[Segment], held: dict[Segment, bytearray]) -> str | None:
        """On a worker thread: each segment of ``batch`` sent by its owner to the other ranks that need it, in the
        same order on every rank; received segments are checked and added to ``held``. What went wrong here, if
        anything (the exchange goes on, so that the ranks stay in step)."""
        rank, error = self.call.rank, None
        for seg in batch:
            if len(seg.needers) < 2 or rank not in seg.needers:
                continue
            if rank == seg.owner:  # it holds the segment: a failed fetch was agreed on before the exchange
                data = torch.frombuffer(held[seg], dtype=torch.uint8)
                for peer in seg.needers:
                    for offset in range(0, len(data), CHUNK) if peer != rank else ():
                        dist.send(data[offset:offset + CHUNK], dst=self.call.global_rank(peer), group=self.call.gloo)
                continue
            buf = bytearray(seg.end - seg.start)
            tensor = torch.frombuffer(buf, dtype=torch.uint8)
            for offset in range(0, len(buf), CHUNK):
                dist.recv(tensor[offset:offset + CHUNK], src=self.call.global_rank(seg.owner), group=self.call.gloo)
            try:
                self.check(seg, self._digests(seg, buf), "received")
                held[seg] = buf
            except IntegrityError as exc:
                error = error or str(exc)
        return error

    def _digests(self, seg: Segment, buf: bytearray) -> list[str]:
        cs, view = self.sizes[seg.name], memoryview(buf)
        return [xxhash.xxh3_128_hexdigest(view[i:i + cs]) for i in range(0, len(view), cs)]

    def place(self, held: dict[Segment, bytearray]) -> list[Filling]:
        """Copy the segments held into the spans of this rank that cover them; the spans now complete."""
        done: list[Filling] = []
        for seg, buf in held.items():
            if self.call.rank not in seg.needers:
                continue
            for i in self.by_name[seg.name]:
                span = self.spans[i]
                if seg.end <= span.start or seg.start >= span.end:
                    continue
                filling = self.filling.setdefault(i, Filling(span))
                lo, hi = max(seg.start, span.start), min(seg.end, span.end)
                filling.buf[lo - span.start:hi - span.start] = memoryview(buf)[lo - seg.start:hi - seg.start]
                filling.missing -= hi - lo
                if not filling.missing:
                    done.append(self.filling.pop(i))
        return done
