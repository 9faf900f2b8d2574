"""A gloo job that downloads one checkpoint on every rank: ``python -m tests.ranks.group_job SPEC_JSON``.

Spec keys: uri, world, port, out, group (share the download over the process group, else every rank alone), die
(a rank that exits when the exchange starts, the DCP reader's included; or null), unreadable (a rank whose reads of
its own files fail during the exchange, or null), mode (``download``, the default: each rank downloads to
``{out}/rank-N/``; ``load``: each rank loads stored rank 0's tensor state with ``fastckpt.torch.load``; ``own``: each
rank loads its own stored rank's state; ``safetensors``: each rank loads the safetensors model at ``uri`` with
``fastckpt.torch.load_safetensors``; ``dcp``:
each rank loads the tensors ``keys[rank]`` of a DCP checkpoint with ``dcp.load`` and fastckpt's ``Reader``). Each rank
records ``{out}/rank-N.json``: ``{"ok": ..., "error": ..., "files": {name or tensor key: sha256}, "seconds": ...}``.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

import fastckpt
import fastckpt.torch as ft
from fastckpt import TransferConfig
from fastckpt.checkpoint import group_download
from fastckpt.torch.dcp.group_read import GroupRead
from tests.ranks import spec_main


def rank_main(rank: int, spec: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(spec["port"]))
    dist.init_process_group("gloo", rank=rank, world_size=spec["world"], timeout=timedelta(seconds=30))
    if spec.get("die") == rank:
        def die(*_: object) -> None:
            os._exit(9)

        group_download._exchange = die  # type: ignore[assignment]
        GroupRead.exchange = die  # type: ignore[method-assign]
    if spec.get("unreadable") == rank:
        def unreadable(*_: object) -> None:
            raise OSError(5, "Input/output error (injected)")

        group_download.read_exact = unreadable  # type: ignore[assignment]
    dst = os.path.join(spec["out"], f"rank-{rank}")
    group = dist.group.WORLD if spec["group"] else None
    config = TransferConfig(part_size=1 << 20, max_in_flight=4, retries=2, retry_for=0)
    started, files = time.monotonic(), {}
    try:
        if spec.get("mode") == "dcp":
            files = dcp_load(spec["uri"], spec["keys"][rank], group, config)
        elif spec.get("mode") in ("load", "own", "safetensors"):
            state = (ft.load_safetensors(spec["uri"], group=group, config=config) if spec["mode"] == "safetensors"
                     else ft.load(spec["uri"], rank=rank if spec["mode"] == "own" else 0, group=group, config=config))
            files = {k: hashlib.sha256(v.contiguous().view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()
                     for k, v in state.items()}
        else:
            fastckpt.download_checkpoint(spec["uri"], dst, group=group, config=config)
        record = {"ok": True, "error": ""}
    except (Exception, CheckpointException) as exc:  # DCP's own is a BaseException
        record = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    for root, _, names in os.walk(dst):
        for name in names:
            with open(os.path.join(root, name), "rb") as f:
                files[os.path.relpath(os.path.join(root, name), dst)] = hashlib.sha256(f.read()).hexdigest()
    record.update(files=files, seconds=time.monotonic() - started)
    with open(os.path.join(spec["out"], f"rank-{rank}.json"), "w") as f:
        json.dump(record, f)
    dist.destroy_process_group()


def dcp_load(uri: str, keys: list[str], group: object, config: TransferConfig) -> dict[str, str]:
    """The sha256 of each tensor of ``keys`` loaded from the DCP checkpoint at ``uri`` (shapes and dtypes from its
    metadata), and the value of its ``step`` item."""
    import torch.distributed.checkpoint as dcp

    from fastckpt.torch.dcp import Reader

    meta = Reader(uri, config=config).read_metadata().state_dict_metadata
    state: dict = {k: torch.zeros(meta[k].size, dtype=meta[k].properties.dtype) for k in keys}
    state["step"] = -1
    dcp.load(state, storage_reader=Reader(uri, config=config, group=group))
    step = state.pop("step")
    return {**{k: hashlib.sha256(v.view(-1).view(torch.uint8).numpy().tobytes()).hexdigest() for k, v in state.items()},
            "step": str(step)}


if __name__ == "__main__":
    sys.exit(spec_main(rank_main))
