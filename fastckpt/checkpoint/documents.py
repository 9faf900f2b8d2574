"""The small documents of the commit protocol (manifests, markers, barrier payloads): read whole, bounded in size."""

from __future__ import annotations

from ..errors import CheckpointError
from ..stores.base import Store

__all__ = ["MAX_DOCUMENT", "read_object", "read_small"]

MAX_DOCUMENT = 256 << 20
"""Largest manifest or marker read (about a million files): a bigger one is refused, not loaded."""


async def read_object(store: Store, key: str) -> bytes:
    """The whole of a small object (a manifest, a marker, a barrier payload); ObjectNotFoundError when absent,
    CheckpointError when it is larger than ``MAX_DOCUMENT``."""
    meta = await store.head(key)
    if meta.size > MAX_DOCUMENT:
        raise CheckpointError(f"{key} is {meta.size} bytes, over the limit of {MAX_DOCUMENT} bytes for a fastckpt "
                              "manifest or marker; refusing to read it")
    return await store.get_range(key, 0, meta.size)


async def read_small(store: Store, key: str, first: int = 1 << 20) -> bytes:
    """``read_object`` in one request when the object is under ``first`` bytes (a ranged read from its start, which
    stops at its end), as every barrier payload is; larger ones are read as ``read_object`` reads them."""
    data = await store.get_range(key, 0, first)
    return data if len(data) < first else await read_object(store, key)
