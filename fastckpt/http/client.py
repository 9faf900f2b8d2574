"""Keep-alive connections to one origin, for the requests that move data (ranged GET, part PUT) and, on S3,
the listing and multipart control requests around them.

Backends build and sign the request (each with its own SDK's credentials); this module only carries it.
"""

from __future__ import annotations

import asyncio
import base64
import os
import socket
import ssl
import sys
from collections.abc import Mapping, Sequence
from urllib.parse import SplitResult, unquote, urlsplit

from ..config import proxy_for
from ..transport import Body, ProtocolError, Receiver, body_size
from .connection import ClosedBeforeResponse, Connection, Response

__all__ = ["HttpClient"]


def _check_header(text: str) -> str:
    if "\r" in text or "\n" in text:
        raise ValueError(f"line break in an HTTP header: {text!r}")
    return text


class HttpClient:
    """Up to ``limit`` keep-alive connections to ``origin`` (``http[s]://host[:port]``), reused LIFO; through
    the environment's proxy (an HTTP CONNECT tunnel) when one applies."""

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
        self.proxy = proxy_for(self.scheme, self.host)
        self._slots = asyncio.Semaphore(limit)
        self._idle: list[Connection] = []
        self._closed = False

    @property
    def sends_files(self) -> bool:
        """Whether a request body may hold a ``FileRange``: plain TCP (no TLS layer that must see the bytes) on a
        system with ``sendfile``."""
        return self.ssl is None and hasattr(os, "sendfile")

    async def request(self, method: str, target: str, headers: Mapping[str, str], *,
                      body: Body | Sequence[Body] | None = None, into: Receiver | None = None) -> Response:
        """Send ``method target`` (a path with its query) with ``headers`` (Host and, unless given, Content-Length
        are added) and ``body`` (one piece, or several sent one after the other: buffers and, where
        ``sends_files``, file ranges); a 2xx body of known length goes to ``into`` (see ``Connection.request``).

        A connection the server closed while it sat idle is replaced once, silently; any other failure
        raises (``ProtocolError``, ``OSError``, ``asyncio.TimeoutError`` for a connect timeout).
        """
        lines = [f"{method} {_check_header(target)} HTTP/1.1", f"Host: {self.host_header}"]
        lines += [f"{_check_header(k)}: {_check_header(str(v))}" for k, v in headers.items()]
        pieces = [] if body is None else list(body) if isinstance(body, (list, tuple)) else [body]
        if (pieces or method in ("PUT", "POST")) and not any(k.lower() == "content-length" for k in headers):
            lines.append(f"Content-Length: {sum(body_size(p) for p in pieces)}")
        head = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
        async with self._slots:
            for attempt in range(2):
                conn = await self._connection()
                reused = conn.used
                try:
                    resp = await conn.request(head, pieces, into, head_only=method == "HEAD")
                except ClosedBeforeResponse:
                    if attempt == 0 and reused:
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
        if sys.version_info >= (3, 11):
            async with asyncio.timeout(self.connect_timeout):
                return await self._connect()
        return await asyncio.wait_for(self._connect(), self.connect_timeout)

    async def _connect(self) -> Connection:
        loop = asyncio.get_running_loop()
        server_hostname = self.host if self.ssl else None
        if self.proxy is None:
            _, conn = await loop.create_connection(lambda: Connection(loop), self.host, self.port, ssl=self.ssl,
                                                   server_hostname=server_hostname)
            return conn
        sock = await self._tunnel(loop, self.proxy)
        try:
            _, conn = await loop.create_connection(lambda: Connection(loop), sock=sock, ssl=self.ssl,
                                                   server_hostname=server_hostname)
        except BaseException:
            sock.close()
            raise
        return conn

    async def _tunnel(self, loop: asyncio.AbstractEventLoop, proxy: SplitResult) -> socket.socket:
        """A socket connected to this origin through ``proxy`` (HTTP CONNECT)."""
        infos = await loop.getaddrinfo(proxy.hostname, proxy.port or 80, type=socket.SOCK_STREAM)
        family, kind, proto, _, address = infos[0]
        sock = socket.socket(family, kind, proto)
        sock.setblocking(False)
        try:
            await loop.sock_connect(sock, address)
            target = f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"
            lines = [f"CONNECT {target} HTTP/1.1", f"Host: {target}"]
            if proxy.username:
                token = f"{unquote(proxy.username)}:{unquote(proxy.password or '')}".encode()
                lines.append(f"Proxy-Authorization: Basic {base64.b64encode(token).decode()}")
            await loop.sock_sendall(sock, ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1"))
            answer = b""
            while b"\r\n\r\n" not in answer:
                chunk = await loop.sock_recv(sock, 4096)
                if not chunk or len(answer) > 65536:
                    raise ProtocolError(f"proxy {proxy.hostname}:{proxy.port} closed the CONNECT to {target}")
                answer += chunk
            status = answer.split(b" ", 2)[1:2]
            if status != [b"200"]:
                line = answer.split(b"\r\n", 1)[0].decode("latin-1")
                raise ConnectionRefusedError(f"proxy {proxy.hostname}:{proxy.port} refused CONNECT {target}: {line}")
        except BaseException:
            sock.close()
            raise
        return sock

    async def close(self) -> None:
        """Close every idle connection; connections in use close when their request ends."""
        self._closed = True
        idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()
