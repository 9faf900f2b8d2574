"""8 ranks as separate processes (tests/ranks/job.py) on every real store, with the store and the
torch.distributed (gloo) barriers; ranks killed with SIGKILL at three points of the protocol."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

import fastckpt
from fastckpt import open_store, parse_uri
from harness.uris import below

from ..conftest import BACKENDS, small_config
from ..ranks.job import content, file_names

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
WORLD = 8
SUBSETS = {"all": list(range(WORLD)), "even": [2, 4, 6], "five": [5]}
BARRIER_TIMEOUT = 3.0


SERVERS = [b for b in BACKENDS if b not in ("memory", "local")]
# store barrier on every store, torch barrier on the local store and the S3 server (the barrier does not
# depend on the store); crash tests: all three kill points on local and S3, mid-upload on the others.
MATRIX = ([("local", "store"), ("local", "torch")] + [(b, "store") for b in SERVERS]
          + [("s3", "torch")] * ("s3" in SERVERS))
CRASH_POINTS = ["mid-upload", "after-manifest", "before-manifest"]
CRASHES = ([("local", at) for at in CRASH_POINTS] + [("s3", at) for at in CRASH_POINTS if "s3" in SERVERS]
           + [(b, "mid-upload") for b in SERVERS if b != "s3"])


def base_uri(request: pytest.FixtureRequest, backend: str, tmp_path: Path) -> str:
    """A fresh base URI on ``backend`` (memory cannot be shared by separate processes)."""
    if backend == "local":
        return f"file://{tmp_path}/store"
    return request.getfixturevalue(f"{backend}_uri")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def list_keys(uri: str) -> list[str]:
    """Keys below ``uri``, relative to it."""
    parsed = parse_uri(uri)
    async with open_store(parsed, config=small_config()) as store:
        return sorted([m.key[len(parsed.key) + 1:] async for m in store.list(parsed.key)])


class Job:
    """One run of tests/ranks/job.py: rank outcomes and process exit codes."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.codes: dict[str, int] = json.loads((out / "exitcodes.json").read_text())
        self.ranks = {int(p.stem.split("-")[1]): json.loads(p.read_text()) for p in out.glob("rank-*.json")}

    def outcome(self, rank: int, checkpoint: str) -> dict:
        return self.ranks[rank]["checkpoints"][checkpoint]


def start_job(work: Path) -> subprocess.Popen[bytes]:
    """Start the launcher on ``work/spec.json`` (the environment, e.g. S3 credentials, is passed on)."""
    with open(work / "log.txt", "wb") as log:
        return subprocess.Popen([sys.executable, "-m", "tests.ranks.job", str(work / "spec.json")], cwd=REPO,
                                env=dict(os.environ), stdout=log, stderr=subprocess.STDOUT)


async def run_job(tmp_path: Path, uri: str, barrier: str, checkpoints: list[dict], *, pause: dict | None = None,
                  kill_when=None, tag: str = "job") -> Job:
    """Run the job; with ``pause``, SIGKILL the paused rank (once ``kill_when()`` is true, if given)."""
    work = tmp_path / tag
    work.mkdir()
    spec = {"uri": uri, "world_size": WORLD, "barrier": barrier, "timeout": BARRIER_TIMEOUT, "port": free_port(),
            "workdir": str(work / "src"), "out": str(work / "out"), "checkpoints": checkpoints, "pause": pause}
    (work / "spec.json").write_text(json.dumps(spec))
    proc = start_job(work)
    try:
        if pause is not None:
            signal_file = work / "out" / "paused.json"
            for _ in range(1200):
                if signal_file.exists() or proc.poll() is not None:
                    break
                await asyncio.sleep(0.05)
            assert signal_file.exists(), f"rank never paused: {(work / 'log.txt').read_text()[-3000:]}"
            for _ in range(600):
                if kill_when is None or await kill_when():
                    break
                await asyncio.sleep(0.1)
            os.kill(json.loads(signal_file.read_text())["pid"], signal.SIGKILL)
        await asyncio.to_thread(proc.wait, 180)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert (work / "out" / "exitcodes.json").exists(), (work / "log.txt").read_text()[-3000:]
    return Job(work / "out")


async def check_contents(uri: str, name: str, attempt: str, contributors: list[int], dst: Path) -> None:
    """The checkpoint holds exactly the contributors' two files each, with this attempt's bytes."""
    ckpt = await fastckpt.open_checkpoint_async(uri)
    assert ckpt.info.attempt == attempt and ckpt.info.world_size == WORLD
    assert sorted(ckpt.files) == sorted(n for r in contributors for n in file_names(r))
    await fastckpt.download_checkpoint_async(uri, dst, config=small_config())
    for r in contributors:
        for index, fname in enumerate(file_names(r)):
            assert (dst / fname).read_bytes() == content(name, attempt, r, index), fname


@pytest.mark.parametrize(("backend", "barrier"), MATRIX)
async def test_eight_processes_any_subset(request: pytest.FixtureRequest, tmp_path: Path, backend: str,
                                          barrier: str) -> None:
    """Ranks {0..7}, only {2,4,6}, only 5 contribute; the torch job agrees on its attempt through the barrier."""
    store_uri = base_uri(request, backend, tmp_path)
    checkpoints = [{"name": f"{barrier}-{s}", "attempt": "a1" if barrier == "store" else None, "contributors": c}
                   for s, c in SUBSETS.items()]
    job = await run_job(tmp_path, store_uri, barrier, checkpoints)
    assert set(job.codes.values()) == {0}
    for ck in checkpoints:
        outcomes = [job.outcome(r, ck["name"]) for r in range(WORLD)]
        assert all(o["ok"] for o in outcomes), outcomes
        attempts = {o["attempt"] for o in outcomes}
        assert len(attempts) == 1 and (ck["attempt"] is None or attempts == {"a1"})
        assert {o["files"] for o in outcomes} == {2 * len(ck["contributors"])}
        uri = below(store_uri, ck["name"])
        await check_contents(uri, ck["name"], attempts.pop(), ck["contributors"], tmp_path / ck["name"])
        assert (await fastckpt.verify_async(uri, config=small_config())).ok
    assert sorted(parse_uri(u.uri).key.rsplit("/", 1)[-1] for u in await fastckpt.list_checkpoints_async(store_uri)
                  if u.state == "committed") == sorted(ck["name"] for ck in checkpoints)


