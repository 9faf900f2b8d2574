"""How one store talks to GCS: gcloud-aio-storage (metadata, listing, deletes) and its session (composes, which the
client sends without metadata or preconditions), the shared HTTP data path (ranged reads and uploads, with the
client's token), credentials through gcloud-aio-auth, and one translation of every failure into a fastckpt error.

Every upload carries its CRC32C, which GCS checks; the CRC32C the server reports back is compared too, so an
emulator that does not check is covered.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import secrets
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar
from urllib.parse import quote, urlencode, urlsplit

import aiohttp
import google_crc32c
from gcloud.aio.auth import Token
from gcloud.aio.storage import Storage

from ...errors import AccessDeniedError, TransientStoreError
from ...http import Response
from ...threads import off_loop
from ..classify import ErrorTable, classify, unreachable
from ..datapath import DataPath, counting_trace
from .options import GCSOptions

__all__ = ["CONTENT_TYPE", "ERRORS", "SCOPES", "GCSClient", "HTTPStatus", "crc32c", "server_message"]

T = TypeVar("T")
SCOPES = ["https://www.googleapis.com/auth/devstorage.read_write"]
CONTENT_TYPE = "application/octet-stream"
ERRORS = ErrorTable("gcs", bucket_missing=frozenset({"noSuchBucket"}), conflict=frozenset({"conditionNotMet"}),
                    transient=frozenset({"crc32cMismatch"}))
"""fake codes: GCS's JSON errors carry reasons, not codes; the two that matter are derived in ``call``."""
_CRC_OFF_LOOP = 1 << 20
_CRC_STEP = 4 << 20


def _crc32c_sync(data: memoryview) -> str:
    crc = 0
    for i in range(0, len(data), _CRC_STEP):  # google_crc32c takes only immutable buffers: copy in steps
        crc = google_crc32c.extend(crc, bytes(data[i : i + _CRC_STEP]))
    return base64.b64encode(crc.to_bytes(4, "big")).decode()


async def crc32c(data: memoryview) -> str:
    """Base64 of the big-endian CRC32C of ``data``, as GCS reports it (large buffers off the loop)."""
    return _crc32c_sync(data) if len(data) < _CRC_OFF_LOOP else await off_loop(_crc32c_sync, data)


def server_message(body: str) -> str:
    """The ``error.message`` of a GCS JSON error body, else the body; on one line."""
    try:
        message = json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = body
    return " ".join(str(message).split())[:300] or "no details"


