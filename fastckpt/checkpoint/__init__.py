"""Atomic multi-rank checkpoints: manifests, barriers, commit marker, and list / verify / gc (``fastckpt.latest``
finds the newest).

``writer`` (each rank's files) over ``commit`` (the protocol all ranks run together) and ``attempt`` (run ids);
``catalog`` (list, the newest committed), ``reader`` (open, download, verify), ``gc``, ``retention`` (which
committed checkpoints to keep); ``sync`` holds the
blocking twins.
``one_file``: a checkpoint that is one file at its own path (a framework's format), its digests in a sidecar.
``TorchBarrier`` (``fastckpt.checkpoint.barrier_torch``) and ``RayBarrier`` (``fastckpt.checkpoint.barrier_ray``)
are imported from their modules, so torch and ray stay optional.
"""

from typing import Any

from .._loop import run_sync
from ..deprecation import warn
from .attempt import attempt_from_env
from .barrier import Barrier, BarrierError, BarrierTimeoutError, InProcessBarrier, Rendezvous
from .barrier_store import StoreBarrier
from .catalog import CheckpointInfo, list_checkpoints_async, newest_committed
from .commit import CommitResult
from .gc import GcReport, gc_async
from .manifest import CommitMarker, FileEntry, RankManifest
from .reader import BadFile, Checkpoint, VerifyReport, download_checkpoint_async, open_checkpoint_async, verify_async
from .retention import Retention, apply_retention_async
from .sync import (
    SyncCheckpointWriter,
    apply_retention,
    download_checkpoint,
    gc,
    list_checkpoints,
    open_checkpoint,
    verify,
)
from .writer import CheckpointWriter

__all__ = [
    "BadFile",
    "Barrier",
    "BarrierError",
    "BarrierTimeoutError",
    "Checkpoint",
    "CheckpointInfo",
    "CheckpointWriter",
    "CommitMarker",
    "CommitResult",
    "FileEntry",
    "GcReport",
    "InProcessBarrier",
    "RankManifest",
    "Rendezvous",
    "Retention",
    "StoreBarrier",
    "SyncCheckpointWriter",
    "VerifyReport",
    "apply_retention",
    "apply_retention_async",
    "attempt_from_env",
    "download_checkpoint",
    "download_checkpoint_async",
    "gc",
    "gc_async",
    "list_checkpoints",
    "list_checkpoints_async",
    "open_checkpoint",
    "open_checkpoint_async",
    "verify",
    "verify_async",
]


def __getattr__(name: str) -> Any:
    """``latest`` / ``latest_async`` here are the old spellings of ``fastckpt.latest`` / ``fastckpt.latest_async``
    (the one ``latest``, which also takes ``tier=``)."""
    if name not in ("latest", "latest_async"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    warn(f"fastckpt.checkpoint.{name}", f"use fastckpt.{name}")
    if name == "latest_async":
        return newest_committed
    return lambda uri, *, config=None: run_sync(newest_committed(uri, config=config))
