"""A fixed pool of reusable buffers: it bounds memory and the number of parts in flight."""

from __future__ import annotations

import asyncio
import mmap
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager


class BufferPool:
    """At most ``count`` buffers exist; ``acquire`` waits when all are lent out.

    Buffers are anonymous ``mmap`` regions (page-aligned, not zero-filled twice, returned to the
    OS on close). A request larger than a pooled buffer replaces that buffer, so memory stays at
    ``count * largest size asked for``.
    """

    def __init__(self, size: int, count: int) -> None:
        if count < 1:
            raise ValueError(f"buffer pool needs at least one buffer, got {count}")
        self.size, self.count = size, count
        self._free: list[mmap.mmap] = []
        self._slots = asyncio.Semaphore(count)
        self.allocated = 0

    @asynccontextmanager
    async def buffer(self, nbytes: int) -> AsyncIterator[memoryview]:
        """Lend a buffer viewed as exactly ``nbytes`` bytes."""
        async with self._slots:
            buf = self._take(nbytes)
            view = memoryview(buf)[:nbytes]
            try:
                yield view
            finally:
                view.release()
                self._free.append(buf)

    def _take(self, nbytes: int) -> mmap.mmap:
        while self._free:
            buf = self._free.pop()
            if len(buf) >= nbytes:
                return buf
            buf.close()
            self.allocated -= 1
        self.allocated += 1
        return mmap.mmap(-1, max(nbytes, self.size, 1))

    def close(self) -> None:
        """Unmap free buffers."""
        for buf in self._free:
            buf.close()
        self._free.clear()
