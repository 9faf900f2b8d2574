"""Third-party backends: a store found through the ``fastckpt.stores`` entry-point group works in the
API, the CLI and ``doctor``, and fastckpt's own conformance suite runs against it (``--store-uri``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PLUGIN = Path(__file__).resolve().parents[1] / "plugin"

pytestmark = pytest.mark.timeout(300)


def run(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``python args...`` with the demo plug-in installed (on the path, with its dist-info)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(PLUGIN), str(REPO)]),
           "FASTCKPT_DEMO_ROOT": str(tmp_path / "root")}
    return subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=280)


def test_plugin_store_in_cli_and_doctor(tmp_path: Path) -> None:
    src = tmp_path / "model.bin"
    src.write_bytes(os.urandom(3 << 20))
    up = run(tmp_path, "-m", "fastckpt.cli", "cp", str(src), "demo://bkt/run1/model.bin")
    assert up.returncode == 0, up.stderr
    assert (tmp_path / "root" / "bkt" / "run1" / "model.bin").read_bytes() == src.read_bytes()
    down = run(tmp_path, "-m", "fastckpt.cli", "cp", "demo://bkt/run1/model.bin", str(tmp_path / "back.bin"))
    assert down.returncode == 0, down.stderr
    assert (tmp_path / "back.bin").read_bytes() == src.read_bytes()
    doctor = run(tmp_path, "-m", "fastckpt.cli", "doctor")
    assert "demo" in doctor.stdout and "available" in doctor.stdout.split("demo", 1)[1].splitlines()[0]
    bad = run(tmp_path, "-m", "fastckpt.cli", "cp", str(src), "demo://bkt/x?color=red")
    assert bad.returncode == 1 and "unknown option" in bad.stderr


def test_conformance_suite_runs_against_a_plugin(tmp_path: Path) -> None:
    res = run(tmp_path, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/stores/test_conformance.py",
              "tests/checkpoint/test_checkpoint_writers.py", "--store-uri", "demo://bkt/conf")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    summary = res.stdout.strip().splitlines()[-1]
    assert "failed" not in summary and int(summary.split(" passed")[0].split()[-1]) >= 20, summary
    assert any((tmp_path / "root" / "bkt" / "conf").iterdir())  # the suite really wrote through the plug-in
