"""Exceptions raised by fastckpt. Every message names the object or URI concerned.

Storage and integrity errors are ``OSError``s, as pyarrow's filesystems raise them, so code written
for pyarrow (and the facade) catches them without a parallel hierarchy.
"""

from __future__ import annotations

__all__ = ["AccessDeniedError", "AlreadyExistsError", "BucketNotFoundError", "CheckpointError", "CopyUnsupportedError",
           "FastckptError", "IntegrityError", "ObjectNotFoundError", "SourceChangedError", "StoreError",
           "ThrottledError", "TransientStoreError"]


class FastckptError(Exception):
    """Base class of all fastckpt errors."""


class StoreError(FastckptError, OSError):
    """A storage request failed. ``retryable`` tells whether a retry may help.

    ``key``, ``backend`` and ``status`` (the HTTP status, where there was one) are set where known.
    """

    retryable = False

    def __init__(self, message: str, *, key: str | None = None, backend: str | None = None,
                 status: int | None = None) -> None:
        super().__init__(message)
        self.key, self.backend, self.status = key, backend, status

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""

    def __reduce__(self) -> tuple[object, ...]:  # keep the fields across pickling (Ray, multiprocessing)
        return _rebuild, (type(self), str(self), self.key, self.backend, self.status)


def _rebuild(cls: type[StoreError], message: str, key: str | None, backend: str | None,
             status: int | None) -> StoreError:
    return cls(message, key=key, backend=backend, status=status)


class TransientStoreError(StoreError):
    """A storage request failed in a way that a retry may fix (5xx, throttling, reset, timeout)."""

    retryable = True


class ThrottledError(TransientStoreError):
    """The service asked for fewer requests (503 SlowDown, 429, Azure ServerBusy): retried, and the request
    concurrency towards it lowered (``stores.concurrency``)."""


class ObjectNotFoundError(StoreError, FileNotFoundError):
    """The object (or bucket / container) does not exist."""


class BucketNotFoundError(ObjectNotFoundError):
    """The bucket (or container) itself does not exist, not just one object in it."""


class AlreadyExistsError(StoreError, FileExistsError):
    """A create-if-absent write found the object already there."""


class CopyUnsupportedError(StoreError):
    """The store (or its server) cannot copy these bytes itself: the caller sends them instead."""


class SourceChangedError(StoreError):
    """The source of a server-side copy is no longer the version it was read as (another ETag, generation or file
    version): nothing was copied."""


class AccessDeniedError(StoreError, PermissionError):
    """Credentials are missing, wrong or lack permission."""


class IntegrityError(FastckptError, OSError):
    """Data read back does not match its recorded digest."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class CheckpointError(FastckptError):
    """The checkpoint commit protocol was violated (uncommitted, already committed, conflicting ranks)."""
