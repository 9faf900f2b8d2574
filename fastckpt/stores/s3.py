"""Amazon S3 and S3-compatible stores (MinIO, Ceph, B2, R2, moto ...) on aiobotocore.

``S3Options`` holds everything that configures a store, read from the URI (``?endpoint_override=``,
``region``, ``scheme``, ``profile``, ``anonymous``, ``addressing_style``, as in Arrow's ``S3FileSystem``)
and the environment (the AWS variables botocore reads, and the ``FASTCKPT_S3_*`` knobs in the README's
Configuration section). Credentials come from botocore's chain. A custom endpoint is path-style.

Create-if-absent sends ``If-None-Match: *``; ``stores.conditional`` makes it safe on servers that
ignore it. Ranged GETs, HEADs, puts, part uploads, ListObjectsV2 and the multipart upload's create, complete
and abort go through the shared HTTP data path (``fastckpt.http``), signed with SigV4 (``stores.sigv4``)
for the bucket's region: bodies are sent from the caller's buffer and received into the caller's receiver.
They carry no SDK checksum (fastckpt's XXH3 digests check every byte end to end). On a path-style endpoint
of the user's own the data path is addressed without botocore's client, so a restore never builds one
(~0.2 CPU-s); on AWS botocore's endpoint rules place the bucket. The rest (deletes, ListParts, listing
uploads, metadata a header cannot carry) goes through aiobotocore, whose own retries are off
(``stores.retry`` retries); an endpoint never reached raises StoreError at once. botocore, aiobotocore and
aiohttp are imported on first use: with the keys in the environment (``sigv4.env_credentials``) and an
endpoint of one's own, a restore never loads them.

S3 takes an object's metadata when its multipart upload is created, before a byte of it is read; what is
known only at completion (the digest) goes into a record beside the object, written once the object is
complete: ``<dir>/.fastckpt-meta/<name>``, an empty object whose metadata is the record and the ETag of the
object it belongs to. The object says at creation that it has one (``x-amz-meta-fastckpt-record``) and
``head`` merges it in, so an upload reads each file once. A record is hidden from listings and deleted with
its object; one left by an earlier version of the object names another ETag and is not used. A writer that
loses a create-if-absent race never completes, so it never writes a record. With
``FASTCKPT_S3_DIGEST_RECORDS=0`` (for readers that want the objects alone) no record is written:
``metadata_on_complete`` is then False and the engine hashes a file before its upload starts.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import logging
import os
import posixpath
import re
import secrets
import socket
import ssl
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from email.utils import parsedate_to_datetime
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar
from urllib.parse import quote, unquote_plus, urlsplit
from xml.etree import ElementTree
from xml.sax.saxutils import escape

from ..config import TransferConfig
from ..errors import (
    AccessDeniedError,
    AlreadyExistsError,
    BucketNotFoundError,
    ObjectNotFoundError,
    StoreError,
    TransientStoreError,
)
from ..http import HttpClient, Response
from ..transport import Buffer, BufferReceiver, FileRange, ProtocolError, Receiver, body_size
from ..uri import StorageURI, check_options
from .base import ListPage, MultipartUpload, ObjectMeta, PartInfo, PendingUpload, ReceivingStore, in_prefix
from .classify import ErrorTable, classify, unreachable
from .conditional import IfAbsentGuard
from .sigv4 import UNSIGNED_PAYLOAD, S3Signer, env_credentials

if TYPE_CHECKING:
    from aiobotocore.session import AioSession

log = logging.getLogger("fastckpt")
T = TypeVar("T")
MiB = 1 << 20
DELETE_BATCH = 1000
"""Keys per DeleteObjects request (the S3 maximum)."""
POOL_HEADROOM = 16
"""Connections beyond ``max_in_flight`` for heads, lists, completes and aborts."""

_XMLNS = "http://s3.amazonaws.com/doc/2006-03-01/"
ERRORS = ErrorTable(
    "s3",
    bucket_missing=frozenset({"NoSuchBucket"}),
    not_found=frozenset({"NoSuchKey", "NotFound"}),
    conflict=frozenset({"PreconditionFailed", "ConditionalRequestConflict"}),
    denied=frozenset({"AccessDenied", "AllAccessDisabled", "AccountProblem", "InvalidAccessKeyId",
                      "SignatureDoesNotMatch", "ExpiredToken", "InvalidToken", "TokenRefreshRequired"}),
    transient=frozenset({"SlowDown", "RequestTimeout", "RequestTimeTooSkewed", "InternalError", "ServiceUnavailable",
                         "Throttling", "ThrottlingException", "RequestThrottled", "TooManyRequests",
                         "OperationAborted", "RequestTimeoutException", "PriorRequestNotComplete", "BadDigest"}),
    hints={"InvalidAccessKeyId": "access key id not recognised; check AWS_ACCESS_KEY_ID or the profile",
           "SignatureDoesNotMatch": "secret key does not match the access key; "
                                    "check AWS_SECRET_ACCESS_KEY or the profile",
           **dict.fromkeys(("ExpiredToken", "InvalidToken", "TokenRefreshRequired"),
                           "session token rejected; refresh credentials")},
)
RECORD_DIR = ".fastckpt-meta"
RECORD_MARK = "fastckpt-record"
"""Metadata an object gets at creation when its record may follow (see the module docstring)."""
RECORD_ETAG = "fastckpt-etag"
"""The record's metadata naming the ETag of the object it was written for."""
_NO_CONDITIONAL_CODES = {"NotImplemented", "InvalidArgument", "InvalidRequest", "UnsupportedOperation"}

