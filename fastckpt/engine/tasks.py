"""Running many coroutines: the first failure cancelling the rest, or a bounded number at a time."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Iterable
from typing import TypeVar

T = TypeVar("T")


SIBLING_FAILED = "fastckpt: cancelled because a sibling failed"
"""The message of the CancelledError that ``gather_all`` cancels siblings with (``cancelled_by_failure``)."""


def cancelled_by_failure(exc: BaseException) -> bool:
    """Whether ``exc`` is a cancellation because work beside it failed (not an interrupt from outside)."""
    return isinstance(exc, asyncio.CancelledError) and SIBLING_FAILED in exc.args


async def gather_all(aws: Iterable[Awaitable[T]]) -> list[T]:
    """Like ``asyncio.gather`` but on the first exception the others are cancelled and awaited."""
    tasks = [asyncio.ensure_future(a) for a in aws]
    try:
        return await asyncio.gather(*tasks)
    except BaseException as exc:
        # a cancellation passes on as it came (an interrupt stays an interrupt); a failure says so
        why = (exc.args[0] if exc.args else None) if isinstance(exc, asyncio.CancelledError) else SIBLING_FAILED
        for t in tasks:
            t.cancel(why)
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


async def gather_bounded(aws: Iterable[Awaitable[T]], limit: int) -> list[T]:
    """Like ``asyncio.gather`` with at most ``limit`` of ``aws`` running at once."""
    sem = asyncio.Semaphore(limit)

    async def one(aw: Awaitable[T]) -> T:
        async with sem:
            return await aw

    return list(await asyncio.gather(*(one(a) for a in aws)))
