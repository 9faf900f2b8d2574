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
from dataclasses import dataclass, field, fields
from typing import ClassVar

from ..controls import OPTIONS, customer_key, exclusive, key_digest, read_options


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
        exclusive(given, "encryption_key", "kms_key_name", "GCS")
        if given["encryption_key"]:
            customer_key(given["encryption_key"], "GCS option encryption_key")
        return cls(**given)

    def query(self) -> dict[str, str]:
        """URI options that give these controls back; never the customer key (the environment gives it again)."""
        return {f.name: v for f in fields(self) if f.name != "encryption_key" and (v := getattr(self, f.name))}

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
        if not self.encryption_key:
            return {}
        return {"x-goog-encryption-algorithm": "AES256", "x-goog-encryption-key": self.encryption_key,
                "x-goog-encryption-key-sha256": key_digest(self.encryption_key, "sha256")}
