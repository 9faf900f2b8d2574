"""One Azure upload in blocks: staged in parallel (``Put Block`` on the data path, each with its Content-MD5) and
made visible by one ``Put Block List`` that also sets the metadata."""

from __future__ import annotations

import base64
import secrets
from typing import TYPE_CHECKING
from urllib.parse import quote

from ...errors import CopyUnsupportedError, ObjectNotFoundError, SourceChangedError, StoreError
from ...transport import Buffer
from ..base import CopySource, MultipartUpload, PartInfo
from .client import encode_metadata

__all__ = ["MAX_BLOCKS", "AzureUpload"]

if TYPE_CHECKING:
    from .store import AzureStore

MAX_BLOCKS = 50_000


class AzureUpload(MultipartUpload):
    """Blocks staged with fixed-length ids (upload id + 6-digit index), committed in index order."""

    def __init__(self, store: AzureStore, key: str, metadata: dict[str, str], if_absent: bool,
                 upload_id: str | None = None) -> None:
        self.key, self._store, self._client = key, store, store.client
        self._metadata, self._if_absent = metadata, if_absent
        self.upload_id = upload_id or secrets.token_hex(9)
        self.stored: dict[int, PartInfo] = {}
        self._closed = False
        self._discarded = False

    def block_id(self, index: int) -> str:
        """The block id of part ``index`` (24 characters; the SDK base64-encodes it)."""
        if not 0 <= index < MAX_BLOCKS:
            raise ValueError(f"part index {index} of {self.key!r} is outside 0..{MAX_BLOCKS - 1}")
        return f"{self.upload_id}{index:06d}"

    def _check_open(self) -> None:
        if self._closed:
            raise StoreError(f"multipart upload of {self._client.errors.url(self.key)} is no longer active")

    async def put_part(self, index: int, data: Buffer) -> PartInfo:
        self._check_open()
        block_id = self.block_id(index)
        md5 = await self._client.md5(data)
        headers = {"Content-Length": str(len(data)), **self._store.options.controls.headers(writes=True)}
        if md5:
            headers["Content-MD5"] = base64.b64encode(md5).decode()
        encoded = quote(base64.b64encode(block_id.encode()).decode(), safe="")
        await self._client.send("PUT", self.key, f"comp=block&blockid={encoded}", headers, body=data)
        return PartInfo(index, len(data), block_id)

    async def copy_part(self, index: int, source: CopySource) -> PartInfo:
        """Put Block From URL: the service reads the block from ``source``, conditional on its ETag."""
        self._check_open()
        block_id = self.block_id(index)
        headers = {"Content-Length": "0", **await self._client.copy_source(source.key),
                   "x-ms-source-range": f"bytes={source.start}-{source.start + source.length - 1}",
                   "x-ms-source-if-match": source.etag, **self._store.options.controls.headers(writes=True)}
        encoded = quote(base64.b64encode(block_id.encode()).decode(), safe="")
        try:
            await self._client.send("PUT", self.key, f"comp=block&blockid={encoded}", headers)
        except StoreError as exc:
            if exc.status == 412:
                raise SourceChangedError(f"{self._client.errors.url(source.key)} is no longer ETag {source.etag} "
                                         "(copy source)", key=source.key, backend="azure", status=412) from exc
            if exc.status in (400, 403, 501) and not isinstance(exc, ObjectNotFoundError):
                raise CopyUnsupportedError(f"Put Block From URL refused: {exc}", key=self.key, backend="azure",
                                           status=exc.status) from exc
            raise
        return PartInfo(index, source.length, block_id)

    async def complete(self, parts: list[PartInfo], metadata: dict[str, str] | None = None) -> None:
        self._check_open()
        if [p.index for p in parts] != list(range(len(parts))):
            raise StoreError(f"multipart upload of {self._client.errors.url(self.key)}: parts are not 0..n-1")
        condition = {"if_none_match": "*"} if self._if_absent else {}
        try:
            await self._client.blob(self.key).commit_block_list(
                [p.token or self.block_id(p.index) for p in parts],
                metadata=encode_metadata(self._metadata if metadata is None else metadata),
                headers=self._store.options.controls.headers(creates=True), **condition)
        except Exception as exc:
            raise self._client.errors.translate(exc, self.key, if_absent=self._if_absent) from exc
        self._closed = self._discarded = True

    async def abort(self) -> None:
        self._closed = True
        if not self._discarded:
            await self._store.discard_uncommitted(self.key)
            self._discarded = True
