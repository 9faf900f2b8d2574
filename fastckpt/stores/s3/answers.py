"""What S3 answers in XML and in headers, read into fastckpt's types; and the XML and headers fastckpt sends."""

from __future__ import annotations

import html
import re
from collections.abc import Mapping
from datetime import datetime, timezone
from email.utils import parsedate_to_datetime
from typing import Any
from urllib.parse import unquote_plus
from xml.etree import ElementTree
from xml.sax.saxutils import escape

from ...errors import StoreError
from ..base import ListPage, ObjectMeta, PartInfo

__all__ = ["XMLNS", "answer_fields", "complete_body", "continuation", "delete_body", "delete_failures", "fields",
           "listing", "meta_of", "metadata_headers", "timestamp"]

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


_TRUNCATED = re.compile(rb"<IsTruncated>\s*true\s*</IsTruncated>")
_NEXT = re.compile(rb"<NextContinuationToken>([^<]*)</NextContinuationToken>")


def continuation(body: bytes) -> str | None:
    """The continuation token of a ListObjectsV2 answer, read without parsing its keys; None on its last page."""
    found = _NEXT.search(body) if _TRUNCATED.search(body) else None
    return html.unescape(found[1].decode()) if found else None


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


_NOT_XML = re.compile("[^\t\n\r\x20-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")


def delete_body(keys: list[str]) -> bytes | None:
    """The DeleteObjects document for ``keys`` (quiet: the answer names only failures); None when a key holds a
    character XML 1.0 cannot carry."""
    if any(_NOT_XML.search(k) for k in keys):
        return None
    listed = "".join(f"<Object><Key>{escape(k)}</Key></Object>" for k in keys)
    return f'<Delete xmlns="{XMLNS}"><Quiet>true</Quiet>{listed}</Delete>'.encode()


def delete_failures(body: bytes) -> list[dict[str, str]]:
    """The ``<Error>`` entries (Key, Code, Message) of a DeleteObjects answer."""
    try:
        root = ElementTree.fromstring(body)
    except ElementTree.ParseError as exc:
        raise StoreError(f"unreadable DeleteObjects answer ({exc!r})", backend="s3") from exc
    return [fields(e) for e in root if e.tag.rpartition("}")[2] == "Error"]


def metadata_headers(metadata: Mapping[str, str] | None) -> dict[str, str] | None:
    """``x-amz-meta-*`` headers for ``metadata``; None when a name or value cannot go into a header as is
    (printable ASCII only: botocore encodes the rest)."""
    items = (metadata or {}).items()
    if not all(t.isascii() and t.isprintable() for kv in items for t in kv):
        return None
    return {f"x-amz-meta-{k}": v for k, v in items}
