"""The Ray barrier: 4 ranks as Ray tasks (separate worker processes) on ``ray.init(num_cpus=2)``.

Ray runs in a subprocess (tests/ranks/ray_job.py) under a hard timeout; this module is the only one
that starts Ray.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import fastckpt
from fastckpt import CheckpointError

pytest.importorskip("ray")
pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]


def test_ray_barrier(tmp_path: Path) -> None:
    base = f"{tmp_path}/runs"
    work = tmp_path / "work"
    work.mkdir()
    proc = subprocess.run([sys.executable, "-m", "tests.ranks.ray_job", base, str(work)], cwd=REPO,
                          capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])

    ok = out["ok"]
    assert all(r["ok"] for r in ok), ok
    assert len({r["attempt"] for r in ok}) == 1  # agreed through the barrier (no attempt= given)
    assert {r["files"] for r in ok} == {2}
    assert len({r["pid"] for r in ok} | {out["driver_pid"]}) > 1  # ranks ran in Ray worker processes
    attempt = ok[0]["attempt"]
    files = fastckpt.download_checkpoint(f"{base}/ok", tmp_path / "restored")
    assert sorted(Path(f.path).name for f in files) == ["shard-1.bin", "shard-3.bin"]
    assert (tmp_path / "restored" / "shard-3.bin").read_bytes() == f"{attempt}/3".encode() * 100
    assert fastckpt.verify(f"{base}/ok").ok

    fail = out["fail"]
    assert fail[2] == {"ok": False, "error": "ValueError: rank 2 broke", "pid": fail[2]["pid"]}
    for r in (0, 1, 3):
        assert not fail[r]["ok"] and "rank 2 failed: ValueError: rank 2 broke" in fail[r]["error"], fail[r]
    with pytest.raises(CheckpointError, match="not committed"):
        fastckpt.open_checkpoint(f"{base}/fail")

    absent = out["absent"]
    for r in absent:
        assert "BarrierTimeoutError" in r["error"] and "rank 3 of 4 never arrived" in r["error"], absent
    assert fastckpt.latest(base).endswith("/runs/ok")
