"""How to reach GCS, from the URI's options and the environment (``STORAGE_EMULATOR_HOST``,
``FASTCKPT_GCS_IF_ABSENT``): the only place the GCS backend reads the environment."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import ClassVar

from ...uri import StorageURI, check_options
from .controls import GCSControls

__all__ = ["DEFAULT_ENDPOINT", "GCSOptions"]

DEFAULT_ENDPOINT = "https://storage.googleapis.com"


@dataclass(frozen=True)
class GCSOptions:
    """How to reach GCS: from the URI's options (``QUERY``; ``project``, which gcsfs and Arrow take, is accepted and
    not needed: object requests name the bucket only) and the environment."""

    QUERY: ClassVar[frozenset[str]] = frozenset({"endpoint_override", "project", "anonymous", *GCSControls.QUERY})
    endpoint: str = DEFAULT_ENDPOINT
    anonymous: bool = False
    """Send no credentials (the default for an emulator and for plain-http endpoints)."""
    if_absent_mode: str = "auto"
    controls: GCSControls = field(default_factory=GCSControls)
    """Encryption and bucket policies every request honours (``stores.gcs.controls``)."""

    @classmethod
    def from_uri(cls, uri: StorageURI, env: Mapping[str, str] = os.environ) -> GCSOptions:
        """The options ``uri`` and ``env`` give; ValueError for a bad option or endpoint."""
        opts = check_options(uri, cls.QUERY)
        endpoint = opts.get("endpoint_override") or None
        if endpoint and not re.match(r"^https?://", endpoint):
            raise ValueError(f"GCS endpoint_override {endpoint!r} must start with http:// or https://")
        emulator = env.get("STORAGE_EMULATOR_HOST", "").strip()
        from_emulator = not endpoint and bool(emulator)
        if from_emulator:
            endpoint = emulator if "://" in emulator else f"http://{emulator}"
        endpoint = (endpoint or DEFAULT_ENDPOINT).rstrip("/")
        anonymous = uri.flag("anonymous")
        return cls(endpoint, from_emulator or endpoint.startswith("http://") if anonymous is None else anonymous,
                   env.get("FASTCKPT_GCS_IF_ABSENT", "auto").strip().lower(), GCSControls.from_options(opts, env))

    def query(self) -> dict[str, str]:
        """URI options that give these options back (with the same environment)."""
        pairs = {"endpoint_override": None if self.endpoint == DEFAULT_ENDPOINT else self.endpoint,
                 "anonymous": str(self.anonymous).lower(), **self.controls.query()}
        return {k: v for k, v in pairs.items() if v}