class HTTPStatus(Exception):
    """A non-2xx answer to a request sent on the data path or the session directly."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


class GCSClient:
    """The connections of one bucket's store; made on first use, inside the loop that drives the store."""

    def __init__(self, bucket: str, options: GCSOptions, *, max_connections: int) -> None:
        self.bucket, self.options = bucket, options
        self.endpoint = options.endpoint
        parts = urlsplit(options.endpoint)
        self._base = parts.path
        self.data = DataPath("GCS", options.endpoint, limit=max_connections, origin=f"{parts.scheme}://{parts.netloc}")
        self._max_connections = max_connections
        self._session: aiohttp.ClientSession | None = None
        self._storage: Storage | None = None
        self._token: Token | None = None
        self._had_token = False
        self.bucket_exists = False
        self.timeout = aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=300)

    def url(self, key: str = "") -> str:
        """``gs://bucket/key`` for messages."""
        return f"gs://{self.bucket}/{key}"

    def storage(self) -> Storage:
        """The gcloud-aio-storage client and its session, made on first use inside the running loop."""
        if self._storage is None:
            if self._session is None:
                self._session = aiohttp.ClientSession(
                    connector=aiohttp.TCPConnector(limit=self._max_connections), timeout=self.timeout,
                    trace_configs=[counting_trace("GCS")])
            anonymous = self.options.anonymous
            try:
                if not anonymous:
                    self._token = Token(session=self._session, scopes=SCOPES)
                # anonymous: the client's unused Token gets empty credentials, so no credentials file is read
                self._storage = Storage(session=self._session, token=self._token, api_root=self.endpoint,
                                        api_is_dev=anonymous, service_file=io.StringIO("{}") if anonymous else None)
            except (OSError, ValueError, KeyError) as exc:
                raise self._credentials_error(exc) from exc
        return self._storage

    def _credentials_error(self, exc: BaseException) -> AccessDeniedError:
        reason = " ".join(str(exc).split())[:300] or type(exc).__name__
        return AccessDeniedError(
            f"cannot get GCS credentials for {self.url()} (endpoint {self.endpoint}): {reason}; set "
            "GOOGLE_APPLICATION_CREDENTIALS, run where the metadata server answers, or use ?anonymous=true")

    async def headers(self) -> dict[str, str]:
        """Authorization header (none when anonymous)."""
        self.storage()
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

    async def call(self, what: str, op: Callable[[Storage, dict[str, str]], Awaitable[T]], *, key: str | None = None,
                   if_absent: bool = False) -> T:
        """Run ``op(client, headers)``, its failures (the SDK's, the session's, the data path's answers) as
        fastckpt errors."""
        headers = await self.headers()
        try:
            result = await op(self.storage(), headers)
        except (aiohttp.ClientResponseError, HTTPStatus) as exc:
            self.data.answered()
            message = exc.message if isinstance(exc, HTTPStatus) else server_message(exc.message)
            code = "crc32cMismatch" if exc.status == 400 and "crc32c" in message.lower() else ""
            if exc.status == 404 and not self.bucket_exists and await self._bucket_missing():
                code = "noSuchBucket"
            auth = "anonymous" if self.options.anonymous else "with the credentials found"
            raise classify(ERRORS, exc.status, code, place=what, bucket=f"GCS bucket {self.bucket!r}",
                           at=f" at {self.endpoint}", key=key, detail=message, if_absent=if_absent,
                           denied_hint=f"{auth}: {message}") from exc
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            detail = " ".join(str(exc).split()) or type(exc).__name__
            raise unreachable("GCS", self.endpoint, what, detail, key=key, first_contact=not self.data.connected and
                              isinstance(exc, aiohttp.ClientConnectorError)) from exc
        self.data.answered()
        return result

    async def _bucket_missing(self) -> bool:
        """Whether the bucket is absent (a 404 then names the bucket, not the object)."""
        try:
            await self.storage().get_bucket_metadata(self.bucket, headers=await self.headers(),
                                                     params=self.options.controls.params(),
                                                     timeout=self.timeout)  # type: ignore[arg-type]
        except aiohttp.ClientResponseError as exc:
            return exc.status == 404
        except (aiohttp.ClientError, asyncio.TimeoutError):
            return False
        self.bucket_exists = True
        return False

    async def data_request(self, method: str, path: str, headers: dict[str, str], *, what: str,
                           key: str | None = None, **kwargs: Any) -> Response:
        """A request on the HTTP data path (``path`` below the endpoint, with its query); an error answer (other
        than 416) raises HTTPStatus, for ``call`` to classify."""
        resp = await self.data.request(method, self._base + path, headers, where=what, key=key, **kwargs)
        if resp.status >= 300 and resp.status != 416:
            raise HTTPStatus(resp.status, server_message(resp.body.decode("utf-8", "replace")))
        return resp

    async def session_request(self, method: str, url: str, **kwargs: Any) -> dict[str, Any]:
        """A request on the SDK's session; the JSON answer, or HTTPStatus."""
        async with self._session.request(method, url, **kwargs) as resp:  # type: ignore[union-attr]
            if resp.status >= 300:
                raise HTTPStatus(resp.status, server_message(await resp.text(errors="replace")))
            return await resp.json(content_type=None)

    async def upload_object(
        self, key: str, data: memoryview, metadata: dict[str, str] | None = None, *,
        if_absent: bool = False, crc: str | None = None,
    ) -> dict[str, Any]:
        """One multipart/related upload of ``data`` (sent from the caller's buffer) with its CRC32C.

        ``crc`` overrides the computed CRC32C (tests); a CRC32C the server reports differently makes the
        object be deleted and a TransientStoreError be raised.
        """
        crc = crc or await crc32c(data)
        controls = self.options.controls
        resource = {"name": key, "contentType": CONTENT_TYPE, "crc32c": crc, "metadata": metadata or {},
                    **controls.resource()}
        boundary = secrets.token_hex(16)
        head = (f"--{boundary}\r\nContent-Type: application/json; charset=UTF-8\r\n\r\n"
                f"{json.dumps(resource)}\r\n--{boundary}\r\nContent-Type: {CONTENT_TYPE}\r\n\r\n").encode()
        tail = f"\r\n--{boundary}--\r\n".encode()
        params = {"uploadType": "multipart", **({"ifGenerationMatch": "0"} if if_absent else {}),
                  **controls.params(creates=True)}
        what = self.url(key)

        async def send(_: Storage, headers: dict[str, str]) -> dict[str, Any]:
            headers = {**headers, **controls.headers(), "Content-Type": f"multipart/related; boundary={boundary}"}
            resp = await self.data_request("POST", f"/upload/storage/v1/b/{self.bucket}/o?{urlencode(params)}", headers,
                                           what=what, key=key, body=[head, data, tail])
            return json.loads(resp.body)

        result = await self.call(what, send, key=key, if_absent=if_absent)
        if result.get("crc32c") not in (None, crc):
            generation = result.get("generation")
            await self.call(what, lambda c, h: c.delete(
                self.bucket, key, headers=h, timeout=self.timeout,  # type: ignore[arg-type]
                params={**controls.params(), **({"ifGenerationMatch": str(generation)} if generation else {})}))
            raise TransientStoreError(f"{what}: CRC32C mismatch (sent {crc}, stored {result['crc32c']}); "
                                      "the object was removed")
        return result

    async def compose(self, key: str, sources: list[str], metadata: dict[str, str] | None = None, *,
                      if_absent: bool = False, generations: list[str] | None = None) -> dict[str, Any]:
        """Compose up to 32 ``sources`` (in order) into ``key`` with ``metadata`` (``ifGenerationMatch=0``
        with ``if_absent``; ``generations``: each source only as that generation)."""
        controls = self.options.controls
        conditions = [{"objectPreconditions": {"ifGenerationMatch": g}} for g in generations or []]
        payload = {"sourceObjects": [{"name": s, **c} for s, c in zip(sources, conditions or [{}] * len(sources),
                                                                       strict=True)],
                   "destination": {"contentType": CONTENT_TYPE, "metadata": metadata or {}, **controls.resource()}}
        url = f"{self.endpoint}/storage/v1/b/{self.bucket}/o/{quote(key, safe='')}/compose"
        params = {**({"ifGenerationMatch": "0"} if if_absent else {}), **controls.params(creates=True)}
        return await self.call(self.url(key), lambda _, headers: self.session_request(
            "POST", url, headers={**headers, **controls.headers()}, json=payload, params=params), key=key,
            if_absent=if_absent)

    async def close(self) -> None:
        await self.data.close()
        if self._session is not None:
            await self._session.close()
        self._session = self._storage = self._token = None
