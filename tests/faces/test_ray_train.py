"""Ray Train end to end: TorchTrainer (2 CPU workers) with RunConfig(storage_filesystem=fastckpt.fs.filesystem(...))
on the local moto S3 server. Each group of scenarios runs in one subprocess (one Ray session,
ray.init(num_cpus=2)) under a hard timeout: tests/ray_scenarios/train.py."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pyarrow.fs as pafs
import pytest

import fastckpt.fs as ffs
from fastckpt.integrity import FileDigest

from ..ray_scenarios.train import shard_bytes, weight

pytest.importorskip("ray.train")
torch = pytest.importorskip("torch")
pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
SHARD = 6 << 20  # two 5 MiB parts: every shard goes through a multipart upload
FILES = {"rank0.pt", "rank1.pt", "shard-0.bin", "shard-1.bin"}


def run_scenarios(uri: str, path: str, work: Path, runs: list[dict[str, Any]], timeout: float) -> list[dict[str, Any]]:
    spec = {"uri": uri, "path": path, "work": str(work), "runs": runs}
    env = {**os.environ, "PYTHONPATH": str(REPO), "RAY_DEDUP_LOGS": "0", "RAY_USAGE_STATS_ENABLED": "0",
           "RAY_TRAIN_V2_ENABLED": "1", "TUNE_DISABLE_DATED_SUBDIR": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "tests.ray_scenarios.train", json.dumps(spec)], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the driver and the Ray processes it started
        out, err = proc.communicate()
        pytest.fail(f"Ray scenarios did not finish within {timeout:.0f}s:\n{err[-6000:]}")
    assert proc.returncode == 0, err[-6000:]
    return json.loads(out.strip().splitlines()[-1])["runs"]


def events(run: dict[str, Any], kind: str) -> list[tuple[int, int]]:
    """Sorted (epoch, rank) of the run's worker events of ``kind``."""
    return sorted((e["epoch"], e["rank"]) for e in run["events"] if e["kind"] == kind)


def check_checkpoint(fs: pafs.FileSystem, path: str, epoch: int | None = None, files: set[str] = FILES) -> int:
    """``files`` of both ranks, whole and verified (full reads check the recorded digests), all of one
    epoch (``epoch`` if given); returns the epoch."""
    assert {i.base_name for i in fs.get_file_info(pafs.FileSelector(path)) if i.is_file} == files, path
    data = {}
    for name in sorted(files):  # uploaded by the engine: every object records its digest
        bucket, key = fs.handler.split(f"{path}/{name}")
        store = fs.handler.run(fs.handler.store(bucket))
        meta = fs.handler.run(store.head(key))
        assert FileDigest.from_metadata(meta.size, meta.metadata) is not None, name
        with fs.open_input_stream(f"{path}/{name}") as f:
            data[name] = f.read()
    for rank in (0, 1):
        if f"rank{rank}.pt" in files:
            state = torch.load(io.BytesIO(data[f"rank{rank}.pt"]))
            epoch = state["epoch"] if epoch is None else epoch
            assert state["epoch"] == epoch, (path, rank)
            assert float(state["model"]["weight"].flatten()[0]) == weight(epoch, rank)
    assert epoch is not None
    for rank in (0, 1):
        if f"shard-{rank}.bin" in files:
            assert data[f"shard-{rank}.bin"] == shard_bytes(epoch, rank, SHARD), (path, rank)
    return epoch


def checkpoint_dirs(fs: pafs.FileSystem, experiment: str) -> list[str]:
    return sorted(i.path for i in fs.get_file_info(pafs.FileSelector(experiment))
                  if i.type == pafs.FileType.Directory and i.base_name.startswith("checkpoint_"))


def test_train_keep_two_then_resume_with_new_fit(s3_uri: str, tmp_path: Path) -> None:
    """(a) 3 epochs, ranks report different files, num_to_keep=2, a transient storage error retried;
    (c) a new fit() with the same name resumes from the last checkpoint."""
    fs, base = ffs.from_uri(s3_uri)
    tokens = str(tmp_path / "tokens")
    fault = {"tokens": tokens, "op": "put_part", "match": "shard-1.bin", "nth": 1, "transient": True}
    first, resumed = run_scenarios(s3_uri, base, tmp_path, [
        {"name": "run", "epochs": 3, "shard_bytes": SHARD, "num_to_keep": 2, "fault": fault},
        {"name": "run", "epochs": 4, "shard_bytes": SHARD, "num_to_keep": 2},
    ], timeout=420)

    assert first["ok"], first.get("traceback")
    assert first["filesystem"] == "FacadeFileSystem"
    assert events(first, "report") == [(e, r) for e in range(3) for r in (0, 1)]
    assert len({e["pid"] for e in first["events"]}) == 2  # two worker processes
    assert (Path(tokens) / "fired").read_text().endswith("shard-1.bin")  # the part failed once, was retried
    assert len(first["on_storage"]) == 2 and sorted(first["registered"]) == first["on_storage"]
    assert first["checkpoint"] == first["on_storage"][-1]

    assert resumed["ok"], resumed.get("traceback")
    assert sorted((e["epoch"], e["rank"], e["weight"], e["shard_ok"]) for e in resumed["events"]
                  if e["kind"] == "resume") == [(2, r, weight(2, r), True) for r in (0, 1)]
    assert events(resumed, "report") == [(3, 0), (3, 1)]
    kept = checkpoint_dirs(fs, f"{base}/run")
    assert kept == resumed["on_storage"] == [first["checkpoint"], resumed["checkpoint"]]  # epoch 1's was deleted
    assert sorted(resumed["registered"]) == kept
    assert check_checkpoint(fs, kept[0]) == 2
    assert check_checkpoint(fs, kept[1]) == 3


