"""Small store helpers shared by the writer, the barriers and the readers."""

from __future__ import annotations

from ..stores.base import Store


async def read_object(store: Store, key: str) -> bytes:
    """The whole of a small object; ObjectNotFoundError when absent."""
    meta = await store.head(key)
    return await store.get_range(key, 0, meta.size)
