"""Checkpoint tiers (``fastckpt.tier``): saves committed into a node's tier, drained by a real agent process to the
local store or moto, restored from the nearest copy; trainers and agents killed with SIGKILL."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit

import pytest

torch = pytest.importorskip("torch")

import fastckpt  # noqa: E402
import fastckpt.torch as ft  # noqa: E402
from fastckpt import CheckpointWriter, StoreBarrier  # noqa: E402
from fastckpt.errors import CheckpointError  # noqa: E402
from fastckpt.tier import Tier, TierFullError, ensure_agent  # noqa: E402
from fastckpt.tier.agent import agent_pid  # noqa: E402
from fastckpt.tier.spare import spare_files  # noqa: E402
from harness.proxy import Fault, FaultProxy  # noqa: E402
from harness.uris import below  # noqa: E402
from tests.ranks.tier_job import digest, state  # noqa: E402

pytestmark = pytest.mark.timeout(240)
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def short_lived_agents(monkeypatch) -> None:
    """Agents the tests start exit 3 s after their queue empties; a peer's replica waits 1 s for its own node."""
    monkeypatch.setenv("FASTCKPT_AGENT_IDLE", "3")
    monkeypatch.setenv("FASTCKPT_REPLICA_GRACE", "1")


def committed(uri: str) -> bool:
    return any(i.state == "committed" for i in fastckpt.list_checkpoints(uri))


