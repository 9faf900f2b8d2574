"""fastckpt: parallel, verified checkpoint transfers to object storage and shared filesystems."""

from .api import download, download_async, latest, latest_async, upload, upload_async
from .checkpoint import (
    CheckpointInfo,
    CheckpointWriter,
    GcReport,
    InProcessBarrier,
    Retention,
    StoreBarrier,
    SyncCheckpointWriter,
    VerifyReport,
    apply_retention,
    apply_retention_async,
    download_checkpoint,
    download_checkpoint_async,
    gc,
    gc_async,
    list_checkpoints,
    list_checkpoints_async,
    open_checkpoint,
    open_checkpoint_async,
    verify,
    verify_async,
)
from .config import TransferConfig
from .engine.session import FileResult
from .errors import (
    AccessDeniedError,
    AlreadyExistsError,
    BucketNotFoundError,
    CheckpointError,
    FastckptError,
    IntegrityError,
    ObjectNotFoundError,
    StoreError,
    ThrottledError,
    TransientStoreError,
)
from .integrity import FileDigest
from .stores import open_store
from .uri import StorageURI, parse_uri

__version__ = "0.1.0"

__all__ = [
    "AccessDeniedError",
    "AlreadyExistsError",
    "BucketNotFoundError",
    "CheckpointError",
    "CheckpointInfo",
    "CheckpointWriter",
    "FastckptError",
    "FileDigest",
    "FileResult",
    "GcReport",
    "InProcessBarrier",
    "IntegrityError",
    "ObjectNotFoundError",
    "Retention",
    "StorageURI",
    "StoreBarrier",
    "StoreError",
    "SyncCheckpointWriter",
    "ThrottledError",
    "TransferConfig",
    "TransientStoreError",
    "VerifyReport",
    "apply_retention",
    "apply_retention_async",
    "download",
    "download_async",
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
    "open_store",
    "parse_uri",
    "upload",
    "upload_async",
    "verify",
    "verify_async",
]
