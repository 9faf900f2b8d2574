"""fastckpt: parallel, verified checkpoint transfers to object storage and shared filesystems."""

from .api import download, download_async, upload, upload_async
from .config import TransferConfig
from .engine.transfer import FileResult
from .errors import (
    AccessDeniedError,
    AlreadyExistsError,
    CheckpointError,
    FastckptError,
    IntegrityError,
    ObjectNotFoundError,
    StoreError,
    TransientStoreError,
)
from .integrity import FileDigest
from .stores import open_store
from .uri import StorageURI, parse_uri

__version__ = "0.1.0"

__all__ = [
    "AccessDeniedError",
    "AlreadyExistsError",
    "CheckpointError",
    "FastckptError",
    "FileDigest",
    "FileResult",
    "IntegrityError",
    "ObjectNotFoundError",
    "StorageURI",
    "StoreError",
    "TransferConfig",
    "TransientStoreError",
    "download",
    "download_async",
    "open_store",
    "parse_uri",
    "upload",
    "upload_async",
]
