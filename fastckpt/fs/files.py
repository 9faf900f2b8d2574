"""pyarrow file objects over the engine's streams, for callers on any thread.

The engine objects live on the facade's background loop; these adapters block the calling thread
(never the loop) and copy bytes on the caller's thread.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import pyarrow as pa

from .._loop import BackgroundLoop
from ..engine.stream import StreamReader, StreamWriter
from ..integrity import FileDigest
from ..transport import Buffer

__all__ = ["InputFile", "OutputStream", "ReaderHandle", "Runner", "WriterHandle"]

T = TypeVar("T")
Runner = Callable[[Coroutine[Any, Any, T]], T]


def _schedule(coro: Coroutine[Any, Any, None]) -> None:
    """Start ``coro`` on the background loop without waiting for it (finalizers of unclosed files)."""
    if sys.is_finalizing():  # the loop thread is gone and no thread may be started
        coro.close()
        return
    try:
        asyncio.run_coroutine_threadsafe(coro, BackgroundLoop.get().loop)
    except RuntimeError:
        coro.close()


class WriterHandle:
    """The file-like object behind an output stream: buffered writes become part uploads.

    The object is written on ``close()``; errors of any part surface from the next ``write()`` and
    from ``close()``. ``abort()`` (or an unclosed handle being garbage collected) discards it.
    """

    mode = "wb"

    def __init__(self, run: Runner, writer: StreamWriter, path: str) -> None:
        self._run, self._writer, self.path = run, writer, path
        self.closed = False
        self.digest: FileDigest | None = None
        self._free: memoryview | None = None
        self._used = 0
        self._error: BaseException | None = None

    def writable(self) -> bool:
        return True

    def write(self, data: Buffer) -> int:
        """Copy ``data`` into part buffers (waits while every buffer is in flight)."""
        if self.closed:
            raise ValueError(f"write to closed stream {self.path!r}")
        if self._error is not None:
            raise OSError(f"{self.path} is not being written: an earlier write failed") from self._error
        view = memoryview(data).cast("B")
        total = len(view)
        try:
            while view:
                if self._free is None:
                    self._free, self._used = self._run(self._writer.reserve()), 0
                n = min(len(self._free) - self._used, len(view))
                self._free[self._used : self._used + n] = view[:n]
                self._used += n
                view = view[n:]
                if self._used == len(self._free):
                    self._commit()
        except BaseException as exc:
            self._error = exc
            self._abort()
            raise
        return total

    def _commit(self) -> None:
        free, used = self._free, self._used
        self._free, self._used = None, 0
        if free is not None:
            free.release()
            self._run(self._writer.commit(used))

    def flush(self) -> None:
        """Nothing to do: an object becomes visible only whole, on close."""

    def close(self) -> None:
        """Upload the rest and complete the object; raises when any part of it failed."""
        if self.closed:
            return
        self.closed = True
        if self._error is not None:
            raise OSError(f"{self.path} was not written: an earlier write failed") from self._error
        try:
            self._commit()
            self.digest = self._run(self._writer.close())
        except BaseException as exc:
            self._error = exc
            self._abort()
            raise

    def abort(self) -> None:
        """Discard the object being written."""
        self.closed = True
        self._abort()

    def _abort(self) -> None:
        if self._free is not None:
            self._free.release()
            self._free = None
        if self._writer.state == "open":
            self._run(self._writer.abort())

    def __del__(self) -> None:
        if getattr(self, "closed", True) or self._writer.state != "open":
            return
        if self._free is not None:
            self._free.release()
        _schedule(self._writer.abort())


class OutputStream(pa.PythonFile):
    """pyarrow output stream of the facade; leaving a ``with`` block by an exception aborts it."""

    def __init__(self, handle: WriterHandle, mode: str = "w") -> None:
        self.handle = handle

    def abort(self) -> None:
        """Discard the object: nothing is written."""
        self.handle.abort()

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is not None:
            self.handle.abort()
        super().__exit__(exc_type, exc, tb)


class ReaderHandle:
    """The file-like object behind input streams and random-access files.

    Reads continuing where the previous one ended are served from whole parts fetched ahead in
    parallel; other reads fetch exactly their range. A read that reaches the end of an object read
    whole checks its digest first (IntegrityError, an OSError, on mismatch).
    """

    mode = "rb"

    def __init__(self, run: Runner, reader: StreamReader, path: str) -> None:
        self._run, self._reader, self.path = run, reader, path
        self.closed = False
        self._pos = 0
        self._next = 0
        self._cur: tuple[int, memoryview] | None = None

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def size(self) -> int:
        return self._reader.size

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = 0) -> int:
        base = {0: 0, 1: self._pos, 2: self._reader.size}.get(whence)
        if base is None:
            raise ValueError(f"invalid whence {whence}")
        if base + offset < 0:
            raise OSError(f"{self.path}: cannot seek to negative position {base + offset}")
        self._pos = base + offset
        return self._pos

    def read(self, nbytes: int | None = -1) -> bytes | bytearray:
        if self.closed:
            raise ValueError(f"read from closed file {self.path!r}")
        pos, size = self._pos, self._reader.size
        n = max(0, size - pos) if nbytes is None or nbytes < 0 else max(0, min(nbytes, size - pos))
        if n == 0:
            return b""
        data = self._parts(pos, n) if pos == self._next else self._run(self._reader.read_range(pos, n))
        self._pos = self._next = pos + len(data)
        return data

    def _parts(self, pos: int, n: int) -> bytes | bytearray:
        psize = self._reader.part_size
        first, last = pos // psize, (pos + n - 1) // psize
        if first == last:
            start = pos - first * psize
            return bytes(self._part(first, 1)[start : start + n])
        out = bytearray(n)
        done = 0
        for index in range(first, last + 1):
            begin = index * psize
            a, b = max(pos, begin) - begin, min(pos + n, begin + psize) - begin
            out[done : done + b - a] = self._part(index, last - index + 1)[a:b]
            done += b - a
        return out

    def _part(self, index: int, wanted: int) -> memoryview:
        if self._cur is not None and self._cur[0] == index:
            return self._cur[1]
        self._cur = None
        view = self._run(self._reader.part(index, wanted))
        self._cur = (index, view)
        return view

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._cur = None
            self._run(self._reader.close())

    def __del__(self) -> None:
        if not getattr(self, "closed", True):
            self._cur = None
            _schedule(self._reader.close())


class InputFile(pa.PythonFile):
    """pyarrow random-access file (and input stream) of the facade."""

    def __init__(self, handle: ReaderHandle, mode: str = "r") -> None:
        self.handle = handle
