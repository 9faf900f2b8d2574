"""A link emulator: a TCP proxy on 127.0.0.1 in front of one emulator that makes loopback look like a cloud link.

Each direction of each connection is a pipe that delays every byte by half the round trip (plus optional jitter,
order kept), paced by a rate ceiling per connection and by one total rate per direction shared by all connections.
A new connection's first bytes wait ``handshake_rtts`` more round trips (TCP, TLS). Optional faults: loss-like
stalls (a chunk held ``stall`` seconds, as a retransmission timeout holds a TCP stream) and connection resets.

Chunks leave each pipe in the order they came. A pipe reads ahead of its reader no more than ``WINDOW`` bytes (a
receive window), so a slow reader slows the sender as TCP would. Requests are counted by following HTTP/1.1 request
heads and ``Content-Length`` bodies upward (``requests``, ``connections``, ``moved``).

``LinkEmulator(port, profile)`` runs in a thread of the caller (tests); ``python -m harness.link PORT PROFILE``
runs one in its own process (benchmarks: a proxy sharing the client's interpreter would take its CPU), printing
its port, then its counts as JSON when its stdin closes. ``ceiling()`` measures what the proxy carries here.
"""

from __future__ import annotations

import asyncio
import collections
import heapq
import json
import os
import random
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from harness.loopserver import LoopServer, reset

CHUNK = 64 << 10
WINDOW = 4 << 20
"""Bytes a pipe holds (read from its sender, not yet taken by its receiver) before it stops reading."""
SLACK = 0.01
"""Seconds of pacing a late timer may make up with a burst (timers here fire up to a millisecond late)."""
MB = 1_000_000


@dataclass(frozen=True)
class LinkProfile:
    """What a link does to traffic (rates in bytes per second per direction; 0: no ceiling)."""

    name: str
    rtt: float
    """Seconds of a round trip: half of it each way."""
    per_connection: float = 0.0
    total: float = 0.0
    jitter: float = 0.0
    """Up to this many seconds more per chunk, at random (order kept)."""
    handshake_rtts: int = 1
    """Round trips a new connection's first bytes wait (TCP's handshake: 1; with TLS 1.3: 2)."""
    stall_p: float = 0.0
    """Chance per chunk of a loss-like stall."""
    stall: float = 0.2
    reset_p: float = 0.0
    """Chance per connection of a reset once a random 0-8 MiB went through it."""

    def scaled(self, **changes: float) -> LinkProfile:
        """This profile with ``changes``."""
        return LinkProfile(**{**asdict(self), **changes})


PROFILES = {
    "near": LinkProfile("near", rtt=0.010, per_connection=32 * MB, total=240 * MB),
    "far": LinkProfile("far", rtt=0.060, per_connection=16 * MB, total=240 * MB),
}
"""The link profiles of the benchmarks: a region's own bucket, one a continent away; the totals stay under the
proxy's ceiling on a 2-core host (``ceiling()``, measured with the client and server beside it)."""


class _Pacer:
    """A rate as a virtual clock: ``reserve(n)`` is when ``n`` more bytes may go."""

    def __init__(self, rate: float) -> None:
        self.rate, self.next = rate, 0.0

    def reserve(self, n: int, now: float) -> float:
        if not self.rate:
            return now
        start = max(self.next, now - SLACK)
        self.next = start + n / self.rate
        return start


class _Share:
    """One rate shared fairly by the pipes that use it (start-time fair queueing): a pipe's chunk is served in the
    order of its start tag, the bytes that pipe was granted before it (never less than the tag in service), so
    that each backlogged pipe gets an equal share in bytes, whatever the size of its reads."""

    def __init__(self, rate: float) -> None:
        self.rate, self.next, self.tag = rate, 0.0, 0.0
        self._queue: list[tuple[float, int, int, asyncio.Future[None]]] = []
        self._order = 0
        self._timer: asyncio.TimerHandle | None = None

    async def take(self, n: int, finish: list[float]) -> None:
        """Wait for ``n`` bytes of the rate (``finish``: the pipe's own tag, updated)."""
        if not self.rate:
            return
        loop = asyncio.get_running_loop()
        start = max(self.tag, finish[0])
        finish[0] = start + n
        waiter = loop.create_future()
        self._order += 1
        heapq.heappush(self._queue, (start, self._order, n, waiter))
        if self._timer is None:
            self._serve()
        await waiter

    def _serve(self) -> None:
        loop = asyncio.get_running_loop()
        self._timer = None
        now = loop.time()
        while self._queue and self.next <= now + SLACK:
            start, _, n, waiter = heapq.heappop(self._queue)
            self.tag = start
            self.next = max(self.next, now - SLACK) + n / self.rate
            if not waiter.done():
                waiter.set_result(None)
        if self._queue:
            self._timer = loop.call_at(self.next - SLACK, self._serve)


