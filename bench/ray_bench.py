"""Ray Train checkpointing through ``RunConfig(storage_filesystem=...)``: fastckpt's facade vs pyarrow's S3FileSystem.

    python -m bench.ray_bench --size 2GiB --reports 3 --rounds 2
    python -m bench.ray_bench --size 256MiB --workers 2 --knob part_size=64MiB

Both filesystems talk to the same local S3 server (the JuiceFS gateway of ``bench/juicefs.py``, or
``--endpoint``), in interleaved rounds, from a TorchTrainer with ``--workers`` CPU workers in one Ray
session. Each worker reports a synthetic checkpoint (``bench/generate.py``; ``--size`` split over the
workers, each worker's files below ``rank<N>/``) ``--reports`` times; a second ``fit()`` of the same
run restores the last one with ``get_checkpoint().to_directory()``. Timed in the workers:
``ray.train.report`` (a sync upload through ``pyarrow.fs.copy_files``) and the restore. Peak memory is
the worker's ``VmHWM`` over each timed window (reset before it). Every upload is checked on the server
(names and sizes) and every restore against the source files (sizes and XXH3), so a silently failed
transfer is reported, not timed.
Results: a table on stdout and JSON in ``bench/results/ray-<time>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

import xxhash

from bench.juicefs import ACCESS_KEY, SECRET_KEY, JuiceFSGateway, delete_prefix

MiB = 1 << 20
BUCKET = "bench"
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def vm_hwm_reset() -> None:
    """Restart this process's peak-RSS counter (Linux ``clear_refs`` 5)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def vm_mib(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return 0.0


def digests(root: str) -> dict[str, tuple[int, str]]:
    """relative path -> (size, XXH3-128) of every file below ``root``."""
    out = {}
    for dirpath, _, names in os.walk(root):
        for name in names:
            path = os.path.join(dirpath, name)
            h = xxhash.xxh3_128()
            with open(path, "rb") as f:
                while chunk := f.read(8 * MiB):
                    h.update(chunk)
            out[os.path.relpath(path, root)] = (os.path.getsize(path), h.hexdigest())
    return out


def train_func(config: dict[str, Any]) -> None:
    """Save mode: report the generated checkpoint ``reports`` times. Restore mode: download the last one."""
    import ray.train

    from bench.generate import generate

    rank = ray.train.get_context().get_world_rank()
    record: dict[str, Any] = {"engine": config["engine"], "round": config["round"], "rank": rank,
                              "mode": config["mode"], "pid": os.getpid(), "windows": []}
    scratch = tempfile.mkdtemp(dir=config["scratch"])
    try:
        source = os.path.join(config["scratch"], f"source-{rank}")
        if not os.path.isdir(source):  # generated once per rank, shared by engines and rounds (untimed)
            generate(os.path.join(source + ".tmp", f"rank{rank}"), config["bytes_per_worker"], ranks=1, seed=rank)
            os.rename(source + ".tmp", source)
        if config["mode"] == "save":
            for i in range(config["reports"]):
                vm_hwm_reset()
                rss0, t0 = vm_mib("VmRSS"), time.perf_counter()
                ray.train.report({"report": i}, checkpoint=ray.train.Checkpoint.from_directory(source))
                record["windows"].append({"seconds": time.perf_counter() - t0, "rss_before_mib": rss0,
                                          "peak_mib": vm_mib("VmHWM")})
        else:
            checkpoint = ray.train.get_checkpoint()
            assert checkpoint is not None, "nothing to restore"
            target = os.path.join(scratch, "restored")
            vm_hwm_reset()
            rss0, t0 = vm_mib("VmRSS"), time.perf_counter()
            checkpoint.to_directory(target)
            record["windows"].append({"seconds": time.perf_counter() - t0, "rss_before_mib": rss0,
                                      "peak_mib": vm_mib("VmHWM")})
            want, got = digests(source), digests(target)
            mine = {k: v for k, v in got.items() if k in want}
            record["verified"] = mine == want
        record["bytes"] = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(source) for f in fs)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    with open(os.path.join(config["records"], f"{config['engine']}-{config['round']}-{config['mode']}-{rank}.json"),
              "w") as f:
        json.dump(record, f)


