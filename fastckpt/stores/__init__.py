"""Storage backends behind one async protocol, and ``open_store`` to pick one from a URI."""

from __future__ import annotations

import importlib
import importlib.util

from ..config import TransferConfig
from ..deprecation import keywords_only
from ..uri import ENTRY_POINTS, StorageURI, parse_uri, plugin_schemes
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


def _factory_target(backend: str) -> tuple[str, str] | None:
    """(module, attribute) of ``backend``'s factory: built in, or a third-party entry point."""
    if backend in _FACTORIES:
        module, _, func = _FACTORIES[backend].partition(":")
        return module, func
    import importlib.metadata  # only for plug-ins (it costs ~20 ms to import)

    for ep in importlib.metadata.entry_points(group=ENTRY_POINTS):
        if ep.name.lower() == backend:
            module, _, func = ep.value.partition(":")
            return module.strip(), func.strip()
    return None


def backend_status() -> dict[str, str]:
    """``available`` for each backend (built in or installed as a plug-in) whose module imports, else the
    import error (for ``fastckpt doctor``)."""
    status = {}
    for name in [*_FACTORIES, *sorted(plugin_schemes())]:
        module, _ = _factory_target(name)  # type: ignore[misc]
        try:
            loaded = importlib.import_module(module)
            # packages a backend imports on first use only (``LAZY_IMPORTS``): found, not loaded
            missing = [m for m in getattr(loaded, "LAZY_IMPORTS", ()) if importlib.util.find_spec(m) is None]
            status[name] = f"unavailable: No module named {missing[0]!r}" if missing else "available"
        except ImportError as exc:
            status[name] = f"unavailable: {exc}"
    return status


@keywords_only(1, "config")
def open_store(uri: str | StorageURI, *, config: TransferConfig | None = None, retry: bool = True) -> Store:
    """A store for ``uri``'s backend and bucket. Keys passed to it are full keys (``uri.key`` + ...).

    The backend is built in or a plug-in registered under the entry-point group ``fastckpt.stores``.
    Its requests are retried per ``stores.retry`` unless ``retry`` is False (to wrap it first, e.g. in
    fault injection, then apply ``retrying``).
    """
    parsed = parse_uri(uri) if isinstance(uri, str) else uri
    target = _factory_target(parsed.backend)
    if target is None:
        raise ValueError(f"{parsed.raw!r}: scheme {parsed.scheme!r} has no fastckpt backend "
                         f"(supported: {', '.join(sorted({*_FACTORIES, *plugin_schemes()}))}); "
                         "use fastckpt.fs for delegation")
    module, func = target
    try:
        factory = getattr(importlib.import_module(module), func)
    except ImportError as exc:
        raise ImportError(f"backend {parsed.backend!r} for {parsed.raw!r} is unavailable: {exc}") from exc
    config = config or TransferConfig.from_env()
    store = factory(parsed, config)
    return RetryingStore(store, config) if retry else store


__all__ = ["MultipartUpload", "ObjectMeta", "PartInfo", "PendingUpload", "Store", "backend_status", "open_store"]
