"""Atomic multi-rank checkpoints: manifests, barriers, commit marker, and latest / verify / gc.

``writer`` (each rank's files) over ``commit`` (the protocol all ranks run together) and ``attempt`` (run ids);
``catalog`` (list, latest), ``reader`` (open, download, verify), ``gc``; ``sync`` holds the blocking twins.
``one_file``: a checkpoint that is one file at its own path (a framework's format), its digests in a sidecar.
``TorchBarrier`` (``fastckpt.checkpoint.barrier_torch``) and ``RayBarrier`` (``fastckpt.checkpoint.barrier_ray``)
are imported from their modules, so torch and ray stay optional.
"""

from .attempt import attempt_from_env
from .barrier import Barrier, BarrierError, BarrierTimeoutError, InProcessBarrier, Rendezvous
from .barrier_store import StoreBarrier
from .catalog import CheckpointInfo, latest_async, list_checkpoints_async
from .commit import CommitResult
from .gc import GcReport, gc_async
from .manifest import CommitMarker, FileEntry, RankManifest
from .reader import BadFile, Checkpoint, VerifyReport, download_checkpoint_async, open_checkpoint_async, verify_async
from .sync import SyncCheckpointWriter, download_checkpoint, gc, latest, list_checkpoints, open_checkpoint, verify
from .writer import CheckpointWriter

__all__ = ["BadFile", "Barrier", "BarrierError", "BarrierTimeoutError", "Checkpoint", "CheckpointInfo",
           "CheckpointWriter", "CommitMarker", "CommitResult", "FileEntry", "GcReport", "InProcessBarrier",
           "RankManifest", "Rendezvous", "StoreBarrier", "SyncCheckpointWriter", "VerifyReport", "attempt_from_env",
           "download_checkpoint", "download_checkpoint_async", "gc", "gc_async", "latest", "latest_async",
           "list_checkpoints", "list_checkpoints_async", "open_checkpoint", "open_checkpoint_async", "verify",
           "verify_async"]
