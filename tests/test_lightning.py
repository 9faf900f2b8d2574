"""fastckpt's Lightning ``CheckpointIO`` with a real Trainer on CPU and checkpoints on moto: a fit killed after two
epochs and resumed from its stored checkpoint ends with the same weights as an uninterrupted fit; ``save_top_k``
removes old checkpoints; every kept one is a committed, verified fastckpt checkpoint."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

pytest.importorskip("lightning")

import fastckpt

from .servers.s3 import BUCKET

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[1]


def fit(tmp_path: Path, endpoint: str, dirpath: str, **spec: object) -> tuple[int, dict]:
    out = tmp_path / f"weights-{uuid.uuid4().hex[:6]}.json"
    env = {**os.environ, "AWS_ENDPOINT_URL": endpoint}
    run = subprocess.run([sys.executable, "-m", "tests.ranks.lightning_job",
                          json.dumps({"dirpath": f"fastckpt://{dirpath}", "out": str(out), **spec})],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    if run.returncode not in (0, -signal.SIGKILL):
        raise AssertionError(run.stdout[-3000:] + run.stderr[-3000:])
    return run.returncode, json.loads(out.read_text()) if out.exists() else {}


def committed(base: str) -> list[str]:
    return sorted(c.name for c in fastckpt.list_checkpoints(base) if c.state == "committed")


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_killed_fit_resumes_to_the_same_weights(tmp_path: Path, moto_server, monkeypatch: pytest.MonkeyPatch,
                                                asynchronous: bool) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL", moto_server.endpoint)
    run = f"s3://{BUCKET}/lightning-{uuid.uuid4().hex[:8]}"
    _, straight = fit(tmp_path, moto_server.endpoint, f"{run}/straight", epochs=4, asynchronous=asynchronous)
    assert committed(f"{run}/straight") == ["epoch=2.ckpt", "epoch=3.ckpt"]  # save_top_k=2 removed the others

    code, _ = fit(tmp_path, moto_server.endpoint, f"{run}/killed", epochs=4, die_at=2, asynchronous=asynchronous)
    assert code == -signal.SIGKILL
    assert committed(f"{run}/killed") == ["epoch=0.ckpt", "epoch=1.ckpt"]
    assert fastckpt.verify(f"{run}/killed/epoch=1.ckpt").ok

    _, resumed = fit(tmp_path, moto_server.endpoint, f"{run}/killed", epochs=4, asynchronous=asynchronous,
                     ckpt_path=f"fastckpt://{run}/killed/epoch=1.ckpt")
    assert resumed == straight
    assert committed(f"{run}/killed") == ["epoch=2.ckpt", "epoch=3.ckpt"]