LAZY_IMPORTS = ("aiobotocore", "botocore", "aiohttp")
"""Imported on first use only (~0.45 s): a restore from an endpoint of one's own with the keys in the environment
never needs them (``fastckpt doctor`` checks they are installed)."""
_SDKS = frozenset(LAZY_IMPORTS)


def _request_failure(exc: BaseException) -> bool:
    """Whether ``exc`` is a failed request: the socket's, the HTTP data path's, or one of the SDKs'."""
    return isinstance(exc, (OSError, asyncio.TimeoutError, ProtocolError)) or (
        type(exc).__module__.partition(".")[0] in _SDKS)


class _NoSuchUpload(StoreError):
    """The multipart upload was completed or aborted already."""


def _truthy(text: str | None) -> bool:
    return (text or "").strip().lower() in ("1", "true", "yes", "on")


def _display(url: str | None) -> str:
    """An endpoint URL fit for messages: no user info, query or path."""
    if not url:
        return "AWS S3"
    parts = urlsplit(url)
    host = parts.hostname or ""
    port = f":{parts.port}" if parts.port else ""
    return f"{parts.scheme}://{host}{port}"


def _timestamp(value: Any) -> datetime:
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


def _meta_of(key: str, headers: Mapping[str, str], size: int) -> ObjectMeta:
    """``ObjectMeta`` from the headers of a HEAD or GET answer (lower-case names)."""
    metadata = {k[11:]: v for k, v in headers.items() if k.startswith("x-amz-meta-")}
    modified = headers.get("last-modified")
    mtime = parsedate_to_datetime(modified).timestamp() if modified else 0.0
    return ObjectMeta(key, size, mtime, headers.get("etag"), metadata)


def _local(tag: str) -> str:
    """An XML element's name without its namespace."""
    return tag.rpartition("}")[2]


def _fields(element: ElementTree.Element) -> dict[str, str]:
    """The text of each child of ``element``, by name."""
    return {_local(child.tag): child.text or "" for child in element}


def _listed(key: str, fields: dict[str, str]) -> ObjectMeta:
    """``ObjectMeta`` of one ``Contents`` entry of a listing."""
    modified = fields.get("LastModified")
    return ObjectMeta(key, int(fields.get("Size") or 0), _timestamp(modified).timestamp() if modified else 0.0,
                      fields.get("ETag") or None)


def _plain_header(text: str) -> bool:
    """Whether ``text`` goes into an HTTP header as is (printable ASCII); other metadata goes through the SDK."""
    return text.isascii() and text.isprintable()


def _metadata_headers(metadata: dict[str, str] | None) -> dict[str, str] | None:
    """``x-amz-meta-*`` headers for ``metadata``; None when a name or value cannot go into a header as is
    (printable ASCII only: botocore encodes the rest)."""
    items = (metadata or {}).items()
    if not all(_plain_header(k) and _plain_header(v) for k, v in items):
        return None
    return {f"x-amz-meta-{k}": v for k, v in items}


def record_of(key: str) -> str:
    """The key of object ``key``'s record."""
    head, _, name = key.rpartition("/")
    return f"{head}/{RECORD_DIR}/{name}" if head else f"{RECORD_DIR}/{name}"


def resolve_endpoint(options: Mapping[str, str], environ: Mapping[str, str] = os.environ) -> str | None:
    """Endpoint URL from ``endpoint_override`` (+ ``scheme``), else the AWS endpoint env vars."""
    endpoint = options.get("endpoint_override") or None
    if endpoint is None and not _truthy(environ.get("AWS_IGNORE_CONFIGURED_ENDPOINT_URLS")):
        endpoint = environ.get("AWS_ENDPOINT_URL_S3") or environ.get("AWS_ENDPOINT_URL") or None
    if endpoint is None:
        return None
    if "://" not in endpoint:
        endpoint = f"{options.get('scheme') or 'https'}://{endpoint}"
    return endpoint.rstrip("/")


def _content_md5(request: Any, **_: Any) -> None:
    """Add Content-MD5 to DeleteObjects: MinIO-based servers (the JuiceFS gateway) refuse it without,
    and botocore's newer defaults send only a CRC."""
    body = request.body if isinstance(request.body, bytes) else None
    if body is not None and "Content-MD5" not in request.headers:
        request.headers["Content-MD5"] = base64.b64encode(hashlib.md5(body).digest()).decode()


