"""A downloaded range hashed and written to its file slice by slice, while the rest of it is still arriving.

Each slice is hashed and written by an I/O thread moments after the socket put it into a small ring
buffer, while it is still in the CPU's cache; a part hashed and written only once all of it had arrived is
read back from memory twice (measured on a 1 GiB download: the page-cache copy cost 3.5x what s5cmd's
costs). The ring, not the range, bounds memory, so ranges can be as long as servers like them. One slice
at a time per range keeps the chunk hashes in order; ``writer`` (one lock per file) keeps ranges of one
file from writing at once, which makes the kernel spin on the inode lock.
"""

from __future__ import annotations

import asyncio
import errno
import fcntl
import mmap
import os
import select
import stat
import threading
from collections.abc import Awaitable

from ..errors import StoreError
from ..fileio import read_exact, write_at
from ..integrity import ChunkHasher
from ..threads import io_executor, socket_executor
from ..transport import ProtocolError, Receiver

__all__ = ["COPY_SLICE", "PIPE", "RING", "SLICE", "STEP", "RingSink", "copy_and_hash", "hash_file_range"]

SLICE = 1 << 20
"""Bytes that land before they are hashed and written."""
STEP = 256 << 10
"""Bytes hashed, then written, at a time: each piece is copied to the page cache while hashing left it in the
CPU's cache (4 GiB downloads, two sets of alternating runs: 1 MiB steps cost the client 1.2-1.5x the CPU, most
of it in that copy)."""
RING = 8 << 20
"""Bytes of ring buffer per range being received, at most (``TransferSession.ring``)."""
COPY_SLICE = 4 << 20
"""Bytes per step of a local copy (1 GiB of a checkpoint: 4 MiB steps 0.56 s, 1 MiB steps 0.72 s, measured)."""
PIPE = 1 << 20
"""Bytes of the pipe a body moves through from its socket to its file (the most a process may ask for unprivileged)."""
_SPLICE = hasattr(os, "splice")
_scratch = threading.local()
_PAGE = mmap.ALLOCATIONGRANULARITY
_NO_COPY_RANGE = {errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.EBADF}


def copy_and_hash(src: str | int, offset: int, length: int, fd: int, writer: threading.Lock, chunk: int
                  ) -> list[bytes]:
    """On an I/O thread: copy ``length`` bytes at ``offset`` of local file ``src`` (a path, or an open file
    descriptor) to the same offset of ``fd``, slice by slice, and hash what was written; the chunk digests.
    EOFError when ``src`` is shorter.

    Each slice is copied inside the kernel (``copy_file_range``, what ``cp`` does) and hashed from a mapping of
    the file it was written to, while its pages are in the CPU's cache: the bytes never cross into a buffer of
    ours. Where the kernel cannot copy between the two files, a small buffer is read, hashed and written.
    """
    hasher = ChunkHasher(chunk)
    src_fd = os.open(src, os.O_RDONLY) if isinstance(src, str) else src
    try:
        in_kernel = hasattr(os, "copy_file_range")
        for pos in range(offset, offset + length, COPY_SLICE):
            size = min(COPY_SLICE, offset + length - pos)
            if in_kernel:
                try:
                    with writer:
                        _copy_range(src_fd, fd, pos, size)
                    _hash_mapped(fd, pos, size, hasher)
                    continue
                except OSError as exc:
                    if exc.errno not in _NO_COPY_RANGE:
                        raise
                    in_kernel = False
            buf = getattr(_scratch, "buf", None)
            if buf is None:
                buf = _scratch.buf = memoryview(bytearray(COPY_SLICE))
            view = buf[:size]
            read_exact(src_fd, pos, view)
            hasher.update(view)
            with writer:
                write_at(fd, pos, view)
    finally:
        if isinstance(src, str):
            os.close(src_fd)
    return hasher.finish()


def _copy_range(src_fd: int, fd: int, pos: int, size: int) -> None:
    done = 0
    while done < size:
        n = os.copy_file_range(src_fd, fd, size - done, pos + done, pos + done)
        if n == 0:
            raise EOFError(f"end of the source file at byte {pos + done}")
        done += n


