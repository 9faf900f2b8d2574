"""One HTTP/1.1 keep-alive connection whose bodies move between the socket and the caller's buffer.

The response head is parsed by ``httptools`` (the C parser under uvloop and uvicorn). A 2xx body of known
length bound for a caller's ``Receiver`` is then received by the event loop straight into the receiver's
room (``asyncio.BufferedProtocol``: no ``bytes`` object per socket read, no copy); while the receiver has
no room, the connection stops reading (TCP holds the sender back) until it wakes it. A receiver may instead
take a long body straight from a plain TCP socket on a thread of its own (``Receiver.from_socket``): the
connection stops reading until that thread has let go of the socket. A request body is
handed to the transport as a view of the caller's buffer (uvloop sends from it without copying); one with a
``FileRange`` is sent by a socket thread instead, the file's bytes with ``sendfile`` (from the page cache to
the socket: never read into a buffer), the connection not reading meanwhile. Other bodies (errors, chunked
answers) go through the parser into a small ``bytearray``.

A connection serves one request at a time. One that failed, was cancelled or saw anything unexpected is
closed, never reused: a dying connection must not touch a buffer after its request returned.
"""

from __future__ import annotations

import asyncio
import errno
import os
import select
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

import httptools

from ..threads import socket_executor
from ..transport import Body, FileRange, ProtocolError, Receiver, SendfileUnsupported, body_size

__all__ = ["HANDOFF", "MAX_BODY", "SCRATCH", "ClosedBeforeResponse", "Connection", "Response"]

SCRATCH = 64 << 10
"""Bytes received per socket read while no caller's buffer takes them (heads, error bodies)."""
HANDOFF = 256 << 10
"""Bodies from this many bytes are offered to the receiver's thread (``Receiver.from_socket``)."""
MAX_BODY = 16 << 20
"""Largest body accepted into memory (error answers, bodies without a caller's buffer)."""
_NO_SENDFILE = {errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP}


class ClosedBeforeResponse(ProtocolError):
    """The connection closed before any byte of the response arrived (a kept-alive connection the server had
    closed while it sat idle, when it was reused)."""


@dataclass
class Response:
    """A response: status, headers (lower-case names), the body when it was not received by a caller's
    ``Receiver``, and how many body bytes that receiver got."""

    status: int
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""
    received: int = 0


