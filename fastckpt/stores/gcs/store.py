"""``GCSStore``: the store protocol on one GCS bucket (requests through ``GCSClient``)."""

from __future__ import annotations

import json
import logging
import re
import secrets
from datetime import datetime, timezone
from typing import Any
from urllib.parse import quote, urlencode

from ...errors import AlreadyExistsError, CopyUnsupportedError, ObjectNotFoundError, SourceChangedError, StoreError
from ...tasks import gather_bounded
from ...transport import Buffer, Receiver
from ..base import CopySource, ListPage, NamedUploadStore, ObjectMeta, PendingUpload, in_prefix
from ..conditional import IfAbsentGuard, probe
from ..datapath import ranged
from .client import GCSClient
from .options import DEFAULT_ENDPOINT, GCSOptions
from .upload import PARALLEL, PART_RE, PARTS_DIR, GCSUpload, parts_prefix

__all__ = ["GCSStore"]

log = logging.getLogger("fastckpt")


def _parse_time(text: str | None) -> float:
    """Seconds since the epoch of an RFC 3339 time such as ``2024-05-01T10:00:00.12345Z``."""
    if not text:
        return 0.0
    match = re.match(r"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(?:\.(\d+))?(Z|[+-]\d\d:\d\d)?$", text)
    if not match:
        return 0.0
    zone = match[3] if match[3] and match[3] != "Z" else "+00:00"
    stamp = datetime.fromisoformat(match[1] + zone).astimezone(timezone.utc).timestamp()
    return stamp + float("0." + match[2]) if match[2] else stamp


def _meta(item: dict[str, Any]) -> ObjectMeta:
    """An object resource as ObjectMeta; its version (``etag``) is its generation: what a copy is conditional on."""
    version = item.get("generation") or item.get("etag")
    return ObjectMeta(item["name"], int(item.get("size", 0)), _parse_time(item.get("updated")),
                      str(version) if version else None, dict(item.get("metadata") or {}))


