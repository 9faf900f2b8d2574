"""The HTTP data path as every cloud store drives it, written once: its client (made on first use, closed with
the store), the first-contact rule for requests that get no answer, and the check of a ranged GET's answer."""

from __future__ import annotations

import asyncio
import socket
import ssl
import time
from collections.abc import Sequence
from typing import Any

from .. import otel, stats
from ..errors import StoreError
from ..http import HttpClient, Response
from ..transport import Body, Receiver, body_size
from .classify import unreachable

__all__ = ["NO_ANSWER", "DataPath", "counting_trace", "ranged"]

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
        up, status, begun = _size(body), None, time.monotonic()
        stats.started()
        try:
            with otel.request_span(method, self.service, target):
                resp = await self.client.request(method, target, headers, body=body, into=into)
            status = resp.status
        except NO_ANSWER as exc:
            raise self.failure(exc, where, key) from exc
        finally:
            stats.started(-1)
            stats.request(method, self.service, up, 0 if status is None else resp.received or len(resp.body),
                          time.monotonic() - begun, status)
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


def _size(body: Body | Sequence[Body] | None) -> int:
    """Bytes of a request body (one, or a sequence of pieces sent one after another)."""
    if body is None:
        return 0
    return sum(body_size(b) for b in body) if isinstance(body, list) else body_size(body)  # type: ignore[arg-type]


def counting_trace(service: str) -> Any:
    """An aiohttp ``TraceConfig`` that counts an SDK session's requests in ``fastckpt.stats`` as the data path counts
    its own (method, body bytes each way, time, status)."""
    import aiohttp

    trace = aiohttp.TraceConfig()

    async def start(_: Any, ctx: Any, params: Any) -> None:
        ctx.begun, ctx.up = time.monotonic(), 0
        stats.started()

    async def sent(_: Any, ctx: Any, params: Any) -> None:
        ctx.up += len(params.chunk)

    async def received(_: Any, ctx: Any, params: Any) -> None:  # the body is read after the request has ended
        stats.received(service, len(params.chunk))

    async def end(_: Any, ctx: Any, params: Any) -> None:
        stats.started(-1)
        response = getattr(params, "response", None)
        stats.request(params.method, service, ctx.up, 0, time.monotonic() - ctx.begun,
                      response.status if response else None)

    trace.on_request_start.append(start)
    trace.on_request_chunk_sent.append(sent)
    trace.on_response_chunk_received.append(received)
    trace.on_request_end.append(end)
    trace.on_request_exception.append(end)
    return trace
