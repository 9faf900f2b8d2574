"""A gloo job saving into checkpoint tiers, one tier directory per simulated node: ``python -m tests.ranks.tier_job
SPEC_JSON``.

Spec keys: uri (the durable checkpoint), world, port, tiers (one per rank: its node's tier), out, step, mode
(``save``: ``async_save(..., tier=, replicas=)`` and ``wait()``; ``load``: ``load(..., tier=)``; ``restore``:
``restore_tier`` then ``load(..., tier=)``), replicas (save: 0 or 1), kill (save: each rank SIGKILLs itself as soon
as ``wait()`` returned; a list: the ranks that do), warm (save: a save of step 0 to this URI first, so the
save runs as a trainer's later saves do: into the tier's recycled files, handed to the agent before it is committed),
stagger (save: each rank waits for the ranks before it to be dead or done first), durable (save: the ranks not
killed ``wait(durable=True)``). Each rank records ``{out}/rank-N.json``: ``{"ok", "error", "sha", "received"}``
(save: of the state it saved; load and restore: of the state it loaded; restore: the ranks it received from peers).
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

import fastckpt.torch as ft
from fastckpt.tier.spare import spare_files
from fastckpt.torch import restore_tier
from tests.ranks import spec_main


def state(step: int, rank: int) -> dict:
    """Rank ``rank``'s state at ``step`` (two tensors over the multipart threshold, and scalars)."""
    g = torch.Generator().manual_seed(step * 1000 + rank)
    return {"w": torch.randn(1024, 1024, generator=g), "b": torch.randn(700, generator=g).to(torch.bfloat16),
            "step": step, "rank": rank}


def digest(st: dict) -> str:
    h = hashlib.sha256()
    for key in sorted(st):
        v = st[key]
        h.update(key.encode() + (v.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
                                 if isinstance(v, torch.Tensor) else repr(v).encode()))
    return h.hexdigest()


def killed(spec: dict, rank: int) -> bool:
    """Whether rank ``rank`` SIGKILLs itself once its save returned."""
    kill = spec.get("kill")
    return kill is True or (isinstance(kill, list) and rank in kill)


def rank_main(rank: int, spec: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(spec["port"]))
    dist.init_process_group("gloo", rank=rank, world_size=spec["world"], timeout=timedelta(seconds=30))
    record: dict = {"ok": True, "error": "", "sha": "", "received": []}
    try:
        if spec["mode"] == "save":
            tier = spec["tiers"][rank]
            if spec.get("warm"):
                ft.async_save(state(0, rank), spec["warm"], tier=tier).wait(durable=True, timeout=60)
                deadline = time.monotonic() + 30
                while not spare_files(tier) and time.monotonic() < deadline:  # readied after the first save
                    time.sleep(0.05)
            for before in range(rank if spec.get("stagger") else 0):
                while not os.path.exists(os.path.join(spec["out"], f"rank-{before}.json")):
                    time.sleep(0.05)
            time.sleep(0.5 if spec.get("stagger") else 0)  # the rank before is dead by now
            st = state(spec["step"], rank)
            record["sha"] = digest(st)
            h = ft.async_save(st, spec["uri"], tier=tier, replicas=spec.get("replicas", 0))
            h.wait(timeout=60, durable=spec.get("durable", False) and not killed(spec, rank))
        else:
            if spec["mode"] == "restore":
                record["received"] = restore_tier(spec["uri"], spec["tiers"][rank])
            record["sha"] = digest(ft.load(spec["uri"], rank=rank, tier=spec["tiers"][rank]))
    except Exception as exc:
        record.update(ok=False, error=f"{type(exc).__name__}: {exc}")
    with open(os.path.join(spec["out"], f"rank-{rank}.json"), "w") as f:
        json.dump(record, f)
    if record["ok"] and killed(spec, rank):
        os.kill(os.getpid(), signal.SIGKILL)
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(spec_main(rank_main))