def _hash_mapped(fd: int, pos: int, size: int, hasher: ChunkHasher) -> None:
    """Hash ``size`` bytes at ``pos`` of ``fd`` through a read-only mapping (no copy out of the page cache).

    Pages are mapped as they are touched, 16 per fault: 0.12 s per GiB hashed, against 0.19 with
    ``MAP_POPULATE`` (which maps one page at a time) and 0.47 read into a buffer (measured, page-cached file)."""
    start = pos - pos % _PAGE
    with mmap.mmap(fd, size + pos - start, prot=mmap.PROT_READ, offset=start,
                   flags=mmap.MAP_SHARED) as mapped, memoryview(mapped) as view:
        hasher.update(view[pos - start:])


def hash_file_range(fd: int, offset: int, length: int, chunk: int) -> list[bytes] | None:
    """On an I/O thread: the chunk digests of ``length`` bytes at ``offset`` of ``fd``, read through a mapping of
    ``COPY_SLICE`` bytes at a time (what is mapped counts in the process's RSS); None when the file is shorter."""
    if os.fstat(fd).st_size < offset + length:
        return None
    hasher = ChunkHasher(chunk)
    for pos in range(offset, offset + length, COPY_SLICE):
        _hash_mapped(fd, pos, min(COPY_SLICE, offset + length - pos), hasher)
    return hasher.finish()


def _drain(pipe: int, fd: int, pos: int, n: int) -> None:
    """Move ``n`` bytes from ``pipe`` to ``pos`` of ``fd`` (through a buffer where the filesystem cannot splice)."""
    done = 0
    while done < n:
        try:
            done += os.splice(pipe, fd, n - done, offset_dst=pos + done)
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
            rest = os.read(pipe, n - done)
            write_at(fd, pos + done, memoryview(rest))
            done += len(rest)