@dataclass
class LinkStats:
    """What went through the link."""

    connections: int = 0
    requests: list[str] = field(default_factory=list)
    """Each request's method and target, in the order they arrived."""
    moved: dict[str, int] = field(default_factory=lambda: {"up": 0, "down": 0})
    stalls: int = 0
    resets: int = 0
    peak_connections: int = 0


class _RequestHeads:
    """Follows a client's HTTP/1.1 stream to note each request's first line (bodies skipped by Content-Length)."""

    def __init__(self, note: Callable[[str], None]) -> None:
        self.note, self.head, self.body, self.lost = note, b"", 0, False

    def feed(self, data: bytes) -> None:
        while data and not self.lost:
            if self.body:
                skip = min(self.body, len(data))
                self.body, data = self.body - skip, data[skip:]
                continue
            self.head += data
            end = self.head.find(b"\r\n\r\n")
            if end < 0:
                self.lost = len(self.head) > 1 << 16
                return
            head, data, self.head = self.head[:end], self.head[end + 4:], b""
            lines = head.decode("latin-1").split("\r\n")
            self.note(" ".join(lines[0].split(" ")[:2]))
            for line in lines[1:]:
                name, _, value = line.partition(":")
                if name.strip().lower() == "content-length":
                    self.body = int(value)
                elif name.strip().lower() == "transfer-encoding":
                    self.lost = True  # chunked bodies are not followed: counts stop here


