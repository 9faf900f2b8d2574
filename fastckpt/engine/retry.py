"""Retry with exponential backoff and full jitter for retryable storage errors."""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Awaitable, Callable
from typing import TypeVar

from ..config import TransferConfig
from ..errors import TransientStoreError

T = TypeVar("T")
log = logging.getLogger("fastckpt")

RETRYABLE: tuple[type[BaseException], ...] = (TransientStoreError, ConnectionError, asyncio.TimeoutError)


async def with_retries(op: Callable[[], Awaitable[T]], config: TransferConfig, what: str) -> T:
    """Run ``op()``; on a retryable error sleep (jittered exponential backoff) and run it again.

    After ``config.retries`` retries the last error is raised as TransientStoreError naming ``what``.
    Non-retryable errors propagate at once.
    """
    attempt = 0
    while True:
        try:
            return await op()
        except RETRYABLE as exc:
            if attempt >= config.retries:
                raise TransientStoreError(f"{what}: failed after {attempt + 1} attempts: {exc}") from exc
            delay = random.uniform(0, min(config.backoff_max, config.backoff_base * 2**attempt))
            log.debug("retrying %s in %.2fs after %s", what, delay, exc)
            attempt += 1
            await asyncio.sleep(delay)
