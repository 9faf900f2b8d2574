"""The optional native accelerator (``native/``, built as ``fastckpt._native``): loaded when built and turned on
with ``FASTCKPT_NATIVE=1``."""

from __future__ import annotations

import importlib
from types import ModuleType

from .config import env_flag

__all__ = ["NATIVE", "native_info"]


def _load_native() -> tuple[ModuleType | None, str]:
    """The native accelerator module (or None) and a word on why."""
    if not env_flag("FASTCKPT_NATIVE", False):
        return None, "off (FASTCKPT_NATIVE=1 turns it on)"
    try:
        module = importlib.import_module(f"{__package__}._native")
    except ModuleNotFoundError:
        return None, "not built"
    except ImportError as exc:  # built, but e.g. libxxhash.so is missing
        return None, f"failed to load: {exc}"
    return module, "loaded"


native, _STATUS = _load_native()
NATIVE = native is not None
"""Whether the accelerator is loaded (``native`` is its module, else None)."""


def native_info() -> dict[str, object]:
    """What ``fastckpt doctor`` shows about the native accelerator."""
    info: dict[str, object] = {"native": NATIVE, "status": _STATUS}
    if native is not None:
        info.update(path=native.__file__, xxhash=native.XXHASH_VERSION, dispatch=bool(native.DISPATCH))
    return info