class LinkEmulator(LoopServer):
    """``with LinkEmulator(upstream_port, profile) as link:`` and send requests to ``link.url``."""

    def __init__(self, upstream_port: int, profile: LinkProfile, seed: int = 0) -> None:
        super().__init__("link-emulator")
        self.upstream_port, self.profile = upstream_port, profile
        self.stats = LinkStats()
        self._rng = random.Random(seed)
        self._total = {"up": _Share(profile.total), "down": _Share(profile.total)}
        self._open = 0

    def reset_stats(self) -> None:
        """Start counting afresh (connections open now count towards the peak)."""
        self.stats = LinkStats(peak_connections=self._open)

    async def _handle(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        try:
            await self._connection(client_r, client_w)
        except asyncio.CancelledError:  # the emulator is stopping
            client_w.transport.abort()

    async def _connection(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        stats = self.stats
        stats.connections += 1
        self._open += 1
        stats.peak_connections = max(stats.peak_connections, self._open)
        try:
            upstream_r, upstream_w = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        except OSError:
            client_w.transport.abort()
            self._open -= 1
            return
        pair = (client_w, upstream_w)
        for writer in pair:
            writer.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        p = self.profile
        reset_after = self._rng.uniform(0, 8 << 20) if p.reset_p and self._rng.random() < p.reset_p else None
        heads = _RequestHeads(stats.requests.append)
        conn = {"up": _Pacer(p.per_connection), "down": _Pacer(p.per_connection)}
        moved = [0]
        try:
            await asyncio.gather(
                self._pipe(client_r, upstream_w, "up", conn["up"], p.handshake_rtts * p.rtt, heads, moved,
                           reset_after, pair),
                self._pipe(upstream_r, client_w, "down", conn["down"], 0.0, None, moved, reset_after, pair))
        finally:
            self._open -= 1
            for writer in pair:
                writer.transport.abort()

    async def _pipe(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter, direction: str, pacer: _Pacer,
                    first_wait: float, heads: _RequestHeads | None, moved: list[int], reset_after: float | None,
                    pair: tuple[asyncio.StreamWriter, asyncio.StreamWriter]) -> None:
        """Copy ``src`` to ``dst`` through the link: paced, then delayed, at most ``WINDOW`` ahead. Chunks wait in one
        queue per pipe, released in order by one timer (timers of a loop may fire out of order when their times are
        close: uvloop rounds them to milliseconds)."""
        loop, p, stats = asyncio.get_running_loop(), self.profile, self.stats
        queue: collections.deque[tuple[float, bytes | None]] = collections.deque()
        finish = [0.0]
        held = [0]
        room = asyncio.Event()
        room.set()
        done: asyncio.Future[None] = loop.create_future()
        timer: list[asyncio.TimerHandle | None] = [None]

        def release() -> None:
            timer[0] = None
            now = loop.time()
            while queue and queue[0][0] <= now:
                _, data = queue.popleft()
                if dst.transport.is_closing():
                    continue
                if data is None:
                    if dst.can_write_eof():
                        dst.write_eof()
                    if not done.done():
                        done.set_result(None)
                    return
                dst.write(data)
                held[0] -= len(data)
            if held[0] < WINDOW:
                room.set()
            if queue:
                timer[0] = loop.call_at(queue[0][0], release)

        def enqueue(at: float, data: bytes | None) -> None:
            queue.append((max(at, queue[-1][0]) if queue else at, data))
            if timer[0] is None:
                timer[0] = loop.call_at(queue[0][0], release)

        try:
            while True:
                await room.wait()
                data = await src.read(CHUNK)
                now = loop.time()
                if heads is not None and data:
                    heads.feed(data)
                start = pacer.reserve(len(data), now)
                if start > now:
                    await asyncio.sleep(start - now)
                await self._total[direction].take(len(data), finish)
                now = loop.time()
                if not data:
                    enqueue(now + p.rtt / 2, None)
                    await done
                    return
                stats.moved[direction] += len(data)
                moved[0] += len(data)
                if reset_after is not None and moved[0] > reset_after:
                    stats.resets += 1
                    for writer in pair:
                        reset(writer)
                    return
                at = now + p.rtt / 2 + first_wait + (self._rng.uniform(0, p.jitter) if p.jitter else 0.0)
                first_wait = 0.0
                if p.stall_p and self._rng.random() < p.stall_p:
                    stats.stalls += 1
                    at += p.stall
                held[0] += len(data)
                if held[0] >= WINDOW:
                    room.clear()
                enqueue(at, data)
                # a receiver that does not read holds the pipe as TCP's window would
                if dst.transport.get_write_buffer_size() > WINDOW:
                    await dst.drain()
        except (ConnectionError, OSError):
            for writer in pair:
                writer.transport.abort()
        finally:
            if timer[0] is not None:
                timer[0].cancel()


class LinkProcess:
    """A ``LinkEmulator`` in a process of its own: ``with LinkProcess(port, "far") as link:``; ``link.stats`` (a dict)
    once it is stopped."""

    def __init__(self, upstream_port: int, profile: str | LinkProfile) -> None:
        self.profile = PROFILES[profile] if isinstance(profile, str) else profile
        self.upstream_port = upstream_port
        self.stats: dict[str, object] = {}
        self.port = 0
        self._proc: subprocess.Popen[str] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> LinkProcess:
        self._proc = subprocess.Popen([sys.executable, "-m", "harness.link", str(self.upstream_port),
                                       json.dumps(asdict(self.profile))],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                      cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        assert self._proc.stdout is not None
        line = self._proc.stdout.readline()
        if not line:
            raise RuntimeError("link emulator process did not start")
        self.port = int(line)
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._proc is not None and self._proc.stdin is not None and self._proc.stdout is not None
        self._proc.stdin.close()
        out = self._proc.stdout.read()
        self._proc.wait(10)
        self.stats = json.loads(out) if out.strip() else {}


def ceiling(profile: LinkProfile | None = None, seconds: float = 3.0, connections: int = 8) -> float:
    """Bytes per second this host's emulator carries down a link of ``profile`` (default: no delay, no ceilings):
    ``connections`` streams from a local sender to a local reader, each in a thread of this process, the proxy in a
    process of its own."""
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    stop = threading.Event()
    block = b"\0" * (1 << 20)

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except OSError:
                return
            threading.Thread(target=_send_until, args=(conn, block, stop), daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    got = [0] * connections
    with LinkProcess(port, profile or LinkProfile("open", rtt=0.0, handshake_rtts=0)) as link:
        def read(i: int) -> None:
            with socket.create_connection(("127.0.0.1", link.port)) as sock:
                end = time.monotonic() + seconds
                while time.monotonic() < end:
                    got[i] += len(sock.recv(1 << 20))

        readers = [threading.Thread(target=read, args=(i,)) for i in range(connections)]
        for t in readers:
            t.start()
        for t in readers:
            t.join()
        stop.set()
    server.close()
    return sum(got) / seconds


def _send_until(conn: socket.socket, block: bytes, stop: threading.Event) -> None:
    with conn:
        while not stop.is_set():
            try:
                conn.sendall(block)
            except OSError:
                return


def main() -> None:
    """``python -m harness.link UPSTREAM_PORT PROFILE_JSON``: prints the port, then the counts when stdin closes."""
    try:
        import uvloop
        uvloop.install()
    except ImportError:
        pass
    profile = LinkProfile(**json.loads(sys.argv[2]))
    with LinkEmulator(int(sys.argv[1]), profile) as link:
        print(link.port, flush=True)
        sys.stdin.read()
        stats = asdict(link.stats)
    stats["requests"] = len(stats["requests"])
    print(json.dumps(stats), flush=True)


if __name__ == "__main__":
    main()
