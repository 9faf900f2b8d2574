"""A downloaded part hashed and written to its file slice by slice, while the rest of it is still arriving.

Each slice is hashed and written by an I/O thread moments after the socket put it into the pooled buffer,
while it is still in the CPU's cache; a part hashed and written only once all of it had arrived is read
back from memory twice (measured on a 1 GiB download: the page-cache copy cost 3.5x what s5cmd's costs).
One slice at a time per part keeps the chunk hashes in order; ``writer`` (one lock per file) keeps
parts of one file from writing at once, which makes the kernel spin on the inode lock.
"""

from __future__ import annotations

import asyncio
import threading

from ..integrity import ChunkHasher, write_at
from .io import io_executor

SLICE = 1 << 20
"""Bytes hashed and written per step."""


class PartSink:
    """Hashes (XXH3-128 per ``chunk`` bytes) and writes ``buf`` at ``offset`` of ``fd`` as ``on_data`` reports it
    filled; ``finish`` handles the rest and returns the chunk digests."""

    def __init__(self, fd: int, writer: threading.Lock, offset: int, buf: memoryview, chunk: int) -> None:
        self.fd, self.writer, self.offset, self.buf = fd, writer, offset, buf
        self._hasher = ChunkHasher(chunk)
        self._done = 0  # bytes hashed and written (or being so)
        self._arrived = 0
        self._job: asyncio.Future[int] | None = None
        self._failed: BaseException | None = None

    def on_data(self, n: int) -> None:
        """The first ``n`` bytes of ``buf`` are in (a retried request reports from 0 again: those bytes are the
        same ones, already handled)."""
        self._arrived = max(self._arrived, n)
        if self._job is None and self._failed is None and self._arrived - self._done >= SLICE:
            self._start(self._done + (self._arrived - self._done) // SLICE * SLICE)

    def _start(self, end: int) -> None:
        loop = asyncio.get_running_loop()
        self._job = loop.run_in_executor(io_executor(), self._work, self._done, end)
        self._job.add_done_callback(self._settled)

    def _settled(self, job: asyncio.Future[int]) -> None:
        self._job = None
        if job.cancelled() or job.exception() is not None:
            self._failed = job.exception() if not job.cancelled() else asyncio.CancelledError()
            return
        self._done = job.result()
        self.on_data(self._arrived)

    def _work(self, start: int, end: int) -> int:
        """On an I/O thread: hash ``buf[start:end]`` along chunk boundaries, then write it."""
        view = self.buf[start:end]
        self._hasher.update(view)
        with self.writer:
            write_at(self.fd, self.offset + start, view)
        view.release()
        return end

    async def settle(self) -> None:
        """Wait for the slice being worked on (before the file is closed or the buffer reused)."""
        while self._job is not None:
            await asyncio.wait([self._job])

    async def finish(self, n: int) -> list[bytes]:
        """All ``n`` bytes are in: handle what is left; the chunk digests of the part."""
        self._arrived = n
        await self.settle()
        if self._failed is not None:
            raise self._failed
        if self._done < n:
            self._start(n)
            await self.settle()
            if self._failed is not None:
                raise self._failed
        return self._hasher.finish()
