"""A wire-level fault proxy: a TCP proxy on 127.0.0.1 in front of one emulator that breaks connections
the way networks, load balancers and overloaded servers do.

Each accepted connection asks ``rule(n)`` (n counts connections from 0) for a ``Fault`` or None:

- ``reset_request`` / ``reset_response``: an RST on both sides once ``after`` bytes went up / came down;
- ``truncate_response``: a clean close (FIN) after ``after`` bytes of the answer: a short body;
- ``stall`` / ``stall_response``: once ``after`` bytes went up / came down, that direction stops for
  ``seconds`` (then it goes on): a server that stops reading, or sending, mid-body;
- ``status``: the first request is answered by the proxy with ``status`` (503 ``SlowDown`` by default);
- ``refuse``: an RST as soon as the connection is accepted.

``outage(seconds)`` resets every open connection and refuses new ones for that long (a server restart
or a load-balancer failover). ``throttle(k)`` turns the proxy into a service that throttles: each request goes
upstream on a connection of its own, and one that arrives while ``k`` others are being served is answered
503 SlowDown (or the status and code given) by the proxy. The proxy runs its own event loop in a thread, so
clients of any loop (and synchronous ones) can use it.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass

from harness.loopserver import LoopServer, reset

KINDS = ("reset_request", "reset_response", "truncate_response", "stall", "stall_response", "status", "refuse")
CHUNK = 64 << 10
BODY_SEEN = 4096
"""How much of each request's body a throttling proxy keeps (``bodies``)."""


@dataclass(frozen=True)
class Fault:
    """What to do to one connection (see the module doc)."""

    kind: str
    after: int = 0
    seconds: float = 0.0
    status: int = 503
    code: str = "SlowDown"
    across: bool = False
    """``after`` counts the bytes of every connection in that direction, not just this one's."""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown fault {self.kind!r}: expected one of {KINDS}")


