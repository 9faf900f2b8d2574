"""DCP's ZStandard extension on a real training state: bytes stored, save and load seconds, with and without it.

    python -m bench.dcp_extensions --rounds 3 --out bench/results/dcp-zstd.json

The state is a GPT-2-shaped ``transformers`` model (6 layers, width 512: 45M parameters, fp32) after a few AdamW
steps on random tokens, with its optimizer state (``exp_avg``, ``exp_avg_sq``): what ``dcp.save`` of a fine-tune
holds. Engines, each save and load in its own process, rounds interleaved, to a local directory (this host's disk):

- ``fastckpt`` / ``fastckpt-zstd``: ``fastckpt.torch.dcp.Writer`` / ``Reader``, without and with
  ``_extensions=[ZStandard()]``;
- ``dcp`` / ``dcp-zstd``: DCP's ``FileSystemWriter`` / ``FileSystemReader``, the same two ways.
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

from bench.spec_worker import answer, run_spec, worker_flag

ENGINES = ["fastckpt", "fastckpt-zstd", "dcp", "dcp-zstd"]


def training_state() -> dict[str, Any]:
    """The model and optimizer state after 3 AdamW steps (the same in every process: seeded, on the CPU)."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=6, n_embd=512, n_head=8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for _ in range(3):
        tokens = torch.randint(0, 50257, (2, 64))
        model(input_ids=tokens, labels=tokens).loss.backward()
        opt.step()
        opt.zero_grad()
    return {"model": model.state_dict(), "optim": opt.state_dict()}


def worker(spec: dict[str, Any]) -> dict[str, Any]:
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._extension import ZStandard

    from fastckpt.torch.dcp import Reader, Writer

    state, path = training_state(), spec["path"]
    extensions = [ZStandard()] if spec["engine"].endswith("zstd") else None
    ours = spec["engine"].startswith("fastckpt")
    started = time.perf_counter()
    if spec["op"] == "save":
        writer = Writer(path, _extensions=extensions) if ours else dcp.FileSystemWriter(path, _extensions=extensions)
        dcp.save(state, storage_writer=writer, no_dist=True)
        seconds = time.perf_counter() - started
        stored = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs
                     if f.endswith(".distcp"))
        return {"save_s": seconds, "stored": stored}
    target = {"model": {k: torch.zeros_like(v) for k, v in state["model"].items()},
              "optim": {"state": {k: {n: torch.zeros_like(t) if torch.is_tensor(t) else t for n, t in s.items()}
                                  for k, s in state["optim"]["state"].items()},
                        "param_groups": state["optim"]["param_groups"]}}
    reader = Reader(path) if ours else dcp.FileSystemReader(path)
    dcp.load(target, storage_reader=reader, no_dist=True)
    seconds = time.perf_counter() - started
    same = all(torch.equal(target["model"][k], v) for k, v in state["model"].items())
    return {"load_s": seconds, "equal": same}


def run(spec: dict[str, Any]) -> dict[str, Any]:
    out = run_spec("bench.dcp_extensions", spec, timeout=1200)
    if "error" in out:
        raise SystemExit(f"{spec}: {out['error']}")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--out", default=None)
    worker_flag(ap)
    args = ap.parse_args(argv)
    if args.worker:
        return answer(args.worker, worker)
    work = args.workdir or tempfile.mkdtemp(prefix="fastckpt-dcp-ext-")
    results: dict[str, list[dict[str, Any]]] = {e: [] for e in ENGINES}
    for _ in range(args.rounds):
        for engine in ENGINES:
            path = os.path.join(work, engine)
            shutil.rmtree(path, ignore_errors=True)
            os.sync()
            saved = run({"engine": engine, "op": "save", "path": path})
            loaded = run({"engine": engine, "op": "load", "path": path})
            if not loaded["equal"]:
                raise SystemExit(f"{engine}: the loaded state differs from the saved one")
            results[engine].append({**saved, **loaded})
    table = {e: {k: statistics.median(r[k] for r in rs) for k in ("stored", "save_s", "load_s")}
             for e, rs in results.items()}
    print(f"{'engine':<15} {'stored MiB':>11} {'save s':>8} {'load s':>8}   (medians of {args.rounds})")
    for e, row in table.items():
        print(f"{e:<15} {row['stored'] / 2**20:>11.1f} {row['save_s']:>8.2f} {row['load_s']:>8.2f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"rounds": results, "medians": table}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
