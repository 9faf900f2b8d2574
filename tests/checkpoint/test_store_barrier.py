"""The store barrier in groups: leaders combine their members' manifests, the root reads one object per group,
readers read the group objects; missing members, dead leaders and damaged group objects fail or fall back clearly.

Ranks are tasks of this process over one store client (multi-process runs of the same barrier are in
test_checkpoint_ranks.py); request counts come from a counting wrapper over the real backend.
"""

from __future__ import annotations

import json
from collections import Counter

import pytest

import fastckpt
from fastckpt import open_store, parse_uri
from fastckpt.checkpoint import BarrierTimeoutError, CommitResult, StoreBarrier
from fastckpt.checkpoint.manifest import group_key, marker_key, meta_prefix
from fastckpt.checkpoint.reader import load
from fastckpt.stores.base import Store
from harness.faults import FaultInjectingStore
from harness.uris import below

from ..conftest import small_config
from .test_checkpoint import corrupt_object, keys_below, payload, write_ranks

WORLD, GROUP = 20, 4


def barrier(timeout: float = 20.0) -> StoreBarrier:
    return StoreBarrier(timeout=timeout, poll_interval=0.01, max_poll_interval=0.1, group_size=GROUP)


class Counting(FaultInjectingStore):
    """Counts the requests that reach the store by operation (the inner store belongs to the caller)."""

    def __init__(self, inner: Store) -> None:
        super().__init__(inner)
        self.counts: Counter[str] = Counter()

    async def fault(self, op: str, key: str) -> None:
        self.counts[op] += 1

    async def close(self) -> None:
        """The caller closes the inner store."""


async def test_grouped_commit_on_every_backend(store_uri: str, tmp_path) -> None:
    """20 ranks in groups of 4: one group object per group, the marker records the grouping, and the
    checkpoint reads back exactly (the readers take the manifests from the group objects)."""
    uri = below(store_uri, "step-1")
    results = await write_ranks(uri, tmp_path, contributors=range(WORLD), barrier=barrier(), world=WORLD,
                                names=lambda r: [f"shard-{r:05d}.bin"])
    assert all(isinstance(r, CommitResult) for r in results), results
    keys = await keys_below(uri)
    assert [k for k in keys if "/group-" in k] == [f".fastckpt/a1/group-{f:05d}.json" for f in range(0, WORLD, GROUP)]
    parsed = parse_uri(uri)
    async with open_store(parsed, config=small_config()) as store:
        marker = json.loads(await store.get_range(marker_key(parsed.key), 0, 1 << 20))
    assert marker["group_size"] == GROUP and marker["world_size"] == WORLD
    out = tmp_path / "out"
    await fastckpt.download_checkpoint_async(uri, out, config=small_config())
    for r in range(WORLD):
        assert (out / f"shard-{r:05d}.bin").read_bytes() == payload("step-1", "a1", r)
    assert (await fastckpt.verify_async(uri, config=small_config())).ok


async def test_requests_stay_flat_and_readers_read_one_object_per_group(fast_uri: str, tmp_path) -> None:
    """64 ranks in groups of 16: the root reads a group object per group, not a manifest per rank; the ranks
    together make a few requests each; a reader of the checkpoint reads 4 group objects, not 64 manifests."""
    uri, world = below(fast_uri, "step-1"), 64
    inner = open_store(uri, config=small_config())
    counters = [Counting(inner) for _ in range(world)]
    try:
        results = await write_ranks(uri, tmp_path, contributors=[], barrier=StoreBarrier(
            timeout=20, poll_interval=0.01, max_poll_interval=0.2), world=world, stores=counters)
        assert all(isinstance(r, CommitResult) for r in results), results
        root = sum(counters[0].counts.values())
        total = sum(sum(c.counts.values()) for c in counters)
        # the root: its group's 15 reads and 3 group objects, plus its own writes, listing, marker, outcome
        assert root <= world // 16 + 15 + 12, counters[0].counts
        assert total / world <= 5, Counter(op for c in counters for op in c.counts.elements())
        reader = Counting(inner)
        ckpt = await load(reader, parse_uri(uri), allow_uncommitted=False)
        assert not ckpt.problems and ckpt.info.world_size == world
        assert reader.counts["get_range"] == 1 + world // 16, reader.counts  # the marker and 4 group objects
    finally:
        await inner.close()


@pytest.mark.parametrize("absent", [6, 4], ids=["member", "leader"])
async def test_missing_rank_fails_every_rank_naming_it(fast_uri: str, tmp_path, absent: int) -> None:
    """A member that never arrives is reported by its leader; a leader that never arrives leaves no group object,
    and the root reads that group's members itself: either way every rank fails naming the missing rank."""
    uri = below(fast_uri, "step-1")
    results = await write_ranks(uri, tmp_path, contributors=[0], barrier=barrier(timeout=0.5), world=12,
                                absent=(absent,))
    assert all(isinstance(r, BarrierTimeoutError) for r in results), results
    assert results[0].missing == [absent]
    assert all(f"rank {absent} of 12 never arrived" in str(r) for r in results)
    assert ".fastckpt/COMMITTED" not in await keys_below(uri)


async def test_damaged_group_object_falls_back_to_the_rank_manifests(fast_uri: str, tmp_path) -> None:
    """A group object changed after the commit is not trusted: its ranks' manifests are read instead, and a
    manifest that does not match the marker is still reported."""
    uri = below(fast_uri, "step-1")
    results = await write_ranks(uri, tmp_path, contributors=range(WORLD), barrier=barrier(), world=WORLD,
                                names=lambda r: [f"shard-{r:05d}.bin"])
    assert all(isinstance(r, CommitResult) for r in results), results
    parsed = parse_uri(uri)
    rel = group_key(meta_prefix(parsed.key), "a1", GROUP)[len(parsed.key) + 1:]
    await corrupt_object(uri, rel)
    assert (await fastckpt.verify_async(uri, config=small_config())).ok
    await corrupt_object(uri, ".fastckpt/a1/rank-00005.json")
    report = await fastckpt.verify_async(uri, config=small_config())
    assert not report.ok and [b.name for b in report.bad] == [".fastckpt/a1/rank-00005.json"]