class FaultProxy(LoopServer):
    """``with FaultProxy(upstream_port, rule) as proxy:`` and send requests to ``proxy.url``."""

    def __init__(self, upstream_port: int, rule: Callable[[int], Fault | None] = lambda n: None) -> None:
        super().__init__("fault-proxy")
        self.upstream_port, self.rule = upstream_port, rule
        self.triggered: list[str] = []
        """Kinds of the faults that took effect so far, in order."""
        self._count = itertools.count()
        self.moved = {"up": 0, "down": 0}
        """Bytes passed so far, client to server ("up") and back ("down"), over all connections."""
        self._budget: int | None = None
        self._down_until = 0.0
        self._live: set[asyncio.StreamWriter] = set()
        self._throttle: tuple[Fault, int] | None = None
        self._serving = 0
        self.answers: list[bool] = []
        """Under ``throttle``: one entry per request, in order, True when the proxy throttled it."""
        self.requests: list[str] = []
        """Under ``throttle``: each request's first line (method and target), in order."""
        self.headers: list[dict[str, str]] = []
        """Under ``throttle``: each request's headers (names in lower case), in order."""
        self.sent = 0
        """Under ``throttle``: the bytes of request bodies (as their ``Content-Length`` gives them)."""
        self.strip: frozenset[str] = frozenset()
        """Under ``throttle``: headers (lower-case names) recorded but not sent upstream, for an emulator that refuses
        what it does not implement (a request then must not sign them: a SAS signs none)."""
        self.bodies: list[bytes] = []
        """Under ``throttle``: the first ``BODY_SEEN`` bytes of each request's body, in order."""

    def arm(self, fault: Fault | None, times: int | None = 1, skip: int = 0) -> None:
        """Apply ``fault`` ``times`` times (None: every time), to connections opened after the next ``skip``:
        a byte-triggered fault goes to the first connections whose traffic gets that far (``arm(None)``:
        no faults)."""
        self._budget = times
        skipped = [skip]

        def rule(_: int) -> Fault | None:
            if skipped[0] > 0:
                skipped[0] -= 1
                return None
            return fault if self._budget is None or self._budget > 0 else None

        self.rule = rule

    def _take(self) -> bool:
        """Whether a fault may take effect now (and count it against ``arm``'s budget)."""
        if self._budget is None:
            return True
        self._budget -= 1
        return self._budget >= 0

    def throttle(self, max_in_flight: int | None, status: int = 503, code: str = "SlowDown") -> None:
        """From now on, answer ``status`` ``code`` to a request that arrives while ``max_in_flight`` others are being
        served (each request is sent upstream with ``Connection: close``, so that its end is its connection's);
        None: throttle no more."""
        self._throttle = None if max_in_flight is None else (Fault("status", status=status, code=code), max_in_flight)

    def outage(self, seconds: float) -> None:
        """Reset every open connection now and refuse new ones for ``seconds``."""
        self._down_until = time.monotonic() + seconds
        self._loop.call_soon_threadsafe(lambda: [reset(w) for w in list(self._live)])

    def _closing(self) -> None:
        for writer in list(self._live):
            writer.transport.abort()

    async def _handle(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        if self._throttle is not None:
            await self._throttled(client_r, client_w, *self._throttle)
            return
        fault = self.rule(next(self._count))
        forced = time.monotonic() < self._down_until
        if forced:
            fault = Fault("refuse")
        if fault is not None and fault.kind in ("refuse", "status") and not (forced or self._take()):
            fault = None
        if fault is not None and fault.kind == "refuse":
            self.triggered.append(fault.kind)
            reset(client_w)
            return
        if fault is not None and fault.kind == "status":
            self.triggered.append(fault.kind)
            await self._answer(client_r, client_w, fault)
            return
        try:
            upstream_r, upstream_w = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        except OSError:
            reset(client_w)
            return
        pair = (client_w, upstream_w)
        self._live.update(pair)
        up = fault if fault is not None and fault.kind in ("reset_request", "stall") else None
        down = fault if fault is not None and fault.kind in ("reset_response", "truncate_response",
                                                             "stall_response") else None
        try:
            await asyncio.gather(self._pipe(client_r, upstream_w, up, pair, "up"),
                                 self._pipe(upstream_r, client_w, down, pair, "down"))
        finally:
            self._live.difference_update(pair)
            for writer in pair:
                writer.transport.abort()

    async def _pipe(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter, fault: Fault | None,
                    pair: tuple[asyncio.StreamWriter, asyncio.StreamWriter], direction: str,
                    seen: Callable[[bytes], None] | None = None) -> None:
        """Copy ``src`` to ``dst``, applying ``fault`` once ``fault.after`` bytes have passed (``seen`` sees each
        chunk)."""
        moved = 0
        try:
            while True:
                data = await src.read(CHUNK)
                if seen is not None:
                    seen(data)
                if not data:
                    if dst.can_write_eof():
                        dst.write_eof()
                    return
                if fault is not None and fault.across:
                    moved = self.moved[direction]
                self.moved[direction] += len(data)
                if fault is not None and moved + len(data) > fault.after and not self._take():
                    fault = None
                if fault is not None and moved + len(data) > fault.after:
                    head = data[: max(0, fault.after - moved)]
                    dst.write(head)
                    await dst.drain()
                    self.triggered.append(fault.kind)
                    if fault.kind.startswith("stall"):
                        await asyncio.sleep(fault.seconds)
                        dst.write(data[len(head):])
                        fault = None
                    elif fault.kind == "truncate_response":
                        dst.close()
                        pair[0 if dst is pair[1] else 1].transport.abort()
                        return
                    else:
                        for writer in pair:
                            reset(writer)
                        return
                else:
                    dst.write(data)
                moved += len(data)
                await dst.drain()
        except (ConnectionError, OSError):
            for writer in pair:
                writer.transport.abort()

    async def _throttled(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter, fault: Fault,
                         limit: int) -> None:
        """One request: answered ``fault`` when ``limit`` are being served, else sent upstream and its answer back."""
        try:
            head = await client_r.readuntil(b"\r\n\r\n")
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError, OSError):
            client_w.transport.abort()
            return
        self.answers.append(self._serving >= limit)
        first, *lines = head.decode("latin-1").split("\r\n")[:-2]
        self.requests.append(first)
        self.headers.append({n.strip().lower(): v.strip() for n, _, v in (line.partition(":") for line in lines)})
        self.sent += int(self.headers[-1].get("content-length", 0))
        index = len(self.bodies)
        self.bodies.append(b"")
        if self.answers[-1]:
            await self._answer(client_r, client_w, fault, head)
            return
        self._serving += 1
        try:
            upstream_r, upstream_w = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        except OSError:
            self._serving -= 1
            reset(client_w)
            return
        lines = [line for line in head.split(b"\r\n")[:-2]
                 if line.split(b":", 1)[0].strip().lower().decode("latin-1") not in self.strip | {"connection"}]
        upstream_w.write(b"\r\n".join([*lines, b"Connection: close", b"", b""]))
        pair = (client_w, upstream_w)

        def seen(data: bytes) -> None:
            if len(self.bodies[index]) < BODY_SEEN:
                self.bodies[index] += data[:BODY_SEEN - len(self.bodies[index])]

        up = asyncio.ensure_future(self._pipe(client_r, upstream_w, None, pair, "up", seen))
        served = False

        def serve() -> None:  # the answer's last bytes are going out: served, as a server counts it
            nonlocal served
            if not served:
                self._serving, served = self._serving - 1, True

        try:
            await self._relay_answer(upstream_r, client_w, head.split(b" ", 1)[0].upper() == b"HEAD", serve)
            await self._pipe(upstream_r, client_w, None, pair, "down")
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError, OSError, ValueError):
            pass
        finally:
            serve()
        try:
            await asyncio.wait_for(up, 10)  # until the client closes the connection the answer closed
        except asyncio.TimeoutError:
            pass
        finally:
            for writer in pair:
                writer.transport.abort()

    async def _relay_answer(self, upstream: asyncio.StreamReader, client: asyncio.StreamWriter, head_only: bool,
                            served: Callable[[], None]) -> None:
        """Pass one answer down (interim ``1xx`` heads too), calling ``served()`` just before its last bytes go out
        (known by its Content-Length; an answer without one goes on until the server closes)."""
        while True:
            head = await upstream.readuntil(b"\r\n\r\n")
            status = int(head.split(b" ", 2)[1])
            self.moved["down"] += len(head)
            if status >= 200:
                break
            client.write(head)
        lengths = [line.split(b":", 1)[1] for line in head.lower().split(b"\r\n")
                   if line.startswith(b"content-length:")]
        left = 0 if head_only or status in (204, 304) else int(lengths[0]) if lengths else None
        if left == 0:
            served()
        client.write(head)
        while left is None or left > 0:
            data = await upstream.read(CHUNK if left is None else min(CHUNK, left))
            if not data:
                break
            self.moved["down"] += len(data)
            left = None if left is None else left - len(data)
            if left == 0:
                served()
            client.write(data)
            await client.drain()
        await client.drain()

    async def _answer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, fault: Fault,
                      head_read: bytes = b"") -> None:
        """Read one request (its body unless it waits for ``100 Continue``; its head unless ``head_read`` holds it)
        and answer ``fault.status`` (with an error document, but to a HEAD)."""
        try:
            head = (head_read or await reader.readuntil(b"\r\n\r\n")).decode("latin-1").lower()
            length = next((int(line.split(":", 1)[1]) for line in head.split("\r\n")
                           if line.startswith("content-length:")), 0)
            if "expect: 100-continue" not in head and length:
                await reader.readexactly(length)
            body = (f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{fault.code}</Code>'
                    f"<Message>injected by the fault proxy</Message></Error>").encode()
            writer.write(f"HTTP/1.1 {fault.status} Injected\r\nContent-Type: application/xml\r\n"
                         f"x-ms-error-code: {fault.code}\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n"
                         .encode() + (b"" if head.startswith("head ") else body))  # a HEAD's answer has no body
            await writer.drain()
        except (ConnectionError, OSError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()