class S3Upload(MultipartUpload):
    """One S3 multipart upload; parts are numbered ``index + 1``."""

    def __init__(self, store: S3Store, key: str, upload_id: str, if_absent: bool = False,
                 created: dict[str, str] | None = None) -> None:
        self.key, self.upload_id = key, upload_id
        self._store, self._if_absent = store, if_absent
        self._created = created or {}
        self._finished = False
        self._complete_sent = False
        self._etag = ""
        self.stored: dict[int, PartInfo] = {}

    def sends_files(self) -> bool:
        return self._store.sends_files

    async def put_part(self, index: int, data: Buffer | FileRange) -> PartInfo:
        if self._finished:
            raise StoreError(f"multipart upload of {self._store.where(self.key)} is no longer active")
        query = {"partNumber": str(index + 1), "uploadId": self.upload_id}
        resp = await self._store.send("PUT", self.key, query, {}, body=data)
        return PartInfo(index, body_size(data), resp.headers.get("etag", ""))

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
        listing = "".join(f"<Part><PartNumber>{p.index + 1}</PartNumber><ETag>{escape(p.token)}</ETag></Part>"
                          for p in sorted(parts, key=lambda p: p.index))
        body = f'<CompleteMultipartUpload xmlns="{_XMLNS}">{listing}</CompleteMultipartUpload>'.encode()
        headers = await self._store.if_absent_headers(self.key) if self._if_absent else {}
        retry, self._complete_sent = self._complete_sent, True
        try:
            resp = await self._store.send("POST", self.key, {"uploadId": self.upload_id}, headers, body=body,
                                          if_absent=self._if_absent)
            if b"<Error>" in resp.body:  # S3 reports a complete that failed after it began in a 200 answer
                raise self._store.answer_error(resp, "POST", self.key, self._if_absent)
        except _NoSuchUpload:
            # A retried complete whose first attempt succeeded but lost its response.
            if retry:
                found = await self._store.plain_head(self.key)
                if found is not None and found.size == sum(p.size for p in parts):
                    return found.etag or ""
            raise
        try:
            return _fields(ElementTree.fromstring(resp.body)).get("ETag", "")
        except ElementTree.ParseError:
            return ""

    async def abort(self) -> None:
        if self._finished:
            return
        await self._store.abort_upload(self.key, self.upload_id)
        self._finished = True


