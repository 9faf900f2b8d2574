"""Ray Train (TorchTrainer, 2 CPU workers) persisting checkpoints through fastckpt's pyarrow facade.

    python -m tests.ray_scenarios.train SPEC_JSON

SPEC: {"uri": storage URI (facade options), "path": storage_path on it, "work": local scratch dir,
"runs": [run, ...]}; each run: {"name", "epochs", "shard_bytes", "num_to_keep", "max_failures",
"fail_worker": [epoch, rank] (raise once), "fault": {NthRequestFault arguments} (store wrapper)}.
Runs go one after another in one Ray session; runs with the same name resume. The last stdout line is
JSON: per run the fit outcome, the checkpoints Ray registered, the checkpoint directories on storage
after the run and the workers' events (reports, resumes).
"""

from __future__ import annotations

import functools
import glob
import json
import os
import random
import sys
import tempfile
import time
import traceback
from typing import Any

import pyarrow.fs as pafs

MiB = 1 << 20


def shard_bytes(epoch: int, rank: int, size: int) -> bytes:
    """The content rank ``rank`` writes at ``epoch`` (recomputable by the test)."""
    return random.Random(epoch * 1000 + rank).randbytes(size)


def weight(epoch: int, rank: int) -> float:
    """Every parameter of rank ``rank``'s model after ``epoch``."""
    return float(epoch * 10 + rank)


def train_func(config: dict[str, Any]) -> None:
    import ray.train
    import torch

    ctx = ray.train.get_context()
    rank = ctx.get_world_rank()
    events = config["events"]

    def event(**fields: Any) -> None:
        fields.update(run=config["run"], rank=rank, pid=os.getpid(), time=time.time())
        with open(os.path.join(events, f"{config['run']}-{rank}-{time.time_ns()}.json"), "w") as f:
            json.dump(fields, f)

    model = torch.nn.Linear(4, 2)
    start = 0
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as local:
            state = torch.load(os.path.join(local, f"rank{rank}.pt"))
            model.load_state_dict(state["model"])
            start = state["epoch"] + 1
            shard = open(os.path.join(local, f"shard-{rank}.bin"), "rb").read()
        event(kind="resume", epoch=state["epoch"], weight=float(model.weight.flatten()[0]),
              shard_ok=shard == shard_bytes(state["epoch"], rank, config["shard_bytes"]),
              checkpoint=checkpoint.path)
    for epoch in range(start, config["epochs"]):
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(weight(epoch, rank))
        fail = config.get("fail_worker")
        if fail and [epoch, rank] == fail:
            try:
                os.close(os.open(os.path.join(events, f"{config['run']}.failed"), os.O_CREAT | os.O_EXCL))
                event(kind="raise", epoch=epoch)
                raise RuntimeError(f"injected worker failure at epoch {epoch} on rank {rank}")
            except FileExistsError:
                pass
        with tempfile.TemporaryDirectory(dir=config["tmp"]) as tmp:
            torch.save({"model": model.state_dict(), "epoch": epoch}, os.path.join(tmp, f"rank{rank}.pt"))
            with open(os.path.join(tmp, f"shard-{rank}.bin"), "wb") as f:
                f.write(shard_bytes(epoch, rank, config["shard_bytes"]))
            ray.train.report({"epoch": epoch}, checkpoint=ray.train.Checkpoint.from_directory(tmp))
        event(kind="report", epoch=epoch)


def make_filesystem(spec: dict[str, Any], run: dict[str, Any]) -> Any:
    import fastckpt.fs
    from fastckpt import TransferConfig

    from .faults import NthRequestFault

    config = TransferConfig.from_env(part_size=5 * MiB, multipart_threshold=5 * MiB, max_in_flight=4,
                                     retries=3, backoff_base=0.05, backoff_max=0.2)
    wrapper = functools.partial(NthRequestFault, **run["fault"]) if run.get("fault") else None
    return fastckpt.fs.filesystem(spec["uri"], config=config, store_wrapper=wrapper)


def fit(spec: dict[str, Any], run: dict[str, Any]) -> dict[str, Any]:
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    fs = make_filesystem(spec, run)
    events = os.path.join(spec["work"], "events")
    tmp = os.path.join(spec["work"], "tmp")
    os.makedirs(events, exist_ok=True)
    os.makedirs(tmp, exist_ok=True)
    config = {"run": run["name"], "epochs": run["epochs"], "shard_bytes": run["shard_bytes"], "events": events,
              "tmp": tmp, "fail_worker": run.get("fail_worker")}
    trainer = TorchTrainer(
        train_func,
        train_loop_config=config,
        scaling_config=ScalingConfig(num_workers=2, use_gpu=False, resources_per_worker={"CPU": 1}),
        run_config=RunConfig(
            name=run["name"], storage_path=spec["path"], storage_filesystem=fs,
            checkpoint_config=CheckpointConfig(num_to_keep=run.get("num_to_keep")),
            failure_config=FailureConfig(max_failures=run.get("max_failures", 0)),
        ),
    )
    started = time.monotonic()
    out: dict[str, Any] = {"name": run["name"]}
    try:
        result = trainer.fit()
        out.update(ok=True, checkpoint=result.checkpoint.path if result.checkpoint else None,
                   registered=[c.path for c, _ in (result.best_checkpoints or [])],
                   filesystem=type(result.checkpoint.filesystem).__name__ if result.checkpoint else None)
    except Exception as exc:
        out.update(ok=False, error=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc()[-3000:])
    out["seconds"] = round(time.monotonic() - started, 1)
    listing = fs.get_file_info(pafs.FileSelector(f"{spec['path']}/{run['name']}", allow_not_found=True))
    out["on_storage"] = sorted(i.path for i in listing if i.type == pafs.FileType.Directory
                               and i.base_name.startswith("checkpoint_"))
    found = []
    for name in glob.glob(os.path.join(events, f"{run['name']}-*.json")):
        with open(name) as f:
            found.append(json.load(f))
        os.unlink(name)
    out["events"] = sorted(found, key=lambda e: e["time"])
    return out


def main() -> None:
    spec = json.loads(sys.argv[1])
    import ray

    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=200 * MiB, log_to_driver=True,
             runtime_env={"env_vars": {"PYTHONPATH": os.environ.get("PYTHONPATH", "")}})
    try:
        results = [fit(spec, run) for run in spec["runs"]]
    finally:
        ray.shutdown()
    print(json.dumps({"runs": results}))


if __name__ == "__main__":
    main()
