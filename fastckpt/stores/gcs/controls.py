"""What a company bucket may require of every request to GCS: its Cloud KMS key (CMEK), a customer-supplied key
(CSEK), requester pays (``user_project``) and a storage class.

Named as in the JSON API, in snake_case; each comes from the URI's options, else from ``FASTCKPT_GCS_<NAME>``. A KMS
key and a storage class go on the requests that create an object (uploads, composes); a customer key on every
request that reads or writes an object (uploads, composes, media and metadata reads); ``userProject`` on every
request.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import ClassVar

from ..controls import OPTIONS, check_customer_key, control_query, key_headers, read_options

__all__ = ["GCSControls"]


@dataclass(frozen=True)
class GCSControls:
    """A bucket's requirements (see the module doc); the default requires nothing."""

    QUERY: ClassVar[tuple[str, ...]] = OPTIONS["gcs"]
    kms_key_name: str = ""
    encryption_key: str = field(default="", repr=False)
    """Base64 of a 256-bit key: a secret, never shown, never written into a URI."""
    user_project: str = ""
    storage_class: str = ""

    @classmethod
    def from_options(cls, options: Mapping[str, str], env: Mapping[str, str] = os.environ) -> GCSControls:
        """The controls ``options`` (a URI's) and ``env`` give; ValueError naming a bad value or combination."""
        given = read_options(cls.QUERY, options, env, "GCS")
        check_customer_key(given, "encryption_key", "kms_key_name", "GCS")
        return cls(**given)

    def query(self) -> dict[str, str]:
        """URI options that give these controls back; never the customer key (the environment gives it again)."""
        return control_query(self, "encryption_key")

    def params(self, *, creates: bool = False) -> dict[str, str]:
        """Query parameters of every request; ``creates``: of one that creates an object."""
        out = {"userProject": self.user_project} if self.user_project else {}
        if creates and self.kms_key_name:
            out["kmsKeyName"] = self.kms_key_name
        return out

    def resource(self) -> dict[str, str]:
        """Fields of a new object's resource."""
        return {"storageClass": self.storage_class} if self.storage_class else {}

    def headers(self) -> dict[str, str]:
        """Headers of a request that reads or writes an object: the customer key, if any."""
        return key_headers("x-goog-encryption-", self.encryption_key, "sha256") if self.encryption_key else {}
