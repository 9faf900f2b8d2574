"""DCP loads shared over a process group (``Reader(uri, group=pg)``): each byte range that several ranks need is read
from storage by one of them and sent to the others.

Every rank cuts its load plan into chunk-aligned spans as the reader does alone; the spans of all ranks are gathered,
and each file is cut at every rank's span boundaries into segments, each needed by a fixed set of ranks (and at
``SEGMENT`` bytes, so that a long shared range is fetched by several of them). A segment is fetched by the rank of
its set with the fewest bytes to fetch so far, checked there against the manifest's chunk digests, and sent to the
others of its set over the group's gloo twin, ``CHUNK`` bytes at a time, in one order every rank follows (none waits
on one that waits on it); receivers check every chunk again. Bytes land in the spans' layouts, as when a rank reads
alone (whole stored tensors straight into their destinations). Segments go in rounds in which each rank fetches about
``BATCH`` bytes, and a rank hands a span to the planner as soon as all of its segments are in: memory stays at the
spans being filled plus one ``CHUNK`` buffer. A failure on any rank fails every rank with the same error.
"""

from __future__ import annotations

import itertools
from collections import Counter, defaultdict
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from typing import Any

from ..._loop import BackgroundLoop
from ...checkpoint.group import GroupCall, chunk_buffer, recv_span, send_span
from ...engine.layout import Layout, read_layout
from ...engine.transfer import Transfer
from ...errors import CheckpointError, IntegrityError
from ...integrity import ChunkHasher
from ...stores.base import Store
from ...tasks import gather_all

__all__ = ["BATCH", "SEGMENT", "Filling", "GroupRead", "Segment", "Span", "batches", "segments"]

SEGMENT = 64 << 20
"""Longest segment: a range shared by several ranks is fetched by several of them, this much each at most."""
BATCH = 128 << 20
"""Bytes of segments one rank fetches in one round (then the round's segments are exchanged)."""

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
    """``segs`` in rounds in which each rank fetches about ``BATCH`` bytes, the segments of different sets of ranks
    taken in turn (each set in file order): every round keeps as many ranks fetching as there is work for (a round
    of a fixed size overall left most ranks idle where each loads a shard of its own)."""
    by_set: dict[tuple[int, ...], list[Segment]] = defaultdict(list)
    for seg in segs:
        by_set[seg.needers].append(seg)
    turns = [seg for round_ in itertools.zip_longest(*by_set.values()) for seg in round_ if seg is not None]
    out: list[list[Segment]] = [[]]
    fetching: Counter[int] = Counter()
    for seg in turns:
        if fetching[seg.owner] >= BATCH:
            out.append([])
            fetching.clear()
        out[-1].append(seg)
        fetching[seg.owner] += seg.end - seg.start
    return out


