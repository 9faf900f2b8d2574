"""Blocking work off the event loop: the engine's I/O threads, and walking local directories."""

from __future__ import annotations

import asyncio
import functools
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")
_IO_THREADS = 16
_SOCKET_THREADS = 32
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
    job = asyncio.get_running_loop().run_in_executor(_IO, functools.partial(fn, *args))
    try:
        return await asyncio.shield(job)
    except asyncio.CancelledError:
        await asyncio.wait([job])
        if not job.cancelled() and job.exception() is None and undo is not None:
            undo(job.result())
        raise


def local_files(src: str) -> list[tuple[str, str]]:
    """(path, relative '/'-path) of every file below directory ``src``, sorted.

    A symlink is uploaded as the file it points to when that file lies inside ``src``; a symlink that
    points outside the tree, to a directory or nowhere is refused (ValueError naming it): a tree's upload
    never reads outside the tree.
    """
    root = os.path.realpath(src)
    out = []
    for dirpath, dirnames, filenames in os.walk(src):
        dirnames.sort()
        for name in sorted(filenames) + [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]:
            path = os.path.join(dirpath, name)
            if os.path.islink(path):
                target = os.path.realpath(path)
                if not os.path.isfile(target) or os.path.commonpath([root, target]) != root:
                    raise ValueError(f"refusing to upload symlink {path} -> {os.readlink(path)}: it points outside "
                                     f"{src}, to a directory or nowhere")
            out.append((path, os.path.relpath(path, src).replace(os.sep, "/")))
    return out


def paths_below(root: str, rels: list[str]) -> list[str]:
    """The local paths of the '/'-separated names ``rels`` below directory ``root`` (download targets).

    The names come from storage, so they are untrusted: ValueError when one has an empty, '.' or '..'
    part or a NUL, or would land outside ``root`` through a symlinked directory already there.
    """
    real_root = os.path.realpath(root)
    inside: dict[str, bool] = {}  # parent directory -> whether it resolves below root (one check per directory)
    out = []
    for rel in rels:
        parts = rel.split("/")
        if any(p in ("", ".", "..") or "\0" in p for p in parts):
            raise ValueError(f"refusing unsafe object name {rel!r} (below {root})")
        path = os.path.join(root, *parts)
        parent = os.path.dirname(path)
        if parent not in inside:
            inside[parent] = os.path.commonpath([real_root, os.path.realpath(parent)]) == real_root
        if not inside[parent]:
            raise ValueError(f"refusing to write {rel!r}: {parent} leads outside {root} (a symlink)")
        out.append(path)
    return out
