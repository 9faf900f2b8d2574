"""A transfer session on one store: the buffer pools, the limits on files and requests in flight, retries and
progress, shared by the upload and download pipelines (``engine.upload``, ``engine.download``)."""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass

from ..config import TransferConfig
from ..integrity import FileDigest
from ..stores.base import Store
from ..stores.retry import retrying
from ..threads import start_io_threads
from .pool import BufferPool
from .progress import Progress, ProgressCallback
from .reuse import Reuse
from .sink import RING, SLICE

__all__ = ["FileResult", "TransferSession"]


@dataclass(frozen=True)
class FileResult:
    """One file moved: its key in the store, its local path and its digest."""

    key: str
    path: str
    digest: FileDigest
    chunks: tuple[bytes, ...] = ()
    """Its chunk digests, where the transfer learnt them."""
    copied: int = 0
    """Bytes of it the store copied from a base object instead of receiving them."""


class TransferSession:
    """What every transfer on ``store`` shares."""

    def __init__(
        self, store: Store, config: TransferConfig | None = None, progress: ProgressCallback | None = None
    ) -> None:
        start_io_threads()
        self.config = config or TransferConfig.from_env()
        self.store = retrying(store, self.config)
        self.pool = BufferPool(self.config.part_size, self.config.memory_limit, self.config.max_in_flight)
        """Parts read into memory, small files, and the ring buffers of ranges being received (``engine.sink``)."""
        share = self.config.memory_limit // max(1, self.config.max_in_flight)
        self.ring = max(SLICE, min(RING, share // SLICE * SLICE))
        """Bytes of ring per range being received: ``max_in_flight`` of them fit in ``memory_limit``."""
        self.progress = Progress(progress)
        self._files = asyncio.Semaphore(self.config.max_open_files)
        self._dirs: set[str] = set()
        self._copy_slots = max(2, min(self.config.max_in_flight, os.cpu_count() or 2))
        """Ranges copied between local files at once: each keeps a core busy (more only switch between threads)."""
        self._local_copies = asyncio.Semaphore(self._copy_slots)
        self._file_parts = asyncio.Semaphore(self.config.max_in_flight)
        """Parts sent from their files at once (no buffer bounds them)."""
        self.reuse = Reuse(self.store)
        """Base objects' bytes copied by the store (incremental checkpoints)."""
        self._send_files = True
        """Whether parts may be sent from their files (until a filesystem refuses a mapping or ``sendfile``)."""

    def close(self) -> None:
        """Release pooled buffers."""
        self.pool.close()

    def planned_requests(self) -> int:
        """How many requests to cut a transfer on this session's endpoint into (``AdaptiveLimit.planned``)."""
        return self.store.planned_requests()
