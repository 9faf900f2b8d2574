"""Event loops: uvloop when installed, and one background loop thread for callers on foreign threads."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

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
        """Run ``coro`` on the background loop and wait for its result (never on the loop thread)."""
        if threading.current_thread() is self.thread:
            coro.close()
            raise RuntimeError("fastckpt: blocking call made from its own background loop thread")
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result()
        except BaseException:  # an interrupt while waiting (Ctrl-C): the coroutine does not go on alone
            future.cancel()
            raise


def run_sync(coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro`` to completion from synchronous code.

    On a thread without a running loop a fresh (uv)loop runs it; on a thread that already runs a
    loop (Jupyter, Ray actors, async frameworks) it runs on the background loop thread instead.
    """
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        runner = asyncio.Runner(loop_factory=new_loop) if hasattr(asyncio, "Runner") else None
        if runner is None:  # Python 3.10
            return asyncio.run(coro)
        with runner:
            return runner.run(coro)
    return BackgroundLoop.get().run(coro)