def wait_for(check, timeout: float = 60.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def test_save_safe_in_tier_then_durable_then_read_nearest(tmp_path: Path) -> None:
    """``wait()``: committed in the tier; ``wait(durable=True)``: committed at the URI by the agent; ``load(tier=)``
    reads the tier's copy (the durable files may be gone), and the durable copy alone once the tier is wiped."""
    uri, tier = f"{tmp_path}/run/step-1", str(tmp_path / "tier")
    st = state(1, 0)
    h = ft.async_save(st, uri, tier=tier)
    in_tier = h.wait(timeout=60)
    assert in_tier.uri.startswith(tier) and in_tier.world_size == 1
    durable = h.wait(durable=True, timeout=60)
    assert (durable.uri, durable.attempt, durable.bytes) == (uri, in_tier.attempt, in_tier.bytes)
    assert fastckpt.verify(uri).ok
    moved = tmp_path / "moved"
    shutil.move(f"{uri}/rank-00000.safetensors", moved)
    assert digest(ft.load(uri, tier=tier)) == digest(st)  # the tier's copy
    with pytest.raises(Exception, match="rank-00000"):
        ft.load(uri)
    shutil.move(moved, f"{uri}/rank-00000.safetensors")
    shutil.rmtree(tier)
    assert digest(ft.load(uri, tier=tier)) == digest(st)  # wiped tier: the durable store


def test_latest_across_tier_and_durable(tmp_path: Path) -> None:
    """The newest committed checkpoint is found in the tier before the agent drained it, and in the durable store
    when this node's tier never held it."""
    run, tier = f"{tmp_path}/run", Tier(tmp_path / "tier")
    ft.save(state(1, 0), f"{run}/step-1")
    ft.save(state(2, 0), f"{run}/step-2", tier=tier)
    assert fastckpt.latest(run, tier=tier) == f"{run}/step-2"
    ft.save(state(3, 0), f"{run}/step-3")
    assert fastckpt.latest(run) in (f"{run}/step-2", f"{run}/step-3")
    assert fastckpt.latest(run, tier=tier) == f"{run}/step-3"
    assert fastckpt.latest(f"{tmp_path}/empty", tier=tier) is None


def test_copies_beyond_keep_dropped_once_drained(tmp_path: Path) -> None:
    """keep=2: the third save drops the oldest copy (drained), never one still queued."""
    run, tier = f"{tmp_path}/run", Tier(tmp_path / "tier", keep=2)
    for step in (1, 2, 3):
        ft.async_save(state(step, 0), f"{run}/step-{step}", tier=tier).wait(durable=True, timeout=60)
    ft.save(state(4, 0), f"{run}/step-4", tier=tier)
    kept = sorted(os.listdir(os.path.join(tier.root, "data", "file", "_", *run.strip("/").split("/"))))
    assert kept[-2:] == ["step-3", "step-4"] and "step-1" not in kept
    for step in (1, 2, 3):
        assert digest(ft.load(f"{run}/step-{step}", tier=tier)) == digest(state(step, 0))


def test_files_recycled_save_after_save(tmp_path: Path) -> None:
    """keep=1: the first save goes through staging and readies a spare file for the second; from the third on, each
    save writes into the file of the copy two saves back, once it is drained; every checkpoint stays bit-exact."""
    run, tier = f"{tmp_path}/run", Tier(tmp_path / "tier", keep=1)
    inodes = []
    for step in (1, 2, 3, 4):
        ft.async_save(state(step, 0), f"{run}/step-{step}", tier=tier).wait(durable=True, timeout=60)
        inodes.append(os.stat(f"{tier.copy_of(f'{run}/step-{step}').raw}/rank-00000.safetensors").st_ino)
        if step == 1:  # readied in the background once the first save is committed
            wait_for(lambda: spare_files(tier.root), what="a spare file for the next save")
    assert inodes[2] == inodes[0] and inodes[3] == inodes[1] and inodes[0] != inodes[1]
    for step in (1, 2, 3, 4):
        assert digest(ft.load(f"{run}/step-{step}")) == digest(state(step, 0))


def test_full_tier_refused_and_undrained_copies_kept(s3_uri: str, moto_server, tmp_path: Path) -> None:
    """With the durable store unreachable nothing drains: no copy is dropped to make room, and a save that does not
    fit the tier's capacity fails clearly before writing anything."""
    size = sum(v.numel() * v.element_size() for v in state(1, 0).values() if isinstance(v, torch.Tensor))
    tier = Tier(tmp_path / "tier", keep=1, capacity=int(2.5 * size))
    with FaultProxy(urlsplit(moto_server.endpoint).port) as proxy:
        proxy.outage(120)
        base = s3_uri.replace(moto_server.endpoint, proxy.url)
        for step in (1, 2):
            ft.save(state(step, 0), below(base, f"step-{step}"), tier=tier)
        with pytest.raises(TierFullError, match="room for"):
            ft.save(state(3, 0), below(base, "step-3"), tier=tier)
        assert len(tier.copies()) == 2 and len(tier.pending()) == 2
        proxy.outage(0)
        for step in (1, 2):
            wait_for(lambda s=step: committed(below(s3_uri, f"step-{s}")), what=f"step-{step} drained")
    for step in (1, 2):
        assert digest(ft.load(below(s3_uri, f"step-{step}"))) == digest(state(step, 0))


def test_drain_refused_when_another_writer_committed(tmp_path: Path) -> None:
    """A durable checkpoint committed meanwhile by another writer is not touched: the agent records why, and
    ``wait(durable=True)`` raises it."""
    uri, tier = f"{tmp_path}/run/step-1", Tier(tmp_path / "tier")
    other = tmp_path / "other.bin"
    other.write_bytes(b"x")
    with fastckpt.SyncCheckpointWriter(uri) as w:
        w.put_file(other)
    h = ft.async_save(state(1, 0), uri, tier=tier)
    with pytest.raises(CheckpointError, match="committed by"):
        h.wait(durable=True, timeout=60)
    wait_for(lambda: tier.failures(), what="the agent's failure record")
    assert "committed by another writer" in str(tier.failures()[0]["error"]) and not tier.pending()
    assert os.path.isdir(tier.copy_of(uri).raw)
    assert fastckpt.open_checkpoint(uri).files.keys() == {"other.bin"}


def test_tier_refuses_store_barrier_and_store(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="per_node"):
        CheckpointWriter(f"{tmp_path}/c", rank=0, world_size=2, barrier=StoreBarrier(), per_node=True)
    with pytest.raises(ValueError, match="store="):
        ft.save(state(1, 0), f"{tmp_path}/c", tier=tmp_path / "tier", store=fastckpt.open_store(f"{tmp_path}/s"))


@pytest.mark.parametrize("how", ["async_save", "dcp"])
def test_tier_saves_drain_incrementally_from_the_base(s3_uri: str, moto_server, tmp_path: Path, how: str) -> None:
    """``base="latest"`` with ``tier=``: the agent resolves the base in the bucket as it drains and has the store copy
    the frozen weights; what it sends is the changed bytes, counted on the wire, and the result loads bit-exact with
    the base gone."""
    import torch.distributed.checkpoint as dcp

    from fastckpt.torch.dcp import Reader, Writer
    from tests.torch.test_torch_incremental import CFG, _delete_all_but, frozen_weights, lora_state, same

    tier, frozen = Tier(tmp_path / "tier"), frozen_weights()
    states = [lora_state(step, frozen) for step in (1, 2)]
    sent = []
    with FaultProxy(urlsplit(moto_server.endpoint).port) as proxy:
        proxied = s3_uri.replace(moto_server.endpoint, proxy.url)
        for step, st in enumerate(states, 1):
            before, uri = proxy.moved["up"], below(proxied, f"run/step-{step}")
            if how == "dcp":
                writer = Writer(uri, config=CFG, base="latest", tier=tier)
                dcp.save(st, storage_writer=writer, no_dist=True)
                wait_for(lambda uri=uri: committed(uri), what=f"step {step} in the bucket")
            else:
                ft.async_save(st, uri, config=CFG, base="latest", tier=tier).wait(timeout=120, durable=True)
            sent.append(proxy.moved["up"] - before)
    frozen_bytes = sum(t.numel() * t.element_size() for t in frozen.values())
    assert sent[0] > frozen_bytes and sent[1] < sent[0] - 0.9 * frozen_bytes, sent
    changed = sum(t.numel() * t.element_size() for k, t in states[1]["model"].items() if "lora" in k) * 3
    assert sent[1] <= 1.1 * changed + (2 << 20), (sent, changed)
    _delete_all_but(below(s3_uri, "run"), "step-2")
    shutil.rmtree(tier.root)
    if how == "dcp":
        loaded = {k: (torch.zeros_like(v) if isinstance(v, torch.Tensor) else v) for k, v in states[1].items()}
        dcp.load(loaded, storage_reader=Reader(below(s3_uri, "run/step-2")), no_dist=True)
    else:
        loaded = ft.load(below(s3_uri, "run/step-2"))
    assert same(loaded, states[1])


HANDED_RANK = """
import os, signal, sys
import torch
import fastckpt.torch as ft
from fastckpt import InProcessBarrier
from tests.ranks.tier_job import state
uri, tier, rank = sys.argv[1], sys.argv[2], int(sys.argv[3])
st = {**state(6, rank), "big": torch.full((12 << 20,), float(rank))}  # hashed in several spans
h = ft.async_save(st, uri, rank=rank, world_size=2, barrier=InProcessBarrier(), attempt="run-1", tier=tier)
h.wait(timeout=60)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_saves_handed_to_the_agent_survive_their_trainers(tmp_path: Path) -> None:
    """A save into the tier's recycled files is safe once handed to the agent, before its ranks commit in the tier.
    Two ranks of one node, each in a process SIGKILLed as soon as ``wait()`` returned (its commit still waiting for
    the other rank), with no agent running: their records stay. Rank 0's file is then published, as a trainer
    killed in its commit leaves it. The agent started then finishes both (hashes, publishes, writes the manifests),
    drains them and commits from the durable manifests; both load bit-exact from the store and from the tier."""
    import fcntl

    from fastckpt.tier.handoff import Handoff, handoffs
    from fastckpt.torch.tiered.staging import prepare_spares

    uri, tier = f"{tmp_path}/run/step-6", Tier(tmp_path / "tier")
    prepare_spares(tier, [(f"rank-{r:05d}.safetensors", 64 << 20) for r in (0, 1)])
    lock = os.open(os.path.join(tier.agent_dir, "lock"), os.O_RDWR | os.O_CREAT)
    fcntl.flock(lock, fcntl.LOCK_EX)  # as an agent would: none starts
    try:
        for rank in (0, 1):
            run = subprocess.run([sys.executable, "-c", HANDED_RANK, uri, tier.root, str(rank)], cwd=REPO,
                                 capture_output=True, text=True, timeout=120)
            assert run.returncode == -signal.SIGKILL, run.stderr[-3000:]
        records = [Handoff.decode(Path(p).read_bytes(), p) for p in handoffs(tier)]
        assert sorted(r.rank for r in records) == [0, 1] and not tier.pending() and not committed(uri)
        [first] = [f for r in records if r.rank == 0 for f in r.files]
        os.replace(first.tmp, first.final)
    finally:
        os.close(lock)
    ensure_agent(tier)
    wait_for(lambda: committed(uri), what="the agent's commit of the handed saves")
    assert not handoffs(tier) and not tier.failures() and fastckpt.verify(uri).ok

    def saved(rank: int) -> str:
        return digest({**state(6, rank), "big": torch.full((12 << 20,), float(rank))})

    for rank in (0, 1):
        assert digest(ft.load(uri, rank=rank)) == saved(rank)
    wait_for(lambda: os.path.exists(os.path.join(tier.copy_of(uri).raw, ".fastckpt", "COMMITTED")),
             what="the tier's copy adopting the marker")
    shutil.rmtree(uri)
    for rank in (0, 1):
        assert digest(ft.load(uri, rank=rank, tier=tier)) == saved(rank)


def job(tmp_path: Path, spec: dict) -> list[dict]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / f"out-{os.urandom(3).hex()}"
    out.mkdir()
    spec = {**spec, "port": port, "out": str(out)}
    run = subprocess.run([sys.executable, "-m", "tests.ranks.tier_job", json.dumps(spec)], cwd=REPO,
                         capture_output=True, text=True, timeout=200)
    records = [json.loads(p.read_text()) for p in sorted(out.glob("rank-*.json"))]
    assert len(records) == spec["world"], run.stdout[-2000:] + run.stderr[-2000:]
    return records


@pytest.mark.slow
def test_trainers_killed_after_save_lose_nothing(s3_uri: str, tmp_path: Path) -> None:
    """Two ranks on two simulated nodes (a tier each) save and are SIGKILLed as soon as ``wait()`` returned: each
    node's agent drains its rank, the last one commits on moto, and both states load bit-exact from there; a
    restart on the same nodes reads them from the tiers."""
    uri, tiers = below(s3_uri, "step-7"), [str(tmp_path / "node-0"), str(tmp_path / "node-1")]
    saved = job(tmp_path, {"uri": uri, "world": 2, "tiers": tiers, "mode": "save", "step": 7, "kill": True})
    assert all(r["ok"] for r in saved), saved
    wait_for(lambda: committed(uri), what="the agents' durable commit")
    marker = fastckpt.open_checkpoint(uri).info
    assert (marker.world_size, marker.files) == (2, 2)
    for rank in (0, 1):
        assert digest(ft.load(uri, rank=rank)) == saved[rank]["sha"] == digest(state(7, rank))
    loaded = job(tmp_path, {"uri": uri, "world": 2, "tiers": tiers, "mode": "load"})
    assert [r["sha"] for r in loaded] == [r["sha"] for r in saved]


@pytest.mark.slow
def test_a_rank_killed_after_handing_off_fails_no_one(s3_uri: str, tmp_path: Path) -> None:
    """Two ranks on two nodes, saving into their tiers' recycled files (``warm``). Rank 0 is SIGKILLed as soon as
    ``wait()`` returned, its commit still waiting for rank 1; rank 1 saves after that, so its commit in the tier
    fails, and its process leaves the save to its agent. Each agent finishes its rank's save, both drain, one commits
    on moto from the durable manifests, and rank 1's ``wait(durable=True)`` returns; both states load bit-exact
    from moto and, once each node adopted the marker, from the tiers."""
    uri, tiers = below(s3_uri, "step-5"), [str(tmp_path / "node-0"), str(tmp_path / "node-1")]
    saved = job(tmp_path, {"uri": uri, "world": 2, "tiers": tiers, "mode": "save", "step": 5,
                           "warm": below(s3_uri, "step-0"),
                           "stagger": True, "kill": [0], "durable": True})
    assert all(r["ok"] for r in saved), saved
    assert committed(uri) and fastckpt.open_checkpoint(uri).info.world_size == 2
    for rank in (0, 1):
        assert digest(ft.load(uri, rank=rank)) == saved[rank]["sha"] == digest(state(5, rank))
        log = Path(Tier(tiers[rank]).agent_dir, "agent.log").read_text()
        assert "handed over by its process" in log, log[-2000:]
    for t in tiers:
        wait_for(lambda t=t: os.path.exists(os.path.join(Tier(t).copy_of(uri).raw, ".fastckpt", "COMMITTED")),
                 what="each node adopting the marker")
    loaded = job(tmp_path, {"uri": uri, "world": 2, "tiers": tiers, "mode": "load"})
    assert [r["sha"] for r in loaded] == [r["sha"] for r in saved]


def test_agent_killed_mid_drain_is_resumed(s3_uri: str, moto_server, tmp_path: Path) -> None:
    """The agent SIGKILLed while its upload stalls mid-body leaves the queue entry; the next agent drains it and
    commits, every byte verified."""
    tier = Tier(tmp_path / "tier")
    with FaultProxy(urlsplit(moto_server.endpoint).port) as proxy:
        proxy.arm(Fault("stall", after=1 << 20, seconds=60), times=None)
        uri = below(s3_uri.replace(moto_server.endpoint, proxy.url), "step-3")
        st = state(3, 0)
        ft.save(st, uri, tier=tier)
        wait_for(lambda: agent_pid(tier) is not None, what="the agent")
        time.sleep(1.0)  # well into the stalled upload
        pid = agent_pid(tier)
        assert pid is not None and tier.pending() and not committed(uri)
        os.kill(pid, signal.SIGKILL)
        wait_for(lambda: agent_pid(tier) is None, what="the agent's death")
        assert len(tier.pending()) == 1
        proxy.arm(None)
        ensure_agent(tier)
        wait_for(lambda: committed(uri), what="the resumed drain")
    durable = below(s3_uri, "step-3")
    assert fastckpt.verify(durable).ok
    shutil.rmtree(tier.root)
    assert digest(ft.load(durable, tier=tier)) == digest(st)


@pytest.mark.parametrize("restore", ["latest", "load"])
def test_a_killed_agent_is_restarted_by_a_restore(s3_uri: str, moto_server, tmp_path: Path, restore: str, capsys
                                                  ) -> None:
    """The agent SIGKILLed mid-drain and no save after it (the trainer died too): ``--status`` shows how long the
    entry has waited, and the restart's first look at the tier (``latest(tier=)`` or ``load(tier=)``) starts an agent
    that drains it."""
    from fastckpt.cli import main

    tier = Tier(tmp_path / "tier")
    with FaultProxy(urlsplit(moto_server.endpoint).port) as proxy:
        proxy.arm(Fault("stall", after=1 << 20, seconds=60), times=None)
        proxied = s3_uri.replace(moto_server.endpoint, proxy.url)
        parent, uri = below(proxied, "run"), below(proxied, "run/step-5")
        st = state(5, 0)
        ft.save(st, uri, tier=tier)
        wait_for(lambda: agent_pid(tier) is not None, what="the agent")
        time.sleep(1.0)
        os.kill(agent_pid(tier), signal.SIGKILL)
        wait_for(lambda: agent_pid(tier) is None, what="the agent's death")
        proxy.arm(None)
        time.sleep(1.0)
        assert main(["agent", tier.root, "--status", "--json"]) == 0
        status = json.loads(capsys.readouterr().out)
        assert status["pending"] == 1 and status["agent_pid"] is None and status["oldest_queued_s"] >= 1.0
        if restore == "latest":
            assert fastckpt.latest(parent, tier=tier) == uri
        else:
            assert digest(ft.load(uri, tier=tier)) == digest(st)
        wait_for(lambda: committed(uri), what="the drain the restore resumed")
    assert fastckpt.verify(below(s3_uri, "run/step-5")).ok


def test_a_rerun_saves_again_over_a_tier_copy_the_bucket_never_committed(s3_uri: str, moto_server, tmp_path: Path
                                                                          ) -> None:
    """Step 14 committed in the tier, its drain stuck and its agent killed (the job died); the rerun restores step 13
    and saves step 14 anew: the stale copy is superseded (its queue entry dropped), the new one drains, and what the
    bucket commits is the rerun's. A step committed in the bucket is still never written again."""
    tier = Tier(tmp_path / "tier")
    with FaultProxy(urlsplit(moto_server.endpoint).port) as proxy:
        proxy.arm(Fault("stall", after=1 << 20, seconds=60), times=None)
        uri = below(s3_uri.replace(moto_server.endpoint, proxy.url), "run/step-14")
        ft.save(state(14, 0), uri, tier=tier)
        wait_for(lambda: agent_pid(tier) is not None, what="the agent")
        os.kill(agent_pid(tier), signal.SIGKILL)
        wait_for(lambda: agent_pid(tier) is None, what="the agent's death")
        assert len(tier.pending()) == 1
        rerun = {**state(14, 0), "w": state(99, 0)["w"]}
        ft.save(rerun, uri, tier=tier)
        assert len(tier.pending()) == 1  # the new attempt's entry alone
        proxy.arm(None)
        wait_for(lambda: committed(uri), what="the rerun's drain")
        with pytest.raises(CheckpointError, match="already committed"):
            ft.save(state(15, 0), uri, tier=tier)
    durable = below(s3_uri, "run/step-14")
    assert fastckpt.verify(durable).ok
    shutil.rmtree(tier.root)
    assert digest(ft.load(durable)) == digest(rerun)


def test_dcp_writer_and_reader_with_a_tier(tmp_path: Path) -> None:
    """``dcp.save`` through ``Writer(tier=)`` commits in the tier; ``wait_durable`` returns once the agent committed
    it at the URI; ``Reader(tier=)`` reads the tier's copy, the URI for a file damaged there and once it is wiped."""
    import torch.distributed.checkpoint as dcp

    from fastckpt.torch.dcp import Reader, Writer

    uri, tier = f"{tmp_path}/run/dcp-1", Tier(tmp_path / "tier")
    st = state(4, 0)
    writer = Writer(uri, tier=tier)
    dcp.save(st, storage_writer=writer)
    assert writer.result is not None and writer.result.uri.startswith(tier.root)
    assert writer.wait_durable(timeout=60).uri == uri and fastckpt.verify(uri).ok

    def loaded() -> dict[str, int]:
        into = {"w": torch.zeros_like(st["w"]), "b": torch.zeros_like(st["b"]), "step": -1, "rank": -1}
        reader = Reader(uri, tier=tier)
        dcp.load(into, storage_reader=reader)
        assert digest(into) == digest(st)
        return reader.bytes_read

    size = os.path.getsize(f"{uri}/rank-00000.distcp")
    moved, copy = tmp_path / "moved", "/" + tier.copy_of(uri).join("rank-00000.distcp")
    shutil.move(f"{uri}/rank-00000.distcp", moved)
    index = os.path.getsize(f"{uri}/.metadata") + os.path.getsize(f"{uri}/.metadata.fastckpt")
    assert loaded() == {"tier": size + index, "uri": 0}  # the tier's copy
    shutil.move(moved, f"{uri}/rank-00000.distcp")
    with open(copy, "r+b") as f:  # the tier's copy damaged: that file is read from the URI
        f.seek(size // 2)
        f.write(b"\xff" * 64)
    assert loaded()["uri"] >= size // 2
    shutil.rmtree(tier.root)
    assert loaded()["tier"] == 0  # the durable checkpoint
    with pytest.raises(ValueError, match="tier= or group="):
        Reader(uri, tier=tier, group=object())


def test_dcp_saves_recycle_the_tiers_files(tmp_path: Path) -> None:
    """DCP saves into a tier with keep=1 write into the files of the copy two saves back once it is drained, as
    ``ft.async_save`` does; every checkpoint stays bit-exact."""
    import torch.distributed.checkpoint as dcp

    from fastckpt.torch.dcp import Reader, Writer

    run, tier = f"{tmp_path}/run", Tier(tmp_path / "tier", keep=1)
    inodes = []
    for step in (1, 2, 3):
        writer = Writer(f"{run}/step-{step}", tier=tier)
        dcp.save(state(step, 0), storage_writer=writer)
        writer.wait_durable(timeout=60)
        inodes.append(os.stat(f"{tier.copy_of(f'{run}/step-{step}').raw}/rank-00000.distcp").st_ino)
        if step == 2:
            wait_for(lambda: spare_files(tier.root), what="the first copy's file made spare")
    assert inodes[2] == inodes[0] != inodes[1]
    for step in (1, 2, 3):
        into = {"w": torch.zeros_like(state(step, 0)["w"]), "b": torch.zeros_like(state(step, 0)["b"]), "step": -1,
                "rank": -1}
        dcp.load(into, storage_reader=Reader(f"{run}/step-{step}", tier=tier))
        assert digest(into) == digest(state(step, 0)) and fastckpt.verify(f"{run}/step-{step}").ok


@pytest.mark.slow
def test_dcp_ranks_on_two_nodes_drain_and_adopt_the_marker(s3_uri: str, tmp_path: Path, monkeypatch) -> None:
    """Two ranks, each saving into its own node's tier through DCP: the coordinator's node commits in its tier, the
    other node's agent drains its rank and, once the coordinator's agent committed on moto, adopts the marker so its
    copy is committed on that node too. A restart reads each rank's file from its node's tier (``dcp_job``)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("TIER_ROOT", str(tmp_path))
    run = subprocess.run([sys.executable, "-m", "tests.ranks.dcp_job", "tier", s3_uri, "2", str(port)], cwd=REPO,
                         capture_output=True, text=True, timeout=200)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    uri = below(s3_uri, "d")
    assert fastckpt.verify(uri).ok
    other = Tier(tmp_path / "node-1")
    wait_for(lambda: os.path.exists(os.path.join(other.copy_of(uri).raw, ".fastckpt", "COMMITTED")),
             what="node 1 adopting the marker")
    assert not other.pending() and not other.failures()


@pytest.mark.slow
def test_peer_replicas_restore_a_wiped_node_without_the_bucket(s3_uri: str, moto_server, tmp_path: Path) -> None:
    """``replicas=1``: each rank's copy also lands in the other node's tier. With the bucket unreachable, node 0's
    tier is wiped; after ``restore_tier`` both ranks load bit-exact from their tiers (rank 0's copy came back from
    node 1); once the bucket is back, node 1's agent drains rank 0's replica as well and commits the checkpoint there.
    A checkpoint saved without replicas (drained before) has no peer copy: rank 0 reads it from the bucket."""
    tiers = [str(tmp_path / "node-0"), str(tmp_path / "node-1")]
    with FaultProxy(urlsplit(moto_server.endpoint).port) as proxy:
        base = s3_uri.replace(moto_server.endpoint, proxy.url)
        with_replica, without = below(base, "step-8"), below(base, "step-9")
        saved = job(tmp_path, {"uri": without, "world": 2, "tiers": tiers, "mode": "save", "step": 9})
        assert all(r["ok"] for r in saved), saved
        wait_for(lambda: committed(below(s3_uri, "step-9")), what="step-9 drained")
        proxy.outage(600)
        saved = job(tmp_path, {"uri": with_replica, "world": 2, "tiers": tiers, "mode": "save", "step": 8,
                               "replicas": 1})
        assert all(r["ok"] for r in saved), saved
        assert os.path.exists(f"{Tier(tiers[1]).copy_of(with_replica).raw}/rank-00000.safetensors")  # the replica
        assert not os.path.exists(f"{Tier(tiers[1]).copy_of(without).raw}/rank-00000.safetensors")
        shutil.rmtree(tiers[0])
        restored = job(tmp_path, {"uri": with_replica, "world": 2, "tiers": tiers, "mode": "restore", "step": 8})
        assert [r["received"] for r in restored] == [[0], []], restored
        assert [r["sha"] for r in restored] == [digest(state(8, 0)), digest(state(8, 1))], restored
        proxy.outage(0)  # node 0's agent and queue went with its tier: node 1's agent drains rank 0's replica too
        wait_for(lambda: committed(below(s3_uri, "step-8")), what="step-8 committed from node 1's tier alone")
        assert digest(ft.load(below(s3_uri, "step-8"), rank=0)) == digest(state(8, 0))
        again = job(tmp_path, {"uri": without, "world": 2, "tiers": tiers, "mode": "restore", "step": 9})
        assert [r["received"] for r in again] == [[], []], again
        assert [r["sha"] for r in again] == [digest(state(9, 0)), digest(state(9, 1))], again


def test_agent_command_drains_and_reports(tmp_path: Path, capsys) -> None:
    """``fastckpt agent DIR`` drains what is queued and exits once idle; ``--status`` reports the queue, failures and
    copies without draining."""
    from fastckpt.cli import main

    run, tier = f"{tmp_path}/run", Tier(tmp_path / "tier")
    ft.save(state(1, 0), f"{run}/step-1", tier=tier)
    wait_for(lambda: agent_pid(tier) is None and not tier.pending(), what="the started agent")
    assert main(["agent", tier.root, "--status", "--json"]) == 0
    status = json.loads(capsys.readouterr().out)
    assert (status["served"], status["pending"], status["handed"], status["failed"]) == (False, 0, 0, [])
    assert status["copies"] == [f"{run}/step-1"]
    tier.enqueue(fastckpt.uri.parse_uri(f"{run}/step-2"), "nope", 0, time.time())  # a copy that is not there
    assert main(["agent", tier.root, "--idle", "0.2", "--json"]) == 0
    ran = json.loads(capsys.readouterr().out)
    assert ran["served"] and ran["pending"] == 0 and "is gone" in str(ran["failed"][0]["error"])