def test_worker_failure_and_storage_failure(s3_uri: str, tmp_path: Path) -> None:
    """(b) max_failures=1 and a worker raising once: resumes from the last checkpoint with its state;
    (d) an upload failing for good surfaces as the run's error, and the partial checkpoint is never
    registered: a new fit resumes from a checkpoint before it."""
    fs, base = ffs.from_uri(s3_uri)
    tokens = str(tmp_path / "tokens")
    fault = {"tokens": tokens, "op": "complete", "match": "shard-1.bin", "nth": 3}  # rank 1's epoch-2 upload
    worker_failure, storage_failure, after = run_scenarios(s3_uri, base, tmp_path, [
        {"name": "flaky-worker", "epochs": 3, "shard_bytes": SHARD, "max_failures": 1, "fail_worker": [2, 1]},
        {"name": "flaky-storage", "epochs": 3, "shard_bytes": SHARD, "fault": fault},
        {"name": "flaky-storage", "epochs": 3, "shard_bytes": SHARD},
    ], timeout=480)

    assert worker_failure["ok"], worker_failure.get("traceback")
    assert events(worker_failure, "raise") == [(2, 1)]
    # rank 1 raises once its epoch-1 report returned, which Ray lets happen only after the controller
    # consumed its epoch-0 result: the restart resumes from epoch 0 or 1, whichever was registered last
    resumes = [e for e in worker_failure["events"] if e["kind"] == "resume"]
    assert len(resumes) == 2 and {e["rank"] for e in resumes} == {0, 1}, worker_failure["events"]
    resumed_from = resumes[0]["epoch"]
    assert resumed_from in (0, 1) and all(e["epoch"] == resumed_from for e in resumes)
    assert all(e["weight"] == weight(resumed_from, e["rank"]) and e["shard_ok"] for e in resumes)
    assert (2, 0) in events(worker_failure, "report") and (2, 1) in events(worker_failure, "report")
    assert sorted(check_checkpoint(fs, path) for path in worker_failure["registered"]) == [0, 1, 2]
    assert check_checkpoint(fs, worker_failure["checkpoint"]) == 2

    assert not storage_failure["ok"]
    assert "injected permanent failure" in storage_failure["error"] + storage_failure["traceback"]
    assert (Path(tokens) / "fired").read_text().endswith("shard-1.bin")
    reports = events(storage_failure, "report")  # rank 0's epoch-2 files went up; rank 1's upload failed
    assert [(e, r) for e in (0, 1) for r in (0, 1)] == reports[:4] and (2, 1) not in reports
    epochs = {}
    for path in storage_failure["on_storage"]:  # what is on storage is whole or absent
        names = {i.base_name for i in fs.get_file_info(pafs.FileSelector(path)) if i.is_file}
        epochs[path] = check_checkpoint(fs, path, files=names)
    partial = [p for p, e in epochs.items() if e == 2]
    assert len(partial) == 1 and fs.get_file_info(f"{partial[0]}/shard-1.bin").type == pafs.FileType.NotFound

    assert after["ok"], after.get("traceback")
    resumes = [e for e in after["events"] if e["kind"] == "resume"]
    assert len(resumes) == 2 and {e["rank"] for e in resumes} == {0, 1}, after["events"]
    resumed_from = resumes[0]["epoch"]
    assert resumed_from in (0, 1) and all(e["epoch"] == resumed_from and e["shard_ok"] for e in resumes)
    assert events(after, "report") == [(e, r) for e in range(resumed_from + 1, 3) for r in (0, 1)]
    assert partial[0] not in after["registered"]  # the partial checkpoint was never registered
    assert sorted(check_checkpoint(fs, path) for path in after["registered"]) == [0, 1, 2]
    assert check_checkpoint(fs, after["checkpoint"]) == 2
