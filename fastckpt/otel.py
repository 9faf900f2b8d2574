"""OpenTelemetry, where the application uses it (the ``otel`` extra): spans for each call, file and request, and
metrics of what moved. The names follow OTel's semantic conventions where they have one
(``http.client.request.duration``, ``http.request.method``, ``error.type``, ``network.io.direction``); the rest are
``fastckpt.*``.

fastckpt asks the global tracer and meter providers, which the application sets up as usual. It starts doing so once
the application has imported OpenTelemetry's API (as setting a provider does): until then each function here costs
one dictionary lookup, and importing fastckpt does not import OpenTelemetry.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["SCOPE", "gauge", "in_flight", "request", "request_bytes", "request_span", "retried", "span", "throttled"]

SCOPE = "fastckpt"


class _Instruments:
    """The tracer and the metric instruments, made once the API is loaded."""

    def __init__(self) -> None:
        from opentelemetry import metrics, trace

        self.client = trace.SpanKind.CLIENT
        self.tracer = trace.get_tracer(SCOPE)
        self.meter = meter = metrics.get_meter(SCOPE)
        self.duration = meter.create_histogram("http.client.request.duration", unit="s",
                                               description="Duration of the requests fastckpt sent")
        self.requests = meter.create_counter("fastckpt.requests", unit="{request}", description="Requests sent")
        self.io = meter.create_counter("fastckpt.io", unit="By", description="Request and response body bytes moved")
        self.retries = meter.create_counter("fastckpt.retries", unit="{request}", description="Requests sent again")
        self.throttles = meter.create_counter("fastckpt.throttles", unit="{response}",
                                              description="Answers asking to slow down (503 SlowDown, 429, ServerBusy)")
        self.in_flight = meter.create_up_down_counter("fastckpt.requests.in_flight", unit="{request}",
                                                      description="Requests waiting for their answer")


_made: list[_Instruments] = []


def _on() -> _Instruments | None:
    """The instruments, once the application has loaded OpenTelemetry's API; None before."""
    if _made:
        return _made[0]
    if "opentelemetry.trace" not in sys.modules and "opentelemetry.metrics" not in sys.modules:
        return None
    _made.append(_Instruments())
    return _made[0]


@contextlib.contextmanager
def span(name: str, **attributes: Any) -> Iterator[None]:
    """A span named ``name`` around the block (the current span's child)."""
    on = _on()
    if on is None:
        yield
        return
    with on.tracer.start_as_current_span(name, attributes=attributes):
        yield


@contextlib.contextmanager
def request_span(method: str, backend: str, target: str) -> Iterator[None]:
    """A client span around one HTTP request."""
    on = _on()
    if on is None:
        yield
        return
    attributes = {"http.request.method": method, "fastckpt.backend": backend, "url.path": target.split("?", 1)[0]}
    with on.tracer.start_as_current_span(method, kind=on.client, attributes=attributes):
        yield


def request(method: str, backend: str, up: int, down: int, seconds: float | None, status: int | None) -> None:
    """Metrics of one answered (or failed) request."""
    on = _on()
    if on is None:
        return
    attributes: dict[str, Any] = {"http.request.method": method, "fastckpt.backend": backend}
    if status is not None:
        attributes["http.response.status_code"] = status
    on.requests.add(1, attributes)
    if seconds is not None:
        on.duration.record(seconds, attributes)
    request_bytes(backend, up, down)


def request_bytes(backend: str, up: int, down: int) -> None:
    """Body bytes sent (``up``) and received (``down``)."""
    on = _on()
    if on is None:
        return
    if up:
        on.io.add(up, {"network.io.direction": "transmit", "fastckpt.backend": backend})
    if down:
        on.io.add(down, {"network.io.direction": "receive", "fastckpt.backend": backend})


def in_flight(n: int) -> None:
    if (on := _on()) is not None:
        on.in_flight.add(n)


def retried(cause: str) -> None:
    if (on := _on()) is not None:
        on.retries.add(1, {"error.type": cause})


def throttled() -> None:
    if (on := _on()) is not None:
        on.throttles.add(1)


def gauge(name: str, unit: str, description: str, read: Callable[[], float | None]) -> None:
    """An observable gauge ``name`` whose value ``read()`` gives at each collection (None: no value)."""
    on = _on()
    if on is None:
        return
    from opentelemetry.metrics import Observation

    def observe(_: Any) -> list[Observation]:
        value = read()
        return [] if value is None else [Observation(value)]

    on.meter.create_observable_gauge(name, callbacks=[observe], unit=unit, description=description)
