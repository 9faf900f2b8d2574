"""``AzureStore``: the store protocol on one Azure Blob Storage container (requests through ``AzureClient``)."""

from __future__ import annotations

import asyncio
import re

from azure.storage.blob.aio import BlobPrefix

from ...errors import (
    AlreadyExistsError,
    BucketNotFoundError,
    CopyUnsupportedError,
    ObjectNotFoundError,
    SourceChangedError,
    StoreError,
)
from ...tasks import gather_bounded
from ...transport import Buffer, Receiver
from ..base import CopySource, ListPage, NamedUploadStore, ObjectMeta, PartInfo, PendingUpload, in_prefix
from ..datapath import ranged
from .client import AzureClient, decode_metadata, encode_metadata
from .options import AzureOptions
from .upload import MAX_BLOCKS, AzureUpload

__all__ = ["AzureStore", "MiB"]

MiB = 1 << 20


class AzureStore(NamedUploadStore):
    """Blobs of one container. Small files are one ``Put Blob`` (Content-MD5 checked by the service), large ones
    an ``AzureUpload``; create-if-absent sends ``If-None-Match: *``."""

    name = "azure"
    scheme = "az"
    min_part_size = 1
    max_part_size = 4000 * MiB
    max_parts = MAX_BLOCKS
    upload_type = AzureUpload
    upload_ids = re.compile(r"[0-9a-f]{18}")

    def __init__(self, container: str, options: AzureOptions, *, max_connections: int = 16,
                 connection_timeout: float = 20, read_timeout: float = 60) -> None:
        self.container = self.bucket = container
        self.options = options
        self.client = AzureClient(container, options, max_connections=max_connections,
                                  connection_timeout=connection_timeout, read_timeout=read_timeout)

    def __repr__(self) -> str:
        return f"AzureStore({self.options.url}/{self.container})"

    async def close(self) -> None:
        await self.client.close()

    async def head(self, key: str) -> ObjectMeta:
        try:
            props = await self.client.blob(key).get_blob_properties(headers=self.options.controls.headers())
        except Exception as exc:
            raise self.client.errors.translate(exc, key) from exc
        return ObjectMeta(key, props.size, props.last_modified.timestamp(), props.etag, decode_metadata(props.metadata))

    async def receive(self, key: str, start: int, length: int, into: Receiver) -> int:
        """One ranged Get Blob on the HTTP data path, its body received straight by ``into``."""
        if not length:
            return 0
        resp = await self.client.send("GET", key, "", {"x-ms-range": f"bytes={start}-{start + length - 1}",
                                                       **self.options.controls.headers()}, into=into)
        return ranged(resp, start, self.client.errors.url(key), self.options.url)

    async def put(
        self, key: str, data: Buffer, *, if_absent: bool = False, metadata: dict[str, str] | None = None
    ) -> None:
        md5 = await self.client.md5(data)
        extra = {"transactional_content_md5": md5} if md5 else {}
        try:
            await self.client.blob(key).upload_blob(
                data if isinstance(data, bytes) else bytes(data), length=len(data), overwrite=not if_absent,
                metadata=encode_metadata(metadata), max_concurrency=1,
                headers=self.options.controls.headers(creates=True), **extra)
        except Exception as exc:
            raise self.client.errors.translate(exc, key, if_absent=if_absent) from exc

    async def copy(self, key: str, source: CopySource, *, if_absent: bool = False,
                   metadata: dict[str, str] | None = None) -> None:
        """Copy Blob (whole blobs; within one account the service copies at once), conditional on the source's
        ETag; a copy the service reports pending is waited for."""
        found = await self.head(source.key)
        if source.start or source.length != found.size:
            raise CopyUnsupportedError(f"Copy Blob copies whole blobs, not {source.start}+{source.length} of "
                                       f"{self.client.errors.url(source.key)}", key=source.key, backend="azure")
        headers = {"Content-Length": "0", **await self.client.copy_source(source.key),
                   "x-ms-source-if-match": source.etag,
                   **{f"x-ms-meta-{k}": v for k, v in encode_metadata(metadata).items()},
                   **self.options.controls.headers(creates=True)}
        if if_absent:
            headers["If-None-Match"] = "*"
        try:
            resp = await self.client.send("PUT", key, "", headers)
        except StoreError as exc:
            if exc.status not in (409, 412):
                raise
            if if_absent and (exc.status == 409 or await self.exists(key)):  # 412 for either condition: which?
                raise AlreadyExistsError(f"{self.client.errors.url(key)} already exists", key=key, backend="azure",
                                         status=exc.status) from exc
            raise SourceChangedError(f"{self.client.errors.url(source.key)} is no longer ETag {source.etag} "
                                     "(copy source)", key=source.key, backend="azure", status=412) from exc
        status = resp.headers.get("x-ms-copy-status", "success")
        while status == "pending":
            await asyncio.sleep(0.05)
            status = (await self.client.blob(key).get_blob_properties(
                headers=self.options.controls.headers())).copy.status
        if status != "success":
            raise StoreError(f"copy of {self.client.errors.url(source.key)} to {self.client.errors.url(key)} ended "
                             f"{status}", key=key, backend="azure")

    async def list_page(self, prefix: str, delimiter: str | None = None, token: str | None = None) -> ListPage:
        """One List Blobs request (a hierarchical listing when ``delimiter`` is given)."""
        container = self.client.container_client()
        options = {"name_starts_with": prefix or None, "include": ["metadata"], "results_per_page": 1000}
        paged = (container.walk_blobs(delimiter=delimiter, **options) if delimiter
                 else container.list_blobs(**options))
        pages = paged.by_page(continuation_token=token)
        objects: list[ObjectMeta] = []
        prefixes: list[str] = []
        try:
            async for item in await pages.__anext__():
                if isinstance(item, BlobPrefix):
                    prefixes.append(item.name)
                else:
                    objects.append(ObjectMeta(item.name, item.size, item.last_modified.timestamp(), item.etag,
                                              decode_metadata(item.metadata)))
        except StopAsyncIteration:
            pass
        except Exception as exc:
            raise self.client.errors.translate(exc, None) from exc
        return ListPage(objects, prefixes, pages.continuation_token or None)

    async def delete(self, key: str) -> None:
        try:
            await self.client.blob(key).delete_blob()
        except Exception as exc:
            err = self.client.errors.translate(exc, key)
            if type(err) is not ObjectNotFoundError:
                raise err from exc

    async def delete_many(self, keys: list[str]) -> None:
        await gather_bounded([self.delete(k) for k in keys], self.client.max_connections)

    async def find_parts(self, upload: AzureUpload) -> None:
        """The blob's uncommitted blocks of this upload (their ids start with the upload id)."""
        try:
            _, uncommitted = await self.client.blob(upload.key).get_block_list("uncommitted")
        except Exception as exc:
            error = self.client.errors.translate(exc, upload.key)
            if type(error) is ObjectNotFoundError:
                return
            raise error from exc
        for block in uncommitted:
            index = block.id[len(upload.upload_id):]
            if block.id.startswith(upload.upload_id) and index.isdigit():
                upload.stored[int(index)] = PartInfo(int(index), block.size, block.id)

    async def list_pending_uploads(self, prefix: str = "") -> list[PendingUpload]:
        """Blobs that have staged (uncommitted) blocks and no committed version.

        Uncommitted blocks staged over an existing committed blob are not reported: Azure lists only
        the committed blob then (they are discarded by its next commit, or after 7 days).
        """
        prefix = prefix.strip("/")
        container = self.client.container_client()
        try:
            committed = {b.name async for b in container.list_blobs(name_starts_with=prefix or None)}
            return [PendingUpload(b.name, f"uncommitted:{b.name}", b.last_modified.timestamp())
                    async for b in container.list_blobs(name_starts_with=prefix or None,
                                                        include=["uncommittedblobs"])
                    if b.name not in committed and in_prefix(b.name, prefix)]
        except Exception as exc:
            raise self.client.errors.translate(exc, None) from exc

    async def abort_pending_upload(self, upload: PendingUpload) -> None:
        await self.discard_uncommitted(upload.key)

    async def discard_uncommitted(self, key: str) -> None:
        """Drop the staged blocks of ``key`` when it has no committed version (deleting that blob
        is the only way to); blocks staged over a committed blob are left to expire."""
        try:
            await self.head(key)
        except BucketNotFoundError:
            raise
        except ObjectNotFoundError:
            await self.delete(key)
