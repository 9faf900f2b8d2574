"""Running many coroutines: the first failure cancelling the rest, or a bounded number at a time."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Iterable
from typing import TypeVar

__all__ = ["gather_all", "gather_bounded"]

T = TypeVar("T")


async def gather_all(aws: Iterable[Awaitable[T]], failed: asyncio.Event | None = None) -> list[T]:
    """Like ``asyncio.gather`` but on the first exception the others are cancelled and awaited.

    ``failed`` is set when that exception is a failure (not a cancellation from outside), before the
    others are cancelled, so they can tell the two apart (a CancelledError's message does not survive
    every await).
    """
    tasks = [asyncio.ensure_future(a) for a in aws]
    try:
        return await asyncio.gather(*tasks)
    except BaseException as exc:
        if failed is not None and not isinstance(exc, asyncio.CancelledError):
            failed.set()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


async def gather_bounded(aws: Iterable[Awaitable[T]], limit: int) -> list[T]:
    """Like ``asyncio.gather`` with at most ``limit`` of ``aws`` running at once."""
    sem = asyncio.Semaphore(limit)

    async def one(aw: Awaitable[T]) -> T:
        async with sem:
            return await aw

    return list(await asyncio.gather(*(one(a) for a in aws)))
