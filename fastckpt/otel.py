"""OpenTelemetry, where its API is installed (the ``otel`` extra): spans for each call, file and request, and
metrics of what moved. The names follow OTel's semantic conventions where they have one
(``http.client.request.duration``, ``http.request.method``, ``error.type``, ``network.io.direction``); the rest are
``fastckpt.*``. Without the API each function here does nothing; with it and no SDK set up, the API's no-op
providers take the calls. The application sets up its tracer and meter providers as usual: fastckpt only asks the
global ones.
"""

from __future__ import annotations

import contextlib
import importlib.util
from collections.abc import Callable, Iterator
from typing import Any

ENABLED = importlib.util.find_spec("opentelemetry") is not None
SCOPE = "fastckpt"

if ENABLED:
    from opentelemetry import metrics, trace

    _tracer = trace.get_tracer(SCOPE)
    _meter = metrics.get_meter(SCOPE)
    _duration = _meter.create_histogram("http.client.request.duration", unit="s",
                                        description="Duration of the requests fastckpt sent")
    _requests = _meter.create_counter("fastckpt.requests", unit="{request}", description="Requests sent")
    _io = _meter.create_counter("fastckpt.io", unit="By", description="Request and response body bytes moved")
    _retries = _meter.create_counter("fastckpt.retries", unit="{request}", description="Requests sent again")
    _throttles = _meter.create_counter("fastckpt.throttles", unit="{response}",
                                       description="Answers asking to slow down (503 SlowDown, 429, ServerBusy)")
    _in_flight = _meter.create_up_down_counter("fastckpt.requests.in_flight", unit="{request}",
                                               description="Requests waiting for their answer")


@contextlib.contextmanager
def span(name: str, **attributes: Any) -> Iterator[None]:
    """A span named ``name`` around the block (the current span's child)."""
    if not ENABLED:
        yield
        return
    with _tracer.start_as_current_span(name, attributes=attributes):
        yield


@contextlib.contextmanager
def request_span(method: str, backend: str, target: str) -> Iterator[None]:
    """A client span around one HTTP request."""
    if not ENABLED:
        yield
        return
    attributes = {"http.request.method": method, "fastckpt.backend": backend, "url.path": target.split("?", 1)[0]}
    with _tracer.start_as_current_span(method, kind=trace.SpanKind.CLIENT, attributes=attributes):
        yield


def request(method: str, backend: str, up: int, down: int, seconds: float | None, status: int | None) -> None:
    """Metrics of one answered (or failed) request."""
    if not ENABLED:
        return
    attributes: dict[str, Any] = {"http.request.method": method, "fastckpt.backend": backend}
    if status is not None:
        attributes["http.response.status_code"] = status
    _requests.add(1, attributes)
    if seconds is not None:
        _duration.record(seconds, attributes)
    request_bytes(backend, up, down)


def request_bytes(backend: str, up: int, down: int) -> None:
    """Body bytes sent (``up``) and received (``down``)."""
    if not ENABLED:
        return
    if up:
        _io.add(up, {"network.io.direction": "transmit", "fastckpt.backend": backend})
    if down:
        _io.add(down, {"network.io.direction": "receive", "fastckpt.backend": backend})


def in_flight(n: int) -> None:
    if ENABLED:
        _in_flight.add(n)


def retried(cause: str) -> None:
    if ENABLED:
        _retries.add(1, {"error.type": cause})


def throttled() -> None:
    if ENABLED:
        _throttles.add(1)


def gauge(name: str, unit: str, description: str, read: Callable[[], float | None]) -> None:
    """An observable gauge ``name`` whose value ``read()`` gives at each collection (None: no value)."""
    if not ENABLED:
        return
    from opentelemetry.metrics import Observation

    def observe(_: Any) -> list[Observation]:
        value = read()
        return [] if value is None else [Observation(value)]

    _meter.create_observable_gauge(name, callbacks=[observe], unit=unit, description=description)