class Connection(asyncio.BufferedProtocol):
    """The protocol of one keep-alive connection; ``request`` sends one request and awaits its response."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.used = False
        """Whether a request completed on it (a reused connection may have been closed by the server)."""
        self._scratch = memoryview(bytearray(SCRATCH))
        self._parser: httptools.HttpResponseParser | None = None
        self._done: asyncio.Future[None] | None = None
        self._into: Receiver | None = None
        self._held = b""
        """Body bytes of the head's read that found no room yet."""
        self._paused = False
        self._head_only = False
        self._direct = False
        self._sock: int | None = None
        """The socket's descriptor, when the connection is plain TCP (a socket thread may read or write it)."""
        self._handoff = False
        self._job: asyncio.Future[None] | asyncio.Future[bool] | None = None
        """The socket thread that holds the socket (receiving a body, or sending one)."""
        self._cut = False
        """The request's body was not all sent (the server answered or closed first)."""
        self._stop = threading.Event()
        self._expected = 0
        self._got_any = False
        self._reset_response()

    def _reset_response(self) -> None:
        self.response = Response(0)
        self._headers: dict[str, str] = {}
        self._name = b""
        self._body = bytearray()
        self._complete = False
        self._keep_alive = False

    # ----------------------------------------------------------------------------- asyncio callbacks

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        sock = transport.get_extra_info("socket")
        if sock is not None and transport.get_extra_info("ssl_object") is None:
            self._sock = sock.fileno()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._release_sink()
        if self._done is not None and not self._done.done():
            what = "reset" if exc else "closed by the server"
            error = ProtocolError if self._got_any else ClosedBeforeResponse
            self._done.set_exception(error(
                f"connection {what} {'mid-response' if self._got_any else 'before any response'}"
                + (f": {exc}" if exc else "")))

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._direct and self._into is not None:  # never past the promised length: extra bytes are an error
            room = self._into.free()[:self._expected - self.response.received]
            if len(room):
                return room
            self._direct = False  # no room, yet the transport reads: the bytes go to scratch, and the request fails
        return self._scratch

    def buffer_updated(self, nbytes: int) -> None:
        self._got_any = True
        if self._direct:
            self._landed(nbytes)
            return
        if self._into is not None and self._expected:
            self._fail(ProtocolError("the transport read while the receiver had no room or the socket"))
            return
        if self._parser is None:  # bytes while no request is waiting: the stream is out of step
            self.close()
            return
        try:
            self._parser.feed_data(self._scratch[:nbytes])
        except httptools.HttpParserError as exc:
            self._fail(ProtocolError(f"malformed HTTP response: {exc}"))
            return
        if self._handoff and self._job is None and not self.closed:
            self._hand_off()

    def eof_received(self) -> bool:
        return False

    # ----------------------------------------------------------------------------- httptools callbacks

    def on_header(self, name: bytes, value: bytes) -> None:
        if name:
            self._name = name
            self._headers[name.decode("latin-1").lower()] = value.decode("latin-1")
        else:  # a value continued in a second callback
            key = self._name.decode("latin-1").lower()
            self._headers[key] += value.decode("latin-1")

    def on_headers_complete(self) -> None:
        assert self._parser is not None
        resp = self.response
        resp.status = self._parser.get_status_code()
        resp.headers = self._headers
        self._keep_alive = self._parser.should_keep_alive()  # read now: the parser forgets it at the message's end
        if 100 <= resp.status < 200:  # an interim answer (100 Continue): the real one follows
            self._headers = {}
            return
        if self._head_only:  # the answer to a HEAD: its Content-Length describes no body that follows
            self._finish()
            return
        length = self._headers.get("content-length")
        if (self._into is not None and 200 <= resp.status < 300 and length is not None
                and "transfer-encoding" not in self._headers):
            self._expected = int(length)
            if self._expected > self._into.remaining:
                self._fail(ProtocolError(f"server sent {self._expected} bytes for a "
                                         f"{self._into.remaining}-byte range"))
                return
            if self._sock is not None and self._expected >= HANDOFF:  # offered once this read is parsed
                self._handoff = True
                self._pause()
                return
            self._direct = True
            self._into.wake = self._resume
            if self._expected == 0:
                self._finish()

    def on_body(self, body: bytes) -> None:
        if self._handoff:  # held for the receiver's thread, which writes it before what it reads itself
            self._held += body[:self._expected - len(self._held)]
        elif self._direct:  # the part of the body that came in the same read as the head
            self._held += body[:self._expected - self.response.received - len(self._held)]
            self._place_held()
        elif len(self._body) + len(body) > MAX_BODY:
            self._fail(ProtocolError(f"response body over {MAX_BODY} bytes"))
        else:
            self._body += body

    def on_message_complete(self) -> None:
        if 100 <= self.response.status < 200:
            return
        if not self._direct and not self._handoff:
            self._finish()

    def _hand_off(self) -> None:
        """Offer the rest of the body to the receiver's thread; when it declines, receive it here."""
        assert self._into is not None and self._sock is not None
        held, self._held = self._held, b""
        self._stop = threading.Event()
        start = self._into.count
        job = self._into.from_socket(self._sock, held, self._expected, self._stop)
        if job is None:
            self._handoff, self._held, self._direct = False, held, True
            self._into.wake = self._resume
            self._resume()
            return
        self._job = job
        job.add_done_callback(lambda job: self._handed(job, start))

    def _handed(self, job: asyncio.Future[None], start: int) -> None:
        """The receiver's thread let go of the socket."""
        self._job, self._handoff = None, False
        got = self._into.count - start if self._into is not None else 0
        self.response.received += got
        exc = ProtocolError("the receiver's thread was cancelled") if job.cancelled() else job.exception()
        if exc is not None:
            self._fail(exc)
        elif got != self._expected:
            self._fail(ProtocolError(f"the receiver took {got} of {self._expected} bytes"))
        else:
            self._finish()

    async def _let_go(self) -> None:
        """Stop the socket thread (receiving or sending a body), if one holds the socket, and wait until it has let
        go: the socket may be closed only then (another connection could get its descriptor number)."""
        job = self._job
        if job is None:
            return
        self._stop.set()
        while not job.done():
            try:
                await asyncio.wait([job])
            except asyncio.CancelledError:  # cancelled again: the wait for the thread still comes first
                continue

    def _landed(self, n: int) -> None:
        """``n`` body bytes went into the receiver's room."""
        assert self._into is not None
        self.response.received += n
        self._into.landed(n)
        if self.response.received >= self._expected:
            self._finish()
        elif not len(self._into.free()):
            self._pause()

    def _place_held(self) -> None:
        """Move held bytes into the receiver's room, as far as it goes."""
        while self._held and self._direct and self._into is not None:
            room = self._into.free()
            n = min(len(room), len(self._held))
            if not n:
                self._pause()
                return
            room[:n] = self._held[:n]
            self._held = self._held[n:]
            self._landed(n)

    def _pause(self) -> None:
        """Stop reading the socket until the receiver has room (``_resume``)."""
        if not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()

    def _resume(self) -> None:
        """The receiver has room again."""
        if self._held:
            self._place_held()
        if not self._held and self._direct:
            self._unpause()

    def _unpause(self) -> None:
        """Read the socket again (``_pause`` undone), unless the connection is closed."""
        if self._paused:
            self._paused = False
            if not self.closed and self.transport is not None:
                self.transport.resume_reading()

    # ----------------------------------------------------------------------------- requests

    async def request(self, head: bytes, body: Sequence[Body] = (), into: Receiver | None = None, *,
                      head_only: bool = False) -> Response:
        """Send ``head`` (request line and headers) and the ``body`` pieces; the response, its 2xx body received by
        ``into`` when given (``Response.received`` bytes; the receiver's calls run on the loop and must not
        raise), other bodies in ``Response.body``. ``head_only``: the request was a HEAD (the answer ends with its
        headers).

        Raises ``ProtocolError`` (or the ``OSError`` of the socket) when the exchange breaks; the connection
        is then closed. Cancelling closes it too.
        """
        if self.closed or self.transport is None:
            raise ProtocolError("connection is closed")
        self._reset_response()
        self._parser = httptools.HttpResponseParser(self)
        self._into, self._held, self._direct, self._expected, self._got_any = into, b"", False, 0, False
        self._handoff, self._cut = False, False
        self._head_only = head_only
        self._done = self.loop.create_future()
        try:
            if any(isinstance(piece, FileRange) for piece in body):
                self._send_on_thread([head, *body])
            else:
                self.transport.writelines([head, *body])
            await self._done
            if self._cut and 200 <= self.response.status < 300:
                raise ProtocolError("the server answered before the whole request body was sent")
        except BaseException:
            await self._let_go()
            self.close()
            raise
        finally:
            self._done = None
            self._release_sink()
        resp = self.response
        resp.body = bytes(self._body)
        if not self._reusable(any(body_size(piece) for piece in body)):
            self.close()
        self._parser = None
        self.used = True
        return resp

    def _reusable(self, sent_body: bool) -> bool:
        """Whether the next request may use this connection: the answer was whole and asked for no close, and,
        when the request had a body, it was a 2xx (an error may come before the server read the body: the rest
        of it, queued here or in the socket, would be taken for the next request, and a queued rest still
        refers to the caller's buffer)."""
        return (not self.closed and self._keep_alive and self._complete and self.transport is not None
                and not self._cut and (not sent_body or 200 <= self.response.status < 300)
                and self.transport.get_write_buffer_size() == 0)

    def _send_on_thread(self, pieces: list[Body]) -> None:
        """Send ``pieces`` from a socket thread; the socket is not read until the thread has let go (``_sent``): a
        transport that saw the server's close would close the descriptor under the thread."""
        if self._sock is None:
            raise ProtocolError("a file body needs a plain TCP connection")
        self._pause()
        self._stop = threading.Event()
        job = self.loop.run_in_executor(socket_executor(), _send_pieces, self._sock, pieces, self._stop)
        self._job = job
        job.add_done_callback(self._sent)

    def _sent(self, job: asyncio.Future[bool]) -> None:
        """The sending thread let go of the socket: the answer is read now (a failure of the file fails the
        request instead)."""
        self._job = None
        self._unpause()
        exc = ProtocolError("the sending thread was cancelled") if job.cancelled() else job.exception()
        if exc is not None:
            self._fail(exc)
        elif not job.result():
            self._cut = True

    def _finish(self) -> None:
        self._complete = True
        self._release_sink()
        if self._done is not None and not self._done.done():
            self._done.set_result(None)

    def _fail(self, exc: Exception) -> None:
        self._release_sink()
        if self._done is not None and not self._done.done():
            self._done.set_exception(exc)
        self.close()

    def _release_sink(self) -> None:
        """From here on nothing is received into the caller's receiver (and reading goes on, for the next
        answer or the server's close)."""
        if self._into is not None:
            self._into.wake = None
        self._direct, self._handoff, self._expected, self._into, self._held = False, False, 0, None, b""
        self._unpause()

    def close(self) -> None:
        """Close the connection at once (buffered writes are dropped)."""
        self.closed = True
        if self.transport is not None:
            self.transport.abort()


