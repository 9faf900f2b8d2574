"""What the clouds' encryption and bucket controls share (``stores.s3.controls``, ``stores.gcs.controls``,
``stores.azure.controls``): where each option is read from, and the customer-provided keys."""

from __future__ import annotations

import base64
import binascii
import dataclasses
import functools
import hashlib
import logging
from collections.abc import Mapping

from ..uri import option_text

__all__ = ["OPTIONS", "check_customer_key", "control_query", "hide_in_logs", "key_headers", "read_options"]

OPTIONS = {
    "s3": ("server_side_encryption", "sse_kms_key_id", "sse_kms_encryption_context", "bucket_key_enabled",
           "sse_customer_key", "request_payer", "storage_class", "tagging", "expected_bucket_owner"),
    "gcs": ("kms_key_name", "encryption_key", "user_project", "storage_class"),
    "azure": ("encryption_scope", "customer_key", "access_tier"),
}
"""Each backend's control options, named as in its cloud's API in snake_case."""


def read_options(names: tuple[str, ...], options: Mapping[str, str], env: Mapping[str, str],
                 prefix: str) -> dict[str, str]:
    """Each of ``names`` from a URI's ``options``, else from ``FASTCKPT_<PREFIX>_<NAME>`` in ``env`` ('' if neither)."""
    return {n: options.get(n) or env.get(f"FASTCKPT_{prefix}_{n.upper()}", "") for n in names}


def check_customer_key(given: Mapping[str, str], key: str, other: str, backend: str) -> None:
    """ValueError when option ``key`` (a customer's key) and option ``other`` (a key of the service's) are both set
    (an object has one kind of key), or when ``key`` is not the base64 of a 256-bit AES key (the key not shown)."""
    if given[key] and given[other]:
        raise ValueError(f"{backend} options {key} and {other} exclude each other: an object is encrypted with a "
                         "key of the customer's or by the service, not both")
    if not given[key]:
        return
    where = f"{backend} option {key}"
    try:
        raw = base64.b64decode(given[key], validate=True)
    except (binascii.Error, ValueError):
        raise ValueError(f"{where}: not base64 (expected the base64 of a 256-bit AES key)") from None
    if len(raw) != 32:
        raise ValueError(f"{where}: {len(raw)} bytes once decoded; an AES-256 key has 32")


@functools.lru_cache(maxsize=16)
def _key_headers(prefix: str, key: str, digest: str) -> tuple[tuple[str, str], ...]:
    sum_ = base64.b64encode(hashlib.new(digest, base64.b64decode(key)).digest()).decode()
    return ((f"{prefix}algorithm", "AES256"), (f"{prefix}key", key),
            (f"{prefix}key-{'MD5' if digest == 'md5' else digest}", sum_))


def key_headers(prefix: str, key: str, digest: str) -> dict[str, str]:
    """The headers naming a customer ``key`` (base64): ``{prefix}algorithm`` (AES256), ``{prefix}key`` and
    ``{prefix}key-MD5`` / ``{prefix}key-sha256``, the ``digest`` (``md5``, ``sha256``) of the key that the cloud checks
    it against (worked out once per key, not per request)."""
    return dict(_key_headers(prefix, key, digest))


def control_query(controls: object, secret: str) -> dict[str, str]:
    """URI options that give a backend's ``controls`` (a dataclass) back: the fields that are set, booleans as
    ``true``/``false``; never the ``secret`` field (the customer key: the environment gives it again)."""
    out = {}
    for f in dataclasses.fields(controls):  # type: ignore[arg-type]
        value = getattr(controls, f.name)
        if f.name != secret and value not in ("", None):
            out[f.name] = option_text(value)
    return out


class _Hidden(logging.Filter):
    """Replaces the secrets it holds in every record of the logger it filters."""

    def __init__(self) -> None:
        super().__init__()
        self.secrets: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        if any(s in text for s in self.secrets):
            for secret in self.secrets:
                text = text.replace(secret, "REDACTED")
            record.msg, record.args = text, ()
        return True


_HIDDEN = _Hidden()


def hide_in_logs(secret: str, loggers: tuple[str, ...]) -> None:
    """Keep ``secret`` out of what ``loggers`` log: an SDK's debug lines show the headers it signs and sends."""
    _HIDDEN.secrets.add(secret)
    for name in loggers:
        logger = logging.getLogger(name)
        if _HIDDEN not in logger.filters:
            logger.addFilter(_HIDDEN)
