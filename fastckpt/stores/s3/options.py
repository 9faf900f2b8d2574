"""How to reach one S3 endpoint, from the URI's options and the environment: the only place the S3 backend reads
the environment (the AWS variables botocore reads, and the ``FASTCKPT_S3_*`` knobs in the README)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import ClassVar
from urllib.parse import urlsplit

from ...config import env_flag
from ...uri import StorageURI, check_options
from .controls import S3Controls
from .sigv4 import StaticCredentials

__all__ = ["S3Options", "env_credentials", "resolve_endpoint"]


@dataclass(frozen=True)
class S3Options:
    """How to reach one S3 endpoint: from the URI's options (``QUERY``) and the environment."""

    QUERY: ClassVar[frozenset[str]] = frozenset(
        {"endpoint_override", "region", "scheme", "profile", "anonymous", "addressing_style", *S3Controls.QUERY})
    endpoint_url: str | None = None
    region: str | None = None
    profile: str | None = None
    env_profile: str | None = None
    """``AWS_PROFILE`` (botocore reads it itself; named in messages)."""
    anonymous: bool = False
    addressing_style: str | None = None
    """None: path-style on a custom endpoint, botocore's choice on AWS."""
    use_ssl: bool = True
    request_checksum_calculation: str = "when_required"
    response_checksum_validation: str = "when_required"
    payload_signing: bool | None = False
    """None: botocore's default (signed on plain http)."""
    connect_timeout: float = 10.0
    read_timeout: float = 60.0
    if_absent_mode: str = "auto"
    digest_records: bool = True
    """Record the digest after the data (``stores.s3.records``); off: objects only, hashed before their upload."""
    controls: S3Controls = field(default_factory=S3Controls)
    """Encryption and bucket policies every request honours (``stores.s3.controls``)."""

    @classmethod
    def from_uri(cls, uri: StorageURI, env: Mapping[str, str] = os.environ) -> S3Options:
        """The options ``uri`` and ``env`` give; ValueError for an option S3 does not take."""
        opts = check_options(uri, cls.QUERY)
        signing = env.get("FASTCKPT_S3_PAYLOAD_SIGNING", "0").strip().lower()
        return cls(
            endpoint_url=resolve_endpoint(opts, env),
            region=opts.get("region") or env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION") or None,
            profile=opts.get("profile") or None,
            env_profile=env.get("AWS_PROFILE") or None,
            anonymous=bool(uri.flag("anonymous")),
            addressing_style=opts.get("addressing_style") or None,
            use_ssl=(opts.get("scheme") or "https").lower() != "http",
            request_checksum_calculation=env.get("AWS_REQUEST_CHECKSUM_CALCULATION", "when_required").lower(),
            response_checksum_validation=env.get("AWS_RESPONSE_CHECKSUM_VALIDATION", "when_required").lower(),
            payload_signing=None if signing == "auto" else env_flag("FASTCKPT_S3_PAYLOAD_SIGNING", False, env),
            connect_timeout=float(env.get("FASTCKPT_S3_CONNECT_TIMEOUT", "10")),
            read_timeout=float(env.get("FASTCKPT_S3_READ_TIMEOUT", "60")),
            if_absent_mode=env.get("FASTCKPT_S3_IF_ABSENT", "auto").strip().lower(),
            digest_records=env_flag("FASTCKPT_S3_DIGEST_RECORDS", True, env),
            controls=S3Controls.from_options(opts, env),
        )

    def query(self) -> dict[str, str]:
        """URI options that give these options back (with the same environment)."""
        pairs = {"endpoint_override": self.endpoint_url, "region": self.region, "profile": self.profile,
                 "anonymous": "true" if self.anonymous else None, "addressing_style": self.addressing_style,
                 "scheme": None if self.use_ssl else "http", **self.controls.query()}
        return {k: v for k, v in pairs.items() if v}

    @property
    def shown(self) -> str:
        """The endpoint fit for messages: no user info, query or path."""
        if not self.endpoint_url:
            return "AWS S3"
        parts = urlsplit(self.endpoint_url)
        return f"{parts.scheme}://{parts.hostname or ''}{f':{parts.port}' if parts.port else ''}"


def resolve_endpoint(options: Mapping[str, str], environ: Mapping[str, str] = os.environ) -> str | None:
    """Endpoint URL from ``endpoint_override`` (+ ``scheme``), else the AWS endpoint env vars."""
    endpoint = options.get("endpoint_override") or None
    if endpoint is None and not env_flag("AWS_IGNORE_CONFIGURED_ENDPOINT_URLS", False, environ):
        endpoint = environ.get("AWS_ENDPOINT_URL_S3") or environ.get("AWS_ENDPOINT_URL") or None
    if endpoint is None:
        return None
    if "://" not in endpoint:
        endpoint = f"{options.get('scheme') or 'https'}://{endpoint}"
    return endpoint.rstrip("/")


def env_credentials(environ: Mapping[str, str] = os.environ) -> StaticCredentials | None:
    """The keys in the environment, where botocore's first provider would take them as they are (both keys set,
    no ``AWS_CREDENTIAL_EXPIRATION``: such keys are refreshed); None otherwise (botocore's chain decides). Read
    here, so a store that needs nothing else from botocore never imports it."""
    key, secret = environ.get("AWS_ACCESS_KEY_ID"), environ.get("AWS_SECRET_ACCESS_KEY")
    if not key or not secret or environ.get("AWS_CREDENTIAL_EXPIRATION"):
        return None
    # botocore's order (``EnvProvider.TOKENS``): the older name first
    return StaticCredentials(key, secret, environ.get("AWS_SECURITY_TOKEN") or environ.get("AWS_SESSION_TOKEN"))