def _send_pieces(sock: int, pieces: Sequence[Body], stop: threading.Event) -> bool:
    """On a socket thread: write ``pieces`` to the non-blocking ``sock``, a ``FileRange`` with ``sendfile``. False
    when the server answered, closed or reset before all of them went out (its answer decides), or on ``stop``;
    EOFError when a file ends before its range does."""
    poller = select.poll()
    poller.register(sock, select.POLLOUT | select.POLLIN)
    for piece in pieces:
        if isinstance(piece, FileRange):
            view, fd, pos, end = None, piece.fd, piece.offset, piece.offset + piece.length
        else:
            view = memoryview(piece).cast("B")
            fd, pos, end = -1, 0, len(view)
        while pos < end:
            if stop.is_set():
                return False
            try:
                if view is not None:
                    n = os.write(sock, view[pos:])
                else:
                    n = os.sendfile(sock, fd, pos, end - pos)
                    if not n:
                        raise EOFError(f"end of file at byte {pos}: wanted bytes up to {end}")
            except BlockingIOError:
                if any(events & ~select.POLLOUT for _, events in poller.poll(50)):  # a stop is seen within 50 ms
                    return False  # something to read (an early answer, a close) or an error: not sent whole
                continue
            except ConnectionError:
                return False
            except OSError as exc:
                if view is None and exc.errno in _NO_SENDFILE:
                    raise SendfileUnsupported(f"sendfile: {exc}") from exc
                raise
            pos += n
    return True
