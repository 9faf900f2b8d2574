"""The stores ``fastckpt.torch`` keeps open on fastckpt's background loop, one per location and config, so a
training loop that saves every N steps pays for clients and connections once, not at every save."""

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

_open: dict[tuple[str, TransferConfig], Store] = {}


@contextlib.asynccontextmanager
async def store_for(uri: StorageURI, config: TransferConfig) -> AsyncIterator[Store]:
    """An open store of ``uri``'s location: the kept one on the background loop, else one closed after use."""
    if asyncio.get_running_loop() is not BackgroundLoop.get().loop:
        async with open_store(uri, config) as store:
            yield store
        return
    key = (uri.with_key("").uri(), config)
    store = _open.get(key)
    if store is None:
        if not _open:
            atexit.register(_close_all)
        store = _open[key] = open_store(uri, config)
    yield store


def _close_all() -> None:
    """Close the kept stores at exit (their connections belong to the background loop)."""
    stores = list(_open.values())
    _open.clear()

    async def close() -> None:
        for store in stores:
            with contextlib.suppress(Exception):
                await store.close()

    with contextlib.suppress(Exception):
        BackgroundLoop.get().run(close())