class RingSink(Receiver):
    """``length`` bytes of object ``what`` for ``offset`` of file ``fd`` (None: hashed only), received through
    ``ring`` (a multiple of ``SLICE`` bytes, however long the range): each slice is hashed and written by an I/O
    thread as soon as it is in, and its room goes to the bytes that follow; while every slice waits, the socket
    is not read. ``receive`` runs the request and returns the range's chunk digests.

    A body on a plain TCP socket bound for a regular file skips the ring (``from_socket``): a thread moves it from
    the socket to the file through a pipe (``splice``, so the bytes never cross into user space) and hashes each
    slice from a mapping of the file just after writing it. That costs the client half the CPU of receiving and
    writing from a buffer (1 GiB over loopback: 0.5 CPU-s against 1.1, measured).
    """

    def __init__(self, what: str, fd: int | None, writer: threading.Lock, offset: int, length: int,
                 ring: memoryview, chunk: int) -> None:
        self.what, self.fd, self.writer, self.offset, self.length, self.ring = what, fd, writer, offset, length, ring
        self._hasher = ChunkHasher(chunk)
        self._done = 0  # bytes hashed and written
        self._job: asyncio.Future[int] | None = None
        self._failed: BaseException | None = None
        self._request: asyncio.Future[int] | None = None
        self._regular: bool | None = None

    @property
    def remaining(self) -> int:
        return self.length - self.count

    def free(self) -> memoryview:
        size = len(self.ring)
        start = self.count % size
        return self.ring[start:min(size, start + size - (self.count - self._done))]

    def landed(self, n: int) -> None:
        self.count += n
        self._next()

    def _next(self) -> None:
        """Start on the next whole slice (or, once everything is in, the rest)."""
        pending = self.count - self._done
        if self._job is not None or self._failed is not None or not pending or (
                pending < SLICE and self.count < self.length):
            return
        start = self._done % len(self.ring)
        n = min(pending, len(self.ring) - start)
        if self.count < self.length:
            n -= n % SLICE
        self._job = asyncio.get_running_loop().run_in_executor(io_executor(), self._work, start, n,
                                                               self.offset + self._done)
        self._job.add_done_callback(self._settled)

    def _work(self, start: int, n: int, position: int) -> int:
        """On an I/O thread: hash ``n`` bytes of the ring from ``start`` and write them at ``position``, ``STEP``
        bytes at a time."""
        with self.ring[start:start + n] as view:
            for i in range(0, n, STEP):
                with view[i:i + STEP] as piece:
                    self._hasher.update(piece)
                    if self.fd is not None:
                        with self.writer:
                            write_at(self.fd, position + i, piece)
        return n

    def from_socket(self, sock: int, head: bytes, n: int, stop: threading.Event) -> asyncio.Future[None] | None:
        if self._regular is None:
            self._regular = _SPLICE and self.fd is not None and stat.S_ISREG(os.fstat(self.fd).st_mode)
        if not self._regular or self._job is not None or self._failed is not None or self._done != self.count:
            return None
        job = asyncio.get_running_loop().run_in_executor(socket_executor(), self._splice, sock, head, n, stop)
        job.add_done_callback(self._spliced)
        return job

    def _splice(self, sock: int, head: bytes, n: int, stop: threading.Event) -> None:
        """On a socket thread: write ``head``, then move ``n - len(head)`` bytes from ``sock`` to the file through
        a pipe, hashing them from the file every ``COPY_SLICE`` bytes and at the end. A failure of the file is kept
        in ``_failed`` (the range fails); one of the socket is raised (the request is retried)."""
        assert self.fd is not None
        start = self.offset + self.count
        written = hashed = 0
        try:
            if head:
                with self.writer:
                    write_at(self.fd, start, memoryview(head))
                written = len(head)
            pipe_out, pipe_in = os.pipe()
            try:
                try:
                    fcntl.fcntl(pipe_in, fcntl.F_SETPIPE_SZ, PIPE)
                except OSError:  # a lower limit (fs.pipe-max-size): the default pipe, fewer bytes per move
                    pass
                poller = select.poll()
                poller.register(sock, select.POLLIN)
                while written < n and not stop.is_set():
                    try:
                        k = os.splice(sock, pipe_in, min(PIPE, n - written),
                                      flags=os.SPLICE_F_MOVE | os.SPLICE_F_NONBLOCK)
                    except BlockingIOError:
                        poller.poll(50)  # a stop is seen within 50 ms
                        continue
                    except OSError as exc:
                        raise ProtocolError(f"connection broke mid-response: {exc}") from exc
                    if not k:
                        raise ProtocolError("connection closed by the server mid-response")
                    with self.writer:
                        _drain(pipe_out, self.fd, start + written, k)
                    written += k
                    if written - hashed >= COPY_SLICE:
                        _hash_mapped(self.fd, start + hashed, written - hashed, self._hasher)
                        hashed = written
            finally:
                os.close(pipe_out)
                os.close(pipe_in)
        except ProtocolError:
            raise
        except BaseException as exc:
            self._failed = exc
            raise
        finally:
            if written > hashed and self._failed is None:
                try:
                    _hash_mapped(self.fd, start + hashed, written - hashed, self._hasher)
                except BaseException as exc:
                    self._failed = exc
                    raise
            self.count += written
            self._done += written

    def _spliced(self, job: asyncio.Future[None]) -> None:
        if self._failed is not None and self._request is not None:
            self._request.cancel()  # a failed file fails the range (receive raises it); retries cannot help

    def _settled(self, job: asyncio.Future[int]) -> None:
        self._job = None
        if job.cancelled() or job.exception() is not None:
            self._failed = asyncio.CancelledError() if job.cancelled() else job.exception()
            if self._request is not None:
                self._request.cancel()
            return
        self._done += job.result()
        self.woken()
        self._next()

    async def receive(self, receiving: Awaitable[int]) -> list[bytes]:
        """Run ``receiving`` (a store's ``receive`` into this sink), then hash and write what is left; the range's
        chunk digests. A failed hash or write stops the request and is raised; StoreError when the object ends
        early. Whatever happens, no thread touches the ring or the file for this range once this returns."""
        self._request = asyncio.ensure_future(receiving)
        try:
            try:
                n = await self._request
            except asyncio.CancelledError:
                if self._failed is not None:
                    raise self._failed from None
                raise
            if n != self.length:
                raise StoreError(f"{self.what}: object shrank during download (got {n} of {self.length} bytes "
                                 f"at {self.offset})")
            while self._job is not None or self._done < n:
                if self._failed is not None:
                    raise self._failed
                self._next()
                if self._job is not None:
                    await asyncio.wait([self._job])
            if self._failed is not None:
                raise self._failed
            return self._hasher.finish()
        finally:
            if not self._request.done():
                self._request.cancel()
                await asyncio.wait([self._request])
            self._failed = self._failed or asyncio.CancelledError()  # nothing more is started
            while self._job is not None:
                await asyncio.wait([self._job])
