"""Blocking twins of the async checkpoint API, run on fastckpt's background event loop (so they also work on
threads that run a loop)."""

from __future__ import annotations

import os
from types import TracebackType
from typing import Any

from .._loop import BackgroundLoop, run_sync
from ..config import TransferConfig
from ..deprecation import keywords_only
from ..engine.progress import ProgressCallback
from ..engine.session import FileResult
from ..uri import StorageURI
from .catalog import CheckpointInfo, list_checkpoints_async
from .commit import CommitResult
from .gc import GcReport, gc_async
from .reader import Checkpoint, VerifyReport, download_checkpoint_async, open_checkpoint_async, verify_async
from .retention import Retention, apply_retention_async
from .writer import CheckpointWriter

__all__ = ["SyncCheckpointWriter", "apply_retention", "download_checkpoint", "gc", "list_checkpoints",
           "open_checkpoint", "verify"]


def open_checkpoint(uri: str | StorageURI, *, allow_uncommitted: bool = False,
                    config: TransferConfig | None = None) -> Checkpoint:
    """Sync twin of ``open_checkpoint_async``."""
    return run_sync(open_checkpoint_async(uri, allow_uncommitted=allow_uncommitted, config=config))


def download_checkpoint(uri: str | StorageURI, dst: str | os.PathLike[str], *, allow_uncommitted: bool = False,
                        config: TransferConfig | None = None, progress: ProgressCallback | None = None,
                        group: Any = None) -> list[FileResult]:
    """Sync twin of ``download_checkpoint_async``."""
    return run_sync(download_checkpoint_async(uri, dst, allow_uncommitted=allow_uncommitted, config=config,
                                              progress=progress, group=group))


def list_checkpoints(uri: str | StorageURI, *, config: TransferConfig | None = None) -> list[CheckpointInfo]:
    """Sync twin of ``list_checkpoints_async``."""
    return run_sync(list_checkpoints_async(uri, config=config))


def verify(uri: str | StorageURI, *, allow_uncommitted: bool = False, config: TransferConfig | None = None,
           progress: ProgressCallback | None = None) -> VerifyReport:
    """Sync twin of ``verify_async``."""
    return run_sync(verify_async(uri, allow_uncommitted=allow_uncommitted, config=config, progress=progress))


@keywords_only(1, "older_than", "dry_run", renamed={"older_than_s": "older_than"})
def gc(uri: str | StorageURI, *, older_than: float = 24 * 3600.0, dry_run: bool = False,
       config: TransferConfig | None = None, keep_last: int | None = None,
       retention: Retention | None = None) -> GcReport:
    """Sync twin of ``gc_async``."""
    return run_sync(gc_async(uri, older_than=older_than, dry_run=dry_run, config=config, keep_last=keep_last,
                             retention=retention))


def apply_retention(uri: str | StorageURI, policy: Retention, *, dry_run: bool = False,
                    config: TransferConfig | None = None) -> list[str]:
    """Sync twin of ``apply_retention_async``."""
    return run_sync(apply_retention_async(uri, policy, dry_run=dry_run, config=config))


class SyncCheckpointWriter:
    """Sync twin of ``CheckpointWriter`` (``with`` block, blocking ``put_file`` / ``put_dir``); takes its arguments."""

    def __init__(self, uri: str | StorageURI, **options: Any) -> None:
        self._writer = CheckpointWriter(uri, **options)
        self._loop = BackgroundLoop.get()

    @property
    def attempt(self) -> str:
        """The attempt id (known once the block is entered)."""
        return self._writer.attempt

    @property
    def result(self) -> CommitResult | None:
        """Set once the checkpoint is committed."""
        return self._writer.result

    def __enter__(self) -> SyncCheckpointWriter:
        self._loop.run(self._writer.__aenter__())
        return self

    def put_file(self, path: str | os.PathLike[str], name: str | None = None) -> FileResult:
        """Upload local file ``path`` as ``name`` inside the checkpoint."""
        return self._loop.run(self._writer.put_file(path, name))

    def put_dir(self, path: str | os.PathLike[str], prefix: str = "") -> list[FileResult]:
        """Upload every file below local directory ``path``."""
        return self._loop.run(self._writer.put_dir(path, prefix))

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._loop.run(self._writer.__aexit__(exc_type, exc, tb))
