"""Small store helpers shared by the writer, the barriers and the readers."""

from __future__ import annotations

from ..config import TransferConfig
from ..engine.retry import with_retries
from ..stores.base import Store


async def read_object(store: Store, key: str, config: TransferConfig) -> bytes:
    """The whole of a small object (with retries); ObjectNotFoundError when absent."""
    meta = await with_retries(lambda: store.head(key), config, f"read of {key}")
    return await with_retries(lambda: store.get_range(key, 0, meta.size), config, f"read of {key}")
