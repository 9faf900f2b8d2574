"""What the clouds' encryption and bucket controls share (``stores.s3.controls``, ``stores.gcs.controls``,
``stores.azure.controls``): where each option is read from, and the customer-provided keys."""

from __future__ import annotations

import base64
import binascii
import hashlib
import logging
from collections.abc import Mapping

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


def customer_key(text: str, where: str) -> bytes:
    """The 256-bit key ``text`` (base64) gives; ValueError (not showing it) otherwise."""
    try:
        key = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError(f"{where}: not base64 (expected the base64 of a 256-bit AES key)") from None
    if len(key) != 32:
        raise ValueError(f"{where}: {len(key)} bytes once decoded; an AES-256 key has 32")
    return key


def key_digest(key: str, algorithm: str) -> str:
    """Base64 of the ``algorithm`` (``md5``, ``sha256``) digest of the base64 customer ``key``."""
    return base64.b64encode(hashlib.new(algorithm, base64.b64decode(key)).digest()).decode()


def exclusive(values: Mapping[str, str], first: str, second: str, backend: str) -> None:
    """ValueError when both options ``first`` and ``second`` are set: an object has one kind of key."""
    if values[first] and values[second]:
        raise ValueError(f"{backend} options {first} and {second} exclude each other: an object is encrypted with a "
                         "key of the customer's or by the service, not both")


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
