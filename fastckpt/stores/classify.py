"""Errors classified once: a service's HTTP status and error code become fastckpt's exception types.

Each cloud backend supplies an ``ErrorTable`` (its service's codes) and, per failure, what to name
in the message; ``classify`` decides the type the same way for all of them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from ..errors import (
    AccessDeniedError,
    AlreadyExistsError,
    BucketNotFoundError,
    ObjectNotFoundError,
    StoreError,
    ThrottledError,
    TransientStoreError,
)

__all__ = ["THROTTLE_STATUS", "TRANSIENT_STATUS", "EndpointUnreachableError", "ErrorTable", "classify", "unreachable"]

TRANSIENT_STATUS = frozenset({408, 429, 500, 502, 503, 504})
THROTTLE_STATUS = frozenset({429, 503})
"""What services answer a client that should send fewer requests at once (S3's SlowDown and GCS's rate limits,
Azure's ServerBusy)."""


@dataclass(frozen=True)
class ErrorTable:
    """One backend's service error codes, by what they mean."""

    backend: str
    bucket_missing: frozenset[str] = frozenset()
    not_found: frozenset[str] = frozenset()
    conflict: frozenset[str] = frozenset()
    """A create-if-absent precondition failed: the object exists."""
    denied: frozenset[str] = frozenset()
    transient: frozenset[str] = frozenset()
    throttling: frozenset[str] = frozenset()
    """Codes that ask for fewer requests whatever their status (beside 429 and 503)."""
    hints: Mapping[str, str] = field(default_factory=dict)
    """Code -> what to tell the user (credentials problems, mostly)."""
    denied_hint: str = "credentials are missing, invalid or lack permission"


def classify(table: ErrorTable, status: int, code: str, *, place: str, bucket: str, at: str = "",
             key: str | None = None, detail: str = "", if_absent: bool = False,
             denied_hint: str | None = None) -> StoreError:
    """The exception for a request on ``place`` (the object, as messages name it) that failed with
    HTTP ``status`` and service error ``code``.

    ``bucket`` names the bucket and ``at`` the endpoint (" at endpoint ...") in missing-bucket and
    access messages; ``if_absent`` marks a create-if-absent request, whose 409 / 412 means the object
    exists. Messages are one line and carry no credentials.
    """
    label = f"HTTP {status}" + (f" {code}" if code and code != str(status) else "")
    fields = {"key": key, "backend": table.backend, "status": status or None}
    if code in table.bucket_missing:
        return BucketNotFoundError(f"{bucket} does not exist{at}", **fields)
    if if_absent and (status in (409, 412) or code in table.conflict):
        return AlreadyExistsError(f"{place} already exists", **fields)
    if status == 404 or code in table.not_found:
        return ObjectNotFoundError(f"{place} does not exist", **fields)
    if status in (401, 403) or code in table.denied:
        hint = table.hints.get(code) or denied_hint or table.denied_hint
        return AccessDeniedError(f"access denied to {place}{at} ({label}): {hint}", **fields)
    if status in THROTTLE_STATUS or code in table.throttling:
        return ThrottledError(f"{place}: {label}{at}: the service asks for fewer requests", **fields)
    if status in TRANSIENT_STATUS or status >= 500 or code in table.transient:
        return TransientStoreError(f"{place}: {label}{at}", **fields)
    return StoreError(f"{place}: {label}{at}" + (f": {detail}" if detail else ""), **fields)


class EndpointUnreachableError(TransientStoreError):
    """The endpoint has never answered this store: the connection was refused or the host does not resolve.

    Retried ``config.retries`` times only, not for the whole ``retry_for`` budget: a wrong endpoint fails
    in seconds, a refusal during a restart or failover is ridden out.
    """


def unreachable(service: str, endpoint: str, place: str, detail: str, *, key: str | None = None,
                first_contact: bool = False) -> StoreError:
    """A request on ``place`` that got no answer from ``endpoint`` of ``service`` (S3, GCS, Azure).

    ``first_contact``: the endpoint has never answered and refused the connection or does not resolve
    (``EndpointUnreachableError``). Otherwise (a reset, a timeout, an outage after it answered) a
    TransientStoreError.
    """
    fields = {"key": key, "backend": service.lower()}
    if first_contact:
        return EndpointUnreachableError(f"cannot reach {service} endpoint {endpoint} for {place}: {detail}", **fields)
    return TransientStoreError(f"{place}: connection to {endpoint} failed: {detail}", **fields)
