"""The HTTP data path (``fastckpt.http``) against a raw HTTP/1.1 server on 127.0.0.1 that misbehaves on demand:
keep-alive reuse, idle connections the server closed, short bodies, oversized bodies, chunked error answers,
cancellation mid-body, bodies sent from a caller's buffer or from a file on a thread, bodies a file's receiver
takes from the socket on a thread; under asyncio's loop and uvloop's (what the library runs on)."""

from __future__ import annotations

import asyncio
import errno
import os
import ssl
import threading
from collections.abc import AsyncIterator, Awaitable

import pytest
import trustme

from fastckpt.engine import sink as sinks
from fastckpt.engine.sink import RingSink
from fastckpt.http import HttpClient
from fastckpt.http import connection as connections
from fastckpt.integrity import hash_chunks
from fastckpt.transport import BufferReceiver, FileRange, ProtocolError, Receiver, SendfileUnsupported

DATA = os.urandom(3 << 20)

pytestmark = pytest.mark.both_loops


class Server:
    """Answers ``GET /data?start=S&end=E`` with DATA[S:E] (206), ``PUT /echo`` with the body's length and bytes
    kept, ``GET /short?length=N`` with half the promised N (1000) bytes then a close, ``GET /error`` with a
    chunked 503, ``GET /stall?length=N`` with a head for N (100000) bytes and 1 KiB of them then nothing;
    ``close_after`` closes each connection after that many answers."""

    def __init__(self) -> None:
        self.connections = 0
        self.close_after = 0
        self.received: list[bytes] = []
        self.stalled = asyncio.Event()
        self.server: asyncio.Server | None = None

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        answered = 0
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                line, *fields = head.decode("latin-1").split("\r\n")
                method, target, _ = line.split(" ")
                headers = {k.lower(): v.strip() for k, _, v in (f.partition(":") for f in fields if f)}
                body = await reader.readexactly(int(headers.get("content-length", "0")))
                await self.answer(method, target, body, writer)
                answered += 1
                if self.close_after and answered >= self.close_after:
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def answer(self, method: str, target: str, body: bytes, writer: asyncio.StreamWriter) -> None:
        path, _, query = target.partition("?")
        args = dict(p.split("=") for p in query.split("&") if p)
        if path == "/data":
            part = DATA[int(args["start"]):int(args["end"])]
            writer.write(b"HTTP/1.1 206 Partial Content\r\nContent-Length: %d\r\n\r\n" % len(part) + part)
        elif path == "/echo":
            self.received.append(body)
            writer.write(b"HTTP/1.1 200 OK\r\nETag: \"%d\"\r\nContent-Length: 0\r\n\r\n" % len(body))
        elif path == "/short":
            length = int(args.get("length", 1000))
            writer.write(b"HTTP/1.1 206 Partial Content\r\nContent-Length: %d\r\n\r\n" % length + DATA[:length // 2])
            await writer.drain()
            raise ConnectionError("cut short")
        elif path == "/error":
            writer.write(b"HTTP/1.1 503 Slow Down\r\nTransfer-Encoding: chunked\r\n\r\n"
                         b"5\r\n<Code\r\n10\r\n>SlowDown</Code>\r\n0\r\n\r\n")
        elif path == "/stall":
            length = int(args.get("length", 100000))
            writer.write(b"HTTP/1.1 206 Partial Content\r\nContent-Length: %d\r\n\r\n" % length + DATA[:1024])
            await writer.drain()
            self.stalled.set()
            await asyncio.sleep(3600)
        await writer.drain()


@pytest.fixture
async def server() -> AsyncIterator[tuple[Server, HttpClient]]:
    srv = Server()
    srv.server = await asyncio.start_server(srv.handle, "127.0.0.1", 0)
    port = srv.server.sockets[0].getsockname()[1]
    client = HttpClient(f"http://127.0.0.1:{port}", limit=4)
    yield srv, client
    await client.close()
    srv.server.close()


@pytest.fixture
async def tls_server() -> AsyncIterator[tuple[Server, HttpClient]]:
    """The same server behind TLS (a certificate of a throwaway CA that the client trusts)."""
    ca = trustme.CA()
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1").configure_cert(server_ctx)
    client_ctx = ssl.create_default_context()
    ca.configure_trust(client_ctx)
    srv = Server()
    srv.server = await asyncio.start_server(srv.handle, "127.0.0.1", 0, ssl=server_ctx)
    port = srv.server.sockets[0].getsockname()[1]
    client = HttpClient(f"https://127.0.0.1:{port}", limit=4, ssl_context=client_ctx)
    yield srv, client
    await client.close()
    srv.server.close()


async def test_ranged_gets_land_in_the_buffer_on_one_kept_alive_connection(server) -> None:
    srv, client = server
    for start, end in [(0, 1), (5, 70000), (1 << 20, 3 << 20)]:
        buf = bytearray(end - start)
        resp = await client.request("GET", f"/data?start={start}&end={end}", {}, into=BufferReceiver(memoryview(buf)))
        assert resp.status == 206 and resp.received == end - start and bytes(buf) == DATA[start:end]
    assert srv.connections == 1


class Trickle(Receiver):
    """Takes a body through a ring of ``room`` bytes that is drained a loop turn after bytes land: the connection
    must stop reading while it is full, and go on when woken."""

    def __init__(self, length: int, room: int) -> None:
        self.length, self.ring, self.out = length, bytearray(room), bytearray()
        self.pending = self.full = 0

    @property
    def remaining(self) -> int:
        return self.length - self.count

    def free(self) -> memoryview:
        start = self.count % len(self.ring)
        room = memoryview(self.ring)[start:min(len(self.ring), start + len(self.ring) - self.pending)]
        self.full += not len(room)
        return room

    def landed(self, n: int) -> None:
        self.count += n
        self.pending += n
        asyncio.get_running_loop().call_soon(self.drain)

    def drain(self) -> None:
        start = (self.count - self.pending) % len(self.ring)
        while self.pending:
            n = min(self.pending, len(self.ring) - start)
            self.out += self.ring[start:start + n]
            self.pending -= n
            start = (start + n) % len(self.ring)
        self.woken()


@pytest.mark.parametrize(("length", "room"), [((3 << 20) - 5, 64 << 10), (200_000, 128)])
async def test_a_receiver_out_of_room_holds_the_socket_until_it_wakes(server, length: int, room: int) -> None:
    """A body far longer than the receiver's room arrives whole and in order: reading stops while the room is
    full (128 bytes: less than the body bytes that come with the head, which wait for room too)."""
    srv, client = server
    trickle = Trickle(length, room)
    resp = await client.request("GET", f"/data?start=5&end={5 + length}", {}, into=trickle)
    assert resp.status == 206 and resp.received == length and bytes(trickle.out) == DATA[5:5 + length]
    assert trickle.full > 0
    buf = bytearray(10)  # the connection is whole and reading again
    resp = await client.request("GET", "/data?start=0&end=10", {}, into=BufferReceiver(memoryview(buf)))
    assert bytes(buf) == DATA[:10] and srv.connections == 1


async def test_a_connection_the_server_closed_while_idle_is_replaced(server) -> None:
    srv, client = server
    srv.close_after = 1
    for _ in range(3):
        buf = bytearray(10)
        resp = await client.request("GET", "/data?start=0&end=10", {}, into=BufferReceiver(memoryview(buf)))
        assert resp.status == 206 and bytes(buf) == DATA[:10]
        await asyncio.sleep(0.05)  # the server's close arrives while the connection sits idle
    assert srv.connections == 3


async def test_short_body_raises_and_the_connection_is_not_reused(server) -> None:
    srv, client = server
    buf = bytearray(1000)
    with pytest.raises(ProtocolError, match="mid-response"):
        await client.request("GET", "/short", {}, into=BufferReceiver(memoryview(buf)))
    resp = await client.request("GET", "/data?start=0&end=4", {}, into=BufferReceiver(memoryview(bytearray(4))))
    assert resp.status == 206 and srv.connections == 2


async def test_more_bytes_than_the_buffer_holds_is_an_error(server) -> None:
    _, client = server
    with pytest.raises(ProtocolError, match="server sent 100 bytes for a 10-byte range"):
        await client.request("GET", "/data?start=0&end=100", {}, into=BufferReceiver(memoryview(bytearray(10))))


async def test_error_answers_keep_their_body_out_of_the_buffer(server) -> None:
    _, client = server
    buf = bytearray(b"untouched")
    resp = await client.request("GET", "/error", {}, into=BufferReceiver(memoryview(buf)))
    assert resp.status == 503 and resp.body == b"<Code>SlowDown</Code>" and resp.received == 0
    assert buf == b"untouched"


async def test_cancelled_read_closes_and_never_writes_the_buffer_again(server) -> None:
    srv, client = server
    buf = bytearray(100000)
    task = asyncio.ensure_future(client.request("GET", "/stall", {}, into=BufferReceiver(memoryview(buf))))
    await asyncio.wait_for(srv.stalled.wait(), 10)
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert bytes(buf[:1024]) == DATA[:1024]
    buf[:] = bytes(len(buf))
    await asyncio.sleep(0.1)
    assert not any(buf)  # the closed connection wrote nothing more
    resp = await client.request("GET", "/data?start=0&end=4", {}, into=BufferReceiver(memoryview(bytearray(4))))
    assert resp.status == 206 and srv.connections == 2


async def test_put_sends_a_view_of_the_callers_buffer(server) -> None:
    srv, client = server
    resp = await client.request("PUT", "/echo", {"X-Test": "1"}, body=memoryview(DATA)[7:(2 << 20) + 7])
    assert resp.status == 200 and resp.headers["etag"] == f'"{2 << 20}"'
    assert srv.received == [DATA[7:(2 << 20) + 7]]


def test_header_injection_is_refused() -> None:
    client = HttpClient("http://127.0.0.1:1")
    with pytest.raises(ValueError, match="line break"):
        asyncio.run(client.request("GET", "/x", {"X-Bad": "a\r\nHost: evil"}))


async def test_requests_go_through_the_environments_proxy(server, monkeypatch) -> None:
    """HTTP_PROXY / HTTPS_PROXY are honoured (a CONNECT tunnel, with the proxy's credentials) and NO_PROXY
    exempts hosts, as botocore and curl do."""
    _, direct = server
    port = int(direct.host_header.rsplit(":", 1)[1])
    seen: list[bytes] = []

    async def tunnel(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        seen.append(head)
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"HTTP/1.1 200 Connection established\r\n\r\n")

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            while data := await src.read(1 << 16):
                dst.write(data)
                await dst.drain()
            dst.close()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer), return_exceptions=True)

    proxy = await asyncio.start_server(tunnel, "127.0.0.1", 0)
    proxy_port = proxy.sockets[0].getsockname()[1]
    monkeypatch.setenv("HTTP_PROXY", f"http://us%40r:p%3Ass@127.0.0.1:{proxy_port}")
    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.delenv("no_proxy", raising=False)
    try:
        client = HttpClient(f"http://127.0.0.1:{port}")
        buf = bytearray(100)
        resp = await client.request("GET", "/data?start=0&end=100", {}, into=BufferReceiver(memoryview(buf)))
        assert resp.status == 206 and bytes(buf) == DATA[:100]
        assert seen and seen[0].startswith(f"CONNECT 127.0.0.1:{port} HTTP/1.1".encode())
        assert b"Proxy-Authorization: Basic dXNAcjpwOnNz" in seen[0]  # us@r:p:ss
        await client.close()
        monkeypatch.setenv("NO_PROXY", "127.0.0.1")
        assert HttpClient(f"http://127.0.0.1:{port}").proxy is None
    finally:
        proxy.close()