class S3Store(ReceivingStore):
    """One bucket on S3 or an S3-compatible server; one aiobotocore client, created on first use.

    Use it inside one event loop (the client's connection pool belongs to the loop that first
    used the store) and ``await close()`` at the end.
    """

    name = "s3"
    scheme = "s3"
    min_part_size = 5 * MiB
    max_part_size = 5 << 30
    max_parts = 10_000

    @property
    def metadata_on_complete(self) -> bool:  # type: ignore[override]
        return self.options.digest_records

    def __init__(self, bucket: str, options: S3Options | None = None, *,
                 max_pool_connections: int = 8 + POOL_HEADROOM, page_size: int = 1000) -> None:
        self.bucket = bucket
        self.options = options = options or S3Options()
        self.if_absent = IfAbsentGuard(options.if_absent_mode, "FASTCKPT_S3_IF_ABSENT", "If-None-Match: *")
        self.endpoint_url = options.endpoint_url
        self.endpoint = _display(options.endpoint_url)
        self.addressing_style = options.addressing_style or ("path" if options.endpoint_url else "auto")
        self.max_pool_connections = max_pool_connections
        self.page_size = page_size
        self._client: Any = None
        self._aio_session: AioSession | None = None
        self._clients = contextlib.AsyncExitStack()
        self._http: HttpClient | None = None
        self._signing: tuple[str, Any, S3Signer] | None = None  # (bucket's path, credentials, signer)
        self._client_lock, self._path_lock = asyncio.Lock(), asyncio.Lock()
        self._connected = False
        self._bucket_ok = False

    def where(self, key: str) -> str:
        """``s3://bucket/key`` for messages (``s3://bucket`` without a key)."""
        return f"s3://{self.bucket}/{key}" if key else f"s3://{self.bucket}"

    # ----------------------------------------------------------------------------- client

    async def client(self) -> Any:
        """The store's aiobotocore S3 client, for the requests off the data path (created on first use, in the
        running loop)."""
        if self._client is None:
            async with self._client_lock:
                if self._client is None:
                    self._client = await self._translating(lambda: self._open_client(self._configured_region()))
                    self._client.meta.events.register("before-sign.s3.DeleteObjects", _content_md5)
        return self._client

    def _session(self) -> AioSession:
        if self._aio_session is None:
            from aiobotocore.session import AioSession

            self._aio_session = AioSession(profile=self.options.profile)
            # listings of many uploads: ISO 8601 times parsed by datetime, not dateutil
            self._aio_session.get_component("response_parser_factory").set_parser_defaults(
                timestamp_parser=_timestamp)
        return self._aio_session

    def _configured_region(self) -> str:
        return self.options.region or self._session().get_config_variable("region") or "us-east-1"

    async def _open_client(self, region: str) -> Any:
        from aiobotocore.config import AioConfig
        from botocore import UNSIGNED

        s3_config: dict[str, Any] = {"addressing_style": self.addressing_style}
        opts = self.options
        if opts.payload_signing is not None:
            s3_config["payload_signing_enabled"] = opts.payload_signing
        config = AioConfig(
            max_pool_connections=self.max_pool_connections,
            connect_timeout=opts.connect_timeout,
            read_timeout=opts.read_timeout,
            retries={"total_max_attempts": 1, "mode": "standard"},
            s3=s3_config,
            request_checksum_calculation=opts.request_checksum_calculation,
            response_checksum_validation=opts.response_checksum_validation,
            signature_version=UNSIGNED if opts.anonymous else None,
            user_agent_extra="fastckpt",
        )
        return await self._clients.enter_async_context(self._session().create_client(
            "s3", region_name=region, endpoint_url=self.endpoint_url, use_ssl=opts.use_ssl, config=config))

    async def _data_path(self) -> tuple[str, Any, S3Signer]:
        """(the bucket's path, the credentials, the signer) of the data path, started on first use.

        Path-style addressing on an endpoint of the user's own is derived here, without botocore's client (whose
        creation costs ~0.2 CPU-s, most of a small restore's client CPU). On AWS, botocore's endpoint rules place
        the bucket: its client presigns a URL for it in the bucket's region.
        """
        if self._signing is None:
            async with self._path_lock:
                if self._signing is None:
                    await self._translating(self._start_data_path)
        return self._signing  # type: ignore[return-value]

    async def _translating(self, start: Callable[[], Awaitable[T]]) -> T:
        """``await start()``, a botocore failure raised as a fastckpt error."""
        try:
            return await start()
        except StoreError:
            raise
        except Exception as exc:
            if not _request_failure(exc):
                raise
            raise self._translate(exc, "") from exc

    async def _start_data_path(self) -> None:
        opts = self.options
        credentials = None
        if not opts.anonymous:  # the keys in the environment come first, as in botocore's chain (unless ?profile=)
            credentials = (None if opts.profile else env_credentials()) or await self._session().get_credentials()
            if credentials is None:
                raise self._no_credentials("")
        own_endpoint = bool(self.endpoint_url) and self.addressing_style == "path"
        if own_endpoint:
            endpoint = urlsplit(self.endpoint_url)
            origin, path = f"{endpoint.scheme}://{endpoint.netloc}", f"{endpoint.path.rstrip('/')}/{self.bucket}/"
            region = self._configured_region()
        else:
            client = await self.client()
            region = await self._bucket_region(client) or client.meta.region_name
            addressing = client if region == client.meta.region_name else await self._open_client(region)
            origin, path = await self._address(addressing)
        http = HttpClient(origin, limit=self.max_pool_connections, connect_timeout=opts.connect_timeout)
        self._http, self._signing = http, (path, credentials, S3Signer(http.host_header, region))
        if own_endpoint:
            await self._follow_bucket_region()

    async def _address(self, client: Any) -> tuple[str, str]:
        """The origin and the bucket's path as ``client`` (in the bucket's region) addresses it."""
        probe = "k"
        url = await client.generate_presigned_url("get_object", Params={"Bucket": self.bucket, "Key": probe},
                                                  ExpiresIn=60)
        parts = urlsplit(url)
        if not parts.path.endswith("/" + probe):
            raise StoreError(f"botocore addressed s3://{self.bucket}/{probe} as {parts.path!r}; fastckpt needs an "
                             "update")
        return f"{parts.scheme}://{parts.netloc}", parts.path[:-len(probe)]

    async def _bucket_region(self, client: Any) -> str | None:
        """The bucket's region as botocore's HeadBucket reports it (``x-amz-bucket-region``); None when unknown
        (no such header, a failure: the requests that follow report those)."""
        from botocore.exceptions import ClientError

        try:
            answer = await client.head_bucket(Bucket=self.bucket)
            self._bucket_ok = True
        except ClientError as exc:
            answer = exc.response
        except Exception as exc:
            if not _request_failure(exc):
                raise
            return None
        return answer.get("ResponseMetadata", {}).get("HTTPHeaders", {}).get("x-amz-bucket-region")

    async def _follow_bucket_region(self) -> None:
        """HeadBucket on the data path: requests are signed for the region it names (``x-amz-bucket-region``,
        sent whatever the answer's status), as botocore follows a bucket to its region."""
        assert self._signing is not None and self._http is not None
        path, credentials, signer = self._signing
        try:
            resp = await self._sign_and_send("HEAD", path, {}, None, None)
        except Exception as exc:
            if not _request_failure(exc):
                raise
            return  # the requests that follow report it
        self._bucket_ok = 200 <= resp.status < 300
        region = resp.headers.get("x-amz-bucket-region")
        if region and region != signer.region:
            self._signing = (path, credentials, S3Signer(self._http.host_header, region))

    @property
    def sends_files(self) -> bool:
        """Whether part bodies may be sent from their files: the data path is plain HTTP, and payloads are not
        signed (signing would read the bytes)."""
        return (self._http is not None and self._http.sends_files and self._signing is not None
                and (self.options.payload_signing is False or self._signing[1] is None))

    async def send(self, method: str, key: str, query: dict[str, str], headers: dict[str, str], *,
                   body: Buffer | FileRange | None = None, into: Receiver | None = None,
                   if_absent: bool = False) -> Response:
        """A request on the data path, signed with SigV4 as botocore would (``stores.sigv4``); errors as fastckpt
        errors (a 2xx or 416 answer is returned, a 206 or 200 with its body received by ``into``)."""
        path = (await self._data_path())[0]
        target = path + quote(key, safe="/~")
        if query:
            target += "?" + "&".join(f"{k}={quote(v, safe='-_.~')}" if v else k for k, v in query.items())
        try:
            resp = await self._sign_and_send(method, target, headers, body, into)
        except Exception as exc:
            if not _request_failure(exc):
                raise
            raise self._translate(exc, key, if_absent=if_absent) from exc
        if not 200 <= resp.status < 300 and resp.status != 416:
            raise self.answer_error(resp, method, key, if_absent)
        return resp

    async def _sign_and_send(self, method: str, target: str, headers: dict[str, str], body: Buffer | FileRange | None,
                             into: Receiver | None) -> Response:
        assert self._signing is not None and self._http is not None
        _, credentials, signer = self._signing
        if credentials is not None:
            payload = UNSIGNED_PAYLOAD if self.options.payload_signing is False else hashlib.sha256(
                body if body is not None else b"").hexdigest()  # None: the SDK's default, signed
            signer.sign(method, target, headers, await credentials.get_frozen_credentials(), payload)
        resp = await self._http.request(method, target, headers, body=body, into=into)
        self._connected = True
        return resp

    def answer_error(self, resp: Response, method: str, key: str, if_absent: bool) -> StoreError:
        """The fastckpt error for an S3 error answer (its XML Code and Message)."""
        def field(name: str) -> str:
            found = re.search(rf"<{name}>([^<]*)</{name}>".encode(), resp.body)
            return found[1].decode("utf-8", "replace") if found else ""

        return self._service_error(resp.status, field("Code") or str(resp.status), field("Message"), key, if_absent)

    async def close(self) -> None:
        self._client = self._signing = None
        http, self._http = self._http, None
        if http is not None:
            await http.close()
        clients, self._clients = self._clients, contextlib.AsyncExitStack()
        await clients.aclose()

    async def call(self, op: str, key: str, *, if_absent: bool = False, **params: Any) -> Any:
        """Run client operation ``op`` on this bucket; botocore errors become fastckpt errors."""
        client = await self.client()
        try:
            resp = await getattr(client, op)(Bucket=self.bucket, **params)
        except Exception as exc:
            if not _request_failure(exc):
                raise
            raise self._translate(exc, key, if_absent=if_absent) from exc
        self._connected = True
        return resp

    # ----------------------------------------------------------------------------- errors

    def _translate(self, exc: BaseException, key: str, *, if_absent: bool = False) -> StoreError:
        """The fastckpt error for a botocore / aiohttp failure (one line, never credentials)."""
        error = self._error_for(exc, key, if_absent)
        error.key, error.backend = error.key or key or None, "s3"
        return error

    def _error_for(self, exc: BaseException, key: str, if_absent: bool) -> StoreError:
        where = self.where(key)
        if type(exc).__module__.partition(".")[0] in _SDKS:
            error = self._sdk_error(exc, key, where, if_absent)
            if error is not None:
                return error
        elif isinstance(exc, ssl.SSLError):
            return self._tls_error(where)
        elif isinstance(exc, (ConnectionRefusedError, socket.gaierror)):  # connecting on the data path
            return unreachable("S3", self.endpoint, where, " ".join(str(exc).split()),
                               first_contact=not self._connected)
        elif isinstance(exc, (asyncio.TimeoutError, ConnectionError)):
            return self._transient(exc, where)
        return StoreError(f"{where}: {type(exc).__name__} at endpoint {self.endpoint}: {' '.join(str(exc).split())}")

    def _sdk_error(self, exc: BaseException, key: str, where: str, if_absent: bool) -> StoreError | None:
        """The fastckpt error for a botocore or aiohttp failure (raised by the SDK, so it is imported); None for
        one without a meaning of its own."""
        import aiohttp
        from botocore import exceptions as bx

        if isinstance(exc, bx.ClientError):
            error = exc.response.get("Error", {})
            status = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
            return self._service_error(status, str(error.get("Code", "")), str(error.get("Message", "")), key,
                                       if_absent)
        if isinstance(exc, bx.NoCredentialsError):
            return self._no_credentials(key)
        if isinstance(exc, (bx.PartialCredentialsError, bx.CredentialRetrievalError)):
            return AccessDeniedError(f"AWS credentials for {where} are incomplete or unavailable: {exc}")
        if isinstance(exc, bx.ProfileNotFound):
            return StoreError(f"AWS profile {self.options.profile or os.environ.get('AWS_PROFILE')!r} not found "
                              f"(needed for {where})")
        if isinstance(exc, bx.SSLError):
            return self._tls_error(where)
        if isinstance(exc, (bx.EndpointConnectionError, bx.ConnectTimeoutError)):
            cause = exc.kwargs.get("error", exc)
            refused = isinstance(exc, bx.ConnectTimeoutError) or isinstance(
                cause, (aiohttp.ClientConnectorError, socket.gaierror))  # not a reset after connecting
            return unreachable("S3", self.endpoint, where, " ".join(str(cause).split()),
                               first_contact=refused and not self._connected)
        if isinstance(exc, (bx.ReadTimeoutError, bx.HTTPClientError, bx.IncompleteReadError, aiohttp.ClientError)):
            return self._transient(exc, where)
        return None

    def _transient(self, exc: BaseException, where: str) -> TransientStoreError:
        return TransientStoreError(f"{where}: {type(exc).__name__} talking to {self.endpoint}")

    def _service_error(self, status: int, code: str, message: str, key: str, if_absent: bool) -> StoreError:
        """The fastckpt error for an error the S3 service answered (``code``, from its XML or botocore)."""
        self._connected = True
        where = self.where(key)
        if code == "NoSuchUpload":
            return _NoSuchUpload(f"multipart upload of {where} no longer exists (completed or aborted)")
        error = classify(ERRORS, status, code, place=where, bucket=f"bucket {self.bucket!r}",
                         at=f" at endpoint {self.endpoint}", key=key or None, if_absent=if_absent,
                         detail=" ".join(message.split()))
        error.key, error.backend = error.key or key or None, "s3"
        return error

    def _no_credentials(self, key: str) -> AccessDeniedError:
        return AccessDeniedError(f"no AWS credentials found for {self.where(key)}: set AWS_ACCESS_KEY_ID and "
                                 "AWS_SECRET_ACCESS_KEY, AWS_PROFILE, or use ?anonymous=true", key=key or None,
                                 backend="s3")

    def _tls_error(self, where: str) -> StoreError:
        return StoreError(f"TLS error talking to {self.endpoint} for {where}; for a plain-http endpoint "
                          "use endpoint_override=http://... or &scheme=http")

    async def _missing(self, key: str) -> ObjectNotFoundError:
        """The error for a 404 without a body (HEAD): names the bucket when it is the bucket that is gone."""
        if not self._bucket_ok:
            try:
                await self.send("HEAD", "", {}, {})
                self._bucket_ok = True
            except ObjectNotFoundError as exc:
                return BucketNotFoundError(f"bucket {self.bucket!r} does not exist at endpoint {self.endpoint}",
                                           key=key, backend="s3", status=exc.status)
            except StoreError:
                pass
        return ObjectNotFoundError(f"{self.where(key)} does not exist", key=key, backend="s3", status=404)

    # ----------------------------------------------------------------------------- reads

    async def head(self, key: str) -> ObjectMeta:
        meta = await self.plain_head(key)
        if meta is None:
            raise await self._missing(key)
        return await self._with_record(meta)

    async def plain_head(self, key: str) -> ObjectMeta | None:
        """The object's own metadata (no record merged in); None when it is absent."""
        try:
            answer = await self.send("HEAD", key, {}, {})
        except ObjectNotFoundError:
            return None
        return _meta_of(key, answer.headers, int(answer.headers.get("content-length", 0)))

    async def _with_record(self, meta: ObjectMeta) -> ObjectMeta:
        """``meta`` with its record's metadata merged in, when it has one (see the module docstring)."""
        if RECORD_MARK not in meta.metadata:
            return meta
        metadata = {k: v for k, v in meta.metadata.items() if k != RECORD_MARK}
        record = await self.plain_head(record_of(meta.key))
        if record is not None and meta.etag and record.metadata.get(RECORD_ETAG) == meta.etag:
            metadata.update((k, v) for k, v in record.metadata.items() if k != RECORD_ETAG)
        else:  # none, or an earlier version's: the upload stopped after completing, or a writer raced it
            log.debug("%s has no record of its completion", self.where(meta.key))
        return replace(meta, metadata=metadata)

    async def read_with_meta(self, key: str, buf: memoryview) -> tuple[ObjectMeta, int]:
        """One ranged GET from the start: its answer's headers carry the object's size and metadata."""
        if not buf.nbytes:
            return await super().read_with_meta(key, buf)
        resp = await self.send("GET", key, {}, {"Range": f"bytes=0-{buf.nbytes - 1}"}, into=BufferReceiver(buf))
        if resp.status == 416:  # an empty object
            return await super().read_with_meta(key, buf)
        total = resp.headers.get("content-range", "").rpartition("/")[2]
        size = int(total) if resp.status == 206 and total.isdigit() else resp.received
        return await self._with_record(_meta_of(key, resp.headers, size)), resp.received

    async def receive(self, key: str, start: int, length: int, into: Receiver) -> int:
        """One ranged GET, its body received straight by ``into``."""
        if not length:
            return 0
        resp = await self.send("GET", key, {}, {"Range": f"bytes={start}-{start + length - 1}"}, into=into)
        if resp.status == 416:  # the range starts at or past the end
            return 0
        if resp.status == 206 and resp.headers.get("content-range", "").startswith(f"bytes {start}-"):
            return resp.received
        if resp.status == 200 and not start:
            return resp.received
        raise StoreError(f"{self.where(key)}: endpoint {self.endpoint} ignored the Range header "
                         f"(answered {resp.status} {resp.headers.get('content-range', '')})")

    async def list_page(self, prefix: str, delimiter: str | None = None, token: str | None = None) -> ListPage:
        """One ListObjectsV2 request on the data path; keys travel URL-encoded (``encoding-type=url``, as botocore
        asks for them: XML 1.0 cannot carry every character a key may hold)."""
        query = {"list-type": "2", "max-keys": str(self.page_size), "encoding-type": "url"}
        if prefix:
            query["prefix"] = prefix
        if delimiter:
            query["delimiter"] = delimiter
        if token:
            query["continuation-token"] = token
        resp = await self.send("GET", "", query, {})
        contents: list[dict[str, str]] = []
        prefixes: list[str] = []
        fields: dict[str, str] = {}
        try:
            for element in ElementTree.fromstring(resp.body):
                tag = _local(element.tag)
                if tag == "Contents":
                    contents.append(_fields(element))
                elif tag == "CommonPrefixes":
                    prefixes.append(_fields(element)["Prefix"])
                else:
                    fields[tag] = element.text or ""
            # decoded only where the answer says it is encoded, as botocore does: some servers ignore the request
            decode = unquote_plus if fields.get("EncodingType") == "url" else str
            objects = [_listed(decode(f["Key"]), f) for f in contents]
        except (ElementTree.ParseError, KeyError, ValueError) as exc:
            raise StoreError(f"{self.where(prefix)}: unreadable listing from {self.endpoint} ({exc!r})",
                             key=prefix, backend="s3") from exc
        token = fields.get("NextContinuationToken") if fields.get("IsTruncated") == "true" else None
        return ListPage(objects, [decode(p) for p in prefixes], token)

    # ----------------------------------------------------------------------------- writes

    async def put(
        self, key: str, data: Buffer, *, if_absent: bool = False, metadata: dict[str, str] | None = None
    ) -> None:
        condition = await self.if_absent_headers(key) if if_absent else {}
        headers = _metadata_headers(metadata)
        if headers is not None:
            await self.send("PUT", key, {}, {**headers, **condition}, body=data, if_absent=if_absent)
            return
        body = bytes(data)  # metadata HTTP headers cannot carry as is: botocore encodes it
        await self.call("put_object", key, if_absent=if_absent, Key=key, Body=body, ContentLength=len(body),
                        Metadata=dict(metadata or {}), **({"IfNoneMatch": "*"} if condition else {}))

    async def if_absent_headers(self, key: str) -> dict[str, str]:
        """Request headers that make a PutObject or CompleteMultipartUpload of ``key`` create-if-absent.

        ``If-None-Match: *`` where the server honours it; in best-effort mode on servers that ignore it,
        a HEAD first (AlreadyExistsError when present; racy); otherwise StoreError.
        """
        honoured = await self.if_absent.check(endpoint=self.endpoint_url, shown=self.endpoint, bucket=self.bucket,
                                              where=self.where(key), probe=lambda: self._probe_conditional(key),
                                              head=lambda: self.head(key))
        return {"If-None-Match": "*"} if honoured else {}

    async def _probe_conditional(self, key: str) -> bool:
        probe = posixpath.join(posixpath.dirname(key), f".fastckpt-probe-{secrets.token_hex(8)}")
        await self.call("put_object", probe, Key=probe, Body=b"", ContentLength=0)
        try:
            await self.call("put_object", probe, if_absent=True, Key=probe, Body=b"", ContentLength=0,
                            IfNoneMatch="*")
            return False
        except AlreadyExistsError:
            return True
        except StoreError as exc:
            from botocore.exceptions import ClientError

            cause = exc.__cause__
            if isinstance(cause, ClientError) and (
                    cause.response.get("Error", {}).get("Code") in _NO_CONDITIONAL_CODES
                    or cause.response.get("ResponseMetadata", {}).get("HTTPStatusCode") == 501):
                return False
            raise
        finally:
            with contextlib.suppress(StoreError):
                await self.call("delete_object", probe, Key=probe)

    async def put_record(self, key: str, etag: str, metadata: dict[str, str]) -> None:
        """Record ``metadata`` for object ``key`` as completed with ``etag`` (replacing an earlier version's)."""
        if not etag:  # a server that did not name it in its answer to the completion
            found = await self.plain_head(key)
            etag = found.etag or "" if found is not None else ""
        if not etag:
            raise StoreError(f"{self.where(key)}: {self.endpoint} completed the upload without naming its ETag",
                             key=key, backend="s3")
        await self.put(record_of(key), b"", metadata={**metadata, RECORD_ETAG: etag})

    def is_hidden(self, key: str) -> bool:
        """Records of objects' completions."""
        return f"/{RECORD_DIR}/" in f"/{key}"

    async def delete(self, key: str) -> None:
        await self.delete_many([key])

    async def delete_many(self, keys: list[str]) -> None:
        """DeleteObjects in batches of 1000, each object with its record; the first per-key error is raised
        after all batches."""
        doomed = [*keys, *(record_of(k) for k in keys if not self.is_hidden(k))]
        failures: list[dict[str, Any]] = []
        for i in range(0, len(doomed), DELETE_BATCH):
            batch = doomed[i : i + DELETE_BATCH]
            resp = await self.call("delete_objects", batch[0], Delete={
                "Objects": [{"Key": k} for k in batch], "Quiet": True})
            failures += resp.get("Errors", [])
        if failures:
            first = failures[0]
            code = first.get("Code", "")
            error = self._service_error(403 if code == "AccessDenied" else 400, code, first.get("Message", ""),
                                        first.get("Key", ""), False)
            raise type(error)(f"{len(failures)} of {len(doomed)} deletes failed; first: {error}")

    async def create_multipart(
        self, key: str, part_size: int, metadata: dict[str, str] | None = None, *, if_absent: bool = False
    ) -> MultipartUpload:
        created = dict(metadata or {})
        marked = {**created, RECORD_MARK: "1"} if self.metadata_on_complete else created
        headers = _metadata_headers(marked)
        if headers is None:  # metadata HTTP headers cannot carry as is: botocore encodes it
            resp = await self.call("create_multipart_upload", key, Key=key, Metadata=marked)
            return S3Upload(self, key, resp["UploadId"], if_absent, created)
        answer = await self.send("POST", key, {"uploads": ""}, headers)
        try:
            upload_id = _fields(ElementTree.fromstring(answer.body))["UploadId"]
        except (ElementTree.ParseError, KeyError) as exc:
            raise StoreError(f"{self.where(key)}: {self.endpoint} started a multipart upload without naming it",
                             key=key, backend="s3") from exc
        return S3Upload(self, key, upload_id, if_absent, created)

    async def resume_multipart(self, key: str, upload_id: str, part_size: int, *,
                               if_absent: bool = False) -> MultipartUpload | None:
        """The open upload and its parts, from ListParts."""
        upload = S3Upload(self, key, upload_id, if_absent)
        params: dict[str, Any] = {"Key": key, "UploadId": upload_id, "MaxParts": 1000}
        try:
            while True:
                page = await self.call("list_parts", key, **params)
                for p in page.get("Parts", []):
                    index = int(p["PartNumber"]) - 1
                    upload.stored[index] = PartInfo(index, int(p["Size"]), p["ETag"])
                if not page.get("IsTruncated"):
                    return upload
                params["PartNumberMarker"] = page["NextPartNumberMarker"]
        except (_NoSuchUpload, ObjectNotFoundError):
            return None

    async def list_pending_uploads(self, prefix: str = "") -> list[PendingUpload]:
        prefix = prefix.strip("/")
        params: dict[str, Any] = {"Prefix": prefix, "MaxUploads": self.page_size}
        found: list[PendingUpload] = []
        while True:
            page = await self.call("list_multipart_uploads", prefix, **params)
            for up in page.get("Uploads", []):
                if in_prefix(up["Key"], prefix):
                    started = up["Initiated"].timestamp() if up.get("Initiated") else 0.0
                    found.append(PendingUpload(up["Key"], up["UploadId"], started))
            if not page.get("IsTruncated"):
                return found
            params["KeyMarker"] = page.get("NextKeyMarker", "")
            params["UploadIdMarker"] = page.get("NextUploadIdMarker", "")

    async def abort_pending_upload(self, upload: PendingUpload) -> None:
        await self.abort_upload(upload.key, upload.upload_id)

    async def list_orphans(self, prefix: str = "", older_than: float = 0.0) -> list[str]:
        """Records whose object is gone, or was replaced without one (another ETag)."""
        base = prefix.strip("/")
        metas = {m.key: m async for page in self._pages(base + "/" if base else "") for m in page.objects}
        if base:
            metas.update((m.key, m) for m in [await self.plain_head(base)] if m is not None)
        orphans = []
        for key, meta in metas.items():
            head, _, name = key.rpartition(f"{RECORD_DIR}/")
            if not self.is_hidden(key) or meta.mtime > older_than or "/" in name:
                continue
            owner = metas.get(head + name)
            if owner is not None:
                record = await self.plain_head(key)
                if record is None or record.metadata.get(RECORD_ETAG) == owner.etag:
                    continue
            orphans.append(key)
        return orphans

    async def abort_upload(self, key: str, upload_id: str) -> None:
        """AbortMultipartUpload; one completed or aborted already is not an error."""
        with contextlib.suppress(_NoSuchUpload):
            await self.send("DELETE", key, {"uploadId": upload_id}, {})


