"""What a company bucket may require of every request: server-side encryption (SSE-S3, SSE-KMS, DSSE-KMS, or a
customer-provided key, SSE-C), requester pays, a storage class, object tags and the expected bucket owner.

Named as in S3's API, in snake_case; each comes from the URI's options, else from ``FASTCKPT_S3_<NAME>`` (a customer
key need not sit in a URI). ``headers(operation)`` gives the headers one request carries, by the S3 operation it is:
the encryption of a new object goes on the requests that create one (PutObject, CreateMultipartUpload, CopyObject);
a customer key on every request that reads or writes the object's bytes, and again as the copy source's key on
server-side copies; requester pays and the expected owner on every request.
"""

from __future__ import annotations

import base64
import binascii
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import ClassVar
from urllib.parse import parse_qsl

from ...config import parse_bool
from ..controls import OPTIONS, check_customer_key, control_query, key_headers, read_options

__all__ = ["COPIES", "ENCRYPTIONS", "OF_OBJECT", "WRITES", "S3Controls", "encryption_context", "operation_of"]

ENCRYPTIONS = ("AES256", "aws:kms", "aws:kms:dsse")
WRITES = frozenset({"PutObject", "CreateMultipartUpload", "CopyObject"})
"""Operations that create an object: they name its encryption, storage class and tags."""
COPIES = frozenset({"CopyObject", "UploadPartCopy"})
OF_OBJECT = WRITES | COPIES | {"UploadPart", "CompleteMultipartUpload", "GetObject", "HeadObject"}
"""Operations that read or write an object's bytes: they carry a customer key."""


@dataclass(frozen=True)
class S3Controls:
    """A bucket's requirements (see the module doc); the default requires nothing."""

    QUERY: ClassVar[tuple[str, ...]] = OPTIONS["s3"]
    server_side_encryption: str = ""
    sse_kms_key_id: str = ""
    sse_kms_encryption_context: str = ""
    """Base64 of a JSON object, as the ``x-amz-server-side-encryption-context`` header carries it."""
    bucket_key_enabled: bool | None = None
    sse_customer_key: str = field(default="", repr=False)
    """Base64 of a 256-bit key: a secret, never shown, never written into a URI."""
    request_payer: str = ""
    storage_class: str = ""
    tagging: str = ""
    """URL-encoded ``k1=v1&k2=v2``, as the ``x-amz-tagging`` header carries it."""
    expected_bucket_owner: str = ""

    @classmethod
    def from_options(cls, options: Mapping[str, str], env: Mapping[str, str] = os.environ) -> S3Controls:
        """The controls ``options`` (a URI's) and ``env`` give; ValueError naming a bad value or combination."""
        given = read_options(cls.QUERY, options, env, "S3")
        sse = given["server_side_encryption"]
        if sse and sse not in ENCRYPTIONS:
            raise ValueError(f"S3 option server_side_encryption={sse!r}: expected one of {list(ENCRYPTIONS)}")
        kms = [n for n in ("sse_kms_key_id", "sse_kms_encryption_context", "bucket_key_enabled") if given[n]]
        if kms and not sse.startswith("aws:kms"):
            raise ValueError(f"S3 option(s) {kms} need server_side_encryption=aws:kms or aws:kms:dsse")
        check_customer_key(given, "sse_customer_key", "server_side_encryption", "S3")
        if given["request_payer"] and given["request_payer"] != "requester":
            raise ValueError(f"S3 option request_payer={given['request_payer']!r}: the only value is 'requester'")
        if given["tagging"]:
            try:
                parse_qsl(given["tagging"], keep_blank_values=True, strict_parsing=True)
            except ValueError:
                raise ValueError(f"S3 option tagging={given['tagging']!r}: expected URL-encoded k1=v1&k2=v2") from None
        context = given["sse_kms_encryption_context"]
        bucket_key = given["bucket_key_enabled"]
        return cls(**{**given, "sse_kms_encryption_context": context and encryption_context(context),
                      "bucket_key_enabled": parse_bool(bucket_key, "S3 option bucket_key_enabled")
                      if bucket_key else None})

    def query(self) -> dict[str, str]:
        """URI options that give these controls back; never the customer key (the environment gives it again)."""
        return control_query(self, "sse_customer_key")

    def headers(self, operation: str) -> dict[str, str]:
        """The headers a request of S3 operation ``operation`` carries (``operation_of`` names it)."""
        out: dict[str, str] = {}
        if self.request_payer:
            out["x-amz-request-payer"] = self.request_payer
        if self.expected_bucket_owner:
            out["x-amz-expected-bucket-owner"] = self.expected_bucket_owner
            if operation in COPIES:
                out["x-amz-source-expected-bucket-owner"] = self.expected_bucket_owner
        if operation in WRITES:
            pairs = {"x-amz-server-side-encryption": self.server_side_encryption,
                     "x-amz-server-side-encryption-aws-kms-key-id": self.sse_kms_key_id,
                     "x-amz-server-side-encryption-context": self.sse_kms_encryption_context,
                     "x-amz-storage-class": self.storage_class, "x-amz-tagging": self.tagging}
            out.update((k, v) for k, v in pairs.items() if v)
            if self.bucket_key_enabled is not None:
                out["x-amz-server-side-encryption-bucket-key-enabled"] = str(self.bucket_key_enabled).lower()
            if self.tagging and operation == "CopyObject":
                out["x-amz-tagging-directive"] = "REPLACE"
        if self.sse_customer_key and operation in OF_OBJECT:
            key = self.sse_customer_key
            out.update(key_headers("x-amz-server-side-encryption-customer-", key, "md5"))
            if operation in COPIES:
                out.update(key_headers("x-amz-copy-source-server-side-encryption-customer-", key, "md5"))
        return out


def operation_of(method: str, key: str, query: Mapping[str, str], headers: Mapping[str, str]) -> str:
    """The S3 operation a data-path request is (as botocore names it)."""
    if not key:
        return "Bucket"
    copy = "x-amz-copy-source" in headers
    if method == "PUT":
        if "partNumber" in query:
            return "UploadPartCopy" if copy else "UploadPart"
        return "CopyObject" if copy else "PutObject"
    if method == "POST":
        return "CreateMultipartUpload" if "uploads" in query else "CompleteMultipartUpload"
    if method == "GET":
        return "ListParts" if "uploadId" in query else "GetObject"
    return {"HEAD": "HeadObject"}.get(method, "DeleteObject")


def encryption_context(text: str) -> str:
    """Base64 of an encryption context given as a JSON object or as the base64 of one; ValueError otherwise."""
    try:
        raw = text if text.lstrip().startswith("{") else base64.b64decode(text, validate=True).decode()
        context = json.loads(raw)
    except (binascii.Error, ValueError):
        context = None
    if not isinstance(context, dict) or not all(isinstance(v, str) for v in context.values()):
        raise ValueError(f"S3 option sse_kms_encryption_context={text!r}: expected a JSON object of strings "
                         "(or its base64)")
    return base64.b64encode(json.dumps(context, separators=(",", ":")).encode()).decode()
