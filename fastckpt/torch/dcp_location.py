"""What the DCP writer and reader share: the checkpoint they work on (``_Location``: its URI, config and store), how
a stored item is found (``StoredItem``), and running on fastckpt's loop."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.futures import Future

from .._loop import BackgroundLoop
from ..config import TransferConfig
from ..engine.open_stores import store_for
from ..stores.base import Store
from ..uri import StorageURI, parse_uri

METADATA = ".metadata"


@dataclass(frozen=True)
class StoredItem:
    """Where one DCP item lies: ``name`` (file in the checkpoint), byte ``offset`` and ``length``; for tensors
    their dtype and shape."""

    name: str
    offset: int
    length: int
    dtype: torch.dtype | None = None
    shape: tuple[int, ...] | None = None
    manifest: bytes | None = None
    """The writing rank's manifest, carried to the coordinator on the rank's first item (dropped before
    ``.metadata`` is written)."""


StoredItem.__module__ = "fastckpt.torch.dcp"  # the name DCP's ``.metadata`` pickles it under (re-exported there)


def _run(coro: Any) -> Any:
    return asyncio.run_coroutine_threadsafe(coro, BackgroundLoop.get().loop).result()


def _done(value: Any) -> Future:
    fut: Future = Future()
    fut.set_result(value)
    return fut


class _Location:
    """The checkpoint a DCP writer or reader works on: its URI, its config, and fastckpt's kept store for it."""

    uri: str | None
    config: TransferConfig | None

    def _target(self) -> StorageURI:
        if self.uri is None:
            raise ValueError(f"fastckpt.torch.dcp.{type(self).__name__} needs a checkpoint URI "
                             "(uri= or checkpoint_id=)")
        return parse_uri(self.uri)

    def _where(self) -> tuple[StorageURI, TransferConfig]:
        """The checkpoint's URI and the config (the given one, else the environment's)."""
        return self._target(), self.config or TransferConfig.from_env()

    @contextlib.asynccontextmanager
    async def _store(self) -> AsyncIterator[tuple[StorageURI, TransferConfig, Store]]:
        """(the checkpoint's URI, the config, the open store of its location)."""
        target, cfg = self._where()
        async with store_for(target, cfg) as store:
            yield target, cfg, store

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        """Whether ``checkpoint_id`` is a URI of a fastckpt backend."""
        try:
            return parse_uri(os.fspath(checkpoint_id)).backend != "delegate"
        except ValueError:
            return False


