"""Digest records: what S3 learns of an object only when its upload completes (the digest), kept beside it.

S3 takes an object's metadata when its multipart upload is created, before a byte of it is read; what is known
only at completion goes into a record written once the object is complete: ``<dir>/.fastckpt-meta/<name>``, an
empty object whose metadata is the record and the ETag of the object it belongs to. The object says at creation
that it has one (``x-amz-meta-fastckpt-record``) and ``head`` merges it in, so an upload reads each file once. A
record is hidden from listings and deleted with its object; one left by an earlier version of the object names
another ETag and is not used. A writer that loses a create-if-absent race never completes, so it never writes a
record. With ``FASTCKPT_S3_DIGEST_RECORDS=0`` no record is written: ``metadata_on_complete`` is then False and
the engine hashes a file before its upload starts.
"""

from __future__ import annotations

import logging
from dataclasses import replace

from ...errors import ObjectNotFoundError, StoreError
from ..base import ObjectMeta, Store
from .answers import meta_of
from .client import S3Client

__all__ = ["RECORD_DIR", "RECORD_ETAG", "RECORD_MARK", "DigestRecords", "record_of"]

log = logging.getLogger("fastckpt")
RECORD_DIR = ".fastckpt-meta"
RECORD_MARK = "fastckpt-record"
"""Metadata an object gets at creation when its record may follow."""
RECORD_ETAG = "fastckpt-etag"
"""The record's metadata naming the ETag of the object it was written for."""


def record_of(key: str) -> str:
    """The key of object ``key``'s record."""
    head, _, name = key.rpartition("/")
    return f"{head}/{RECORD_DIR}/{name}" if head else f"{RECORD_DIR}/{name}"


class DigestRecords(Store):
    """The record half of ``S3Store``."""

    client: S3Client

    async def plain_head(self, key: str) -> ObjectMeta | None:
        """The object's own metadata (no record merged in); None when it is absent."""
        try:
            answer = await self.client.send("HEAD", key, {}, {})
        except ObjectNotFoundError:
            return None
        return meta_of(key, answer.headers, int(answer.headers.get("content-length", 0)))

    async def with_record(self, meta: ObjectMeta) -> ObjectMeta:
        """``meta`` with its record's metadata merged in, when it has one."""
        if RECORD_MARK not in meta.metadata:
            return meta
        metadata = {k: v for k, v in meta.metadata.items() if k != RECORD_MARK}
        record = await self.plain_head(record_of(meta.key))
        if record is not None and meta.etag and record.metadata.get(RECORD_ETAG) == meta.etag:
            metadata.update((k, v) for k, v in record.metadata.items() if k != RECORD_ETAG)
        else:  # none, or an earlier version's: the upload stopped after completing, or a writer raced it
            log.debug("%s has no record of its completion", self.client.errors.where(meta.key))
        return replace(meta, metadata=metadata)

    async def put_record(self, key: str, etag: str, metadata: dict[str, str]) -> None:
        """Record ``metadata`` for object ``key`` as completed with ``etag`` (replacing an earlier version's)."""
        if not etag:  # a server that did not name it in its answer to the completion
            found = await self.plain_head(key)
            etag = found.etag or "" if found is not None else ""
        if not etag:
            raise StoreError(f"{self.client.errors.where(key)}: {self.client.options.shown} completed the upload "
                             "without naming its ETag", key=key, backend="s3")
        await self.put(record_of(key), b"", metadata={**metadata, RECORD_ETAG: etag})

    def is_hidden(self, key: str) -> bool:
        """Records of objects' completions."""
        return f"/{RECORD_DIR}/" in f"/{key}"

    async def list_orphans(self, prefix: str = "", before: float = 0.0) -> list[str]:
        """Records whose object is gone, or was replaced without one (another ETag)."""
        base = prefix.strip("/")
        metas = {m.key: m async for page in self._pages(base + "/" if base else "") for m in page.objects}
        if base:
            metas.update((m.key, m) for m in [await self.plain_head(base)] if m is not None)
        orphans = []
        for key, meta in metas.items():
            head, _, name = key.rpartition(f"{RECORD_DIR}/")
            if not self.is_hidden(key) or meta.mtime > before or "/" in name:
                continue
            owner = metas.get(head + name)
            if owner is not None:
                record = await self.plain_head(key)
                if record is None or record.metadata.get(RECORD_ETAG) == owner.etag:
                    continue
            orphans.append(key)
        return orphans
