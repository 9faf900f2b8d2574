"""Exceptions raised by fastckpt. Every message names the object or URI concerned."""

from __future__ import annotations


class FastckptError(Exception):
    """Base class of all fastckpt errors."""


class StoreError(FastckptError):
    """A storage request failed and retrying it will not help."""


class TransientStoreError(StoreError):
    """A storage request failed in a way that a retry may fix (5xx, throttling, reset, timeout)."""


class ObjectNotFoundError(StoreError, FileNotFoundError):
    """The object (or bucket / container) does not exist."""


class AlreadyExistsError(StoreError, FileExistsError):
    """A create-if-absent write found the object already there."""


class AccessDeniedError(StoreError, PermissionError):
    """Credentials are missing, wrong or lack permission."""


class IntegrityError(FastckptError):
    """Data read back does not match its recorded digest."""


class CheckpointError(FastckptError):
    """The checkpoint commit protocol was violated (uncommitted, already committed, conflicting ranks)."""
