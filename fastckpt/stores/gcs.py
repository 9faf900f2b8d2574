"""Google Cloud Storage backend on gcloud-aio-storage (``gs://bucket/prefix``).

Large objects are written as **parallel composite uploads**: each part is a temporary object under a
hidden prefix tied to the upload (``<dir>/.fastckpt-parts/<name>.<upload_id>/<index>.<nonce>``), and
``complete`` composes them (at most 32 sources per compose, in several levels when there are more)
into the target, setting its metadata, then deletes the temporaries. ``abort`` deletes everything
under the upload's prefix; ``list`` / ``list_dir`` never show it, ``list_pending_uploads`` finds it.

Create-if-absent uses ``ifGenerationMatch=0``, on uploads and on the final compose of a composite
upload. Some emulators (fake-gcs-server) ignore it on compose; ``FASTCKPT_GCS_IF_ABSENT`` decides what
happens there (modes in ``stores.conditional``; Google's own endpoint is trusted).

Every upload carries its CRC32C, which GCS checks;
the CRC32C the server reports back is compared too, so an emulator that does not check is covered.

Metadata, listing and deletes go through ``gcloud.aio.storage.Storage``; composes are sent on its
session directly (the client sets neither metadata nor preconditions on compose). Ranged reads and
uploads go through the shared HTTP data path (``fastckpt.http``) with the client's token: a read lands
in the caller's buffer, an upload is sent from it.

Endpoint: ``?endpoint_override=`` in the URI, else ``STORAGE_EMULATOR_HOST``, else
https://storage.googleapis.com. Credentials come the usual way (``GOOGLE_APPLICATION_CREDENTIALS``,
gcloud's application-default file, the GCE metadata server) through gcloud-aio-auth; they are skipped
for ``STORAGE_EMULATOR_HOST``, for plain-http endpoints and with ``?anonymous=true``.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import logging
import os
import re
import secrets
import socket
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar
from urllib.parse import quote, urlsplit

import aiohttp
import google_crc32c
from gcloud.aio.auth import Token
from gcloud.aio.storage import Storage

from ..config import TransferConfig
from ..errors import AccessDeniedError, AlreadyExistsError, ObjectNotFoundError, StoreError, TransientStoreError
from ..http import HttpClient, Response
from ..tasks import gather_bounded
from ..transport import Buffer
from ..uri import StorageURI, check_options
from .base import ListPage, MultipartUpload, ObjectMeta, PartInfo, PendingUpload, ReceivingStore, in_prefix
from .classify import ErrorTable, classify, unreachable
from .conditional import IfAbsentGuard

if TYPE_CHECKING:
    from ..transport import Receiver

T = TypeVar("T")
log = logging.getLogger("fastckpt")

DEFAULT_ENDPOINT = "https://storage.googleapis.com"
SCOPES = ["https://www.googleapis.com/auth/devstorage.read_write"]
PARTS_DIR = ".fastckpt-parts"
COMPOSE_LIMIT = 32
"""Most source objects GCS accepts in one compose request."""
CONTENT_TYPE = "application/octet-stream"
PARALLEL = 16
"""Composes and deletes in flight at once."""
_PART_RE = re.compile(r"^(?P<dir>(?:.*/)?)" + re.escape(PARTS_DIR) + r"/(?P<name>[^/]+)\.(?P<id>[0-9a-f]+)/[^/]+$")
ERRORS = ErrorTable("gcs", bucket_missing=frozenset({"noSuchBucket"}), conflict=frozenset({"conditionNotMet"}),
                    transient=frozenset({"crc32cMismatch"}))
"""fake codes: GCS's JSON errors carry reasons, not codes; the two that matter are derived in ``_call``."""
_CRC_OFF_LOOP = 1 << 20
_CRC_STEP = 4 << 20


def parts_prefix(key: str, upload_id: str) -> str:
    """Hidden prefix (ending in '/') of the temporary part objects of upload ``upload_id`` of ``key``."""
    head, _, name = key.rpartition("/")
    return f"{head}/{PARTS_DIR}/{name}.{upload_id}/" if head else f"{PARTS_DIR}/{name}.{upload_id}/"


def _crc32c_sync(data: memoryview) -> str:
    crc = 0
    for i in range(0, len(data), _CRC_STEP):  # google_crc32c takes only immutable buffers: copy in steps
        crc = google_crc32c.extend(crc, bytes(data[i : i + _CRC_STEP]))
    return base64.b64encode(crc.to_bytes(4, "big")).decode()


