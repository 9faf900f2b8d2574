"""Errors raised through the facade are ``OSError``s (pyarrow's contract) that keep fastckpt's types."""

from __future__ import annotations

from ..errors import FastckptError, IntegrityError, StoreError, TransientStoreError


class StoreIOError(StoreError, OSError):
    """A storage request failed for good (seen through the pyarrow facade)."""


class TransientStoreIOError(TransientStoreError, OSError):
    """A storage request kept failing in a retryable way until retries ran out (through the facade)."""


class IntegrityIOError(IntegrityError, OSError):
    """Data read back did not match its recorded digest (through the facade)."""


def as_oserror(exc: BaseException) -> BaseException:
    """``exc`` itself when pyarrow callers can catch it as OSError, else the matching OSError subclass."""
    if isinstance(exc, OSError) or not isinstance(exc, FastckptError):
        return exc
    if isinstance(exc, TransientStoreError):
        return TransientStoreIOError(str(exc))
    if isinstance(exc, StoreError):
        return StoreIOError(str(exc))
    if isinstance(exc, IntegrityError):
        return IntegrityIOError(str(exc))
    return exc
