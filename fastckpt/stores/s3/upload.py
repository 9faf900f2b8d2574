"""One S3 multipart upload: parts numbered from 1, completed with the digest recorded after the data."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ...errors import CopyUnsupportedError, ObjectNotFoundError, StoreError
from ...transport import Buffer, FileRange, Pieces, body_size
from ..base import CopySource, MultipartUpload, PartInfo
from .answers import answer_fields, complete_body
from .errors import NoSuchUpload

__all__ = ["S3Upload"]

if TYPE_CHECKING:
    from .store import S3Store


class S3Upload(MultipartUpload):
    """One S3 multipart upload; parts are numbered ``index + 1``."""

    def __init__(self, store: S3Store, key: str, upload_id: str, if_absent: bool = False,
                 created: dict[str, str] | None = None) -> None:
        self.key, self.upload_id = key, upload_id
        self._store, self._client, self._if_absent = store, store.client, if_absent
        self._created = created or {}
        self._finished = False
        self._complete_sent = False
        self._etag = ""
        self.stored: dict[int, PartInfo] = {}

    @property
    def sends_files(self) -> bool:
        return self._client.sends_files

    @property
    def sends_pieces(self) -> bool:
        return True

    async def put_part(self, index: int, data: Buffer | FileRange | Pieces) -> PartInfo:
        if self._finished:
            raise StoreError(f"multipart upload of {self._client.errors.where(self.key)} is no longer active")
        query = {"partNumber": str(index + 1), "uploadId": self.upload_id}
        resp = await self._client.send("PUT", self.key, query, {}, body=data)
        return PartInfo(index, body_size(data), resp.headers.get("etag", ""))

    async def copy_part(self, index: int, source: CopySource) -> PartInfo:
        """UploadPartCopy of ``source``'s range, conditional on its ETag (``S3Store.copy_request``)."""
        if self._finished:
            raise StoreError(f"multipart upload of {self._client.errors.where(self.key)} is no longer active")
        query = {"partNumber": str(index + 1), "uploadId": self.upload_id}
        try:
            etag, _ = await self._store.copy_request(self.key, query, {
                "x-amz-copy-source-range": f"bytes={source.start}-{source.start + source.length - 1}"}, source)
        except StoreError as exc:
            if exc.status in (400, 501) and not isinstance(exc, ObjectNotFoundError):
                raise CopyUnsupportedError(f"{self._client.options.shown} refused UploadPartCopy: {exc}",
                                           key=self.key, backend="s3", status=exc.status) from exc
            raise
        return PartInfo(index, source.length, etag)

    async def complete(self, parts: list[PartInfo], metadata: dict[str, str] | None = None) -> None:
        """Assemble the parts, then record what of ``metadata`` the upload was not created with, where records
        are on (a retry after the parts were assembled writes the record only)."""
        if not self._finished:
            self._etag = await self._assemble(parts)
            self._finished = True
        record = {k: v for k, v in (metadata or {}).items() if self._created.get(k) != v}
        if record and self._store.metadata_on_complete:
            await self._store.put_record(self.key, self._etag, record)

    async def _assemble(self, parts: list[PartInfo]) -> str:
        """CompleteMultipartUpload; the object's ETag."""
        headers = await self._store.if_absent_headers(self.key) if self._if_absent else {}
        retry, self._complete_sent = self._complete_sent, True
        try:
            resp = await self._client.send("POST", self.key, {"uploadId": self.upload_id}, headers,
                                           body=complete_body(parts), if_absent=self._if_absent)
            if b"<Error>" in resp.body:  # S3 reports a complete that failed after it began in a 200 answer
                raise self._client.errors.answer(resp, self.key, self._if_absent)
        except NoSuchUpload:
            # A retried complete whose first attempt succeeded but lost its response.
            if retry:
                found = await self._store.plain_head(self.key)
                if found is not None and found.size == sum(p.size for p in parts):
                    return found.etag or ""
            raise
        return answer_fields(resp.body).get("ETag", "")

    async def abort(self) -> None:
        if self._finished:
            return
        await self._store.abort_multipart(self.key, self.upload_id)
        self._finished = True
