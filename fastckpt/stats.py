"""Where a transfer spent its time: counts of what every request, retry and throttling answer did, and the time in
each stage, gathered into ``Summary`` objects.

``observe(name)`` opens a summary for the code it wraps (the calls it makes, on any task or thread they start through
``contextvars``); each public transfer and checkpoint call opens one and logs it at INFO on ``fastckpt.stats``
(``fastckpt -v`` shows it). ``TOTALS`` counts everything the process moved, for a metrics endpoint
(``fastckpt.monitoring``). Where OpenTelemetry's API is installed, the same events become spans and metrics
(``fastckpt.otel``); without it recording costs a few dictionary updates a request.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, ParamSpec, TypeVar

from . import otel

__all__ = [
    "TOTALS",
    "Summary",
    "moved",
    "observe",
    "received",
    "request",
    "retried",
    "stage",
    "started",
    "summarized",
    "throttled",
]

log = logging.getLogger("fastckpt.stats")
P = ParamSpec("P")
T = TypeVar("T")


@dataclass
class Summary:
    """What one call (or the whole process, ``TOTALS``) moved and how."""

    name: str = ""
    bytes_up: int = 0
    """Request body bytes sent (to remote stores; headers not counted)."""
    bytes_down: int = 0
    """Answer body bytes received."""
    files: int = 0
    file_bytes: int = 0
    """Bytes of the files (or objects) moved, on any store: what ``throughput`` counts."""
    requests: Counter[str] = field(default_factory=Counter)
    """Requests sent, by method (``PUT``, ``GET`` ...)."""
    retries: Counter[str] = field(default_factory=Counter)
    """Requests sent again, by what failed (an error's class, with its HTTP status where it had one)."""
    throttled: int = 0
    """Answers that asked to slow down (503 SlowDown, 429, ServerBusy)."""
    limit_changes: list[tuple[float, float]] = field(default_factory=list)
    """Each fall of an endpoint's request limit on throttling: (before, after)."""
    peak_in_flight: int = 0
    in_flight: int = 0
    stages: dict[str, float] = field(default_factory=dict)
    """Seconds spent in each stage (``listing``, ``hashing``, ``sending``, ``receiving``, ``barrier``, ``committing``);
    stages overlap: hashing runs beside sending."""
    started: float = field(default_factory=time.monotonic)
    elapsed: float = 0.0

    @property
    def throughput(self) -> float:
        """File bytes moved per second over ``elapsed`` (0 while it runs): the effective throughput."""
        return self.file_bytes / self.elapsed if self.elapsed else 0.0

    def as_dict(self) -> dict[str, Any]:
        """JSON-able fields."""
        return {"name": self.name, "elapsed_s": round(self.elapsed, 4), "bytes_up": self.bytes_up,
                "bytes_down": self.bytes_down, "files": self.files, "file_bytes": self.file_bytes,
                "requests": dict(self.requests), "retries": dict(self.retries), "throttled": self.throttled,
                "limit_changes": [list(c) for c in self.limit_changes], "peak_in_flight": self.peak_in_flight,
                "stages_s": {k: round(v, 4) for k, v in self.stages.items()},
                "throughput_bytes_per_s": round(self.throughput)}

    def __str__(self) -> str:
        lines = [f"{self.name or 'transfer'}: {self.files} file(s), {self.file_bytes / (1 << 20):.1f} MiB in "
                 f"{self.elapsed:.2f} s ({self.throughput / (1 << 20):.1f} MiB/s); on the wire {self.bytes_up} bytes "
                 f"up, {self.bytes_down} down",
                 f"  requests: {sum(self.requests.values())} ({_pairs(self.requests)}), at most "
                 f"{self.peak_in_flight} at once"]
        if self.retries or self.throttled:
            falls = ", ".join(f"{a:.0f}->{b:.0f}" for a, b in self.limit_changes[:8])
            lines.append(f"  retries: {sum(self.retries.values())} ({_pairs(self.retries)}); throttled "
                         f"{self.throttled}, limit {falls or 'unchanged'}")
        if self.stages:
            lines.append("  stages: " + ", ".join(f"{k} {v:.2f} s" for k, v in self.stages.items()))
        return "\n".join(lines)


def _pairs(counts: Counter[str]) -> str:
    return ", ".join(f"{k} {v}" for k, v in counts.most_common()) or "none"


TOTALS = Summary("process")
"""Everything this process moved since it started."""
_ACTIVE: contextvars.ContextVar[tuple[Summary, ...]] = contextvars.ContextVar("fastckpt_summaries", default=())


def _open() -> tuple[Summary, ...]:
    return (*_ACTIVE.get(), TOTALS)


@contextlib.contextmanager
def observe(name: str = "", *, quiet: bool = True) -> Iterator[Summary]:
    """``with observe("save") as summary:``: what the block moves is counted in ``summary`` (and in every summary
    open around it); ``quiet=False`` logs it at INFO on ``fastckpt.stats`` when the block ends. A span of that name
    covers the block where OpenTelemetry is set up."""
    summary = Summary(name)
    token = _ACTIVE.set((*_ACTIVE.get(), summary))
    try:
        with otel.span(f"fastckpt.{name}" if name else "fastckpt"):
            yield summary
    finally:
        _ACTIVE.reset(token)
        summary.elapsed = time.monotonic() - summary.started
        if not quiet and log.isEnabledFor(logging.INFO):
            log.info("%s", summary)


def summarized(name: str) -> Callable[[Callable[P, Awaitable[T]]], Callable[P, Awaitable[T]]]:
    """Decorate a public async call: each call is observed as ``name`` and its summary logged (``observe``)."""
    def decorate(fn: Callable[P, Awaitable[T]]) -> Callable[P, Awaitable[T]]:
        @functools.wraps(fn)
        async def observed(*args: P.args, **kwargs: P.kwargs) -> T:
            with observe(name, quiet=False):
                return await fn(*args, **kwargs)

        return observed

    return decorate


def request(method: str, backend: str, up: int = 0, down: int = 0, seconds: float | None = None,
            status: int | None = None) -> None:
    """One request was answered (or failed): ``up`` body bytes sent, ``down`` received."""
    for s in _open():
        s.requests[method] += 1
        s.bytes_up += up
        s.bytes_down += down
    otel.request(method, backend, up, down, seconds, status)


def received(backend: str, n: int) -> None:
    """``n`` more body bytes of an answer arrived (an SDK's, read after its request was counted)."""
    for s in _open():
        s.bytes_down += n
    otel.request_bytes(backend, 0, n)


def started(n: int = 1) -> None:
    """``n`` requests went in flight (negative: came back)."""
    for s in _open():
        s.in_flight += n
        s.peak_in_flight = max(s.peak_in_flight, s.in_flight)
    otel.in_flight(n)


def retried(exc: BaseException) -> None:
    """A request failed with ``exc`` and will be sent again."""
    status = getattr(exc, "status", None)
    cause = type(exc).__name__ + (f" {status}" if status else "")
    for s in _open():
        s.retries[cause] += 1
    otel.retried(cause)


def throttled(before: float, after: float) -> None:
    """An endpoint asked to slow down; its request limit fell from ``before`` to ``after`` (equal: it had fallen
    already this round)."""
    for s in _open():
        s.throttled += 1
        if after != before:
            s.limit_changes.append((before, after))
    otel.throttled()


def moved(nbytes: int, files: int = 1) -> None:
    """``files`` files (or objects) of ``nbytes`` bytes in all were moved (``files=0``: more bytes of one)."""
    for s in _open():
        s.files += files
        s.file_bytes += nbytes


@contextlib.contextmanager
def stage(name: str) -> Iterator[None]:
    """Count the block's time in stage ``name`` of every open summary."""
    begun = time.monotonic()
    try:
        yield
    finally:
        spent = time.monotonic() - begun
        for s in _open():
            s.stages[name] = s.stages.get(name, 0.0) + spent