@dataclass(frozen=True)
class S3Options:
    """How to reach one S3 endpoint: from the URI's options (``QUERY``) and the environment (module doc)."""

    QUERY: ClassVar[frozenset[str]] = frozenset(
        {"endpoint_override", "region", "scheme", "profile", "anonymous", "addressing_style"})
    endpoint_url: str | None = None
    region: str | None = None
    profile: str | None = None
    anonymous: bool = False
    addressing_style: str | None = None
    """None: path-style on a custom endpoint, botocore's choice on AWS."""
    use_ssl: bool = True
    request_checksum_calculation: str = "when_required"
    response_checksum_validation: str = "when_required"
    payload_signing: bool | None = False
    """None: botocore's default (signed on plain http)."""
    connect_timeout: float = 10.0
    read_timeout: float = 60.0
    if_absent_mode: str = "auto"
    digest_records: bool = True
    """Record the digest after the data (module doc); off: objects only, hashed before their upload."""

    @classmethod
    def from_uri(cls, uri: StorageURI, env: Mapping[str, str] = os.environ) -> S3Options:
        """The options ``uri`` and ``env`` give; ValueError for an option S3 does not take."""
        opts = check_options(uri, cls.QUERY)
        signing = env.get("FASTCKPT_S3_PAYLOAD_SIGNING", "0").strip().lower()
        return cls(
            endpoint_url=resolve_endpoint(opts, env),
            region=opts.get("region") or env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION") or None,
            profile=opts.get("profile") or None,
            anonymous=bool(uri.flag("anonymous")),
            addressing_style=opts.get("addressing_style") or None,
            use_ssl=(opts.get("scheme") or "https").lower() != "http",
            request_checksum_calculation=env.get("AWS_REQUEST_CHECKSUM_CALCULATION", "when_required").lower(),
            response_checksum_validation=env.get("AWS_RESPONSE_CHECKSUM_VALIDATION", "when_required").lower(),
            payload_signing=None if signing == "auto" else _truthy(signing),
            connect_timeout=float(env.get("FASTCKPT_S3_CONNECT_TIMEOUT", "10")),
            read_timeout=float(env.get("FASTCKPT_S3_READ_TIMEOUT", "60")),
            if_absent_mode=env.get("FASTCKPT_S3_IF_ABSENT", "auto").strip().lower(),
            digest_records=_truthy(env.get("FASTCKPT_S3_DIGEST_RECORDS", "1")),
        )

    def query(self) -> dict[str, str]:
        """URI options that give these options back (with the same environment)."""
        pairs = {"endpoint_override": self.endpoint_url, "region": self.region, "profile": self.profile,
                 "anonymous": "true" if self.anonymous else None, "addressing_style": self.addressing_style,
                 "scheme": None if self.use_ssl else "http"}
        return {k: v for k, v in pairs.items() if v}


def from_uri(uri: StorageURI, config: TransferConfig) -> S3Store:
    """S3 store for ``uri``'s bucket, configured from its options and the AWS environment variables."""
    return S3Store(uri.bucket, S3Options.from_uri(uri), max_pool_connections=config.max_in_flight + POOL_HEADROOM)
