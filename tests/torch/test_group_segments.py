"""How a DCP load shared over a process group splits the ranks' byte ranges
(``fastckpt.torch.dcp.group_read.segments``): every byte a rank needs lies in exactly one segment that names it, each
segment is fetched by one of its ranks, and the fetching is spread over them."""

from __future__ import annotations

from collections import Counter

import pytest

pytest.importorskip("torch")

from fastckpt.torch.dcp import group_read as group_dcp
from fastckpt.torch.dcp.group_read import batches, segments

CHUNK = 1 << 20


def covered(segs: list[group_dcp.Segment], rank: int, name: str) -> list[tuple[int, int]]:
    """The ranges of ``name`` that segments naming ``rank`` cover, merged."""
    out: list[tuple[int, int]] = []
    for s in sorted((s for s in segs if s.name == name and rank in s.needers), key=lambda s: s.start):
        if out and out[-1][1] == s.start:
            out[-1] = (out[-1][0], s.end)
        else:
            out.append((s.start, s.end))
    return out


def test_replicas_share_the_fetching_evenly() -> None:
    """4 ranks needing the same 8 MiB file fetch 2 MiB of it each."""
    segs = segments([[("a", 0, 8 * CHUNK)]] * 4, {"a": CHUNK})
    assert [(s.start, s.end, s.owner) for s in segs] == [(i * 2 * CHUNK, (i + 1) * 2 * CHUNK, i) for i in range(4)]
    assert all(s.needers == (0, 1, 2, 3) for s in segs)


def test_overlapping_ranges_are_cut_at_every_boundary() -> None:
    """Rank 0 needs all of a 10-chunk file, rank 1 chunks 2-6 and rank 2 chunks 5-10 (its last one short): each
    rank's ranges are covered exactly, by segments cut at chunk boundaries, and no byte is fetched twice."""
    size = 9 * CHUNK + 123
    spans = [[("f", 0, size)], [("f", 2 * CHUNK, 6 * CHUNK)], [("f", 5 * CHUNK, size)]]
    segs = segments(spans, {"f": CHUNK})
    for rank, mine in enumerate(spans):
        assert covered(segs, rank, "f") == [(s, e) for _, s, e in mine]
    assert sum(s.end - s.start for s in segs) == size  # each byte in one segment: fetched once
    assert all(s.start % CHUNK == 0 and s.owner in s.needers for s in segs)
    assert set(Counter(s.owner for s in segs)) == {0, 1, 2}


def test_long_shared_ranges_are_cut_and_batched(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(group_dcp, "SEGMENT", 4 * CHUNK)
    monkeypatch.setattr(group_dcp, "BATCH", 8 * CHUNK)
    segs = segments([[("a", 0, 32 * CHUNK)], [("a", 0, 32 * CHUNK)]], {"a": CHUNK})
    assert all(s.end - s.start == 4 * CHUNK for s in segs) and len(segs) == 8
    assert Counter(s.owner for s in segs) == {0: 4, 1: 4}
    assert [len(b) for b in batches(segs)] == [4, 4]  # each rank fetches BATCH bytes a round


def test_every_rank_fetches_in_every_round_when_each_loads_its_own_shard(monkeypatch: pytest.MonkeyPatch) -> None:
    """Four ranks, a shard each (nothing shared): each round has a segment of every rank, none idle."""
    monkeypatch.setattr(group_dcp, "SEGMENT", 2 * CHUNK)
    monkeypatch.setattr(group_dcp, "BATCH", 2 * CHUNK)
    rounds = batches(segments([[(f"s{r}", 0, 6 * CHUNK)] for r in range(4)], {f"s{r}": CHUNK for r in range(4)}))
    assert [sorted(s.owner for s in batch) for batch in rounds] == [[0, 1, 2, 3]] * 3


def test_batches_take_the_sets_of_ranks_in_turn(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two shards each loaded by two ranks: every batch holds work for both pairs, so neither waits on the other."""
    monkeypatch.setattr(group_dcp, "SEGMENT", 2 * CHUNK)
    monkeypatch.setattr(group_dcp, "BATCH", 4 * CHUNK)
    spans = [[("f", 0, 8 * CHUNK)], [("f", 8 * CHUNK, 16 * CHUNK)]] * 2
    for batch in batches(segments(spans, {"f": CHUNK})):
        assert {s.needers for s in batch} == {(0, 2), (1, 3)}
