"""Create-if-absent on servers that may ignore its precondition (S3 gateways and ``If-None-Match: *``,
GCS emulators and ``ifGenerationMatch=0`` on compose).

The mode (a backend's ``FASTCKPT_<BACKEND>_IF_ABSENT``): ``auto`` trusts the provider's own endpoint and
probes a custom one once per endpoint and bucket; where the server ignores the precondition, a
create-if-absent raises StoreError rather than risk an overwrite. ``trust``: no probe. ``best-effort``:
where it is ignored, a HEAD first (AlreadyExistsError when present; a concurrent writer between the two
can still be overwritten).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable

from ..errors import AlreadyExistsError, ObjectNotFoundError, StoreError

__all__ = ["MODES", "IfAbsentGuard", "probe"]

MODES = ("auto", "trust", "best-effort")
_HONOURED: dict[tuple[str, str, str], bool] = {}
"""(precondition, endpoint, bucket) -> whether the server honours it, probed once per process."""


class IfAbsentGuard:
    """One backend's way of making create-if-absent safe: ``precondition`` names what it sends."""

    def __init__(self, mode: str, env_var: str, precondition: str) -> None:
        if mode not in MODES:
            raise ValueError(f"invalid create-if-absent mode {mode!r} ({env_var}): expected one of {MODES}")
        self.mode, self.env_var, self.precondition = mode, env_var, precondition
        self._lock = asyncio.Lock()

    async def check(self, *, endpoint: str | None, shown: str, bucket: str, where: str,
                    probe: Callable[[], Awaitable[bool]], head: Callable[[], Awaitable[object]]) -> bool:
        """True: send the precondition. False: the server ignores it, and in best-effort mode the HEAD
        (``head``) found ``where`` absent. Otherwise StoreError, or AlreadyExistsError in best-effort mode.

        ``endpoint`` None is the provider's own endpoint (trusted); ``shown`` is the endpoint for messages;
        ``probe()`` tells whether the server honours the precondition.
        """
        if self.mode == "trust" or endpoint is None:
            return True
        cache = (self.precondition, endpoint, bucket)
        async with self._lock:
            if cache not in _HONOURED:
                _HONOURED[cache] = await probe()
        if _HONOURED[cache]:
            return True
        if self.mode != "best-effort":
            raise StoreError(f"endpoint {shown} ignores {self.precondition}, so create-if-absent of {where} cannot be "
                             f"made safe; set {self.env_var}=best-effort to accept a HEAD-then-write (racy)")
        try:
            await head()
        except ObjectNotFoundError:
            return False
        raise AlreadyExistsError(f"{where} already exists")


async def probe(write: Callable[[bool], Awaitable[object]], delete: Callable[[], Awaitable[object]],
                unsupported: Callable[[StoreError], bool] = lambda exc: False) -> bool:
    """Whether a server honours a create-if-absent precondition: a throw-away object is written (``write(False)``),
    then written again with the precondition (``write(True)``), which an honouring server refuses; the object is
    deleted either way. ``unsupported(exc)`` tells an error that says the server does not know the precondition."""
    await write(False)
    try:
        await write(True)
        return False
    except AlreadyExistsError:
        return True
    except StoreError as exc:
        if unsupported(exc):
            return False
        raise
    finally:
        with contextlib.suppress(StoreError):
            await delete()