@dataclass
class Filling:
    """One of this rank's spans being filled from segments: its layout (destination tensors where the reader can
    receive straight into them, scratch elsewhere); complete when ``missing`` reaches 0."""

    span: Any
    layout: Layout = field(init=False)
    missing: int = field(init=False)

    def __post_init__(self) -> None:
        self.layout = self.span.layout()
        self.missing = self.layout.size

    def at(self, seg: Segment) -> int:
        """Where ``seg`` starts in this span's layout (segments are cut at every span boundary: each lies inside
        the spans it touches)."""
        return seg.start - self.span.start


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

    def fillings(self, seg: Segment) -> list[Filling]:
        """The spans of this rank that ``seg`` falls in (one, or two where this rank's spans overlap)."""
        out = []
        for i in self.by_name[seg.name]:
            span = self.spans[i]
            if seg.start < span.end and span.start < seg.end:
                out.append(self.filling.setdefault(i, Filling(span)))
        return out

    async def fetch(self, store: Store, config: Any, batch: list[Segment]) -> None:
        """The segments of ``batch`` this rank owns, read from storage into its spans and checked against their
        chunk digests."""
        transfer = Transfer(store, config)

        async def one(seg: Segment) -> None:
            first, *others = self.fillings(seg)
            got = await read_layout(transfer, self.file_key(seg.name), seg.start,
                                    Layout(first.layout.pieces(first.at(seg), seg.end - seg.start)),
                                    self.sizes[seg.name])
            self.check(seg, [d.hex() for d in got], "read from storage")
            self._filled(seg, first, others)

        try:
            await gather_all(one(seg) for seg in batch if seg.owner == self.call.rank)
        finally:
            transfer.close()

    @staticmethod
    def _filled(seg: Segment, first: Filling, others: list[Filling]) -> None:
        """``seg`` is in ``first``: copied into the other spans it falls in too; each counts it as filled."""
        if others:
            data = memoryview(bytearray(seg.end - seg.start))
            first.layout.gather(first.at(seg), data)
            for filling in others:
                filling.layout.scatter(filling.at(seg), data)
        for filling in (first, *others):
            filling.missing -= seg.end - seg.start

    def check(self, seg: Segment, found: list[str], how: str) -> None:
        """IntegrityError unless ``found`` are the recorded digests of the chunks of ``seg``."""
        first, recorded = seg.start // self.sizes[seg.name], self.chunks.get(seg.name)
        if recorded is None:
            raise CheckpointError(f"{self.what}/{seg.name} has no chunk digests recorded; not written by this plugin")
        if found != list(recorded[first:first + len(found)]):
            raise IntegrityError(f"{self.what}/{seg.name}: bytes {seg.start}-{seg.end} {how} by rank {self.call.rank} "
                                 "do not match their recorded chunk digests")

    def exchange(self, batch: list[Segment]) -> str | None:
        """On a worker thread: each segment of ``batch`` sent by its owner to the other ranks that need it, in the
        same order on every rank, ``CHUNK`` bytes at a time; received segments are checked and placed in this
        rank's spans. What went wrong here, if anything (the exchange goes on, so that the ranks stay in step)."""
        rank, error = self.call.rank, None
        buffer = chunk_buffer()
        for seg in batch:
            if len(seg.needers) < 2 or rank not in seg.needers:
                continue
            first, *others = self.fillings(seg)
            offset, length = first.at(seg), seg.end - seg.start
            if rank == seg.owner:  # the segment is in its span: a failed fetch was agreed on before the exchange
                for peer in seg.needers:
                    if peer != rank:
                        send_span(self.call, peer, offset, length, first.layout.gather, buffer)
                continue
            hasher = ChunkHasher(self.sizes[seg.name])

            def take(at: int, piece: memoryview, layout: Layout = first.layout, hasher: ChunkHasher = hasher) -> None:
                layout.scatter(at, piece)
                hasher.update(piece)

            recv_span(self.call, seg.owner, offset, length, take, buffer)
            try:
                self.check(seg, [d.hex() for d in hasher.finish()], "received")
            except IntegrityError as exc:
                error = error or str(exc)
            self._filled(seg, first, others)
        return error

    def complete(self) -> list[Filling]:
        """The spans now filled, taken out of the ones in progress."""
        done = [i for i, f in self.filling.items() if not f.missing]
        return [self.filling.pop(i) for i in done]

    def run(self, opened: Callable[[], AbstractAsyncContextManager[tuple[Any, Any, Store]]],
            hand_over: Callable[[Any, Layout], None]) -> None:
        """From the reader's thread: batch after batch, the segments this rank owns fetched (through the store
        ``opened()`` yields as (uri, config, store)), every rank's outcome agreed on, the segments exchanged, and
        each span they complete handed over; a failure on any rank raised on every rank, in step."""
        loop = BackgroundLoop.get()

        async def fetch(batch: list[Segment]) -> None:
            async with opened() as (_, config, store):
                await self.fetch(store, config, batch)

        for batch in loop.run(self.plan()):
            error = None
            try:
                loop.run(fetch(batch))
            except Exception as exc:
                error = f"{type(exc).__name__}: {exc}"
            loop.run(self.call.agree(error))
            error = loop.run(self.call.run(lambda b=batch: self.exchange(b)))
            try:
                for filling in self.complete():
                    hand_over(filling.span, filling.layout)
            except Exception as exc:
                error = error or f"{type(exc).__name__}: {exc}"
            loop.run(self.call.agree(error))
