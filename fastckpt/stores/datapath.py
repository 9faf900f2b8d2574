"""The HTTP data path as every cloud store drives it, written once: its client (made on first use, closed with
the store), the first-contact rule for requests that get no answer, and the check of a ranged GET's answer."""

from __future__ import annotations

import asyncio
import socket
import ssl
from collections.abc import Sequence

from ..errors import StoreError
from ..http import HttpClient, Response
from ..transport import Body, Receiver
from .classify import unreachable

NO_ANSWER = (ConnectionError, asyncio.TimeoutError, TimeoutError, socket.gaierror, ssl.SSLError)
"""What a request that got no answer raises: a refused, reset or broken connection (``ProtocolError`` included), a
timeout, an unknown host, a TLS failure. Other errors (a receiver's, a full disk's) are not the endpoint's."""


class DataPath:
    """One store's requests to ``origin`` (set now or by ``open``); ``service`` and ``shown`` name the service and
    its endpoint in messages."""

    def __init__(self, service: str, shown: str, *, limit: int, connect_timeout: float = 10.0,
                 origin: str | None = None) -> None:
        self.service, self.shown = service, shown
        self.limit, self.connect_timeout = limit, connect_timeout
        self.origin = origin
        self.connected = False
        """Whether the endpoint has answered this store (through here or its SDK): a refused connection after
        that is an outage to ride out, before it a wrong endpoint (``EndpointUnreachableError``)."""
        self._client: HttpClient | None = None

    def open(self, origin: str) -> None:
        """Send to ``origin`` (``http[s]://host[:port]``) from now on."""
        self.origin = origin

    @property
    def client(self) -> HttpClient:
        """The HTTP client, made on first use."""
        if self._client is None:
            if self.origin is None:
                raise StoreError(f"the {self.service} data path was used before its endpoint was known")
            self._client = HttpClient(self.origin, limit=self.limit, connect_timeout=self.connect_timeout)
        return self._client

    @property
    def started(self) -> bool:
        """Whether the client exists (a store that was only configured has none)."""
        return self._client is not None

    @property
    def sends_files(self) -> bool:
        """Whether request bodies may be ``FileRange``s (see ``HttpClient.sends_files``)."""
        return self._client is not None and self._client.sends_files

    def answered(self) -> None:
        """The endpoint answered a request (made here or through the SDK)."""
        self.connected = True

    async def request(self, method: str, target: str, headers: dict[str, str], *, where: str, key: str | None = None,
                      body: Body | Sequence[Body] | None = None, into: Receiver | None = None) -> Response:
        """``HttpClient.request``; a request that got no answer raises the fastckpt error for it (``failure``)."""
        try:
            resp = await self.client.request(method, target, headers, body=body, into=into)
        except NO_ANSWER as exc:
            raise self.failure(exc, where, key) from exc
        self.connected = True
        return resp

    def failure(self, exc: BaseException, where: str, key: str | None = None) -> StoreError:
        """The error for a request on ``where`` that got no answer: a TLS failure names the likely fix; a refused
        connection or an unknown host before the endpoint ever answered is ``EndpointUnreachableError``; anything
        else is transient."""
        if isinstance(exc, ssl.SSLError):
            return StoreError(f"TLS error talking to {self.shown} for {where}; for a plain-http endpoint use "
                              "endpoint_override=http://... (S3: or &scheme=http)", key=key,
                              backend=self.service.lower())
        refused = isinstance(exc, (ConnectionRefusedError, socket.gaierror))
        return unreachable(self.service, self.shown, where, " ".join(str(exc).split()) or type(exc).__name__,
                           key=key, first_contact=refused and not self.connected)

    async def close(self) -> None:
        """Close the client's connections (a later request makes a new client)."""
        client, self._client = self._client, None
        if client is not None:
            await client.close()


def ranged(resp: Response, start: int, where: str, shown: str) -> int:
    """The bytes a ranged GET from ``start`` received: 0 for a 416 (``start`` at or past the end); StoreError when
    the answer is not for the range asked (a 200 for a non-zero start, a 206 whose Content-Range starts elsewhere)."""
    if resp.status == 416:
        return 0
    if resp.status == 206 and resp.headers.get("content-range", "").startswith(f"bytes {start}-"):
        return resp.received
    if resp.status == 200 and not start:
        return resp.received
    raise StoreError(f"{where}: endpoint {shown} ignored the Range header "
                     f"(answered {resp.status} {resp.headers.get('content-range', '')})")