async def test_an_answer_before_the_body_is_sent_closes_the_connection() -> None:
    """A server that refuses a large PUT at once (before reading its body): the error is returned and the
    connection, with the rest of the body still queued, is closed rather than reused."""
    connections = []

    async def refuse(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(writer)
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 403 Forbidden\r\nContent-Length: 0\r\n\r\n")
        await writer.drain()
        await asyncio.sleep(0.5)  # neither reads the body nor closes
        writer.close()

    srv = await asyncio.start_server(refuse, "127.0.0.1", 0)
    client = HttpClient(f"http://127.0.0.1:{srv.sockets[0].getsockname()[1]}")
    try:
        resp = await client.request("PUT", "/x", {}, body=memoryview(DATA))
        assert resp.status == 403 and client._idle == []
    finally:
        await client.close()
        srv.close()


@pytest.fixture
def data_file(tmp_path) -> AsyncIterator[int]:
    """DATA in a file, open for reading."""
    (tmp_path / "data").write_bytes(DATA)
    fd = os.open(tmp_path / "data", os.O_RDONLY)
    yield fd
    os.close(fd)


@pytest.fixture
def large_file(tmp_path) -> AsyncIterator[int]:
    """A 64 MiB file (sparse: zeros), more than the loopback socket's buffers hold, open for reading."""
    with open(tmp_path / "large", "wb") as out:
        out.truncate(64 << 20)
    fd = os.open(tmp_path / "large", os.O_RDONLY)
    yield fd
    os.close(fd)




async def test_a_file_range_is_sent_from_the_file_on_a_kept_alive_connection(server, data_file, sendfile_bytes
                                                                            ) -> None:
    """A body with a ``FileRange`` goes out with ``sendfile`` (on its own, or between buffers), and the
    connection serves the next request."""
    srv, client = server
    assert client.sends_files
    resp = await client.request("PUT", "/echo", {}, body=FileRange(data_file, 7, 2 << 20))
    assert resp.status == 200 and resp.headers["etag"] == f'"{2 << 20}"'
    resp = await client.request("PUT", "/echo", {}, body=[b"head", FileRange(data_file, 0, len(DATA)), b"tail"])
    assert resp.status == 200
    assert srv.received == [DATA[7:(2 << 20) + 7], b"head" + DATA + b"tail"]
    assert sum(sendfile_bytes) == (2 << 20) + len(DATA) and srv.connections == 1


async def test_an_answer_before_a_file_body_is_sent_stops_the_thread_and_closes(large_file) -> None:
    """A server that refuses a PUT before reading its body: the sending thread stops, the error is returned,
    and the connection is closed (the rest of the body would be taken for the next request)."""
    release = asyncio.Event()

    async def refuse(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 403 Forbidden\r\nContent-Length: 0\r\n\r\n")
        await writer.drain()
        await release.wait()  # neither reads the body nor closes until the test ends
        writer.close()

    srv = await asyncio.start_server(refuse, "127.0.0.1", 0)
    client = HttpClient(f"http://127.0.0.1:{srv.sockets[0].getsockname()[1]}")
    try:
        resp = await asyncio.wait_for(client.request("PUT", "/x", {}, body=FileRange(large_file, 0, 64 << 20)), 3)
        assert resp.status == 403 and client._idle == []
    finally:
        release.set()
        await client.close()
        srv.close()


async def test_a_file_shorter_than_its_range_fails_the_request(server, data_file) -> None:
    """The file ends before its range: EOFError (the source changed; not a broken connection to retry), and the
    server never sees a whole body."""
    srv, client = server
    with pytest.raises(EOFError, match="end of file"):
        await client.request("PUT", "/echo", {}, body=FileRange(data_file, 1 << 20, len(DATA)))
    resp = await client.request("PUT", "/echo", {}, body=b"next")
    assert resp.status == 200 and srv.received == [b"next"] and srv.connections == 2


async def test_a_cancelled_file_body_returns_only_once_the_thread_let_go(large_file, monkeypatch) -> None:
    """Cancelling a PUT whose body the server does not read returns after the sending thread stopped: the
    socket is closed only once no thread can write to its descriptor."""
    running = threading.Event()
    ended = threading.Event()
    real = connections._send_pieces

    def watched(*args: object) -> bool:
        running.set()
        try:
            return real(*args)
        finally:
            ended.set()

    async def stall(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await asyncio.sleep(5)
        writer.close()

    monkeypatch.setattr(connections, "_send_pieces", watched)
    srv = await asyncio.start_server(stall, "127.0.0.1", 0)
    client = HttpClient(f"http://127.0.0.1:{srv.sockets[0].getsockname()[1]}")
    try:
        task = asyncio.ensure_future(client.request("PUT", "/x", {}, body=FileRange(large_file, 0, 64 << 20)))
        await asyncio.sleep(0.3)
        assert running.is_set() and not ended.is_set()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert ended.is_set()
    finally:
        await client.close()
        srv.close()


async def test_a_file_the_kernel_cannot_send_is_named_so(server, data_file, monkeypatch) -> None:
    """``sendfile`` refused for the file (EINVAL: its filesystem cannot): SendfileUnsupported, which no layer takes
    for a broken connection, and the next request goes on a new connection."""
    srv, client = server

    def refuse(*args: object) -> int:
        raise OSError(errno.EINVAL, "Invalid argument")

    monkeypatch.setattr(os, "sendfile", refuse)
    with pytest.raises(SendfileUnsupported):
        await client.request("PUT", "/echo", {}, body=FileRange(data_file, 0, 1 << 20))
    resp = await client.request("PUT", "/echo", {}, body=b"next")
    assert resp.status == 200 and srv.received == [b"next"] and srv.connections == 2


def test_file_ranges_are_not_sent_over_tls() -> None:
    """TLS must see the bytes: a client of an https origin takes buffers only."""
    assert not HttpClient("https://127.0.0.1:1").sends_files


class FileSink:
    """A ``RingSink`` for ``length`` bytes at ``offset`` of a new file, whose ring stays zero unless bytes go
    through it."""

    def __init__(self, path: str, offset: int, length: int, *, flags: int = os.O_RDWR) -> None:
        if not os.path.exists(path):
            open(path, "wb").close()
        self.fd = os.open(path, flags)
        self.ring = bytearray(sinks.SLICE)
        self.sink = RingSink("obj", self.fd, threading.Lock(), offset, length, memoryview(self.ring), 1 << 20)

    def close(self) -> None:
        os.close(self.fd)


async def test_a_body_bound_for_a_file_moves_from_the_socket_on_a_thread(server, tmp_path) -> None:
    """A ranged GET into a file's sink bypasses its ring (the body goes socket -> pipe -> file), is hashed
    from the file, and leaves the connection ready for the next request."""
    srv, client = server
    start, end = 5, (3 << 20) - 7
    target = FileSink(str(tmp_path / "out"), 3, end - start)
    try:
        digests = await target.sink.receive(_received(
            client.request("GET", f"/data?start={start}&end={end}", {}, into=target.sink)))
    finally:
        target.close()
    assert (tmp_path / "out").read_bytes() == bytes(3) + DATA[start:end]
    assert digests == hash_chunks(DATA[start:end], 1 << 20)
    assert not any(target.ring)  # no byte went through the ring
    resp = await client.request("GET", "/data?start=0&end=4", {}, into=BufferReceiver(memoryview(bytearray(4))))
    assert resp.status == 206 and srv.connections == 1


async def test_a_body_over_tls_goes_through_the_ring(tls_server, tmp_path) -> None:
    """Over TLS the socket carries ciphertext: the body is decrypted by the transport and lands in the ring,
    never spliced from the socket."""
    srv, client = tls_server
    length = 3 << 20
    target = FileSink(str(tmp_path / "out"), 0, length)
    try:
        digests = await target.sink.receive(_received(
            client.request("GET", f"/data?start=0&end={length}", {}, into=target.sink)))
    finally:
        target.close()
    assert (tmp_path / "out").read_bytes() == DATA and digests == hash_chunks(DATA, 1 << 20)
    assert any(target.ring) and srv.connections == 1


async def _received(request: Awaitable) -> int:
    return (await request).received


async def test_a_body_cut_short_on_the_thread_keeps_what_came_and_resumes(server, tmp_path) -> None:
    """A body the server cuts off mid-way raises a retryable error; what came is in the file and counted, and
    a second request for the rest completes the range with the same chunk digests as one whole body."""
    srv, client = server
    length = 2 << 20
    target = FileSink(str(tmp_path / "out"), 0, length)

    async def cut_then_rest() -> int:
        with pytest.raises(ProtocolError, match="mid-response"):
            await client.request("GET", f"/short?length={length}", {}, into=target.sink)
        got = target.sink.count
        assert got == length // 2
        resp = await client.request("GET", f"/data?start={got}&end={length}", {}, into=target.sink)
        return got + resp.received

    try:
        digests = await target.sink.receive(cut_then_rest())
    finally:
        target.close()
    assert (tmp_path / "out").read_bytes() == DATA[:length]
    assert digests == hash_chunks(DATA[:length], 1 << 20) and srv.connections == 2


async def test_a_cancelled_body_returns_only_once_the_thread_let_go(server, tmp_path) -> None:
    """Cancelling a request whose body a thread is taking from the socket (the server stalls mid-body) returns
    after that thread has stopped: the bytes it took are already counted, and nothing moves afterwards."""
    srv, client = server
    target = FileSink(str(tmp_path / "out"), 0, 2 << 20)
    try:
        task = asyncio.ensure_future(client.request("GET", f"/stall?length={2 << 20}", {}, into=target.sink))
        await asyncio.wait_for(srv.stalled.wait(), 10)
        await asyncio.sleep(0.1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert target.sink.count == 1024  # counted by the thread as it ended
        await asyncio.sleep(0.2)
        assert target.sink.count == 1024 and os.path.getsize(tmp_path / "out") == 1024
    finally:
        target.close()
    resp = await client.request("GET", "/data?start=0&end=4", {}, into=BufferReceiver(memoryview(bytearray(4))))
    assert resp.status == 206 and srv.connections == 2


async def test_a_file_that_cannot_be_written_fails_the_range_without_retrying(server, tmp_path) -> None:
    """A write the file refuses on the thread (here: opened read-only) stops the request and is raised by the
    sink, not taken for a broken connection."""
    _, client = server
    target = FileSink(str(tmp_path / "ro"), 0, 2 << 20, flags=os.O_RDONLY)
    request = asyncio.ensure_future(client.request("GET", f"/data?start=0&end={2 << 20}", {}, into=target.sink))
    try:
        with pytest.raises(OSError) as info:
            await target.sink.receive(request)
    finally:
        target.close()
    assert info.value.errno == errno.EBADF and request.cancelled()


def test_a_file_system_that_cannot_splice_is_written_from_a_buffer(tmp_path, monkeypatch) -> None:
    """Where the kernel refuses to splice into the file (EINVAL), the pipe's bytes are read and written."""
    real = os.splice

    def no_file_splice(src: int, dst: int, count: int, **kwargs: int) -> int:
        if "offset_dst" in kwargs:
            raise OSError(errno.EINVAL, "no splice_write")
        return real(src, dst, count, **kwargs)

    monkeypatch.setattr(os, "splice", no_file_splice)
    read, write = os.pipe()
    fd = os.open(tmp_path / "out", os.O_RDWR | os.O_CREAT)
    try:
        os.write(write, DATA[:50000])
        sinks._drain(read, fd, 10, 50000)
    finally:
        for each in (read, write, fd):
            os.close(each)
    assert (tmp_path / "out").read_bytes() == bytes(10) + DATA[:50000]
