"""Keep-alive connections to one origin, for the two requests that move data (ranged GET, part PUT).

Backends build and sign the request (each with its own SDK's credentials); this module only carries it.
Everything else (listing, control requests, errors with bodies that need the SDK) stays on the SDKs.
"""

from __future__ import annotations

import asyncio
import ssl
import sys
from collections.abc import Callable, Mapping, Sequence
from urllib.parse import urlsplit

from .connection import Body, Connection, ProtocolError, Response


def _check_header(text: str) -> str:
    if "\r" in text or "\n" in text:
        raise ValueError(f"line break in an HTTP header: {text!r}")
    return text


class HttpClient:
    """Up to ``limit`` keep-alive connections to ``origin`` (``http[s]://host[:port]``), reused LIFO."""

    def __init__(self, origin: str, *, limit: int = 32, connect_timeout: float = 10.0,
                 ssl_context: ssl.SSLContext | None = None) -> None:
        parts = urlsplit(origin)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) origin: {origin!r}")
        self.scheme, self.host = parts.scheme, parts.hostname
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        default_port = self.port == (443 if parts.scheme == "https" else 80)
        host = f"[{self.host}]" if ":" in self.host else self.host
        self.host_header = host if default_port else f"{host}:{self.port}"
        self.ssl = (ssl_context or ssl.create_default_context()) if parts.scheme == "https" else None
        self.connect_timeout = connect_timeout
        self._slots = asyncio.Semaphore(limit)
        self._idle: list[Connection] = []
        self._closed = False

    async def request(self, method: str, target: str, headers: Mapping[str, str], *,
                      body: Body | Sequence[Body] | None = None, sink: memoryview | None = None,
                      on_data: Callable[[int], None] | None = None) -> Response:
        """Send ``method target`` (a path with its query) with ``headers`` (Host and, unless given, Content-Length
        are added)
        and ``body`` (one buffer, or several sent one after the other); a 2xx body of known length lands in
        ``sink`` (see ``Connection.request``).

        A connection the server closed while it sat idle is replaced once, silently; any other failure
        raises (``ProtocolError``, ``OSError``, ``asyncio.TimeoutError`` for a connect timeout).
        """
        lines = [f"{method} {_check_header(target)} HTTP/1.1", f"Host: {self.host_header}"]
        lines += [f"{_check_header(k)}: {_check_header(str(v))}" for k, v in headers.items()]
        pieces = [] if body is None else list(body) if isinstance(body, (list, tuple)) else [body]
        if (pieces or method in ("PUT", "POST")) and not any(k.lower() == "content-length" for k in headers):
            lines.append(f"Content-Length: {sum(memoryview(p).nbytes for p in pieces)}")
        head = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
        async with self._slots:
            for attempt in range(2):
                conn = await self._connection()
                reused = conn.used
                try:
                    resp = await conn.request(head, pieces, sink, on_data, head_only=method == "HEAD")
                except ProtocolError as exc:
                    if attempt == 0 and reused and "before any response" in str(exc):
                        continue  # the server had closed it while idle
                    raise
                if not conn.closed and not self._closed:
                    self._idle.append(conn)
                return resp
        raise AssertionError("unreachable")

    async def _connection(self) -> Connection:
        while self._idle:
            conn = self._idle.pop()
            if not conn.closed:
                return conn
        loop = asyncio.get_running_loop()
        connect = loop.create_connection(lambda: Connection(loop), self.host, self.port, ssl=self.ssl,
                                         server_hostname=self.host if self.ssl else None)
        if sys.version_info >= (3, 11):
            async with asyncio.timeout(self.connect_timeout):
                _, conn = await connect
        else:
            _, conn = await asyncio.wait_for(connect, self.connect_timeout)
        return conn

    async def close(self) -> None:
        """Close every idle connection; connections in use close when their request ends."""
        self._closed = True
        idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()
