"""Atomic multi-rank checkpoints: manifests, barriers, commit marker, and latest / verify / gc.

``TorchBarrier`` (``fastckpt.checkpoint.barrier_torch``) and ``RayBarrier``
(``fastckpt.checkpoint.barrier_ray``) are imported from their modules, so torch and ray stay optional.
"""

from .barrier import Barrier, BarrierError, BarrierTimeoutError, InProcessBarrier, Rendezvous, StoreBarrier
from .manifest import CommitMarker, FileEntry, RankManifest
from .reader import (
    BadFile,
    Checkpoint,
    CheckpointInfo,
    GcReport,
    VerifyReport,
    download_checkpoint,
    download_checkpoint_async,
    gc,
    gc_async,
    latest,
    latest_async,
    list_checkpoints,
    list_checkpoints_async,
    open_checkpoint,
    open_checkpoint_async,
    verify,
    verify_async,
)
from .writer import CheckpointWriter, CommitResult, SyncCheckpointWriter, attempt_from_env

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
    "StoreBarrier",
    "SyncCheckpointWriter",
    "VerifyReport",
    "attempt_from_env",
    "download_checkpoint",
    "download_checkpoint_async",
    "gc",
    "gc_async",
    "latest",
    "latest_async",
    "list_checkpoints",
    "list_checkpoints_async",
    "open_checkpoint",
    "open_checkpoint_async",
    "verify",
    "verify_async",
]