async def crc32c(data: memoryview) -> str:
    """Base64 of the big-endian CRC32C of ``data``, as GCS reports it (large buffers off the loop)."""
    if len(data) < _CRC_OFF_LOOP:
        return _crc32c_sync(data)
    return await asyncio.get_running_loop().run_in_executor(None, _crc32c_sync, data)


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


def _server_message(body: str) -> str:
    """The ``error.message`` of a GCS JSON error body, else the body; on one line."""
    try:
        message = json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = body
    return " ".join(str(message).split())[:300] or "no details"


class _HTTPStatus(Exception):
    """A non-2xx answer to a request sent on the session directly."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


class GCSUpload(MultipartUpload):
    """A parallel composite upload: parts are temporary objects composed on ``complete``."""

    def __init__(self, store: GCSStore, key: str, metadata: dict[str, str], if_absent: bool,
                 upload_id: str | None = None) -> None:
        self.key, self.upload_id = key, upload_id or secrets.token_hex(8)
        self._store, self._metadata, self._if_absent = store, metadata, if_absent
        self.prefix = parts_prefix(key, self.upload_id)
        self._parts: dict[int, tuple[str, int]] = {}
        """index -> (temporary object, size) of the part stored last; a retried part gets a new name, so a
        cancelled attempt's late clean-up never deletes its successor."""
        self._cleanups: set[asyncio.Future[None]] = set()
        self._closed = False
        self.stored: dict[int, PartInfo] = {}

    def _check_open(self) -> None:
        if self._closed:
            raise StoreError(f"composite upload of {self._store.url(self.key)} is no longer active")

    async def put_part(self, index: int, data: Buffer) -> PartInfo:
        self._check_open()
        name = f"{self.prefix}{index}.{secrets.token_hex(4)}"
        with memoryview(data) as raw, raw.cast("B") as view:  # released: the caller's buffer goes back to a pool
            size = len(view)
            try:
                await self._store.upload_object(name, view)
            except asyncio.CancelledError:
                # The whole body may have been sent: the server can still store the part after this; delete it
                # (``abort`` waits for these deletions before clearing the prefix).
                cleanup = asyncio.ensure_future(self._store.delete_quietly([name]))
                self._cleanups.add(cleanup)
                cleanup.add_done_callback(self._cleanups.discard)
                raise
        if self._closed:  # aborted meanwhile: leave nothing behind
            await self._store.delete(name)
            self._check_open()
        replaced = self._parts.get(index)
        self._parts[index] = (name, size)
        if replaced:
            await self._store.delete_quietly([replaced[0]])
        return PartInfo(index, size, name)

    async def complete(self, parts: list[PartInfo], metadata: dict[str, str] | None = None) -> None:
        self._check_open()
        indexes = [p.index for p in parts]
        if indexes != list(range(len(parts))) or any(i not in self._parts for i in indexes):
            raise StoreError(f"composite upload of {self._store.url(self.key)}: parts {indexes} "
                             "are not 0..n-1 as uploaded")
        meta = metadata or self._metadata
        if not parts:
            await self._store.put(self.key, b"", metadata=meta, if_absent=self._if_absent)
        else:
            sources, level, temps = [self._parts[i][0] for i in indexes], 0, []
            while len(sources) > COMPOSE_LIMIT:
                groups = [sources[i : i + COMPOSE_LIMIT] for i in range(0, len(sources), COMPOSE_LIMIT)]
                names = [f"{self.prefix}c{level}-{j}" for j in range(len(groups))]
                await gather_bounded([self._store.compose(n, g) for n, g in zip(names, groups, strict=True)], PARALLEL)
                temps += names
                sources, level = names, level + 1
            if self._if_absent:
                await self._store.check_compose_if_absent(self.key)
            result = await self._store.compose(self.key, sources, meta, if_absent=self._if_absent)
            expected = sum(self._parts[i][1] for i in indexes)
            if int(result.get("size", expected)) != expected:
                raise StoreError(f"compose of {self._store.url(self.key)} made {result.get('size')} bytes, "
                                 f"its parts hold {expected}")
            await self._store.delete_quietly([name for name, _ in self._parts.values()] + temps)
        self._closed = True

    async def abort(self) -> None:
        self._closed = True
        if self._cleanups:
            await asyncio.gather(*self._cleanups, return_exceptions=True)
        await self._store.delete_prefix(self.prefix)


