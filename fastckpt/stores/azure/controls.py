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
from dataclasses import dataclass, field
from typing import ClassVar

from ..controls import OPTIONS, check_customer_key, control_query, key_headers, read_options

__all__ = ["TIERS", "AzureControls"]

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
        check_customer_key(given, "customer_key", "encryption_scope", "Azure")
        tier = given["access_tier"]
        if tier and tier.capitalize() not in TIERS:
            raise ValueError(f"Azure option access_tier={tier!r}: expected one of {list(TIERS)}")
        return cls(**{**given, "access_tier": tier.capitalize()})

    def query(self) -> dict[str, str]:
        """URI options that give these controls back; never the customer key (the environment gives it again)."""
        return control_query(self, "customer_key")

    def headers(self, *, writes: bool = False, creates: bool = False) -> dict[str, str]:
        """Headers of a request that reads a blob; ``writes``: that writes one; ``creates``: that creates one."""
        out = key_headers("x-ms-encryption-", self.customer_key, "sha256") if self.customer_key else {}
        if (writes or creates) and self.encryption_scope:
            out["x-ms-encryption-scope"] = self.encryption_scope
        if creates and self.access_tier:
            out["x-ms-access-tier"] = self.access_tier
        return out
