"""The process's worker threads, below every layer: I/O threads for blocking file work and hashing (``off_loop``),
and socket threads that move a body between a socket and a file. Imports nothing from fastckpt."""

from __future__ import annotations

import asyncio
import contextvars
import functools
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

__all__ = ["io_executor", "off_loop", "socket_executor", "start_io_threads"]

T = TypeVar("T")
_IO_THREADS = 16
_SOCKET_THREADS = 256
"""One per request moving a body between a socket and a file, up to what a transfer may have in flight (started as
needed): on a slow link each holds its thread for seconds."""
_IO = ThreadPoolExecutor(max_workers=_IO_THREADS, thread_name_prefix="fastckpt-io")
_SOCKETS = ThreadPoolExecutor(max_workers=_SOCKET_THREADS, thread_name_prefix="fastckpt-socket")
_io_started = threading.Event()


def _reset_io_after_fork() -> None:
    """A forked child inherits the executors but none of their threads: give it fresh ones."""
    global _IO, _SOCKETS, _io_started
    _IO = ThreadPoolExecutor(max_workers=_IO_THREADS, thread_name_prefix="fastckpt-io")
    _SOCKETS = ThreadPoolExecutor(max_workers=_SOCKET_THREADS, thread_name_prefix="fastckpt-socket")
    _io_started = threading.Event()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_io_after_fork)


def start_io_threads() -> None:
    """Start the I/O threads now, from a side thread (best effort, never blocks the caller).

    ThreadPoolExecutor starts its threads lazily inside ``submit``, and ``Thread.start`` waits for the
    new thread to take the GIL: done on the event loop, that stalls it for milliseconds per thread.
    Tasks that hold their thread until all are submitted make ``submit`` start a thread for each.
    """
    if _io_started.is_set():
        return
    _io_started.set()
    submitted = threading.Event()

    def fill() -> None:
        try:
            for _ in range(_IO_THREADS):
                _IO.submit(submitted.wait, 1.0)
        except RuntimeError:  # the interpreter is exiting
            pass
        submitted.set()

    threading.Thread(target=fill, name="fastckpt-io-start", daemon=True).start()


def io_executor() -> ThreadPoolExecutor:
    """The engine's I/O threads."""
    return _IO


def socket_executor() -> ThreadPoolExecutor:
    """Threads that move a body between a socket and a file (a response into its file, a part from its file);
    each waits on the network for the whole body, so they are kept apart from the I/O threads."""
    return _SOCKETS


async def off_loop(fn: Callable[..., T], *args: object, undo: Callable[[T], object] | None = None) -> T:
    """Run blocking ``fn(*args)`` (file I/O, hashing) on the I/O threads, not the event loop.

    A cancelled caller still waits for ``fn`` to end before the cancellation goes on: a thread cannot be
    stopped, and the file descriptors and buffers it uses are closed or released by the caller's clean-up.
    What ``fn`` returned to a caller cancelled meanwhile goes to ``undo`` (e.g. a file descriptor to close).
    """
    job = asyncio.get_running_loop().run_in_executor(  # in the caller's context: its summaries count the work
        _IO, contextvars.copy_context().run, functools.partial(fn, *args))
    try:
        return await asyncio.shield(job)
    except asyncio.CancelledError:
        await asyncio.wait([job])
        if not job.cancelled() and job.exception() is None and undo is not None:
            undo(job.result())
        raise
