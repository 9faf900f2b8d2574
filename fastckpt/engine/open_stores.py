"""Stores kept open on fastckpt's background loop, one per location and config: a process that uploads or
saves every N steps pays for clients, credentials and connections once, not at every call (about 0.25 s
of CPU and a few round trips per S3 call)."""

from __future__ import annotations

import asyncio
import atexit
import contextlib
from collections.abc import AsyncIterator

from .._loop import BackgroundLoop
from ..config import TransferConfig
from ..stores import open_store
from ..stores.base import Store
from ..uri import StorageURI

__all__ = ["CLOSE_S", "store_for"]

_open: dict[tuple[object, TransferConfig], Store] = {}
CLOSE_S = 5.0
"""Longest the process's exit waits for the kept stores to close."""


@contextlib.asynccontextmanager
async def store_for(uri: StorageURI, config: TransferConfig) -> AsyncIterator[Store]:
    """An open store of ``uri``'s location: the kept one on the background loop, else one closed after use.

    Stores are told apart by what they resolve to (backend, bucket and options, the environment's included),
    so a changed endpoint or account gets a store of its own."""
    store = open_store(uri, config=config)  # nothing is connected before its first request
    if asyncio.get_running_loop() is not BackgroundLoop.get().loop:
        async with store:
            yield store
        return
    key = (store.location, config)
    kept = _open.get(key)
    if kept is None:
        if not _open:
            atexit.register(_close_all)
        kept = _open[key] = store
    yield kept


def _close_all() -> None:
    """Close the kept stores at exit (their connections belong to the background loop), within ``CLOSE_S``."""
    stores = list(_open.values())
    _open.clear()

    async def close() -> None:
        for store in stores:
            with contextlib.suppress(Exception):
                await store.close()

    with contextlib.suppress(Exception):  # as FastckptHandler.close: not waited for past CLOSE_S
        asyncio.run_coroutine_threadsafe(close(), BackgroundLoop.get().loop).result(CLOSE_S)
