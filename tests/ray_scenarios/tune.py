"""A Ray Tune run whose experiment directory is synced through fastckpt's pyarrow facade while it is written.

    python -m tests.ray_scenarios.tune SPEC_JSON

SPEC: {"uri": storage URI (facade options), "path": storage_path on it, "name": experiment name, "steps": steps per
trial, "trials": trial count, "restore": resume the experiment instead of starting it}. Each trial reports every
step, so the driver's logger callbacks keep appending to the trials' ``result.json``, ``progress.csv`` and
``events.out.tfevents`` while the driver syncs the experiment directory to storage (every 0.1 s here). The last
stdout line is JSON: the trials' last steps, the steps they (re)started from, and how many ended in error.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any


def trainable(config: dict[str, Any]) -> None:
    from ray import tune

    start = 0
    checkpoint = tune.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as local, open(os.path.join(local, "step")) as f:
            start = int(f.read()) + 1
    for step in range(start, config["steps"]):
        time.sleep(0.05)
        if step % 5 == 4:
            import tempfile

            with tempfile.TemporaryDirectory() as local:
                with open(os.path.join(local, "step"), "w") as f:
                    f.write(str(step))
                tune.report({"step": step, "start": start}, checkpoint=tune.Checkpoint.from_directory(local))
        else:
            tune.report({"step": step, "start": start})


def main(spec: dict[str, Any]) -> dict[str, Any]:
    import ray
    from ray import tune

    import fastckpt.fs

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=True)
    fs = fastckpt.fs.filesystem(spec["uri"])
    path = f"{spec['path']}/{spec['name']}"
    if spec.get("restore"):
        tuner = tune.Tuner.restore(path, trainable, storage_filesystem=fs, resume_errored=True)
    else:
        tuner = tune.Tuner(
            trainable,
            param_space={"x": tune.grid_search(list(range(1, spec["trials"] + 1))), "steps": spec["steps"]},
            tune_config=tune.TuneConfig(max_concurrent_trials=2),
            run_config=tune.RunConfig(name=spec["name"], storage_path=spec["path"], storage_filesystem=fs,
                                      checkpoint_config=tune.CheckpointConfig(num_to_keep=2)))
    results = tuner.fit()
    out = {"last": sorted(r.metrics.get("step", -1) for r in results), "errors": len(results.errors),
           "starts": sorted(r.metrics.get("start", -1) for r in results)}
    ray.shutdown()
    return out


if __name__ == "__main__":
    os.environ.setdefault("TUNE_GLOBAL_CHECKPOINT_S", "0.1")
    print(json.dumps(main(json.loads(sys.argv[1]))))
