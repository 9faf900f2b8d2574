"""Storage backends behind one async protocol, and ``open_store`` to pick one from a URI."""

from __future__ import annotations

import importlib

from ..config import TransferConfig
from ..uri import StorageURI, parse_uri
from .base import MultipartUpload, ObjectMeta, PartInfo, PendingUpload, Store
from .retry import RetryingStore

# backend name -> "module:factory"; each factory takes (StorageURI, TransferConfig) and returns a Store.
_FACTORIES = {
    "local": "fastckpt.stores.local:from_uri",
    "memory": "fastckpt.stores.memory:from_uri",
    "s3": "fastckpt.stores.s3:from_uri",
    "gcs": "fastckpt.stores.gcs:from_uri",
    "azure": "fastckpt.stores.azure:from_uri",
}


def backend_status() -> dict[str, str]:
    """``available`` for each backend whose module imports, else the import error (for ``fastckpt doctor``)."""
    status = {}
    for name, target in _FACTORIES.items():
        try:
            importlib.import_module(target.split(":")[0])
            status[name] = "available"
        except ImportError as exc:
            status[name] = f"unavailable: {exc}"
    return status


def open_store(uri: str | StorageURI, config: TransferConfig | None = None, *, retry: bool = True) -> Store:
    """A store for ``uri``'s backend and bucket. Keys passed to it are full keys (``uri.key`` + ...).

    Its requests are retried per ``stores.retry`` unless ``retry`` is False (to wrap it first, e.g. in
    fault injection, then apply ``retrying``).
    """
    parsed = parse_uri(uri) if isinstance(uri, str) else uri
    target = _FACTORIES.get(parsed.backend)
    if target is None:
        raise ValueError(f"{parsed.raw!r}: scheme {parsed.scheme!r} has no fastckpt backend "
                         f"(supported: {', '.join(sorted(_FACTORIES))}); use fastckpt.fs for delegation")
    module, func = target.split(":")
    try:
        factory = getattr(importlib.import_module(module), func)
    except ImportError as exc:
        raise ImportError(f"backend {parsed.backend!r} for {parsed.raw!r} is unavailable: {exc}") from exc
    config = config or TransferConfig.from_env()
    store = factory(parsed, config)
    return RetryingStore(store, config) if retry else store


__all__ = ["MultipartUpload", "ObjectMeta", "PartInfo", "PendingUpload", "Store", "backend_status", "open_store"]
