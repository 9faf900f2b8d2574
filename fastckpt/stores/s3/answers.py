"""What S3 answers in XML and in headers, read into fastckpt's types; and the XML and headers fastckpt sends."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime, timezone
from email.utils import parsedate_to_datetime
from typing import Any
from urllib.parse import unquote_plus
from xml.etree import ElementTree
from xml.sax.saxutils import escape

from ...errors import StoreError
from ..base import ListPage, ObjectMeta, PartInfo

XMLNS = "http://s3.amazonaws.com/doc/2006-03-01/"


def timestamp(value: Any) -> datetime:
    """botocore's timestamp parser, with a fast path for the ISO 8601 times S3 lists objects with."""
    if isinstance(value, str):
        try:
            parsed = datetime.fromisoformat(value.replace("Z", "+00:00"))
        except ValueError:
            pass
        else:
            return parsed if parsed.tzinfo else parsed.replace(tzinfo=timezone.utc)
    from botocore.utils import parse_timestamp

    return parse_timestamp(value)


def meta_of(key: str, headers: Mapping[str, str], size: int) -> ObjectMeta:
    """``ObjectMeta`` from the headers of a HEAD or GET answer (lower-case names)."""
    metadata = {k[11:]: v for k, v in headers.items() if k.startswith("x-amz-meta-")}
    modified = headers.get("last-modified")
    mtime = parsedate_to_datetime(modified).timestamp() if modified else 0.0
    return ObjectMeta(key, size, mtime, headers.get("etag"), metadata)


def fields(element: ElementTree.Element) -> dict[str, str]:
    """The text of each child of ``element``, by name (without its namespace)."""
    return {child.tag.rpartition("}")[2]: child.text or "" for child in element}


def answer_fields(body: bytes) -> dict[str, str]:
    """The fields of an XML answer's root element (``CompleteMultipartUploadResult``, ...); {} when unreadable."""
    try:
        return fields(ElementTree.fromstring(body))
    except ElementTree.ParseError:
        return {}


def listing(body: bytes, where: str, shown: str) -> ListPage:
    """One ListObjectsV2 answer; keys are decoded only where the answer says they are URL-encoded, as botocore
    does: some servers ignore ``encoding-type=url``."""
    contents: list[dict[str, str]] = []
    prefixes: list[str] = []
    top: dict[str, str] = {}
    try:
        for element in ElementTree.fromstring(body):
            tag = element.tag.rpartition("}")[2]
            if tag == "Contents":
                contents.append(fields(element))
            elif tag == "CommonPrefixes":
                prefixes.append(fields(element)["Prefix"])
            else:
                top[tag] = element.text or ""
        decode = unquote_plus if top.get("EncodingType") == "url" else str
        objects = [ObjectMeta(decode(f["Key"]), int(f.get("Size") or 0),
                              timestamp(f["LastModified"]).timestamp() if f.get("LastModified") else 0.0,
                              f.get("ETag") or None) for f in contents]
    except (ElementTree.ParseError, KeyError, ValueError) as exc:
        raise StoreError(f"{where}: unreadable listing from {shown} ({exc!r})", backend="s3") from exc
    token = top.get("NextContinuationToken") if top.get("IsTruncated") == "true" else None
    return ListPage(objects, [decode(p) for p in prefixes], token)


def complete_body(parts: list[PartInfo]) -> bytes:
    """The CompleteMultipartUpload document naming ``parts`` in order."""
    listed = "".join(f"<Part><PartNumber>{p.index + 1}</PartNumber><ETag>{escape(p.token)}</ETag></Part>"
                     for p in sorted(parts, key=lambda p: p.index))
    return f'<CompleteMultipartUpload xmlns="{XMLNS}">{listed}</CompleteMultipartUpload>'.encode()


def metadata_headers(metadata: Mapping[str, str] | None) -> dict[str, str] | None:
    """``x-amz-meta-*`` headers for ``metadata``; None when a name or value cannot go into a header as is
    (printable ASCII only: botocore encodes the rest)."""
    items = (metadata or {}).items()
    if not all(t.isascii() and t.isprintable() for kv in items for t in kv):
        return None
    return {f"x-amz-meta-{k}": v for k, v in items}
