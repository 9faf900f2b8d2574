"""Ray Tune end to end with ``RunConfig(storage_filesystem=fastckpt.fs.filesystem(...))``, on the local store and
moto: the driver syncs the live experiment directory (its logger callbacks append to every trial's files meanwhile)
without a failed sync or an unclosed client session in the log, and ``Tuner.restore`` after the driver was
SIGKILLed mid-run resumes the trials from what was synced (tests/ray_scenarios/tune.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pyarrow.fs as pafs
import pytest

import fastckpt.fs as ffs

pytest.importorskip("ray.tune")
pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
STEPS, TRIALS = 40, 4


def driver(spec: dict[str, Any]) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO), "RAY_DEDUP_LOGS": "0", "RAY_USAGE_STATS_ENABLED": "0",
           "TUNE_DISABLE_DATED_SUBDIR": "1"}
    return subprocess.Popen([sys.executable, "-m", "tests.ray_scenarios.tune", json.dumps(spec)], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def finish(proc: subprocess.Popen, timeout: float = 300) -> tuple[dict[str, Any], str]:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"the Tune run did not finish within {timeout:.0f} s:\n{err[-4000:]}")
    assert proc.returncode == 0, err[-6000:]
    log = out + err
    assert "Unclosed" not in log, [line for line in log.splitlines() if "nclosed" in line or "client_session" in line]
    lines = log.splitlines()
    failed = [i for i, line in enumerate(lines) if "failed" in line.lower() and ("sync" in line.lower()
                                                                              or "storage" in line.lower())]
    # "Saving experiment state to storage ... failed", "Last sync command failed": with the error that follows
    assert not failed, "\n".join(lines[failed[0]:failed[0] + 90]) if failed else ""
    return json.loads(out.strip().splitlines()[-1]), log


def where(backend: str, store_uri: str, tmp_path: Path) -> tuple[str, str]:
    """(facade URI, storage_path on it)."""
    if backend == "local":
        root = tmp_path / "storage"
        root.mkdir()
        return str(root), str(root)
    bucket_and_key = store_uri.split("://", 1)[1].split("?", 1)[0]
    return store_uri, bucket_and_key


@pytest.mark.parametrize("backend", ["local", "s3"])
def test_tune_syncs_a_live_experiment_and_restores_after_the_driver_is_killed(backend: str, store_uri: str,
                                                                               tmp_path: Path) -> None:
    uri, path = where(backend, store_uri, tmp_path)
    spec = {"uri": uri, "path": path, "name": "live", "steps": STEPS, "trials": TRIALS}
    result, _ = finish(driver(spec))
    assert result == {"last": [STEPS - 1] * TRIALS, "errors": 0, "starts": [0] * TRIALS}

    fs = ffs.filesystem(uri)
    spec = {**spec, "name": "killed"}
    proc = driver(spec)
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and proc.poll() is None:  # until two trials have a second checkpoint synced
        found = fs.get_file_info(pafs.FileSelector(f"{path}/killed", recursive=True, allow_not_found=True))
        if sum(i.base_name == "checkpoint_000001" for i in found) >= 2:
            break
        time.sleep(0.2)
    assert proc.poll() is None, "the run ended before it could be killed"
    os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate()
    restored, log = finish(driver({**spec, "restore": True}))
    if restored["errors"]:
        (tmp_path / "restore.log").write_text(log)
    assert restored["last"] == [STEPS - 1] * TRIALS and restored["errors"] == 0, (restored, str(tmp_path))
    assert sum(start > 0 for start in restored["starts"]) >= 2, (restored, log[-3000:])
