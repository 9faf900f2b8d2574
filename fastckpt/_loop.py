"""Event loops: uvloop when installed, and the one background loop thread that runs every blocking call."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import logging
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")
log = logging.getLogger("fastckpt")
WAKE_S = 0.2
"""Longest a caller waiting for the background loop sleeps between looks at its pending signal handlers."""
STOP_GRACE_S = 5.0
"""Longest an interrupted caller waits for its cancelled coroutine to finish cleaning up."""

try:
    import uvloop
except ImportError:  # pragma: no cover - uvloop is missing on Windows
    uvloop = None  # type: ignore[assignment]


def new_loop() -> asyncio.AbstractEventLoop:
    """A fresh event loop, uvloop's when available."""
    return uvloop.new_event_loop() if uvloop is not None else asyncio.new_event_loop()


class BackgroundLoop:
    """One daemon thread running an event loop forever; coroutines are submitted from any thread."""

    _instance: BackgroundLoop | None = None
    _lock = threading.Lock()

    def __init__(self) -> None:
        self.loop = new_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="fastckpt-loop", daemon=True)
        self.thread.start()

    @classmethod
    def get(cls) -> BackgroundLoop:
        """The process-wide background loop (started on first use, restarted after fork)."""
        with cls._lock:
            if cls._instance is None or not cls._instance.thread.is_alive():
                cls._instance = BackgroundLoop()
            return cls._instance

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the background loop and wait for its result (never on the loop thread).

        The wait wakes every ``WAKE_S``, so a signal that another thread took is handled that soon: the kernel
        hands a signal sent to the process to any thread, and one taken by a worker thread only marks Python's
        handler as due, which a thread asleep on a lock runs when its wait ends (a Ctrl-C went unanswered until
        a stalled download ended). Worker threads do not block the signals instead: the processes they start
        would inherit the block. An interrupt (Ctrl-C) cancels the coroutine and waits up
        to ``STOP_GRACE_S`` for its clean-up (a second interrupt stops waiting), so that what the call leaves
        behind is settled when the interrupt reaches the caller.
        """
        if threading.current_thread() is self.thread:
            coro.close()
            raise RuntimeError("fastckpt: blocking call made from its own background loop thread")
        result: concurrent.futures.Future[T] = concurrent.futures.Future()  # done once the task has ended
        tasks: list[asyncio.Task[T]] = []

        context = contextvars.copy_context()  # what the caller observes (``stats.observe``) sees the call

        def start() -> None:
            tasks.append(context.run(self.loop.create_task, coro))
            tasks[0].add_done_callback(finish)

        def finish(task: asyncio.Task[T]) -> None:
            if task.cancelled():
                result.cancel()
            elif (exc := task.exception()) is not None:
                result.set_exception(exc)
            else:
                result.set_result(task.result())

        self.loop.call_soon_threadsafe(start)
        try:
            while not result.done():
                concurrent.futures.wait([result], WAKE_S)
            return result.result()
        except BaseException:  # an interrupt while waiting: the coroutine does not go on alone
            self.loop.call_soon_threadsafe(lambda: tasks[0].cancel())  # after start(): the loop runs them in order
            if not concurrent.futures.wait([result], STOP_GRACE_S).done:
                log.warning("fastckpt: the interrupted call is still cleaning up after %.0f s; not waiting for it",
                            STOP_GRACE_S)
            raise


def run_sync(coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro`` to completion from synchronous code, on the background loop: on any thread (those that run
    a loop of their own too), with the stores it opened kept for the next call, and stopped as
    ``BackgroundLoop.run`` says on an interrupt."""
    return BackgroundLoop.get().run(coro)
