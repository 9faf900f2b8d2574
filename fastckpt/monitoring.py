"""Prometheus endpoints (the ``prometheus`` extra): ``serve(port)`` exposes what this process moved (``stats.TOTALS``)
in the Prometheus text format, and with ``tier=`` that tier's agent queue (``fastckpt agent --metrics-port``).
A training process calls ``serve`` itself; each scrape reads the counts as they are then."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from . import stats
from .tier import Tier
from .tier.agent import DRAINED, oldest_queued_s
from .tier.handoff import handoffs

__all__ = ["serve"]

if TYPE_CHECKING:
    from wsgiref.simple_server import WSGIServer


class _Collector:
    """The metrics of ``stats.TOTALS`` (and of ``tier``'s agent), built at each scrape."""

    def __init__(self, tier: Tier | None) -> None:
        self.tier = tier

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        t = stats.TOTALS
        requests = CounterMetricFamily("fastckpt_requests", "Requests sent to stores", labels=["method"])
        for method, n in sorted(t.requests.items()):
            requests.add_metric([method], n)
        wire = CounterMetricFamily("fastckpt_wire_bytes", "Request and answer body bytes", labels=["direction"])
        wire.add_metric(["up"], t.bytes_up)
        wire.add_metric(["down"], t.bytes_down)
        retries = CounterMetricFamily("fastckpt_retries", "Requests sent again, by what failed", labels=["cause"])
        for cause, n in sorted(t.retries.items()):
            retries.add_metric([cause], n)
        yield from (requests, wire, retries)
        yield CounterMetricFamily("fastckpt_files", "Files and objects moved", value=t.files)
        yield CounterMetricFamily("fastckpt_file_bytes", "Bytes of the files and objects moved", value=t.file_bytes)
        yield CounterMetricFamily("fastckpt_throttles", "Answers asking to slow down", value=t.throttled)
        yield GaugeMetricFamily("fastckpt_requests_in_flight", "Requests waiting for their answer", value=t.in_flight)
        if self.tier is None:
            return
        oldest = oldest_queued_s(self.tier)
        yield GaugeMetricFamily("fastckpt_agent_queue_depth", "Saves waiting in the tier's queue",
                                value=len(self.tier.pending()))
        yield GaugeMetricFamily("fastckpt_agent_oldest_entry_age_seconds", "Seconds the oldest queued save has "
                                "waited (0: none waits)", value=oldest or 0.0)
        yield GaugeMetricFamily("fastckpt_agent_handoffs", "Saves handed to the agent mid-upload",
                                value=len(handoffs(self.tier)))
        yield GaugeMetricFamily("fastckpt_agent_failures", "Queue entries the agent gave up on",
                                value=len(self.tier.failures()))
        yield CounterMetricFamily("fastckpt_agent_drained_bytes", "File bytes this agent drained",
                                  value=DRAINED["bytes"])
        yield CounterMetricFamily("fastckpt_agent_drained_checkpoints", "Checkpoints this agent drained and saw "
                                  "committed", value=DRAINED["checkpoints"])


def serve(port: int, addr: str = "127.0.0.1", *, tier: Tier | None = None) -> tuple[WSGIServer, threading.Thread]:
    """Serve ``/metrics`` on ``addr:port`` (0: a free port; ``server.server_port`` names it) from a daemon thread;
    ``server.shutdown()`` stops it. ImportError naming the extra when ``prometheus_client`` is missing."""
    try:
        from prometheus_client import CollectorRegistry, start_http_server
    except ImportError:
        raise ImportError("metrics need prometheus_client: pip install 'fastckpt[prometheus]'") from None
    registry = CollectorRegistry()
    registry.register(_Collector(tier))  # type: ignore[arg-type]
    return start_http_server(port, addr, registry)
