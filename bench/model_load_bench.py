"""Loading a safetensors model (Hugging Face layout) from S3 into tensors: fastckpt against the loaders inference
servers use.

    python -m bench.model_load_bench --size 2GiB --rounds 3 --out bench/results/model-load.json

The model is Llama-shaped (bf16 embedding, per-layer attention and MLP matrices and norms) in 3 shards with an
index, uploaded once to the JuiceFS S3 gateway on 127.0.0.1. Each engine loads every tensor into host memory in its
own process, rounds interleaved; the tensors are compared with the ones written. Engines:

- ``fastckpt``: ``fastckpt.torch.load_safetensors`` (verified against the digests the upload recorded);
- ``runai``: Run:ai Model Streamer's ``SafetensorsStreamer`` (what vLLM's ``--load-format runai_streamer`` uses),
  each streamed tensor cloned out of its buffer;
- ``s5cmd+load_file``: ``s5cmd cp`` to a local directory, then ``safetensors.torch.load_file`` of each shard.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from bench.juicefs import JuiceFSGateway  # noqa: E402
from bench.spec_worker import answer, run_spec, worker_flag  # noqa: E402
from bench.state_bench import s3_env  # noqa: E402
from fastckpt.config import parse_size  # noqa: E402

ENGINES = ["fastckpt", "runai", "s5cmd+load_file"]
BUCKET, PREFIX, SHARDS = "bench", "model", 3
HIDDEN, INTER, VOCAB = 2048, 5632, 32000


def model_tensors(size: int) -> dict[str, Any]:
    """A Llama-shaped bf16 model of about ``size`` bytes (deterministic)."""
    import torch

    g = torch.Generator().manual_seed(0)
    shapes = {"model.embed_tokens.weight": (VOCAB, HIDDEN), "lm_head.weight": (VOCAB, HIDDEN)}
    per_layer = 2 * (4 * HIDDEN * HIDDEN + 3 * HIDDEN * INTER + 2 * HIDDEN)
    for i in range(max(1, (size - 4 * VOCAB * HIDDEN) // per_layer)):
        p = f"model.layers.{i}."
        for n in ("q", "k", "v", "o"):
            shapes[f"{p}self_attn.{n}_proj.weight"] = (HIDDEN, HIDDEN)
        for n in ("gate", "up"):
            shapes[f"{p}mlp.{n}_proj.weight"] = (INTER, HIDDEN)
        shapes[f"{p}mlp.down_proj.weight"] = (HIDDEN, INTER)
        shapes[f"{p}input_layernorm.weight"] = shapes[f"{p}post_attention_layernorm.weight"] = (HIDDEN,)
    return {n: torch.randn(s, generator=g).to(torch.bfloat16) for n, s in shapes.items()}


def write_model(size: int, out: str) -> int:
    """The model in the HF layout below ``out``; its bytes of tensors."""
    from safetensors.torch import save_file

    tensors = model_tensors(size)
    names = list(tensors)
    weight_map = {}
    for s in range(SHARDS):
        shard = f"model-{s + 1:05d}-of-{SHARDS:05d}.safetensors"
        part = {n: tensors[n] for n in names[s::SHARDS]}
        save_file(part, os.path.join(out, shard), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, shard))
    with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    return sum(t.numel() * t.element_size() for t in tensors.values())


def worker(spec: dict[str, Any]) -> dict[str, Any]:
    import torch
    from runai_model_streamer import SafetensorsStreamer
    from safetensors.torch import load_file

    import fastckpt.torch as ft

    endpoint, engine = spec["endpoint"], spec["engine"]
    started = time.perf_counter()  # the engines imported before: a server has imported them long before it loads
    if engine == "fastckpt":
        loaded = ft.load_safetensors(f"s3://{BUCKET}/{PREFIX}?endpoint_override={endpoint}")
    elif engine == "runai":
        with open(spec["index"]) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        loaded = {}
        with SafetensorsStreamer() as streamer:
            streamer.stream_files([f"s3://{BUCKET}/{PREFIX}/{s}" for s in shards])
            for name, tensor in streamer.get_tensors():
                loaded[name] = tensor.clone()
    else:
        local = tempfile.mkdtemp(dir=spec["scratch"])
        subprocess.run(["s5cmd", "--endpoint-url", endpoint, "cp", f"s3://{BUCKET}/{PREFIX}/*", local + "/"],
                       check=True, capture_output=True)
        loaded = {}
        for name in sorted(os.listdir(local)):
            if name.endswith(".safetensors"):
                loaded.update(load_file(os.path.join(local, name)))
    seconds = time.perf_counter() - started
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # before the model is built to compare with
    want = model_tensors(spec["size"])
    same = loaded.keys() == want.keys() and all(torch.equal(loaded[n], t) for n, t in want.items())
    return {"s": seconds, "equal": same, "rss_mib": rss}


def run(spec: dict[str, Any], env: dict[str, str]) -> dict[str, Any]:
    out = run_spec("bench.model_load_bench", spec, env)
    if "error" in out:
        raise SystemExit(f"{spec['engine']}: {out['error']}")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="2GiB")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--engines", default=",".join(ENGINES))
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--out", default=None)
    worker_flag(ap)
    args = ap.parse_args(argv)
    if args.worker:
        return answer(args.worker, worker)
    work = args.workdir or tempfile.mkdtemp(prefix="fastckpt-model-load-")
    model, scratch = os.path.join(work, "model"), os.path.join(work, "scratch")
    os.makedirs(model, exist_ok=True)
    size = parse_size(args.size)
    nbytes = write_model(size, model)
    gateway = JuiceFSGateway(os.path.join(work, "juicefs")).start()
    env = {**s3_env(gateway.endpoint), "AWS_ENDPOINT_URL": gateway.endpoint,
           "RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING": "0", "AWS_EC2_METADATA_DISABLED": "true"}
    results: dict[str, list[dict[str, Any]]] = {e: [] for e in args.engines.split(",")}
    try:
        os.environ.update(env)
        import fastckpt

        fastckpt.upload(model, f"s3://{BUCKET}/{PREFIX}?endpoint_override={gateway.endpoint}")
        spec = {"endpoint": gateway.endpoint, "size": size, "scratch": scratch,
                "index": os.path.join(model, "model.safetensors.index.json")}
        for _ in range(args.rounds):
            for engine in results:
                shutil.rmtree(scratch, ignore_errors=True)
                os.makedirs(scratch)
                os.sync()
                out = run({**spec, "engine": engine}, env)
                if not out["equal"]:
                    raise SystemExit(f"{engine}: the loaded tensors differ from the model's")
                results[engine].append(out)
    finally:
        gateway.stop()
    print(f"model: {nbytes / 2**30:.2f} GiB of tensors in {SHARDS} shards; medians of {args.rounds}")
    print(f"{'engine':<18} {'s':>7} {'GiB/s':>7} {'peak RSS MiB':>13}")
    table = {}
    for engine, rs in results.items():
        s = statistics.median(r["s"] for r in rs)
        table[engine] = {"s": s, "gib_s": nbytes / 2**30 / s, "rss_mib": statistics.median(r["rss_mib"] for r in rs)}
        print(f"{engine:<18} {s:>7.2f} {table[engine]['gib_s']:>7.2f} {table[engine]['rss_mib']:>13.0f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"bytes": nbytes, "rounds": results, "medians": table}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