async def crash_and_recover(base: str, tmp_path: Path, barrier: str, at: str) -> Job:
    """step-1 committed; step-2 crashes (a rank SIGKILLed at ``at``); rerun commits; gc cleans up."""
    src = tmp_path / "prev.bin"
    src.write_bytes(b"previous checkpoint")
    async with fastckpt.CheckpointWriter(below(base, "step-1"), config=small_config()) as w:
        await w.put_file(src, "prev.bin")
    previous = await fastckpt.latest_async(base)
    assert previous is not None

    victim = {"mid-upload": 3, "after-manifest": 0, "before-manifest": 4}[at]  # 4: a leader of the store barrier
    uri = below(base, "step-2")
    others = [r for r in range(WORLD) if r != victim]

    async def others_waiting() -> bool:
        keys = await list_keys(uri)
        return all(f".fastckpt/a1/rank-{r:05d}.json" in keys for r in others)

    crashed = await run_job(
        tmp_path, base, barrier,
        [{"name": "step-2", "attempt": "a1", "contributors": SUBSETS["all"], "extra": [1, victim]}],
        pause={"rank": victim, "at": at, "checkpoint": "step-2"},
        kill_when=others_waiting if at == "before-manifest" else None, tag="crash")
    assert crashed.codes[f"rank-{victim}"] == -signal.SIGKILL
    assert victim not in crashed.ranks
    for r in others:
        assert not crashed.outcome(r, "step-2")["ok"]
    if barrier == "store" and victim != 0:
        assert f"rank {victim} of {WORLD} never arrived" in crashed.outcome(0, "step-2")["error"]
    keys = await list_keys(uri)
    assert ".fastckpt/COMMITTED" not in keys and "scratch/rank-1.bin" in keys
    assert await fastckpt.latest_async(base) == previous
    states = {i.name: i.state for i in await fastckpt.list_checkpoints_async(base)}
    assert states == {"step-1": "committed", "step-2": "uncommitted"}

    rerun = await run_job(tmp_path, base, barrier,
                          [{"name": "step-2", "attempt": "a2", "contributors": SUBSETS["all"]}], tag="rerun")
    assert set(rerun.codes.values()) == {0}
    assert all(rerun.outcome(r, "step-2")["ok"] for r in range(WORLD))
    assert (await fastckpt.latest_async(base)).split("?")[0].endswith("/step-2")
    await check_contents(uri, "step-2", "a2", SUBSETS["all"], tmp_path / "restored")

    report = await fastckpt.gc_async(base, older_than=0, config=small_config())
    removed = {k.split("/step-2/", 1)[1] for k in report.removed if "/step-2/" in k}
    assert "scratch/rank-1.bin" in removed
    assert any(k.startswith(".fastckpt/a1/") for k in removed)
    if at == "mid-upload":
        assert any(k.endswith("step-2/scratch/rank-3.bin") for k in report.aborted_uploads), report
    keys = await list_keys(uri)
    assert not any(k.startswith(("scratch/", ".fastckpt/a1/")) for k in keys), keys
    parsed = parse_uri(base)
    async with open_store(parsed, config=small_config()) as store:
        assert await store.list_pending_uploads(parsed.key) == []
    assert (await fastckpt.verify_async(uri, config=small_config())).ok
    assert (await fastckpt.verify_async(below(base, "step-1"), config=small_config())).ok
    return crashed


@pytest.mark.parametrize(("backend", "at"), CRASHES)
async def test_kill_rank_store_barrier(request: pytest.FixtureRequest, tmp_path: Path, backend: str, at: str) -> None:
    """SIGKILL of one rank (a) mid-upload, (b) rank 0 after its manifest, (c) rank 4, the leader of the second
    group, while the others wait (the root reads that group's manifests itself)."""
    crashed = await crash_and_recover(base_uri(request, backend, tmp_path), tmp_path, "store", at)
    if at == "after-manifest":
        for r in range(1, WORLD):
            assert "rank 0 announced no outcome" in crashed.outcome(r, "step-2")["error"]
    else:
        victim = 3 if at == "mid-upload" else 4
        for r in range(WORLD):
            if r != victim:
                assert f"rank {victim} of {WORLD} never arrived" in crashed.outcome(r, "step-2")["error"]


@pytest.mark.parametrize("at", CRASH_POINTS)
async def test_kill_rank_torch_barrier(tmp_path: Path, at: str) -> None:
    """The same crashes with the torch.distributed (gloo) barrier, on the local store."""
    crashed = await crash_and_recover(f"file://{tmp_path}/runs", tmp_path, "torch", at)
    if at != "after-manifest":
        victim = 3 if at == "mid-upload" else 4
        assert "BarrierTimeoutError" in crashed.outcome(0, "step-2")["error"]
        assert f"rank {victim} of {WORLD} never arrived" in crashed.outcome(0, "step-2")["error"]
