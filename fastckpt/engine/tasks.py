"""Running many coroutines: the first failure cancelling the rest, or a bounded number at a time."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Iterable
from typing import TypeVar

T = TypeVar("T")


async def gather_all(aws: Iterable[Awaitable[T]]) -> list[T]:
    """Like ``asyncio.gather`` but on the first exception the others are cancelled and awaited."""
    tasks = [asyncio.ensure_future(a) for a in aws]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
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