def make_filesystem(engine: str, endpoint: str, knobs: dict[str, Any]) -> Any:
    import pyarrow.fs as pafs

    if engine == "pyarrow":
        host = endpoint.split("://", 1)[1]
        return pafs.S3FileSystem(access_key=os.environ["AWS_ACCESS_KEY_ID"],
                                 secret_key=os.environ["AWS_SECRET_ACCESS_KEY"], endpoint_override=host,
                                 scheme=endpoint.split("://", 1)[0], region=os.environ.get("AWS_DEFAULT_REGION"))
    import fastckpt.fs
    from fastckpt import TransferConfig

    return fastckpt.fs.filesystem(f"s3://{BUCKET}?endpoint_override={endpoint}", TransferConfig.from_env(**knobs))


def server_files(client: Any, prefix: str) -> dict[str, int]:
    """relative key -> size of the objects below ``prefix`` (directory markers and fastckpt's digest records, which
    are its own bookkeeping beside the files, left out)."""
    from bench.verify import is_record

    out = {}
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix + "/"):
        for obj in page.get("Contents", []):
            rel = obj["Key"][len(prefix) + 1:]
            if not obj["Key"].endswith("/") and not (obj["Size"] == 0 and is_record(rel)):
                out[rel] = obj["Size"]
    return out