class GCSStore(ReceivingStore):
    """Objects of one GCS bucket; keys are object names."""

    name = "gcs"
    scheme = "gs"
    min_part_size = 1
    max_part_size = 5 << 30
    max_parts = 10_000

    def __init__(self, bucket: str, options: GCSOptions | None = None, *, max_connections: int = 64) -> None:
        self.bucket = bucket
        self.options = options = options or GCSOptions()
        self.compose_if_absent = IfAbsentGuard(options.if_absent_mode, "FASTCKPT_GCS_IF_ABSENT",
                                               "ifGenerationMatch=0 on compose")
        self.endpoint, self.anonymous = options.endpoint, options.anonymous
        self._max_connections = max_connections
        self._http: aiohttp.ClientSession | None = None
        self._data: HttpClient | None = None
        """The HTTP data path (``fastckpt.http``): ranged reads and uploads, from and into pooled buffers."""
        self._client: Storage | None = None
        self._token: Token | None = None
        self._had_token = False
        self._bucket_exists = False
        self._connected = False
        self._timeout = aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=300)

    def url(self, key: str = "") -> str:
        """``gs://bucket/key`` for messages."""
        return f"gs://{self.bucket}/{key}"

    # ----------------------------------------------------------------------------- plumbing

    def _storage(self) -> Storage:
        """The gcloud-aio-storage client and its session, made on first use inside the running loop."""
        if self._client is None:
            if self._http is None:
                self._http = aiohttp.ClientSession(
                    connector=aiohttp.TCPConnector(limit=self._max_connections), timeout=self._timeout)
            try:
                if not self.anonymous:
                    self._token = Token(session=self._http, scopes=SCOPES)
                # anonymous: the client's unused Token gets empty credentials, so no credentials file is read
                self._client = Storage(session=self._http, token=self._token, api_root=self.endpoint,
                                       api_is_dev=self.anonymous,
                                       service_file=io.StringIO("{}") if self.anonymous else None)
            except (OSError, ValueError, KeyError) as exc:
                raise self._credentials_error(exc) from exc
        return self._client

    def _credentials_error(self, exc: BaseException) -> AccessDeniedError:
        reason = " ".join(str(exc).split())[:300] or type(exc).__name__
        return AccessDeniedError(
            f"cannot get GCS credentials for {self.url()} (endpoint {self.endpoint}): {reason}; set "
            "GOOGLE_APPLICATION_CREDENTIALS, run where the metadata server answers, or use ?anonymous=true")

    async def _headers(self) -> dict[str, str]:
        """Authorization header (none when anonymous)."""
        self._storage()
        if self._token is None:
            return {}
        try:
            token = await self._token.get()
        except aiohttp.ClientResponseError as exc:
            if self._had_token and (exc.status >= 500 or exc.status == 429):
                raise TransientStoreError(f"GCS token refresh for {self.url()}: HTTP {exc.status}") from exc
            raise self._credentials_error(exc) from exc
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            if self._had_token:
                raise TransientStoreError(f"GCS token refresh for {self.url()}: {exc!r}") from exc
            raise self._credentials_error(exc) from exc
        except Exception as exc:  # a malformed key file fails anywhere in the JWT stack
            raise self._credentials_error(exc) from exc
        self._had_token = True
        return {"Authorization": f"Bearer {token}"}

    async def _call(self, what: str, op: Callable[[Storage, dict[str, str]], Awaitable[T]], *, key: str | None = None,
                    if_absent: bool = False) -> T:
        """Run ``op(client, headers)``, turning HTTP and connection failures into fastckpt errors."""
        headers = await self._headers()
        try:
            result = await op(self._storage(), headers)
        except (aiohttp.ClientResponseError, _HTTPStatus) as exc:
            self._connected = True
            message = exc.message if isinstance(exc, _HTTPStatus) else _server_message(exc.message)
            code = "crc32cMismatch" if exc.status == 400 and "crc32c" in message.lower() else ""
            if exc.status == 404 and not self._bucket_exists and await self._bucket_missing():
                code = "noSuchBucket"
            auth = "anonymous" if self.anonymous else "with the credentials found"
            raise classify(ERRORS, exc.status, code, place=what, bucket=f"GCS bucket {self.bucket!r}",
                           at=f" at {self.endpoint}", key=key, detail=message, if_absent=if_absent,
                           denied_hint=f"{auth}: {message}") from exc
        except (aiohttp.ClientError, asyncio.TimeoutError, ConnectionError, socket.gaierror) as exc:
            detail = " ".join(str(exc).split()) or type(exc).__name__
            raise unreachable("GCS", self.endpoint, what, detail, key=key, first_contact=not self._connected and
                              isinstance(exc, (aiohttp.ClientConnectorError, ConnectionRefusedError,
                                               socket.gaierror))) from exc
        self._connected = True
        return result

    async def _bucket_missing(self) -> bool:
        """Whether the bucket is absent (a 404 then names the bucket, not the object)."""
        try:
            await self._storage().get_bucket_metadata(self.bucket, headers=await self._headers(),
                                                      timeout=self._timeout)  # type: ignore[arg-type]
        except aiohttp.ClientResponseError as exc:
            return exc.status == 404
        except (aiohttp.ClientError, asyncio.TimeoutError):
            return False
        self._bucket_exists = True
        return False

    async def _data_request(self, method: str, path: str, headers: dict[str, str], **kwargs: Any) -> Response:
        """A request on the HTTP data path (``path`` below the endpoint, with its query); an error answer (other
        than 416) raises _HTTPStatus, for ``_call`` to classify."""
        if self._data is None:
            parts = urlsplit(self.endpoint)
            self._data = HttpClient(f"{parts.scheme}://{parts.netloc}", limit=self._max_connections)
        resp = await self._data.request(method, urlsplit(self.endpoint).path + path, headers, **kwargs)
        if resp.status >= 300 and resp.status != 416:
            raise _HTTPStatus(resp.status, _server_message(resp.body.decode("utf-8", "replace")))
        return resp

    async def _send(self, method: str, url: str, **kwargs: Any) -> dict[str, Any]:
        """A request on the session; the JSON answer, or _HTTPStatus."""
        async with self._http.request(method, url, **kwargs) as resp:  # type: ignore[union-attr]
            if resp.status >= 300:
                raise _HTTPStatus(resp.status, _server_message(await resp.text(errors="replace")))
            return await resp.json(content_type=None)

    def _object_url(self, key: str) -> str:
        return f"{self.endpoint}/storage/v1/b/{self.bucket}/o/{quote(key, safe='')}"

    def _meta(self, item: dict[str, Any]) -> ObjectMeta:
        return ObjectMeta(item["name"], int(item.get("size", 0)), _parse_time(item.get("updated")),
                          item.get("etag"), dict(item.get("metadata") or {}))

    # ----------------------------------------------------------------------------- writes

    async def upload_object(
        self, key: str, data: memoryview, metadata: dict[str, str] | None = None, *,
        if_absent: bool = False, crc: str | None = None,
    ) -> dict[str, Any]:
        """One multipart/related upload of ``data`` (sent from the caller's buffer) with its CRC32C.

        ``crc`` overrides the computed CRC32C (tests); a CRC32C the server reports differently makes the
        object be deleted and a TransientStoreError be raised.
        """
        crc = crc or await crc32c(data)
        resource = {"name": key, "contentType": CONTENT_TYPE, "crc32c": crc, "metadata": metadata or {}}
        boundary = secrets.token_hex(16)
        head = (f"--{boundary}\r\nContent-Type: application/json; charset=UTF-8\r\n\r\n"
                f"{json.dumps(resource)}\r\n--{boundary}\r\nContent-Type: {CONTENT_TYPE}\r\n\r\n").encode()
        tail = f"\r\n--{boundary}--\r\n".encode()
        query = "uploadType=multipart" + ("&ifGenerationMatch=0" if if_absent else "")
        what = self.url(key)

        async def send(_: Storage, headers: dict[str, str]) -> dict[str, Any]:
            headers = {**headers, "Content-Type": f"multipart/related; boundary={boundary}"}
            resp = await self._data_request("POST", f"/upload/storage/v1/b/{self.bucket}/o?{query}", headers,
                                            body=[head, data, tail])
            return json.loads(resp.body)

        result = await self._call(what, send, key=key, if_absent=if_absent)
        if result.get("crc32c") not in (None, crc):
            generation = result.get("generation")
            await self._call(what, lambda c, h: c.delete(
                self.bucket, key, headers=h, timeout=self._timeout,  # type: ignore[arg-type]
                params={"ifGenerationMatch": str(generation)} if generation else None))
            raise TransientStoreError(f"{what}: CRC32C mismatch (sent {crc}, stored {result['crc32c']}); "
                                      "the object was removed")
        return result

    async def compose(self, key: str, sources: list[str], metadata: dict[str, str] | None = None, *,
                      if_absent: bool = False) -> dict[str, Any]:
        """Compose up to 32 ``sources`` (in order) into ``key`` with ``metadata`` (``ifGenerationMatch=0``
        with ``if_absent``)."""
        payload = {"sourceObjects": [{"name": s} for s in sources],
                   "destination": {"contentType": CONTENT_TYPE, "metadata": metadata or {}}}
        params = {"ifGenerationMatch": "0"} if if_absent else None

        async def send(_: Storage, headers: dict[str, str]) -> dict[str, Any]:
            return await self._send("POST", f"{self._object_url(key)}/compose", headers=headers, json=payload,
                                    params=params)

        return await self._call(self.url(key), send, key=key, if_absent=if_absent)

    async def check_compose_if_absent(self, key: str) -> None:
        """Make a create-if-absent compose of ``key`` safe (``stores.conditional``): return to compose with
        ``ifGenerationMatch=0`` (or, in best-effort mode, when a HEAD found ``key`` absent); raise otherwise."""
        await self.compose_if_absent.check(
            endpoint=None if self.endpoint == DEFAULT_ENDPOINT else self.endpoint, shown=self.endpoint,
            bucket=self.bucket, where=self.url(key), probe=lambda: self._probe_compose(key),
            head=lambda: self.head(key))

    async def _probe_compose(self, key: str) -> bool:
        """Whether a compose onto an existing throw-away object with ``ifGenerationMatch=0`` is refused."""
        probe = f"{key.rsplit('/', 1)[0] + '/' if '/' in key else ''}{PARTS_DIR}/probe.{secrets.token_hex(8)}/0"
        await self.put(probe, b"")
        try:
            await self.compose(probe, [probe], if_absent=True)
            return False
        except AlreadyExistsError:
            return True
        finally:
            await self.delete_quietly([probe])

    async def put(
        self, key: str, data: Buffer, *, if_absent: bool = False, metadata: dict[str, str] | None = None
    ) -> None:
        with memoryview(data) as raw, raw.cast("B") as view:
            await self.upload_object(key, view, metadata, if_absent=if_absent)

    async def create_multipart(
        self, key: str, part_size: int, metadata: dict[str, str] | None = None, *, if_absent: bool = False
    ) -> MultipartUpload:
        return GCSUpload(self, key, dict(metadata or {}), if_absent)

    async def resume_multipart(self, key: str, upload_id: str, part_size: int, *,
                               if_absent: bool = False) -> MultipartUpload | None:
        """The upload's temporary part objects, listed (a part stored twice keeps one copy)."""
        if not re.fullmatch(r"[0-9a-f]{16}", upload_id):
            return None
        upload = GCSUpload(self, key, {}, if_absent, upload_id)
        extra = []
        async for page in self._pages(upload.prefix):
            for meta in page.objects:
                index = meta.key[len(upload.prefix):].split(".", 1)[0]
                if not index.isdigit() or int(index) in upload.stored:
                    extra.append(meta.key)
                    continue
                upload._parts[int(index)] = (meta.key, meta.size)
                upload.stored[int(index)] = PartInfo(int(index), meta.size, meta.key)
        await self.delete_quietly(extra)
        return upload

    async def delete(self, key: str) -> None:
        try:
            await self._call(self.url(key), lambda c, h: c.delete(
                self.bucket, key, headers=h, timeout=self._timeout), key=key)  # type: ignore[arg-type]
        except ObjectNotFoundError:
            if not self._bucket_exists:
                raise

    async def delete_many(self, keys: list[str]) -> None:
        await gather_bounded([self.delete(k) for k in keys], PARALLEL)

    async def delete_quietly(self, keys: list[str]) -> None:
        """Delete ``keys``; failures are logged (gc finds leftovers through list_pending_uploads)."""
        try:
            await self.delete_many(keys)
        except StoreError as exc:
            log.warning("could not delete temporary parts in %s: %s", self.url(), exc)

    async def delete_prefix(self, prefix: str) -> None:
        """Delete every object whose name starts with ``prefix``, hidden ones included."""
        await self.delete_many([m.key async for page in self._pages(prefix) for m in page.objects])

    # ----------------------------------------------------------------------------- reads

    async def head(self, key: str) -> ObjectMeta:
        item = await self._call(self.url(key), lambda c, h: c.download_metadata(
            self.bucket, key, headers=h, timeout=self._timeout), key=key)  # type: ignore[arg-type]
        return self._meta(item)

    async def receive(self, key: str, start: int, length: int, into: Receiver) -> int:
        """One ranged media GET on the HTTP data path, its body received straight by ``into``."""
        if not length:
            return 0
        headers = {"Range": f"bytes={start}-{start + length - 1}", "Accept-Encoding": "identity"}
        path = f"/storage/v1/b/{self.bucket}/o/{quote(key, safe='')}?alt=media"

        async def read(_: Storage, auth: dict[str, str]) -> int:
            resp = await self._data_request("GET", path, {**auth, **headers}, into=into)
            if resp.status == 416:  # start at or past the end
                return 0
            if resp.status == 200 and start:
                raise StoreError(f"{self.url(key)}: {self.endpoint} ignored the Range header")
            return resp.received

        return await self._call(self.url(key), read, key=key)

    async def list_page(self, prefix: str, delimiter: str | None = None, token: str | None = None) -> ListPage:
        """One objects.list request."""
        params = {"prefix": prefix, "maxResults": "1000"}
        if delimiter:
            params["delimiter"] = delimiter
        if token:
            params["pageToken"] = token
        page = await self._call(f"listing of {self.url(prefix)}", lambda c, h: c.list_objects(
            self.bucket, params=params, headers=h, timeout=self._timeout))  # type: ignore[arg-type]
        return ListPage([self._meta(i) for i in page.get("items", [])], list(page.get("prefixes", [])),
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
                    match = _PART_RE.match(meta.key)
                    if match and in_prefix(match["dir"] + match["name"], base):
                        ident = (match["dir"] + match["name"], match["id"])
                        found[ident] = min(found.get(ident, meta.mtime), meta.mtime)
        return [PendingUpload(key, upload_id, started) for (key, upload_id), started in sorted(found.items())]

    async def abort_pending_upload(self, upload: PendingUpload) -> None:
        await self.delete_prefix(parts_prefix(upload.key, upload.upload_id))

    async def close(self) -> None:
        if self._data is not None:
            await self._data.close()
            self._data = None
        if self._http is not None:
            await self._http.close()
        self._http = self._client = self._token = None


@dataclass(frozen=True)
class GCSOptions:
    """How to reach GCS: from the URI's options (``QUERY``; ``project`` is accepted, object requests do
    not need it) and the environment (``STORAGE_EMULATOR_HOST``, ``FASTCKPT_GCS_IF_ABSENT``)."""

    QUERY: ClassVar[frozenset[str]] = frozenset({"endpoint_override", "project", "anonymous"})
    endpoint: str = DEFAULT_ENDPOINT
    anonymous: bool = False
    """Send no credentials (the default for an emulator and for plain-http endpoints)."""
    project: str | None = None
    if_absent_mode: str = "auto"

    @classmethod
    def from_uri(cls, uri: StorageURI, env: Mapping[str, str] = os.environ) -> GCSOptions:
        """The options ``uri`` and ``env`` give; ValueError for a bad option or endpoint."""
        opts = check_options(uri, cls.QUERY)
        endpoint = opts.get("endpoint_override") or None
        if endpoint and not re.match(r"^https?://", endpoint):
            raise ValueError(f"GCS endpoint_override {endpoint!r} must start with http:// or https://")
        emulator = env.get("STORAGE_EMULATOR_HOST", "").strip()
        from_emulator = not endpoint and bool(emulator)
        if from_emulator:
            endpoint = emulator if "://" in emulator else f"http://{emulator}"
        endpoint = (endpoint or DEFAULT_ENDPOINT).rstrip("/")
        anonymous = uri.flag("anonymous")
        return cls(endpoint, from_emulator or endpoint.startswith("http://") if anonymous is None else anonymous,
                   opts.get("project") or None, env.get("FASTCKPT_GCS_IF_ABSENT", "auto").strip().lower())

    def query(self) -> dict[str, str]:
        """URI options that give these options back (with the same environment)."""
        pairs = {"endpoint_override": None if self.endpoint == DEFAULT_ENDPOINT else self.endpoint,
                 "anonymous": str(self.anonymous).lower(), "project": self.project}
        return {k: v for k, v in pairs.items() if v}


def from_uri(uri: StorageURI, config: TransferConfig) -> GCSStore:
    """Store for ``gs://bucket/...``, configured by ``GCSOptions``."""
    return GCSStore(uri.bucket, GCSOptions.from_uri(uri), max_connections=max(64, 2 * config.max_in_flight))
