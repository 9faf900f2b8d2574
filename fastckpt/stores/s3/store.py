"""``S3Store``: the store protocol on one S3 bucket (requests through ``S3Client``)."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import posixpath
import secrets
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import quote

from ...errors import BucketNotFoundError, ObjectNotFoundError, SourceChangedError, StoreError
from ...tasks import gather_bounded
from ...transport import Buffer, BufferReceiver, Receiver
from ..base import CopySource, ListPage, MultipartUpload, ObjectMeta, PartInfo, PendingUpload, ReceivingStore, in_prefix
from ..conditional import IfAbsentGuard, probe
from ..datapath import ranged
from .answers import (
    answer_fields,
    continuation,
    delete_body,
    delete_failures,
    listing,
    meta_of,
    metadata_headers,
)
from .client import S3Client
from .errors import NO_CONDITIONAL, NoSuchUpload
from .options import S3Options
from .records import RECORD_MARK, DigestRecords, record_of
from .upload import S3Upload

__all__ = ["DELETE_BATCH", "DELETE_BATCHES", "POOL_HEADROOM", "MiB", "S3Store"]

MiB = 1 << 20
DELETE_BATCH = 1000
DELETE_BATCHES = 16
"""Keys per DeleteObjects request (the S3 maximum)."""
POOL_HEADROOM = 16
"""Connections beyond ``max_in_flight`` for heads, lists, completes and aborts."""


class S3Store(DigestRecords, ReceivingStore):
    """One bucket on S3 or an S3-compatible server. Use it inside one event loop (its connections belong to the
    loop that first used the store) and ``await close()`` at the end."""

    name = "s3"
    scheme = "s3"
    min_part_size = 5 * MiB
    max_part_size = 5 << 30
    max_parts = 10_000

    def __init__(self, bucket: str, options: S3Options | None = None, *,
                 max_pool_connections: int = 8 + POOL_HEADROOM, page_size: int = 1000) -> None:
        self.bucket = bucket
        self.options = options = options or S3Options()
        self.client = S3Client(bucket, options, max_pool_connections=max_pool_connections)
        self.if_absent = IfAbsentGuard(options.if_absent_mode, "FASTCKPT_S3_IF_ABSENT", "If-None-Match: *")
        self.page_size = page_size

    @property
    def metadata_on_complete(self) -> bool:  # type: ignore[override]
        return self.options.digest_records

    async def close(self) -> None:
        await self.client.close()

    def learned(self) -> dict[str, Any]:
        return self.client.learned()

    def assume(self, learned: dict[str, Any]) -> None:
        self.client.assume(learned)

    # ----------------------------------------------------------------------------- reads

    async def head(self, key: str) -> ObjectMeta:
        meta = await self.plain_head(key)
        if meta is None:
            raise await self._missing(key)
        return await self.with_record(meta)

    async def _missing(self, key: str) -> ObjectNotFoundError:
        """The error for a 404 without a body (HEAD): names the bucket when it is the bucket that is gone."""
        if not self.client.bucket_ok:
            try:
                await self.client.send("HEAD", "", {}, {})
                self.client.bucket_ok = True
            except ObjectNotFoundError as exc:
                return BucketNotFoundError(f"bucket {self.bucket!r} does not exist at endpoint "
                                           f"{self.options.shown}", key=key, backend="s3", status=exc.status)
            except StoreError:
                pass
        return ObjectNotFoundError(f"{self.client.errors.where(key)} does not exist", key=key, backend="s3",
                                   status=404)

    async def read_with_meta(self, key: str, buf: memoryview) -> tuple[ObjectMeta, int]:
        """One ranged GET from the start: its answer's headers carry the object's size and metadata."""
        if not buf.nbytes:
            return await super().read_with_meta(key, buf)
        resp = await self.client.send("GET", key, {}, {"Range": f"bytes=0-{buf.nbytes - 1}"},
                                      into=BufferReceiver(buf))
        if resp.status == 416:  # an empty object
            return await super().read_with_meta(key, buf)
        total = resp.headers.get("content-range", "").rpartition("/")[2]
        size = int(total) if resp.status == 206 and total.isdigit() else resp.received
        return await self.with_record(meta_of(key, resp.headers, size)), resp.received

    async def receive(self, key: str, start: int, length: int, into: Receiver) -> int:
        """One ranged GET, its body received straight by ``into``."""
        if not length:
            return 0
        resp = await self.client.send("GET", key, {}, {"Range": f"bytes={start}-{start + length - 1}"}, into=into)
        return ranged(resp, start, self.client.errors.where(key), self.options.shown)

    async def list_page(self, prefix: str, delimiter: str | None = None, token: str | None = None) -> ListPage:
        """One ListObjectsV2 request on the data path; keys travel URL-encoded (``encoding-type=url``, as botocore
        asks for them: XML 1.0 cannot carry every character a key may hold)."""
        body = await self._list_body(prefix, delimiter, token)
        return listing(body, self.client.errors.where(prefix), self.options.shown)

    async def _list_body(self, prefix: str, delimiter: str | None, token: str | None) -> bytes:
        query = {"list-type": "2", "max-keys": str(self.page_size), "encoding-type": "url"}
        if prefix:
            query["prefix"] = prefix
        if delimiter:
            query["delimiter"] = delimiter
        if token:
            query["continuation-token"] = token
        return (await self.client.send("GET", "", query, {})).body

    async def _pages(self, prefix: str, delimiter: str | None = None) -> AsyncIterator[ListPage]:
        """The pages of a listing, each asked for as soon as the answer before it names it (its continuation token is
        read ahead of its keys), so that the server works on the next page while this one is parsed and used."""
        ahead: asyncio.Future[bytes] | None = asyncio.ensure_future(self._list_body(prefix, delimiter, None))
        try:
            while ahead is not None:
                body = await ahead
                token = continuation(body)
                ahead = asyncio.ensure_future(self._list_body(prefix, delimiter, token)) if token else None
                page = listing(body, self.client.errors.where(prefix), self.options.shown)
                if page.token != token:
                    raise StoreError(f"{self.client.errors.where(prefix)}: a listing page from {self.options.shown} "
                                     f"names its next page two ways ({token!r}, {page.token!r})", backend="s3")
                yield page
        finally:
            if ahead is not None:
                ahead.cancel()
                await asyncio.gather(ahead, return_exceptions=True)

    # ----------------------------------------------------------------------------- writes

    async def put(
        self, key: str, data: Buffer, *, if_absent: bool = False, metadata: dict[str, str] | None = None
    ) -> None:
        condition = await self.if_absent_headers(key) if if_absent else {}
        headers = metadata_headers(metadata)
        if headers is not None:
            await self.client.send("PUT", key, {}, {**headers, **condition}, body=data, if_absent=if_absent)
            return
        body = bytes(data)  # metadata HTTP headers cannot carry as is: botocore encodes it
        await self.client.call("put_object", key, if_absent=if_absent, Key=key, Body=body, ContentLength=len(body),
                               Metadata=dict(metadata or {}), **({"IfNoneMatch": "*"} if condition else {}))

    async def copy(self, key: str, source: CopySource, *, if_absent: bool = False,
                   metadata: dict[str, str] | None = None) -> None:
        """CopyObject (one request; the server moves no bytes where it can, as JuiceFS's gateway does), conditional on
        the source's ETag, where it is as safe as a put: not create-if-absent, or on a server that ignores
        ``If-None-Match`` anyway (best-effort: a HEAD first). Otherwise an upload of copied parts, whose completion
        carries the condition."""
        headers = metadata_headers(metadata)
        condition = await self.if_absent_headers(key) if if_absent else {}
        if condition or headers is None or source.start or not 0 < source.length <= self.max_part_size:
            await super().copy(key, source, if_absent=if_absent, metadata=metadata)
            return
        try:
            _, after = await self.copy_request(key, {}, {"x-amz-metadata-directive": "REPLACE", **headers}, source)
        except SourceChangedError as exc:
            if exc.status is None:  # found after the copy: the object it made may hold other bytes
                await self.delete(key)
            raise
        if after.size != source.length:
            await self.delete(key)
            raise SourceChangedError(f"{self.client.errors.where(source.key)} is not {source.length} bytes (copy "
                                     "source)", key=source.key, backend="s3")

    async def copy_request(self, key: str, query: dict[str, str], headers: dict[str, str], source: CopySource
                           ) -> tuple[str, ObjectMeta]:
        """One copy onto ``key`` (CopyObject; UploadPartCopy with ``query``) from ``source``, conditional on its ETag:
        the ETag the answer names, and the source as it is once the copy is done. SourceChangedError when the server
        refused the condition (412), or, since some servers (moto) ignore it, when the source's ETag is another after
        the copy (no status)."""
        request = {"x-amz-copy-source": "/" + quote(f"{self.bucket}/{source.key}", safe="/~"),
                   "x-amz-copy-source-if-match": source.etag, **headers}
        try:
            resp = await self.client.send("PUT", key, query, request)
            if b"<Error>" in resp.body:  # a copy that failed after it began is answered 200
                raise self.client.errors.answer(resp, key, False)
        except StoreError as exc:
            if exc.status == 412:
                raise SourceChangedError(f"{self.client.errors.where(source.key)} is no longer ETag {source.etag} "
                                         "(copy source)", key=source.key, backend="s3", status=412) from exc
            raise
        after = await self.plain_head(source.key)
        if after is None or after.etag != source.etag:
            raise SourceChangedError(f"{self.client.errors.where(source.key)} changed while it was copied",
                                     key=source.key, backend="s3")
        return answer_fields(resp.body).get("ETag", ""), after

    async def if_absent_headers(self, key: str) -> dict[str, str]:
        """Request headers that make a PutObject or CompleteMultipartUpload of ``key`` create-if-absent.

        ``If-None-Match: *`` where the server honours it; in best-effort mode on servers that ignore it,
        a HEAD first (AlreadyExistsError when present; racy); otherwise StoreError.
        """
        honoured = await self.if_absent.check(
            endpoint=self.options.endpoint_url, shown=self.options.shown, bucket=self.bucket,
            where=self.client.errors.where(key), head=lambda: self.head(key), probe=lambda: self._probe(key))
        return {"If-None-Match": "*"} if honoured else {}

    async def _probe(self, key: str) -> bool:
        """Whether the server honours ``If-None-Match: *`` on a write (``conditional.probe``, beside ``key``)."""
        spare = posixpath.join(posixpath.dirname(key), f".fastckpt-probe-{secrets.token_hex(8)}")

        def unsupported(exc: StoreError) -> bool:
            return exc.status == 501 or getattr(exc.__cause__, "response", {}).get("Error", {}).get(
                "Code") in NO_CONDITIONAL

        return await probe(
            lambda cond: self.client.call("put_object", spare, if_absent=cond, Key=spare, Body=b"", ContentLength=0,
                                          **({"IfNoneMatch": "*"} if cond else {})),
            lambda: self.client.call("delete_object", spare, Key=spare), unsupported)

    async def delete(self, key: str) -> None:
        await self.delete_many([key])

    async def delete_many(self, keys: list[str]) -> None:
        """DeleteObjects, each object with its record (see ``delete_listed``)."""
        await self._delete([*keys, *(record_of(k) for k in keys if not self.is_hidden(k))])

    async def delete_listed(self, metas: list[ObjectMeta]) -> None:
        """DeleteObjects; the record only of an object that a multipart upload wrote (its ETag ends in '-N', or is
        unknown): no other has one (a stale record of an earlier version is an orphan ``gc`` removes)."""
        multipart = [m.key for m in metas if not m.etag or "-" in m.etag]
        await self._delete([*(m.key for m in metas), *(record_of(k) for k in multipart if not self.is_hidden(k))])

    async def _delete(self, doomed: list[str]) -> None:
        """DeleteObjects on the data path in batches of 1000 (``DELETE_BATCHES`` at once); the first per-key error
        is raised after all batches."""

        async def batch(i: int) -> list[dict[str, str]]:
            chunk = doomed[i : i + DELETE_BATCH]
            body = delete_body(chunk)
            if body is None:  # a key XML cannot carry: one DELETE each
                await gather_bounded([self.client.send("DELETE", k, {}, {}) for k in chunk], DELETE_BATCHES)
                return []
            headers = {"content-md5": base64.b64encode(hashlib.md5(body).digest()).decode(),
                       "content-type": "application/xml"}
            return delete_failures((await self.client.send("POST", "", {"delete": ""}, headers, body=body)).body)

        answers = await gather_bounded([batch(i) for i in range(0, len(doomed), DELETE_BATCH)], DELETE_BATCHES)
        failures = [f for errors in answers for f in errors]
        if failures:
            first = failures[0]
            code = first.get("Code", "")
            error = self.client.errors.service(403 if code == "AccessDenied" else 400, code,
                                               first.get("Message", ""), first.get("Key", ""), False)
            raise type(error)(f"{len(failures)} of {len(doomed)} deletes failed; first: {error}")

    async def create_multipart(
        self, key: str, part_size: int, metadata: dict[str, str] | None = None, *, if_absent: bool = False
    ) -> MultipartUpload:
        created = dict(metadata or {})
        marked = {**created, RECORD_MARK: "1"} if self.metadata_on_complete else created
        headers = metadata_headers(marked)
        if headers is None:  # metadata HTTP headers cannot carry as is: botocore encodes it
            resp = await self.client.call("create_multipart_upload", key, Key=key, Metadata=marked)
            return S3Upload(self, key, resp["UploadId"], if_absent, created)
        upload_id = answer_fields((await self.client.send("POST", key, {"uploads": ""}, headers)).body).get("UploadId")
        if not upload_id:
            raise StoreError(f"{self.client.errors.where(key)}: {self.options.shown} started a multipart upload "
                             "without naming it", key=key, backend="s3")
        return S3Upload(self, key, upload_id, if_absent, created)

    async def resume_multipart(self, key: str, upload_id: str, part_size: int, *,
                               if_absent: bool = False) -> MultipartUpload | None:
        """The open upload and its parts, from ListParts."""
        upload = S3Upload(self, key, upload_id, if_absent)
        params: dict[str, Any] = {"Key": key, "UploadId": upload_id, "MaxParts": 1000}
        try:
            while True:
                page = await self.client.call("list_parts", key, **params)
                for p in page.get("Parts", []):
                    index = int(p["PartNumber"]) - 1
                    upload.stored[index] = PartInfo(index, int(p["Size"]), p["ETag"])
                if not page.get("IsTruncated"):
                    return upload
                params["PartNumberMarker"] = page["NextPartNumberMarker"]
        except (NoSuchUpload, ObjectNotFoundError):
            return None

    async def list_pending_uploads(self, prefix: str = "") -> list[PendingUpload]:
        prefix = prefix.strip("/")
        params: dict[str, Any] = {"Prefix": prefix, "MaxUploads": self.page_size}
        found: list[PendingUpload] = []
        while True:
            page = await self.client.call("list_multipart_uploads", prefix, **params)
            for up in page.get("Uploads", []):
                if in_prefix(up["Key"], prefix):
                    started = up["Initiated"].timestamp() if up.get("Initiated") else 0.0
                    found.append(PendingUpload(up["Key"], up["UploadId"], started))
            if not page.get("IsTruncated"):
                return found
            params["KeyMarker"] = page.get("NextKeyMarker", "")
            params["UploadIdMarker"] = page.get("NextUploadIdMarker", "")

    async def abort_pending_upload(self, upload: PendingUpload) -> None:
        await self.abort_multipart(upload.key, upload.upload_id)

    async def abort_multipart(self, key: str, upload_id: str) -> None:
        """AbortMultipartUpload; one completed or aborted already is not an error."""
        with contextlib.suppress(NoSuchUpload):
            await self.client.send("DELETE", key, {"uploadId": upload_id}, {})
