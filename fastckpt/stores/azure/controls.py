"""What a company container may require of every request to Azure Blob Storage: an encryption scope, a customer-
provided key (CPK) and an access tier.

Named as in the REST API, in snake_case; each comes from the URI's options, else from ``FASTCKPT_AZURE_<NAME>``. The
scope goes on every request that writes (Put Blob, Put Block, Put Block From URL, Put Block List, Copy Blob); a
customer key on every request that reads or writes a blob's bytes or properties; the tier on the requests that
create a blob (Put Blob, Put Block List, Copy Blob). The SDK's requests carry them as headers, as the data path's do
(the SDK's own ``cpk=`` refuses plain-http endpoints, such as an emulator's).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import ClassVar

from ..controls import OPTIONS, customer_key, exclusive, key_digest, read_options

TIERS = ("Hot", "Cool", "Cold", "Archive")


@dataclass(frozen=True)
class AzureControls:
    """A container's requirements (see the module doc); the default requires nothing."""

    QUERY: ClassVar[tuple[str, ...]] = OPTIONS["azure"]
    encryption_scope: str = ""
    customer_key: str = field(default="", repr=False)
    """Base64 of a 256-bit key: a secret, never shown, never written into a URI."""
    access_tier: str = ""

    @classmethod
    def from_options(cls, options: Mapping[str, str], env: Mapping[str, str] = os.environ) -> AzureControls:
        """The controls ``options`` (a URI's) and ``env`` give; ValueError naming a bad value or combination."""
        given = read_options(cls.QUERY, options, env, "AZURE")
        exclusive(given, "customer_key", "encryption_scope", "Azure")
        if given["customer_key"]:
            customer_key(given["customer_key"], "Azure option customer_key")
        tier = given["access_tier"]
        if tier and tier.capitalize() not in TIERS:
            raise ValueError(f"Azure option access_tier={tier!r}: expected one of {list(TIERS)}")
        return cls(**{**given, "access_tier": tier.capitalize()})

    def query(self) -> dict[str, str]:
        """URI options that give these controls back; never the customer key (the environment gives it again)."""
        return {f.name: v for f in fields(self) if f.name != "customer_key" and (v := getattr(self, f.name))}

    def headers(self, *, writes: bool = False, creates: bool = False) -> dict[str, str]:
        """Headers of a request that reads a blob; ``writes``: that writes one; ``creates``: that creates one."""
        out = {}
        if self.customer_key:
            out = {"x-ms-encryption-key": self.customer_key, "x-ms-encryption-algorithm": "AES256",
                   "x-ms-encryption-key-sha256": key_digest(self.customer_key, "sha256")}
        if (writes or creates) and self.encryption_scope:
            out["x-ms-encryption-scope"] = self.encryption_scope
        if creates and self.access_tier:
            out["x-ms-access-tier"] = self.access_tier
        return out
