"""Types that move bytes between the layers, below all of them: what a request body is made of (buffers and
file ranges) and where a response body lands (a ``Receiver``). Imports nothing from fastckpt."""

from __future__ import annotations

import asyncio
import functools
import threading
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["Body", "Buffer", "BufferReceiver", "FileRange", "Pieces", "ProtocolError", "Receiver",
           "SendfileUnsupported", "body_size"]

Buffer = bytes | bytearray | memoryview


@dataclass(frozen=True)
class FileRange:
    """``length`` bytes at ``offset`` of the open file ``fd``, as a request body: sent by the kernel from the file
    (plain TCP connections only, see ``HttpClient.sends_files``)."""

    fd: int
    offset: int
    length: int


Body = Buffer | FileRange
Pieces = tuple[Buffer, ...]
"""A request body laid out in several buffers (a part spanning tensors), sent one after the other: no copy into one."""


def body_size(piece: Body | Pieces) -> int:
    """Bytes of a body piece (or of ``Pieces``)."""
    if isinstance(piece, tuple):
        return sum(memoryview(p).nbytes for p in piece)
    return piece.length if isinstance(piece, FileRange) else memoryview(piece).nbytes


class SendfileUnsupported(Exception):
    """The kernel cannot send this file with ``sendfile`` (its filesystem does not support it): send it from a
    buffer. Not an ``OSError``, so that no layer takes it for a broken connection and retries."""


class ProtocolError(ConnectionError):
    """The server broke HTTP/1.1 or the connection closed mid-message (retryable, like a reset)."""


class Receiver:
    """Where a read's bytes land, as they arrive: ``free()`` is the room for the next ones (empty while there
    is none), ``landed(n)`` records that the first ``n`` bytes of that room were filled; ``count`` bytes have
    landed in all, and ``remaining`` more are accepted. A receiver out of room calls ``wake`` (set by whoever
    waits for room) once it has some again."""

    count = 0
    wake: Callable[[], None] | None = None

    @property
    def remaining(self) -> int:
        """Bytes still accepted."""
        raise NotImplementedError

    def free(self) -> memoryview:
        """The room for the next bytes."""
        raise NotImplementedError

    def landed(self, n: int) -> None:
        """``n`` bytes were written at the start of the last ``free()``."""
        self.count += n

    def from_socket(self, sock: int, head: bytes, n: int, stop: threading.Event) -> asyncio.Future[None] | None:
        """Take the next ``n`` bytes, ``head`` and then the rest read straight from socket ``sock`` (plain TCP,
        which the caller leaves alone meanwhile), on a worker thread; the future ends once the thread is done
        with the socket, and ``stop`` set makes it end early. ``count`` grows by the bytes taken, failed or not.
        None when this receiver cannot (its bytes then land through ``free()``)."""
        return None

    def woken(self) -> None:
        """There is room again: tell whoever waits."""
        if self.wake is not None:
            self.wake()

    async def room(self) -> None:
        """Wait until ``free()`` is not empty."""
        while not len(self.free()):
            waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self.wake = functools.partial(_settle, waiter)
            try:
                await waiter
            finally:
                self.wake = None


def _settle(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


class BufferReceiver(Receiver):
    """Bytes received into one buffer, from its start."""

    def __init__(self, buf: memoryview) -> None:
        self.buf = buf

    @property
    def remaining(self) -> int:
        return self.buf.nbytes - self.count

    def free(self) -> memoryview:
        return self.buf[self.count:]