def run(args: argparse.Namespace, endpoint: str, client: Any, work: str) -> list[dict[str, Any]]:
    import ray
    from ray.train import CheckpointConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from bench.run import parse_knobs

    knobs = parse_knobs(args.knob)
    knobs.setdefault("fsync", False)  # as in bench.run without --durable: peers never fsync either
    records = os.path.join(work, "records")
    os.makedirs(records, exist_ok=True)
    results = []
    for rnd in range(args.rounds):
        for engine in args.engines.split(","):
            fs = make_filesystem(engine, endpoint, knobs)
            name = f"{engine}-{rnd}"
            for mode in ("save", "restore"):
                config = {"engine": engine, "round": rnd, "mode": mode, "reports": args.reports,
                          "bytes_per_worker": args.size // args.workers, "scratch": work, "records": records}
                trainer = TorchTrainer(
                    train_func, train_loop_config=config,
                    scaling_config=ScalingConfig(num_workers=args.workers, use_gpu=False,
                                                 resources_per_worker={"CPU": 1}),
                    run_config=RunConfig(name=name, storage_path=f"{BUCKET}/ray", storage_filesystem=fs,
                                         checkpoint_config=CheckpointConfig(num_to_keep=1)))
                result = trainer.fit()
                entry: dict[str, Any] = {"engine": engine, "round": rnd, "mode": mode, "workers": []}
                for rank in range(args.workers):
                    with open(os.path.join(records, f"{engine}-{rnd}-{mode}-{rank}.json")) as f:
                        entry["workers"].append(json.load(f))
                if mode == "save":
                    prefix = result.checkpoint.path.split("/", 1)[1]
                    on_server = server_files(client, prefix)
                    sources = [digests(os.path.join(work, f"source-{r}")) for r in range(args.workers)]
                    expected = {k: v[0] for s in sources for k, v in s.items()}
                    entry["verified"] = on_server == expected
                results.append(entry)
                print(_line(entry), flush=True)
            delete_prefix(client, BUCKET, f"ray/{name}")
    ray.shutdown()
    return results


def _line(entry: dict[str, Any]) -> str:
    windows = [w for rec in entry["workers"] for w in rec["windows"]]
    verified = entry.get("verified", all(r.get("verified") for r in entry["workers"]))
    seconds = ", ".join(f"{w['seconds']:.2f}" for w in windows)
    return (f"{entry['engine']:9} round {entry['round']} {entry['mode']:8} s per window: {seconds}  "
            f"peak RSS MiB: {max(w['peak_mib'] for w in windows):.0f}  verified: {verified}")


def summarize(results: list[dict[str, Any]], size: int) -> list[dict[str, Any]]:
    """Median seconds, GiB/s and worst peak RSS per engine and mode (verified runs only)."""
    rows = []
    for engine in sorted({r["engine"] for r in results}):
        for mode in ("save", "restore"):
            entries = [r for r in results if r["engine"] == engine and r["mode"] == mode]
            ok = [r for r in entries if r.get("verified", all(w.get("verified") for w in r["workers"]))]
            # a window ends when the slowest worker is done: the per-report time is the max over workers
            per_window = [max(ws) for r in ok for ws in zip(*[[w["seconds"] for w in rec["windows"]]
                                                              for rec in r["workers"]], strict=True)]
            peaks = [w["peak_mib"] for r in ok for rec in r["workers"] for w in rec["windows"]]
            rows.append({"engine": engine, "mode": "upload per report" if mode == "save" else "restore",
                         "runs": len(entries), "verified": len(ok),
                         "median_s": statistics.median(per_window) if per_window else None,
                         "gib_per_s": size / (1 << 30) / statistics.median(per_window) if per_window else None,
                         "peak_rss_mib": max(peaks) if peaks else None})
    return rows


def main(argv: list[str] | None = None) -> int:
    from fastckpt.config import parse_size

    parser = argparse.ArgumentParser(prog="bench.ray_bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="2GiB", type=parse_size, help="checkpoint bytes per report (all workers)")
    parser.add_argument("--reports", type=int, default=3, help="checkpoints reported per run")
    parser.add_argument("--rounds", type=int, default=1, help="interleaved rounds of every engine")
    parser.add_argument("--workers", type=int, default=1, help="Ray Train workers (1 CPU each)")
    parser.add_argument("--engines", default="fastckpt,pyarrow")
    parser.add_argument("--endpoint", help="an S3 server to use instead of a fresh JuiceFS gateway "
                                           "(credentials from the environment, bucket 'bench')")
    parser.add_argument("--knob", action="append", default=[], metavar="FIELD=VALUE",
                        help="fastckpt TransferConfig override (default fsync=False, as for the peers)")
    parser.add_argument("--workdir", help="scratch directory (default: a temporary one)")
    parser.add_argument("--out", default=RESULTS, help="directory for the JSON results")
    args = parser.parse_args(argv)

    work = tempfile.mkdtemp(prefix="fastckpt-raybench-", dir=args.workdir)
    env = {"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY, "AWS_DEFAULT_REGION": "us-east-1",
           # pyarrow's S3 client sends CRC trailers by default; the gateway answers HTTP 411 and pyarrow
           # reports success anyway (see bench/README.md)
           "AWS_REQUEST_CHECKSUM_CALCULATION": "when_required", "RAY_DEDUP_LOGS": "0",
           "RAY_USAGE_STATS_ENABLED": "0", "RAY_TRAIN_V2_ENABLED": "1",
           "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.abspath(__file__)))}
    if args.endpoint:
        env = {k: v for k, v in env.items() if not k.startswith("AWS_") or k not in os.environ}
    os.environ.update(env)
    import ray

    gateway = None if args.endpoint else JuiceFSGateway(os.path.join(work, "juicefs"), (BUCKET,)).start()
    try:
        endpoint = args.endpoint or gateway.endpoint
        import boto3

        client = boto3.session.Session().client("s3", endpoint_url=endpoint, region_name="us-east-1")
        ray.init(num_cpus=max(2, args.workers), include_dashboard=False, runtime_env={"env_vars": env})
        started = time.time()
        results = run(args, endpoint, client, work)
    finally:
        if gateway is not None:
            gateway.stop()
        shutil.rmtree(work, ignore_errors=True)
    rows = summarize(results, args.size)
    print(f"\nRay Train checkpoint of {args.size / MiB:.0f} MiB over {args.workers} worker(s), "
          f"{args.reports} reports x {args.rounds} round(s):")
    print(f"{'engine':10}{'what':20}{'verified':>10}{'median s':>10}{'GiB/s':>8}{'peak RSS MiB':>14}")
    for r in rows:
        fmt = (lambda v, spec: format(v, spec) if v is not None else "-")  # noqa: E731
        print(f"{r['engine']:10}{r['mode']:20}{r['verified']:>6}/{r['runs']:<3}{fmt(r['median_s'], '>10.2f')}"
              f"{fmt(r['gib_per_s'], '>8.2f')}{fmt(r['peak_rss_mib'], '>14.0f')}")
    os.makedirs(args.out, exist_ok=True)
    out = os.path.join(args.out, f"ray-{time.strftime('%Y%m%d-%H%M%S')}.json")
    with open(out, "w") as f:
        json.dump({"args": {k: v for k, v in vars(args).items()}, "started": started, "summary": rows,
                   "results": results, "python": sys.version}, f, indent=1)
    print(f"results: {out}")
    return 0 if all(r["verified"] == r["runs"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
