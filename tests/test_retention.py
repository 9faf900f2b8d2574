"""``gc(keep_last=K)`` / ``fastckpt gc --keep-last K`` on every backend: the committed checkpoints below a prefix
but the newest K go (marker first), uncommitted ones are left to the age rule, the newest is never removed, and a
removal cut short leaves nothing a reader takes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import fastckpt
from fastckpt import CheckpointWriter
from fastckpt._loop import run_sync
from fastckpt.checkpoint.manifest import marker_key
from fastckpt.engine.layout import Layout

from .conftest import small_config


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
    await fastckpt.gc_async(base.uri(), older_than_s=0, keep_last=1, config=small_config())
    assert not [m.key async for m in s.list(base.join("step-0"))]
    assert await committed(base.uri()) == ["step-1"]


def test_the_command_line(tmp_path: Path) -> None:
    for step in range(3):
        run_sync(commit(str(tmp_path / f"step-{step}"), b"y"))
    run = subprocess.run([sys.executable, "-m", "fastckpt.cli", "gc", str(tmp_path), "--keep-last", "1"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert [c.name for c in fastckpt.list_checkpoints(str(tmp_path))] == ["step-2"]
