"""Atomic multi-rank checkpoints with ranks inside this process: writer, barriers, readers, gc.

Multi-process ranks (store and torch.distributed barriers, kill -9) are in test_checkpoint_ranks.py,
the Ray barrier in test_checkpoint_ray.py.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time

import pytest

import fastckpt
from fastckpt import CheckpointError, IntegrityError, open_store, parse_uri
from fastckpt.checkpoint import (
    BarrierTimeoutError,
    CommitMarker,
    InProcessBarrier,
    RankManifest,
    StoreBarrier,
    SyncCheckpointWriter,
    attempt_from_env,
)
from fastckpt.checkpoint.barrier import HandedBarrier
from fastckpt.checkpoint.manifest import check_name, digest_of, marker_key, meta_prefix, rank_key
from fastckpt.uri import StorageURI
from harness.uris import below

from ..conftest import small_config

WORLD = 8
SUBSETS = {"all": list(range(WORLD)), "even": [2, 4, 6], "five": [5]}


def payload(name: str, attempt: str, rank: int, index: int = 0, size: int = 2000) -> bytes:
    """Distinct bytes per checkpoint, attempt, rank and file."""
    seed = f"{name}/{attempt}/{rank}/{index}".encode()
    return (seed * (size // len(seed) + 1))[:size]


def make_barrier(kind: str, timeout: float = 10.0):
    """A fresh barrier of ``kind`` shared by the ranks of one checkpoint."""
    if kind == "inprocess":
        return InProcessBarrier(timeout=timeout)
    return StoreBarrier(timeout=timeout, poll_interval=0.01, max_poll_interval=0.1)


async def write_ranks(uri: str, tmp_path, *, contributors, barrier, attempt: str | None = "a1",
                      world: int = WORLD, fail: int | None = None, absent: tuple[int, ...] = (),
                      names=None, stores=None) -> list:
    """Run ``world`` ranks as tasks; return each rank's CommitResult or exception.

    Contributing rank r writes ``names(r)`` (default one file and one nested file); rank ``fail``
    raises inside its block; ranks in ``absent`` never show up; rank r writes through ``stores[r]`` when given.
    """
    name = parse_uri(uri).key.rsplit("/", 1)[-1]
    store = open_store(uri, config=small_config())  # one client for all ranks of this process

    async def rank(r: int):
        async with fastckpt.CheckpointWriter(uri, rank=r, world_size=world, barrier=barrier, attempt=attempt,
                                             config=small_config(), store=stores[r] if stores else store) as w:
            if r in contributors:
                files = names(r) if names else [f"model-{r:05d}.safetensors", f"optim/rank_{r:02d}.pt"]
                for i, fname in enumerate(files):
                    src = tmp_path / f"src-{name}-{w.attempt}-{r}-{i}"
                    src.write_bytes(payload(name, w.attempt, r, i))
                    await w.put_file(src, fname)
            if r == fail:
                raise ValueError(f"rank {r} broke")
        return w.result

    try:
        return await asyncio.gather(*(rank(r) for r in range(world) if r not in absent), return_exceptions=True)
    finally:
        await store.close()


async def keys_below(uri: str) -> list[str]:
    parsed = parse_uri(uri)
    async with open_store(parsed, config=small_config()) as store:
        return sorted([m.key[len(parsed.key) + 1:] async for m in store.list(parsed.key)])


async def corrupt_object(uri: str, rel: str) -> None:
    """Flip one byte in the middle of object ``rel`` below ``uri`` (keeping its metadata)."""
    parsed = parse_uri(uri)
    async with open_store(parsed, config=small_config()) as store:
        key = parsed.join(rel)
        meta = await store.head(key)
        data = bytearray(await store.get_range(key, 0, meta.size))
        data[len(data) // 2] ^= 0x01
        await store.put(key, bytes(data), metadata=meta.metadata)


# ----------------------------------------------------------------------------- across every backend


@pytest.mark.parametrize("kind", ["inprocess", "store"])
async def test_eight_ranks_any_subset_commit(store_uri: str, tmp_path, kind: str) -> None:
    """8 ranks; all, ranks {2,4,6} or only rank 5 contribute files; the others commit empty manifests."""
    for subset, contributors in SUBSETS.items():
        uri = below(store_uri, f"{kind}-{subset}")
        results = await write_ranks(uri, tmp_path, contributors=contributors, barrier=make_barrier(kind))
        assert all(isinstance(r, fastckpt.checkpoint.CommitResult) for r in results), results
        assert {(r.attempt, r.files, r.world_size) for r in results} == {("a1", 2 * len(contributors), WORLD)}
        keys = await keys_below(uri)
        assert [k for k in keys if k.startswith(".fastckpt/a1/rank-")] == [
            f".fastckpt/a1/rank-{r:05d}.json" for r in range(WORLD)]
        assert ".fastckpt/COMMITTED" in keys
        out = tmp_path / f"out-{kind}-{subset}"
        got = await fastckpt.download_checkpoint_async(uri, out, config=small_config())
        assert len(got) == 2 * len(contributors)
        for r in contributors:
            assert (out / f"model-{r:05d}.safetensors").read_bytes() == payload(f"{kind}-{subset}", "a1", r, 0)
            assert (out / "optim" / f"rank_{r:02d}.pt").read_bytes() == payload(f"{kind}-{subset}", "a1", r, 1)
        if subset == "all":
            report = await fastckpt.verify_async(uri, config=small_config())
            assert report.ok and report.files == 2 * len(contributors) and report.bad == []
    infos = await fastckpt.list_checkpoints_async(store_uri)
    assert [(i.name, i.state, i.world_size) for i in infos] == [
        (f"{kind}-{s}", "committed", WORLD) for s in sorted(SUBSETS)]


async def test_corrupt_byte_is_reported_and_download_fails(store_uri: str, tmp_path) -> None:
    uri = below(store_uri, "step-1")
    await write_ranks(uri, tmp_path, contributors=[1, 3], barrier=make_barrier("inprocess"), world=4)
    await corrupt_object(uri, "optim/rank_03.pt")
    report = await fastckpt.verify_async(uri, config=small_config())
    assert not report.ok
    assert [b.name for b in report.bad] == ["optim/rank_03.pt"]
    assert "digest mismatch" in report.bad[0].reason
    with pytest.raises(IntegrityError, match=r"rank_03\.pt"):
        await fastckpt.download_checkpoint_async(uri, tmp_path / "out", config=small_config())


async def test_stale_files_of_dead_attempt_are_ignored(store_uri: str, tmp_path) -> None:
    """Attempt a1 dies (rank 2 fails) after writing files; a2 rewrites some names. Readers see a2 only."""
    uri = below(store_uri, "step-7")
    results = await write_ranks(uri, tmp_path, contributors=[0, 1, 2, 3], barrier=make_barrier("store"),
                                attempt="a1", world=4, fail=2)
    assert all(isinstance(r, CheckpointError) for r in results[:2] + results[3:]), results
    assert all("rank 2 failed: ValueError: rank 2 broke" in str(r) for r in results[:2] + results[3:])
    assert isinstance(results[2], ValueError)
    assert ".fastckpt/COMMITTED" not in await keys_below(uri)
    assert await fastckpt.latest_async(store_uri) is None
    with pytest.raises(CheckpointError, match="not committed"):
        await fastckpt.open_checkpoint_async(uri)

    results = await write_ranks(uri, tmp_path, contributors=[1, 3], barrier=make_barrier("store"),
                                attempt="a2", world=4)
    assert all(r.attempt == "a2" for r in results)
    ckpt = await fastckpt.open_checkpoint_async(uri)
    assert ckpt.info.attempt == "a2"
    assert sorted(ckpt.files) == ["model-00001.safetensors", "model-00003.safetensors", "optim/rank_01.pt",
                                  "optim/rank_03.pt"]
    keys = await keys_below(uri)
    assert "model-00000.safetensors" in keys  # left by a1, ignored by readers
    out = tmp_path / "out"
    await fastckpt.download_checkpoint_async(uri, out, config=small_config())
    assert sorted(p.name for p in out.iterdir()) == ["model-00001.safetensors", "model-00003.safetensors", "optim"]
    assert (out / "model-00001.safetensors").read_bytes() == payload("step-7", "a2", 1, 0)
    assert (await fastckpt.verify_async(uri, config=small_config())).ok

    report = await fastckpt.gc_async(store_uri, older_than=0, config=small_config())
    assert "model-00000.safetensors" in [k.rsplit("/", 1)[-1] for k in report.removed]
    keys = await keys_below(uri)
    assert not any(k.startswith(".fastckpt/a1/") for k in keys)
    assert sorted(k for k in keys if not k.startswith(".fastckpt/")) == sorted(ckpt.files)
    assert (await fastckpt.verify_async(uri, config=small_config())).ok


# ----------------------------------------------------------------------------- protocol rules (memory, local)


async def test_exception_in_block_commits_nothing(fast_uri: str, tmp_path) -> None:
    uri = below(fast_uri, "step-1")
    results = await write_ranks(uri, tmp_path, contributors=SUBSETS["all"], barrier=make_barrier("inprocess"),
                                fail=6)
    assert isinstance(results[6], ValueError)
    for r, res in enumerate(results):
        if r != 6:
            assert isinstance(res, CheckpointError) and "rank 6 failed" in str(res), res
    assert ".fastckpt/COMMITTED" not in await keys_below(uri)
    infos = await fastckpt.list_checkpoints_async(fast_uri)
    assert [(i.name, i.state) for i in infos] == [("step-1", "uncommitted")]


async def test_same_file_from_two_ranks_is_refused(fast_uri: str, tmp_path) -> None:
    uri = below(fast_uri, "step-1")
    results = await write_ranks(uri, tmp_path, contributors=[0, 2, 3], barrier=make_barrier("store"), world=4,
                                names=lambda r: ["shared.bin"] if r in (2, 3) else ["own.bin"])
    assert all(isinstance(r, CheckpointError) for r in results), results
    # Refused at the commit ("'shared.bin' by ranks 2 and 3") or, when the second rank's create-if-absent
    # write finds the first one's file, at that write; either way every rank names the file.
    assert all("shared.bin" in str(r) for r in results), results
    assert ".fastckpt/COMMITTED" not in await keys_below(uri)


async def test_same_name_twice_on_one_rank(fast_uri: str, tmp_path) -> None:
    src = tmp_path / "f"
    src.write_bytes(b"x")
    async with fastckpt.CheckpointWriter(below(fast_uri, "c"), config=small_config()) as w:
        await w.put_file(src, "a/b.bin")
        with pytest.raises(CheckpointError, match="twice"):
            await w.put_file(src, "a//b.bin/")
    assert w.result is not None and w.result.files == 1


async def test_refused_handed_rank_logs_no_failure_report(fast_uri: str, tmp_path, caplog) -> None:
    """A rank writing through a HandedBarrier (the DCP plugin's) whose save is refused because the checkpoint is
    committed raises that, and logs nothing about reporting to a barrier that carries no failures (the plugin
    reports them)."""
    uri = below(fast_uri, "step-1")
    (tmp_path / "f").write_bytes(b"first")
    async with fastckpt.CheckpointWriter(uri, config=small_config(), attempt="first") as w:
        await w.put_file(tmp_path / "f", "f")
    with pytest.raises(CheckpointError, match="already committed"):
        async with fastckpt.CheckpointWriter(uri, rank=1, world_size=2, attempt="again", config=small_config(),
                                             barrier=HandedBarrier({})):
            pass
    assert not [r for r in caplog.records if "could not report" in r.getMessage()], caplog.text


@pytest.mark.parametrize("bad", ["../x", "a/../b", ".fastckpt/COMMITTED", "", "/"])
def test_unsafe_names_are_rejected(bad: str) -> None:
    with pytest.raises(ValueError):
        check_name(bad)


async def test_committing_a_name_twice_is_refused(fast_uri: str, tmp_path) -> None:
    uri = below(fast_uri, "step-1")
    src = tmp_path / "f"
    src.write_bytes(b"first")
    late = fastckpt.CheckpointWriter(uri, config=small_config(), attempt="late")
    await late.__aenter__()  # entered before the first commit, commits after it
    async with fastckpt.CheckpointWriter(uri, config=small_config(), attempt="first") as w:
        await w.put_file(src, "f")
    with pytest.raises(CheckpointError, match="already committed"):
        async with fastckpt.CheckpointWriter(uri, config=small_config()):
            pass
    with pytest.raises(CheckpointError, match="committed by another writer"):
        await late.__aexit__(None, None, None)
    ckpt = await fastckpt.open_checkpoint_async(uri)
    assert ckpt.info.attempt == "first"


async def test_stale_manifests_of_another_attempt_do_not_count(fast_uri: str, tmp_path) -> None:
    """Every rank of dead attempt a1 left a manifest; in attempt a2 rank 3 never arrives -> timeout naming 3."""
    uri = below(fast_uri, "step-1")
    parsed = parse_uri(uri)
    async with open_store(parsed) as store:
        for r in range(4):
            stale = RankManifest("a1", r, 4)
            await store.put(rank_key(meta_prefix(parsed.key), "a1", r), stale.encode())
    results = await write_ranks(uri, tmp_path, contributors=[0, 1], barrier=make_barrier("store", timeout=0.5),
                                attempt="a2", world=4, absent=(3,))
    assert all(isinstance(r, BarrierTimeoutError) for r in results), results
    assert results[0].missing == [3]
    assert all("rank 3 of 4 never arrived" in str(r) for r in results)
    assert ".fastckpt/COMMITTED" not in await keys_below(uri)


@pytest.mark.parametrize("kind", ["inprocess", "store"])
async def test_barrier_timeout_names_missing_ranks(fast_uri: str, tmp_path, kind: str) -> None:
    uri = below(fast_uri, "step-1")
    results = await write_ranks(uri, tmp_path, contributors=[0], barrier=make_barrier(kind, timeout=0.3),
                                world=6, absent=(2, 5))
    assert all(isinstance(r, BarrierTimeoutError) for r in results), results
    assert results[0].missing == [2, 5]
    assert all("ranks 2, 5 of 6 never arrived" in str(r) for r in results)


async def test_attempt_agreed_through_barrier(fast_uri: str, tmp_path, monkeypatch) -> None:
    for var in ("FASTCKPT_ATTEMPT", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID"):
        monkeypatch.delenv(var, raising=False)
    results = await write_ranks(below(fast_uri, "a"), tmp_path, contributors=[1], attempt=None,
                                barrier=make_barrier("inprocess"), world=4)
    assert len({r.attempt for r in results}) == 1
    results = await write_ranks(below(fast_uri, "b"), tmp_path, contributors=[1], attempt=None,
                                barrier=make_barrier("store"), world=4)
    assert all(isinstance(r, CheckpointError) and "attempt=" in str(r) for r in results), results
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job42")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "3")
    results = await write_ranks(below(fast_uri, "b"), tmp_path, contributors=[1], attempt=None,
                                barrier=make_barrier("store"), world=4)
    assert {r.attempt for r in results} == {"job42-r3"}


def test_attempt_from_env() -> None:
    assert attempt_from_env({}) is None
    assert attempt_from_env({"FASTCKPT_ATTEMPT": "run-7"}) == "run-7"
    assert attempt_from_env({"TORCHELASTIC_RUN_ID": "none"}) is None
    assert attempt_from_env({"TORCHELASTIC_RUN_ID": "abc", "TORCHELASTIC_RESTART_COUNT": "2"}) == "abc-r2"
    assert attempt_from_env({"SLURM_JOB_ID": "991"}) == "slurm-991-r0"
    assert attempt_from_env({"TORCHELASTIC_RUN_ID": "a b/c"}) == "a-b-c-r0"
    with pytest.raises(ValueError):
        attempt_from_env({"FASTCKPT_ATTEMPT": "../x"})


async def test_uncommitted_is_refused_unless_allowed(fast_uri: str, tmp_path) -> None:
    uri = below(fast_uri, "step-1")
    await write_ranks(uri, tmp_path, contributors=[0, 1], barrier=make_barrier("inprocess"), world=2, fail=1)
    with pytest.raises(CheckpointError, match="not committed"):
        await fastckpt.download_checkpoint_async(uri, tmp_path / "out")
    ckpt = await fastckpt.open_checkpoint_async(uri, allow_uncommitted=True)
    assert ckpt.info.state == "uncommitted" and sorted(ckpt.files) == ["model-00000.safetensors", "optim/rank_00.pt"]
    got = await fastckpt.download_checkpoint_async(uri, tmp_path / "out", allow_uncommitted=True)
    assert len(got) == 2
    # a plain upload (no manifests at all) reads as its objects
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "w.bin").write_bytes(b"weights")
    await fastckpt.upload_async(plain, below(fast_uri, "plain"), config=small_config())
    with pytest.raises(CheckpointError):
        await fastckpt.open_checkpoint_async(below(fast_uri, "plain"))
    await fastckpt.download_checkpoint_async(below(fast_uri, "plain"), tmp_path / "p", allow_uncommitted=True)
    assert (tmp_path / "p" / "w.bin").read_bytes() == b"weights"


async def test_latest_list_and_corrupt_metadata(fast_uri: str, tmp_path) -> None:
    for name in ("step-2", "step-1", "step-3"):  # committed in this order
        await write_ranks(below(fast_uri, name), tmp_path, contributors=[0], barrier=make_barrier("inprocess"),
                          world=2)
    await write_ranks(below(fast_uri, "step-4"), tmp_path, contributors=[0], barrier=make_barrier("inprocess"),
                      world=2, fail=0)
    assert (await fastckpt.latest_async(fast_uri)).endswith("/runs/step-3")
    infos = {i.name: i for i in await fastckpt.list_checkpoints_async(fast_uri)}
    assert {n: i.state for n, i in infos.items()} == {"step-1": "committed", "step-2": "committed",
                                                      "step-3": "committed", "step-4": "uncommitted"}
    assert infos["step-4"].attempt == "a1" and infos["step-4"].world_size == 2
    assert infos["step-1"].committed_at < infos["step-3"].committed_at
    # a manifest changed after the commit: verify names it, open refuses
    await corrupt_object(below(fast_uri, "step-2"), ".fastckpt/a1/rank-00000.json")
    report = await fastckpt.verify_async(below(fast_uri, "step-2"))
    assert not report.ok and [b.name for b in report.bad] == [".fastckpt/a1/rank-00000.json"]
    with pytest.raises(CheckpointError, match="corrupt"):
        await fastckpt.open_checkpoint_async(below(fast_uri, "step-2"))
    # an unreadable marker: listed as corrupt, skipped by latest
    parsed = parse_uri(below(fast_uri, "step-3"))
    async with open_store(parsed) as store:
        await store.put(marker_key(parsed.key), b"{not json")
    infos = {i.name: i.state for i in await fastckpt.list_checkpoints_async(fast_uri)}
    assert infos["step-3"] == "corrupt"
    assert (await fastckpt.latest_async(fast_uri)).endswith("/runs/step-1")
    # the checkpoint URI itself lists as that one checkpoint
    assert [i.name for i in await fastckpt.list_checkpoints_async(below(fast_uri, "step-1"))] == ["step-1"]


async def test_gc(fast_uri: str, tmp_path) -> None:
    base = parse_uri(fast_uri)
    await write_ranks(below(fast_uri, "good"), tmp_path, contributors=[0, 1], barrier=make_barrier("inprocess"),
                      world=2)
    await write_ranks(below(fast_uri, "dead"), tmp_path, contributors=[0, 1], barrier=make_barrier("inprocess"),
                      world=2, fail=1)
    async with open_store(base) as store:
        # an orphan in the committed checkpoint, a stale upload in the dead one, one in a plain prefix
        await store.put(base.join("good", "orphan.bin"), b"orphan")
        await (await store.create_multipart(base.join("dead", "big.bin"), 1 << 20)).put_part(0, b"x" * 100)
        await (await store.create_multipart(base.join("other", "o.bin"), 1 << 20)).put_part(0, b"y")
        await store.put(base.join("other", "keep.bin"), b"k")

    recent = await fastckpt.gc_async(fast_uri, older_than=3600)
    assert recent.removed == [] and recent.aborted_uploads == []
    assert sorted(recent.skipped) == ["dead: uncommitted, written to recently"]

    before = await keys_below(fast_uri)
    dry = await fastckpt.gc_async(fast_uri, older_than=0, dry_run=True)
    assert dry.dry_run and dry.removed
    assert before == await keys_below(fast_uri)

    report = await fastckpt.gc_async(fast_uri, older_than=0)
    assert sorted(report.removed) == sorted(dry.removed)
    assert sorted(report.aborted_uploads) == sorted([base.join("dead", "big.bin"), base.join("other", "o.bin")])
    rel = sorted(k[len(base.key) + 1:] for k in report.removed)
    assert {"good/orphan.bin", "dead/model-00000.safetensors", "dead/.fastckpt/a1/rank-00000.json"} <= set(rel)
    assert not any(k.startswith("good/") and k != "good/orphan.bin" for k in rel)
    assert report.bytes > 0
    left = await keys_below(fast_uri)
    assert not any(k.startswith("dead/") for k in left)
    assert "other/keep.bin" in left
    async with open_store(base) as store:
        assert await store.list_pending_uploads(base.key) == []
    assert (await fastckpt.verify_async(below(fast_uri, "good"))).ok
    assert [i.name for i in await fastckpt.list_checkpoints_async(fast_uri)] == ["good"]


def test_sync_writer_on_threads(tmp_path) -> None:
    """The sync twin: four ranks on four threads through one in-process barrier."""
    uri = f"file://{tmp_path}/runs/step-1"
    barrier = InProcessBarrier(timeout=10)
    results: dict[int, object] = {}

    def rank(r: int) -> None:
        src = tmp_path / f"r{r}"
        src.write_bytes(payload("s", "t", r))
        with SyncCheckpointWriter(uri, rank=r, world_size=4, barrier=barrier, attempt="t",
                                  config=small_config()) as w:
            if r % 2:
                w.put_file(src, f"shard-{r}.bin")
        results[r] = w.result

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert all(results[r].files == 2 for r in range(4)), results
    assert fastckpt.latest(f"file://{tmp_path}/runs") == f"{tmp_path}/runs/step-1"
    assert fastckpt.verify(uri).ok
    files = fastckpt.download_checkpoint(uri, tmp_path / "out")
    assert sorted(os.path.basename(f.path) for f in files) == ["shard-1.bin", "shard-3.bin"]
    assert [i.state for i in fastckpt.list_checkpoints(f"file://{tmp_path}/runs")] == ["committed"]
    assert fastckpt.gc(f"file://{tmp_path}/runs", older_than=0).removed == []


def test_formats_round_trip_and_reject_unknown() -> None:
    m = RankManifest("a1", 3, 8, created_at=1.0)
    assert RankManifest.decode(m.encode(), "m") == m
    marker = CommitMarker("a1", 1, (digest_of(m.encode()),), 0, 0, committed_at=time.time())
    assert CommitMarker.decode(marker.encode(), "c") == marker
    doc = json.loads(marker.encode())
    doc["format"] = 99
    with pytest.raises(CheckpointError, match="format version 99"):
        CommitMarker.decode(json.dumps(doc).encode(), "c")
    doc["format"], doc["world_size"] = 1, 2
    with pytest.raises(CheckpointError, match="1 manifests for world size 2"):
        CommitMarker.decode(json.dumps(doc).encode(), "c")


def test_delegate_uri_rejected() -> None:
    with pytest.raises(ValueError):
        fastckpt.CheckpointWriter(StorageURI("hdfs://x/y", "hdfs", "delegate", "x", "y"))
