"""Restores at cluster scale: a tensor state saved as S shards, loaded by N ranks (gloo processes on this host), each
shard by R = N / S of them, with ``group=`` (each byte from storage once, shared over the group) and without (every
rank alone), through a proxy in front of the S3 gateway that counts what reaches the store.

    python -m bench.scale_bench --size 512MiB --ranks 8 --replicas 1 2 4 8 [--api torch dcp] [--rounds 3]

``--api torch``: S ranks' files saved with ``fastckpt.torch.save``, loaded with ``fastckpt.torch.load(rank=r % S)``;
``--api dcp``: one DCP checkpoint of S tensors (``shard{k}``) saved with the plugin's ``Writer``, each rank loading
tensor ``shard{r % S}`` with ``dcp.load`` and the plugin's ``Reader``; ``--api safetensors`` (with ``--replicas``
equal to ``--ranks``): a Llama-shaped bf16 model in the Hugging Face layout (``bench.model_load_bench``) uploaded with
``fastckpt.upload``, every rank loading all of it with ``fastckpt.torch.load_safetensors``, as the workers of one
inference server do.

Per run: bytes and requests that reached the store (and the listings among them), wall time (from a barrier to the
slowest rank's loaded state), the largest peak RSS of a rank, every rank's tensors checked against the saved ones.
Every request reaches the gateway on a connection of its own (that is how the proxy counts them), in both modes.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from datetime import timedelta
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from fastckpt.checkpoint import InProcessBarrier  # noqa: E402
from fastckpt.config import TransferConfig, parse_size  # noqa: E402
from harness.proxy import FaultProxy  # noqa: E402

MiB = 1 << 20


def digest_of(tensor: Any) -> str:
    import torch

    return hashlib.sha256(tensor.contiguous().view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def save_shards(uri: str, size: int, shards: int) -> list[str]:
    """``size`` bytes of float32 state saved as ``shards`` ranks' tensor files of checkpoint ``uri`` (committed);
    the digest of each shard's tensor."""

    import fastckpt.torch as ft

    barrier, digests = InProcessBarrier(), [""] * shards

    def one(rank: int) -> None:
        tensor = shard_tensor(rank, size, shards)
        digests[rank] = digest_of(tensor)
        ft.save({"w": tensor}, uri, rank=rank, world_size=shards, barrier=barrier, attempt="scale")

    threads = [threading.Thread(target=one, args=(r,)) for r in range(shards)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return digests


def shard_tensor(rank: int, size: int, shards: int) -> Any:
    import torch

    return torch.empty(size // shards // 4).uniform_(generator=torch.Generator().manual_seed(rank))


def save_dcp(uri: str, size: int, shards: int) -> list[str]:
    """``size`` bytes of float32 state as ``shards`` tensors of one DCP checkpoint at ``uri``; their digests."""
    import torch.distributed.checkpoint as dcp

    from fastckpt.torch.dcp import Writer

    state = {f"shard{k}": shard_tensor(k, size, shards) for k in range(shards)}
    dcp.save(state, storage_writer=Writer(uri), no_dist=True)
    return [digest_of(state[f"shard{k}"]) for k in range(shards)]


def load_dcp(uri: str, shard: int, numel: int, group: Any) -> Any:
    """Tensor ``shard{shard}`` of the DCP checkpoint at ``uri``."""
    import torch
    import torch.distributed.checkpoint as dcp

    from fastckpt.torch.dcp import Reader

    state = {f"shard{shard}": torch.empty(numel)}
    dcp.load(state, storage_reader=Reader(uri, config=TransferConfig.from_env(), group=group))
    return state[f"shard{shard}"]


def model_digest(tensors: dict[str, Any]) -> str:
    """One digest of a model's tensors: their names and bytes, in name order."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        h.update(name.encode())
        h.update(digest_of(tensors[name]).encode())
    return h.hexdigest()


def save_model(uri: str, size: int, shards: int) -> list[str]:
    """A model of about ``size`` bytes in the Hugging Face layout uploaded to ``uri``; its ``model_digest``."""
    import fastckpt
    from bench.model_load_bench import model_tensors, write_model

    with tempfile.TemporaryDirectory() as folder:
        write_model(size, folder)
        fastckpt.upload(folder, uri)
    return [model_digest(model_tensors(size))]


def rank_main(rank: int, spec: dict[str, Any]) -> None:
    """One rank: load shard ``rank % shards`` after a barrier; record time, RSS and whether it came back exact."""
    import torch.distributed as dist

    import fastckpt.torch as ft

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(spec["port"]))
    dist.init_process_group("gloo", rank=rank, world_size=spec["ranks"], timeout=timedelta(seconds=600))
    shard = rank % spec["shards"]
    dist.barrier()
    started = time.monotonic()
    group = dist.group.WORLD if spec["group"] else None
    if spec["api"] == "safetensors":
        model = ft.load_safetensors(spec["uri"], group=group, config=TransferConfig.from_env())
    elif spec["api"] == "dcp":
        tensor = load_dcp(spec["uri"], shard, spec["size"] // spec["shards"] // 4, group)
    else:
        tensor = ft.load(spec["uri"], rank=shard, group=group, config=TransferConfig.from_env())["w"]
    seconds = time.monotonic() - started
    found = model_digest(model) if spec["api"] == "safetensors" else digest_of(tensor)
    record = {"seconds": seconds, "rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
              "exact": found == spec["digests"][shard]}
    with open(os.path.join(spec["out"], f"rank-{rank}.json"), "w") as f:
        json.dump(record, f)
    dist.destroy_process_group()


def launch(spec: dict[str, Any]) -> None:
    """The ranks of one run, forked from a process that has imported torch once."""
    import torch  # noqa: F401  (imported before the fork)

    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=rank_main, args=(r, spec)) for r in range(spec["ranks"])]
    for p in procs:
        p.start()
    for p in procs:
        p.join()


def restore(endpoint: str, uri: str, ranks: int, shards: int, digests: list[str], group: bool, api: str, size: int
            ) -> dict[str, Any]:
    """One run through a counting proxy: what reached the store, the ranks' records summed up."""
    with FaultProxy(int(endpoint.rsplit(":", 1)[1])) as proxy, tempfile.TemporaryDirectory() as out:
        proxy.throttle(1 << 30)  # never throttles: each request on a connection of its own, counted
        spec = {"uri": uri.replace(endpoint, proxy.url), "ranks": ranks, "shards": shards, "digests": digests,
                "group": group, "out": out, "port": _free_port(), "api": api, "size": size}
        subprocess.run([sys.executable, "-m", "bench.scale_bench", "--launch", json.dumps(spec)], cwd=ROOT,
                       check=True)
        records = [json.load(open(os.path.join(out, f"rank-{r}.json"))) for r in range(ranks)]
        return {"api": api, "group": group, "store_bytes": proxy.moved["down"], "requests": len(proxy.requests),
                "lists": sum("list-type=" in line for line in proxy.requests),
                "wall_s": max(r["seconds"] for r in records), "rss_mib": max(r["rss_mib"] for r in records),
                "exact": all(r["exact"] for r in records)}


def medians(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One row of a configuration's runs: medians of the figures, exact only if every run was."""
    row = dict(runs[0])
    for key in ("store_bytes", "requests", "lists", "wall_s", "rss_mib"):
        row[key] = statistics.median(r[key] for r in runs)
    row["exact"], row["runs"] = all(r["exact"] for r in runs), len(runs)
    return row


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", default="512MiB", help="the whole state, over all shards")
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--replicas", type=int, nargs="*", default=[1, 2, 4, 8])
    parser.add_argument("--api", nargs="*", default=["torch"], choices=["torch", "dcp", "safetensors"])
    parser.add_argument("--endpoint", help="an S3 endpoint to use instead of starting the JuiceFS gateway")
    parser.add_argument("--bucket", default="bench", help="the bucket (at --endpoint) the shards are saved in")
    parser.add_argument("--rounds", type=int, default=1,
                        help="runs of each restore, with and without group= in turn (medians reported)")
    parser.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    parser.add_argument("--launch", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.launch:
        launch(json.loads(args.launch))
        return
    from bench.juicefs import JuiceFSGateway

    size = parse_size(args.size)
    gateway = None if args.endpoint else JuiceFSGateway(buckets=("bench",)).start()
    endpoint = args.endpoint or gateway.endpoint  # type: ignore[union-attr]
    if gateway is not None:
        os.environ.update(gateway.env)
    os.environ["FASTCKPT_S3_IF_ABSENT"] = "best-effort"  # the gateway ignores If-None-Match
    rows = []
    try:
        for api in args.api:
            for replicas in args.replicas:
                shards = args.ranks // replicas
                if api == "safetensors" and shards != 1:
                    raise SystemExit("--api safetensors: every rank loads the whole model; give --replicas N with N "
                                     "equal to --ranks")
                uri = f"s3://{args.bucket}/scale-{os.getpid()}-{api}-{shards}?endpoint_override={endpoint}"
                save = {"dcp": save_dcp, "safetensors": save_model}.get(api, save_shards)
                digests = save(uri, size, shards)
                runs: dict[bool, list[dict[str, Any]]] = {True: [], False: []}
                for i in range(args.rounds):
                    for group in (True, False) if i % 2 == 0 else (False, True):
                        runs[group].append(restore(endpoint, uri, args.ranks, shards, digests, group, api, size))
                        print(json.dumps({"shards": shards, "replicas": replicas, **runs[group][-1]}), flush=True)
                rows += [{"shards": shards, "replicas": replicas, **medians(runs[group])} for group in (True, False)]
    finally:
        if gateway is not None:
            gateway.stop()
    print(f"\n{args.ranks} ranks, {args.size} of state, S3 gateway on 127.0.0.1\n")
    print("| API | shards | replicas | `group=` | from the store (x state) | requests | LISTs | wall s "
          "| peak RSS MiB | exact |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['api']} | {r['shards']} | {r['replicas']} | {'yes' if r['group'] else 'no'} | "
              f"{r['store_bytes'] / MiB:.0f} MiB ({r['store_bytes'] / size:.2f}x) | {r['requests']} | {r['lists']} | "
              f"{r['wall_s']:.2f} | {r['rss_mib']:.0f} | {r['exact']} |")
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"scale-{time.strftime('%Y%m%dT%H%M%S')}.json")
    with open(path, "w") as f:
        json.dump({"size": size, "ranks": args.ranks, "rows": rows}, f, indent=1)
    print(f"\nresults: {path}")


if __name__ == "__main__":
    main()