class GCSStore(NamedUploadStore):
    """Objects of one GCS bucket; keys are object names."""

    name = "gcs"
    scheme = "gs"
    min_part_size = 1
    max_part_size = 5 << 30
    max_parts = 10_000
    upload_type = GCSUpload
    upload_ids = re.compile(r"[0-9a-f]{16}")

    def __init__(self, bucket: str, options: GCSOptions | None = None, *, max_connections: int = 64) -> None:
        self.bucket = bucket
        self.options = options = options or GCSOptions()
        self.client = GCSClient(bucket, options, max_connections=max_connections)
        self.compose_if_absent = IfAbsentGuard(options.if_absent_mode, "FASTCKPT_GCS_IF_ABSENT",
                                               "ifGenerationMatch=0 on compose")

    async def close(self) -> None:
        await self.client.close()

    # ----------------------------------------------------------------------------- writes

    async def check_compose_if_absent(self, key: str) -> None:
        """Make a create-if-absent compose of ``key`` safe (``stores.conditional``): return to compose with
        ``ifGenerationMatch=0`` (or, in best-effort mode, when a HEAD found ``key`` absent); raise otherwise."""
        endpoint = self.options.endpoint
        await self.compose_if_absent.check(
            endpoint=None if endpoint == DEFAULT_ENDPOINT else endpoint, shown=endpoint, bucket=self.bucket,
            where=self.client.url(key), head=lambda: self.head(key), probe=lambda: self._probe(key))

    async def _probe(self, key: str) -> bool:
        """Whether the server refuses a compose onto an existing object with ``ifGenerationMatch=0``
        (``conditional.probe``, beside ``key``)."""
        spare = f"{key.rsplit('/', 1)[0] + '/' if '/' in key else ''}{PARTS_DIR}/probe.{secrets.token_hex(8)}/0"
        return await probe(
            lambda cond: self.client.compose(spare, [spare], if_absent=True) if cond else self.put(spare, b""),
            lambda: self.delete(spare))

    async def put(
        self, key: str, data: Buffer, *, if_absent: bool = False, metadata: dict[str, str] | None = None
    ) -> None:
        with memoryview(data) as raw, raw.cast("B") as view:
            await self.client.upload_object(key, view, metadata, if_absent=if_absent)

    async def find_parts(self, upload: GCSUpload) -> None:
        """The upload's temporary part objects, listed (a part stored twice keeps one copy)."""
        extra = []
        async for page in self._pages(upload.prefix):
            for meta in page.objects:
                index = meta.key[len(upload.prefix):].split(".", 1)[0]
                if not index.isdigit() or not upload.adopt(int(index), meta.key, meta.size):
                    extra.append(meta.key)
        await self.delete_quietly(extra)

    async def delete(self, key: str) -> None:
        try:
            await self.client.call(self.client.url(key), lambda c, h: c.delete(
                self.bucket, key, headers=h, params=self.options.controls.params(),
                timeout=self.client.timeout), key=key)  # type: ignore[arg-type]
        except ObjectNotFoundError:
            if not self.client.bucket_exists:
                raise

    async def delete_many(self, keys: list[str]) -> None:
        await gather_bounded([self.delete(k) for k in keys], PARALLEL)

    async def delete_quietly(self, keys: list[str]) -> None:
        """Delete ``keys``; failures are logged (gc finds leftovers through list_pending_uploads)."""
        try:
            await self.delete_many(keys)
        except StoreError as exc:
            log.warning("could not delete temporary parts in %s: %s", self.client.url(), exc)

    async def delete_prefix(self, prefix: str) -> None:
        """Delete every object whose name starts with ``prefix``, hidden ones included."""
        await self.delete_many([m.key async for page in self._pages(prefix) for m in page.objects])

    # ----------------------------------------------------------------------------- reads

    async def head(self, key: str) -> ObjectMeta:
        """objects.get of the metadata on the HTTP data path (the SDK's takes no ``userProject``)."""
        controls, where = self.options.controls, self.client.url(key)
        path = f"/storage/v1/b/{self.bucket}/o/{quote(key, safe='')}"
        if params := controls.params():
            path += "?" + urlencode(params)

        async def get(_: Any, auth: dict[str, str]) -> dict[str, Any]:
            resp = await self.client.data_request("GET", path, {**auth, **controls.headers()}, what=where, key=key)
            return json.loads(resp.body)

        return _meta(await self.client.call(where, get, key=key))

    async def copy(self, key: str, source: CopySource, *, if_absent: bool = False,
                   metadata: dict[str, str] | None = None) -> None:
        """A compose of one source object (whole objects only), conditional on its generation. GCS answers 412 for
        a destination that exists (``if_absent``) and for a source of another generation alike: the destination
        tells which."""
        found = await self.head(source.key)
        if found.etag != source.etag:
            raise SourceChangedError(f"{self.client.url(source.key)} is generation {found.etag}, not {source.etag} "
                                     "(copy source)", key=source.key, backend="gcs")
        if source.start or source.length != found.size:
            raise CopyUnsupportedError(f"GCS copies whole objects only, not {source.start}+{source.length} of "
                                       f"{self.client.url(source.key)}", key=source.key, backend="gcs")
        if if_absent:
            await self.check_compose_if_absent(key)
        try:
            await self.client.compose(key, [source.key], metadata, if_absent=if_absent, generations=[source.etag])
        except StoreError as exc:
            if exc.status != 412 and not isinstance(exc, AlreadyExistsError):
                raise
            if if_absent and await self.exists(key):
                raise AlreadyExistsError(f"{self.client.url(key)} already exists", key=key, backend="gcs",
                                         status=412) from exc
            raise SourceChangedError(f"{self.client.url(source.key)} is no longer generation {source.etag} "
                                     "(copy source)", key=source.key, backend="gcs", status=412) from exc

    async def receive(self, key: str, start: int, length: int, into: Receiver) -> int:
        """One ranged media GET on the HTTP data path, its body received straight by ``into``."""
        if not length:
            return 0
        headers = {"Range": f"bytes={start}-{start + length - 1}", "Accept-Encoding": "identity"}
        controls = self.options.controls
        path = f"/storage/v1/b/{self.bucket}/o/{quote(key, safe='')}?{urlencode({'alt': 'media', **controls.params()})}"
        where = self.client.url(key)

        async def read(_: Any, auth: dict[str, str]) -> int:
            resp = await self.client.data_request("GET", path, {**auth, **headers, **controls.headers()}, what=where,
                                                  key=key, into=into)
            return ranged(resp, start, where, self.options.endpoint)

        return await self.client.call(where, read, key=key)

    async def list_page(self, prefix: str, delimiter: str | None = None, token: str | None = None) -> ListPage:
        """One objects.list request."""
        params = {"prefix": prefix, "maxResults": "1000", **self.options.controls.params()}
        if delimiter:
            params["delimiter"] = delimiter
        if token:
            params["pageToken"] = token
        page = await self.client.call(f"listing of {self.client.url(prefix)}", lambda c, h: c.list_objects(
            self.bucket, params=params, headers=h, timeout=self.client.timeout))  # type: ignore[arg-type]
        return ListPage([_meta(i) for i in page.get("items", [])], list(page.get("prefixes", [])),
                        page.get("nextPageToken") or None)

    def is_hidden(self, key: str) -> bool:
        """Temporary parts of composite uploads."""
        return f"/{PARTS_DIR}/" in f"/{key}"

    # ----------------------------------------------------------------------------- gc

    async def list_pending_uploads(self, prefix: str = "") -> list[PendingUpload]:
        base = prefix.strip("/")
        scans = [base + "/" if base else ""]
        if base:  # parts of an upload to ``base`` itself live beside it
            head, _, name = base.rpartition("/")
            scans.append(f"{head}/{PARTS_DIR}/{name}." if head else f"{PARTS_DIR}/{name}.")
        found: dict[tuple[str, str], float] = {}
        for scan in scans:
            async for page in self._pages(scan):
                for meta in page.objects:
                    match = PART_RE.match(meta.key)
                    if match and in_prefix(match["dir"] + match["name"], base):
                        ident = (match["dir"] + match["name"], match["id"])
                        found[ident] = min(found.get(ident, meta.mtime), meta.mtime)
        return [PendingUpload(key, upload_id, started) for (key, upload_id), started in sorted(found.items())]

    async def abort_pending_upload(self, upload: PendingUpload) -> None:
        await self.delete_prefix(parts_prefix(upload.key, upload.upload_id))
