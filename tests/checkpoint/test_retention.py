"""Retention: ``gc(keep_last=K)`` / ``fastckpt gc --keep-last K`` on every backend (the committed checkpoints below a
prefix but the newest K go, marker first; uncommitted ones are left to the age rule; the newest is never removed; a
removal cut short leaves nothing a reader takes), each rule of a ``Retention``, and the policy applied after each
commit by ``fastckpt.torch.save`` / ``async_save`` (direct and through a tier), the DCP writer and the command line
(the Hugging Face callback's is in ``test_huggingface``)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import pytest

import fastckpt
from fastckpt import CheckpointInfo, CheckpointWriter, Retention
from fastckpt._loop import run_sync
from fastckpt.checkpoint.manifest import marker_key
from fastckpt.engine.layout import Layout

from ..conftest import small_config


async def commit(uri: str, data: bytes) -> None:
    async with CheckpointWriter(uri, config=small_config()) as writer:
        await writer.put_layout("w.bin", Layout([data]))


async def committed(base: str) -> list[str]:
    return [c.name for c in await fastckpt.list_checkpoints_async(base, config=small_config())
            if c.state == "committed"]


async def test_keep_last_removes_the_older_committed_checkpoints(store) -> None:
    s, base = store
    for step in range(4):
        await commit(base.with_key(base.join(f"step-{step}")).uri(), bytes([step]) * 1000)
    dry = await fastckpt.gc_async(base.uri(), dry_run=True, keep_last=2, config=small_config())
    assert any(k.endswith("step-0/.fastckpt/COMMITTED") for k in dry.removed)
    assert await committed(base.uri()) == ["step-0", "step-1", "step-2", "step-3"]

    await fastckpt.gc_async(base.uri(), keep_last=2, config=small_config())
    assert await committed(base.uri()) == ["step-2", "step-3"]
    assert not [m.key async for m in s.list(base.join("step-0"))]
    with pytest.raises(ValueError, match="newest"):
        await fastckpt.gc_async(base.uri(), keep_last=0, config=small_config())


async def test_a_removal_cut_short_is_finished_by_the_next_gc(store) -> None:
    s, base = store
    for step in range(2):
        await commit(base.with_key(base.join(f"step-{step}")).uri(), b"x" * 100)
    await s.delete(marker_key(base.join("step-0")))  # as the first thing a removal does, then killed
    assert await committed(base.uri()) == ["step-1"]
    await fastckpt.gc_async(base.uri(), older_than=0, keep_last=1, config=small_config())
    assert not [m.key async for m in s.list(base.join("step-0"))]
    assert await committed(base.uri()) == ["step-1"]


def test_the_command_line(tmp_path: Path) -> None:
    for step in range(3):
        run_sync(commit(str(tmp_path / f"step-{step}"), b"y"))
    run = subprocess.run([sys.executable, "-m", "fastckpt.cli", "gc", str(tmp_path), "--keep-last", "1"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert [c.name for c in fastckpt.list_checkpoints(str(tmp_path))] == ["step-2"]


def listed(name: str, at: float, metrics: dict[str, float] | None = None) -> CheckpointInfo:
    return CheckpointInfo(name, f"memory://b/{name}", "committed", "a", 1, 1, 1, at, metrics or {})


def test_each_rule_keeps_what_it_says() -> None:
    """The rules on a listing: the union of what each keeps, always the newest, the grace window counted from when a
    checkpoint stopped being the newest."""
    losses = [0.9, 0.2, 0.5, 0.1, 0.7, 0.6]
    found = [listed(f"step-{s * 50:04d}", 1000.0 + 100 * s, {"loss": loss}) for s, loss in enumerate(losses)]
    now = 2000.0

    def kept(**rules: object) -> list[int]:
        return sorted(int(n[5:]) for n in Retention(**rules).kept(found, now))  # type: ignore[arg-type]

    assert kept(grace=0) == [250]
    assert kept(keep_last=2, grace=0) == [200, 250]
    assert kept(keep_every_steps=100, grace=0) == [0, 100, 200, 250]
    assert kept(keep_every=250, grace=0) == [0, 150, 250]  # the first in each 250 s window of commit time
    assert kept(best=2, metric="loss", grace=0) == [50, 150, 250]
    assert kept(best=1, metric="loss", mode="max", grace=0) == [0, 250]
    assert kept(grace=650) == [150, 200, 250]  # step 150 stopped being the newest at 1400 s, 600 s ago
    assert kept(best=1, metric="no-such", grace=0) == [250]
    for bad in ({"keep_last": 0}, {"best": 2}, {"metric": "loss"}, {"mode": "low"}, {"keep_every": 0},
                {"grace": -1}, {"keep_every_steps": True}):
        with pytest.raises(ValueError, match="Retention"):
            Retention(**bad)  # type: ignore[arg-type]


async def test_saves_apply_the_policy_after_each_commit(store) -> None:
    """``fastckpt.torch.save(metrics=, retention=)`` on every backend: after each commit, rank 0 leaves the newest two
    and the best by loss; the metrics are in the listing; what stays loads bit-exact."""
    torch = pytest.importorskip("torch")
    import fastckpt.torch as ft

    _, base = store
    policy = Retention(keep_last=2, best=1, metric="loss", grace=0)
    states = {}
    for step, loss in enumerate([0.5, 0.1, 0.4, 0.3, 0.2]):
        states[step] = {"w": torch.full((256,), float(step))}
        uri = base.with_key(base.join(f"step-{step}")).uri()
        await asyncio.to_thread(ft.save, states[step], uri, config=small_config(), metrics={"loss": loss},
                                retention=policy)
    listing = await fastckpt.list_checkpoints_async(base.uri(), config=small_config())
    assert [(c.name, c.metrics) for c in listing] == [("step-1", {"loss": 0.1}), ("step-3", {"loss": 0.3}),
                                                      ("step-4", {"loss": 0.2})]
    for c in listing:
        loaded = await asyncio.to_thread(ft.load, c.uri, config=small_config())
        assert torch.equal(loaded["w"], states[c.step]["w"])


async def test_a_base_removed_by_retention_leaves_its_child_whole(store) -> None:
    """An incremental save whose base the policy then removes: its unchanged bytes were copied (or linked), never
    referenced, so it still loads bit-exact (``async_save`` with ``retention=``)."""
    torch = pytest.importorskip("torch")
    import fastckpt.torch as ft

    _, base = store
    frozen = torch.arange(1 << 20, dtype=torch.float32)  # 4 MiB, unchanged between the saves
    first = {"frozen": frozen, "head": torch.zeros(64)}
    second = {"frozen": frozen, "head": torch.ones(64)}
    at = [base.with_key(base.join(f"step-{s}")).uri() for s in (0, 1)]
    await asyncio.to_thread(ft.save, first, at[0], config=small_config(), base="latest")  # none yet: all sent
    handle = ft.async_save(second, at[1], config=small_config(), base="latest", retention=Retention(grace=0))
    result = await asyncio.to_thread(handle.wait)
    assert result.copied > 0
    assert await committed(base.uri()) == ["step-1"]
    loaded = await asyncio.to_thread(ft.load, at[1], config=small_config())
    assert torch.equal(loaded["frozen"], frozen) and torch.equal(loaded["head"], second["head"])


def test_a_reader_within_the_grace_period_keeps_its_checkpoint(tmp_path: Path) -> None:
    """A reader that found step-0 with ``latest()`` still loads it after step-1 commits with ``keep_last=1``: step-0
    was the newest less than ``grace`` seconds ago. Once step-2 commits with no grace, only step-2 remains."""
    torch = pytest.importorskip("torch")
    import fastckpt.torch as ft

    base = f"file://{tmp_path}/run"
    ft.save({"w": torch.zeros(8)}, f"{base}/step-0")
    newest = fastckpt.latest(base)
    ft.save({"w": torch.ones(8)}, f"{base}/step-1", retention=Retention(keep_last=1, grace=60))
    assert newest is not None and torch.equal(ft.load(newest)["w"], torch.zeros(8))
    ft.save({"w": torch.ones(8)}, f"{base}/step-2", retention=Retention(keep_last=1, grace=0))
    assert [c.name for c in fastckpt.list_checkpoints(base)] == ["step-2"]


def test_the_dcp_writer_and_a_tier_save_apply_the_policy(tmp_path: Path) -> None:
    """``torch.distributed.checkpoint.save`` with ``Writer(retention=, metrics=)``, and ``async_save(tier=,
    retention=)``, whose node agent applies the policy once it committed the step in the durable store."""
    torch = pytest.importorskip("torch")
    import torch.distributed.checkpoint as dcp

    import fastckpt.torch as ft
    from fastckpt.torch.dcp import Writer

    dcp_base = f"file://{tmp_path}/dcp"
    for step in range(3):
        dcp.save({"w": torch.full((16,), float(step))}, storage_writer=Writer(
            f"{dcp_base}/step-{step}", metrics={"loss": 1.0 - step / 10}, retention=Retention(keep_last=1, grace=0)))
    listing = fastckpt.list_checkpoints(dcp_base)
    assert [(c.name, c.metrics) for c in listing] == [("step-2", {"loss": 0.8})]

    tier_base = f"file://{tmp_path}/tiered"
    for step in range(3):
        handle = ft.async_save({"w": torch.full((16,), float(step))}, f"{tier_base}/step-{step}",
                               tier=tmp_path / "tier", retention=Retention(keep_last=2, grace=0))
        handle.wait(timeout=120, durable=True)
    assert [c.name for c in fastckpt.list_checkpoints(tier_base)] == ["step-1", "step-2"]


def test_the_command_line_takes_every_rule(tmp_path: Path) -> None:
    """``fastckpt gc --keep-last 1 --best 1 --metric loss`` keeps the newest and the best by the recorded loss."""
    for step, loss in enumerate([0.3, 0.1, 0.2]):
        run_sync(commit_with(str(tmp_path / f"step-{step}"), {"loss": loss}))
    run = subprocess.run([sys.executable, "-m", "fastckpt.cli", "gc", str(tmp_path), "--keep-last", "1", "--best",
                          "1", "--metric", "loss"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert [c.name for c in fastckpt.list_checkpoints(str(tmp_path))] == ["step-1", "step-2"]
    bad = subprocess.run([sys.executable, "-m", "fastckpt.cli", "gc", str(tmp_path), "--best", "1"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 1 and "metric" in bad.stderr


async def commit_with(uri: str, metrics: dict[str, float]) -> None:
    async with CheckpointWriter(uri, config=small_config(), metrics=metrics) as writer:
        await writer.put_layout("w.bin", Layout([b"m"]))
