"""Azure Blob Storage on ``azure-storage-blob``'s asyncio client.

Large files are staged as blocks in parallel (``stage_block``) and made visible by one
``commit_block_list`` that also sets the digest metadata; small files are one ``Put Blob``.
Create-if-absent sends ``If-None-Match: *``. Every block and single upload carries a Content-MD5,
computed off the event loop, that the service checks. Ranged reads and staged blocks go through the
shared HTTP data path (``fastckpt.http``), signed as the SDK signs: a read lands in the caller's buffer,
a block is sent from it.

Credentials, first match wins: ``?anonymous``; ``AZURE_STORAGE_CONNECTION_STRING``; an account key
(``AZURE_STORAGE_ACCOUNT_KEY`` / ``AZURE_STORAGE_KEY``); a SAS (``AZURE_STORAGE_SAS_TOKEN``); the
emulator's published key for ``devstoreaccount1`` behind an ``endpoint_override``; ``azure-identity``'s
``DefaultAzureCredential`` when installed. The SDK's own retries are off: the engine retries.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import importlib.util
import os
import re
import secrets
import socket
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from email.utils import formatdate
from typing import TYPE_CHECKING, Any, ClassVar
from urllib.parse import quote, urlsplit

import aiohttp
from azure.core.credentials import AzureNamedKeyCredential
from azure.core.exceptions import (
    ClientAuthenticationError,
    HttpResponseError,
    ServiceRequestError,
    ServiceResponseError,
)
from azure.core.pipeline import PipelineContext, PipelineRequest
from azure.core.pipeline.transport import AioHttpTransport, HttpRequest
from azure.storage.blob import __version__ as VERSION
from azure.storage.blob.aio import BlobClient, BlobPrefix, ContainerClient

from ..config import TransferConfig
from ..errors import AccessDeniedError, BucketNotFoundError, ObjectNotFoundError, StoreError
from ..http import HttpClient, Response
from ..tasks import gather_bounded
from ..transport import Buffer, ProtocolError
from ..uri import StorageURI, check_options, parse_flag
from .base import ListPage, MultipartUpload, ObjectMeta, PartInfo, PendingUpload, ReceivingStore, in_prefix
from .classify import ErrorTable, classify, unreachable

if TYPE_CHECKING:
    from ..transport import Receiver

MiB = 1 << 20
EMULATOR_ACCOUNT = "devstoreaccount1"
# Azurite's and the storage emulator's published well-known key (public; used only for devstoreaccount1).
EMULATOR_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
_MAX_PUT_BLOB = 5000 * MiB
ERRORS = ErrorTable(
    "azure",
    bucket_missing=frozenset({"ContainerNotFound"}),
    not_found=frozenset({"BlobNotFound"}),
    conflict=frozenset({"BlobAlreadyExists", "ConditionNotMet"}),
    denied=frozenset({"AuthenticationFailed", "AuthorizationFailure", "AuthorizationPermissionMismatch"}),
    transient=frozenset({"ServerBusy", "OperationTimedOut", "InternalError", "Md5Mismatch", "Crc64Mismatch"}),
)


# ----------------------------------------------------------------------------- metadata names


def encode_metadata_key(name: str) -> str:
    """An Azure metadata name (a C# identifier) for ``name``, reversible with ``decode_metadata_key``.

    Names of ASCII letters, digits and dashes that start with a letter map dashes to underscores
    (``fastckpt-xxh3`` -> ``fastckpt_xxh3``). Any other name is escaped: a leading ``_``, then each
    character other than an ASCII letter or digit as ``_xx`` per UTF-8 byte.
    """
    if re.fullmatch(r"[A-Za-z][A-Za-z0-9-]*", name):
        return name.replace("-", "_")
    return "_" + "".join(c if c.isascii() and c.isalnum() else "".join(f"_{b:02x}" for b in c.encode())
                         for c in name)


def decode_metadata_key(name: str) -> str:
    """The original name of an Azure metadata name written by ``encode_metadata_key``."""
    if not name.startswith("_"):
        return name.replace("_", "-")
    rest = name[1:]
    if not re.fullmatch(r"(?:[A-Za-z0-9]|_[0-9a-fA-F]{2})*", rest):
        return name  # not ours: keep it as the service returned it
    return re.sub(r"(?:_[0-9a-fA-F]{2})+",
                  lambda m: bytes.fromhex(m[0].replace("_", "")).decode("utf-8", "replace"), rest)


def _encode_metadata(metadata: Mapping[str, str] | None) -> dict[str, str]:
    return {encode_metadata_key(k): v for k, v in (metadata or {}).items()}


def _decode_metadata(metadata: Mapping[str, str] | None) -> dict[str, str]:
    return {decode_metadata_key(k): v for k, v in (metadata or {}).items()}


# ----------------------------------------------------------------------------- endpoint and credentials


@dataclass(frozen=True)
class AzureOptions:
    """Where and as whom to connect, from the URI's options (``QUERY``) and the ``AZURE_STORAGE_*``
    environment (module doc). ``kind`` is ``key``, ``sas``, ``anonymous`` or ``default``
    (``DefaultAzureCredential``, created in the running loop); ``secret`` is never shown."""

    QUERY: ClassVar[frozenset[str]] = frozenset({"account", "endpoint_override", "endpoint_suffix", "anonymous"})
    account: str
    url: str
    kind: str
    source: str
    """Where the credential came from, for error messages (never the secret itself)."""
    secret: str = field(default="", repr=False)
    content_md5: bool = True

    @classmethod
    def from_uri(cls, uri: StorageURI, env: Mapping[str, str] = os.environ) -> AzureOptions:
        """The options ``uri`` and ``env`` give; ValueError for an option Azure does not take."""
        return resolve_endpoint(check_options(uri, cls.QUERY), env)

    @property
    def credential(self) -> AzureNamedKeyCredential | str | None:
        """The SDK credential: a named key, a SAS string, None (anonymous) or ``"default"``."""
        if self.kind == "key":
            return AzureNamedKeyCredential(self.account, self.secret)
        return {"sas": self.secret, "anonymous": None}.get(self.kind, "default")

    def query(self) -> dict[str, str]:
        """URI options that give these options back (with the same environment)."""
        pairs = {"account": self.account, "anonymous": "true" if self.kind == "anonymous" else None,
                 "endpoint_override": None if re.fullmatch(r"https://[a-z0-9]+\.blob\.core\.windows\.net", self.url)
                 else self.url}
        return {k: v for k, v in pairs.items() if v}


def parse_connection_string(text: str) -> dict[str, str]:
    """``Key=Value;...`` pairs of an Azure connection string, keys lower-cased."""
    pairs = (p.partition("=") for p in text.split(";") if p.strip())
    return {k.strip().lower(): v.strip() for k, _, v in pairs}


def resolve_endpoint(options: Mapping[str, str], env: Mapping[str, str] | None = None) -> AzureOptions:
    """Account URL and credential from URI options and the ``AZURE_STORAGE_*`` environment variables."""
    env = os.environ if env is None else env
    conn = parse_connection_string(env.get("AZURE_STORAGE_CONNECTION_STRING", ""))
    devstore = conn.get("usedevelopmentstorage", "").lower() == "true"
    if devstore:
        conn = {"accountname": EMULATOR_ACCOUNT, "accountkey": EMULATOR_KEY,
                "blobendpoint": f"http://127.0.0.1:10000/{EMULATOR_ACCOUNT}"}
    env_account = env.get("AZURE_STORAGE_ACCOUNT_NAME") or env.get("AZURE_STORAGE_ACCOUNT")
    account = options.get("account") or conn.get("accountname") or env_account
    if not account:
        raise ValueError("no Azure storage account given: use abfss://CONTAINER@ACCOUNT.dfs.core.windows.net/..., "
                         "https://ACCOUNT.blob.core.windows.net/CONTAINER/..., ?account=ACCOUNT, "
                         "AZURE_STORAGE_ACCOUNT_NAME or AZURE_STORAGE_CONNECTION_STRING")
    use_conn = bool(conn) and conn.get("accountname", account) == account
    override = options.get("endpoint_override")
    if override:
        parts = urlsplit(override)
        if not parts.scheme or not parts.netloc:
            raise ValueError(f"endpoint_override {override!r} is not a URL like http://127.0.0.1:10000")
        path_style = parts.path.strip("/") == "" and not (parts.hostname or "").startswith(account + ".")
        url = override.rstrip("/") + (f"/{account}" if path_style else "")
    elif use_conn and conn.get("blobendpoint"):
        url = conn["blobendpoint"].rstrip("/")
    else:
        proto = conn.get("defaultendpointsprotocol", "https") if use_conn else "https"
        suffix = options.get("endpoint_suffix") or (conn.get("endpointsuffix") if use_conn else None)
        url = f"{proto}://{account}.blob.{suffix or 'core.windows.net'}"

    env_key = env.get("AZURE_STORAGE_ACCOUNT_KEY") or env.get("AZURE_STORAGE_KEY")
    sas = env.get("AZURE_STORAGE_SAS_TOKEN")
    if parse_flag("anonymous", options.get("anonymous"), "Azure storage URI"):
        kind, secret, source = "anonymous", "", "anonymous access"
    elif use_conn and conn.get("accountkey"):
        kind, secret = "key", conn["accountkey"]
        source = "UseDevelopmentStorage" if devstore else "the key in AZURE_STORAGE_CONNECTION_STRING"
    elif use_conn and conn.get("sharedaccesssignature"):
        kind, secret = "sas", conn["sharedaccesssignature"].lstrip("?")
        source = "the SAS in AZURE_STORAGE_CONNECTION_STRING"
    elif env_key and env_account in (None, account):
        kind, secret, source = "key", env_key, "the account key from the environment"
    elif sas:
        kind, secret, source = "sas", sas.lstrip("?"), "AZURE_STORAGE_SAS_TOKEN"
    elif account == EMULATOR_ACCOUNT and override:
        kind, secret, source = "key", EMULATOR_KEY, "the emulator's well-known key"
    else:
        if importlib.util.find_spec("azure.identity") is None:
            raise AccessDeniedError(
                f"no credentials for Azure storage account {account!r}: set AZURE_STORAGE_CONNECTION_STRING, "
                "AZURE_STORAGE_ACCOUNT_KEY or AZURE_STORAGE_SAS_TOKEN, or install azure-identity")
        kind, secret, source = "default", "", "DefaultAzureCredential"
    md5 = env.get("FASTCKPT_AZURE_CONTENT_MD5", "1").lower() not in ("0", "false", "no", "off")
    return AzureOptions(account, url, kind, source, secret, md5)


# ----------------------------------------------------------------------------- the store


class AzureStore(ReceivingStore):
    """Blobs of one container. The client is made on first use, in the loop that drives the store."""

    name = "azure"
    scheme = "az"
    min_part_size = 1
    max_part_size = 4000 * MiB
    max_parts = 50_000

    def __init__(self, container: str, options: AzureOptions, *, max_connections: int = 16,
                 connection_timeout: float = 20, read_timeout: float = 60) -> None:
        self.container = self.bucket = container
        self.endpoint = self.options = options
        self.max_connections = max_connections
        self.content_md5 = options.content_md5
        self._timeouts = (connection_timeout, read_timeout)
        self._client: ContainerClient | None = None
        self._data: HttpClient | None = None
        """The HTTP data path (``fastckpt.http``): ranged reads and staged blocks, from and into pooled buffers."""
        self._sign: Callable[[str, str, dict[str, str]], dict[str, str]] | None = None
        self._session: aiohttp.ClientSession | None = None
        self._credential: Any = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._connected = False

    def __repr__(self) -> str:
        return f"AzureStore({self.endpoint.url}/{self.container})"

    def url(self, key: str) -> str:
        """Human-readable location of ``key`` (for messages)."""
        return f"azure://{self.endpoint.account}/{self.container}/{key}"

    def _container(self) -> ContainerClient:
        loop = asyncio.get_running_loop()
        if self._client is not None:
            if loop is not self._loop:
                raise StoreError(f"{self!r} is bound to another event loop; open one store per loop")
            return self._client
        credential = self.endpoint.credential
        if credential == "default":
            from azure.identity.aio import DefaultAzureCredential

            credential = self._credential = DefaultAzureCredential()
        connector = aiohttp.TCPConnector(limit=self.max_connections, limit_per_host=0)
        self._session = aiohttp.ClientSession(connector=connector, auto_decompress=False, trust_env=True)
        transport = AioHttpTransport(session=self._session, session_owner=False,
                                     connection_timeout=self._timeouts[0], read_timeout=self._timeouts[1])
        self._client = ContainerClient(self.endpoint.url, self.container, credential=credential,
                                       transport=transport, retry_total=0, max_single_put_size=_MAX_PUT_BLOB,
                                       raw_response_hook=self._answered)
        self._loop = loop
        return self._client

    def _answered(self, _: object) -> None:
        """Every response: the endpoint is reachable (a later connection failure is transient)."""
        self._connected = True

    def _blob(self, key: str) -> BlobClient:
        return self._container().get_blob_client(key)

    async def close(self) -> None:
        data, self._data = self._data, None
        if data is not None:
            await data.close()
        client, self._client = self._client, None
        if client is not None:
            await client.close()
        if self._session is not None:
            await self._session.close()
            self._session = None
        if self._credential is not None:
            await self._credential.close()
            self._credential = None

    def _error(self, exc: Exception, key: str | None, *, if_absent: bool = False) -> Exception:
        """The fastckpt error for an SDK exception: one line, naming the account and container."""
        where = self.url(key) if key is not None else f"container {self.container!r} of account " \
                                                       f"{self.endpoint.account!r}"
        if isinstance(exc, (ServiceRequestError, ServiceResponseError, asyncio.TimeoutError, aiohttp.ClientError)):
            refused = isinstance(getattr(exc, "inner_exception", exc), aiohttp.ClientConnectorError)
            return unreachable("Azure", self.endpoint.url, where, type(exc).__name__, key=key,
                               first_contact=refused and not self._connected)
        if isinstance(exc, ClientAuthenticationError) and exc.response is None:
            return AccessDeniedError(f"{where}: could not get a token from {self.endpoint.source}", key=key,
                                     backend="azure")
        if not isinstance(exc, HttpResponseError):
            return StoreError(f"{where}: {type(exc).__name__}: {_redact(str(exc))}", key=key, backend="azure")
        code = getattr(exc, "error_code", None) or (exc.response.headers.get("x-ms-error-code", "")
                                                    if exc.response is not None else "")
        return self._classify(exc.status_code or 0, str(getattr(code, "value", code)), exc.reason or "", key,
                              if_absent)

    def _classify(self, status: int, code: str, reason: str, key: str | None, if_absent: bool = False) -> Exception:
        where = self.url(key) if key is not None else f"container {self.container!r}"
        return classify(ERRORS, status, code, place=where, key=key, bucket=f"Azure container {self.container!r}",
                        if_absent=if_absent, detail=reason,
                        at=f" in storage account {self.endpoint.account!r} ({self.endpoint.url})",
                        denied_hint=f"check the credentials ({self.endpoint.source}) and their permissions")

    async def send(self, method: str, key: str, query: str, headers: dict[str, str], **kwargs: Any) -> Response:
        """A request on the HTTP data path for blob ``key`` (``query``: its URL query, without the SAS), signed
        as the SDK signs (shared key, SAS, or a token of the SDK's credential; a Content-Length in ``headers`` is
        signed too); an error answer (other than 416) raises the fastckpt error."""
        container = self._container()
        parts = urlsplit(self.endpoint.url)
        origin = f"{parts.scheme}://{parts.netloc}"
        if self._data is None:
            self._data = HttpClient(origin, limit=self.max_connections, connect_timeout=self._timeouts[0])
            if self.endpoint.kind == "key":
                self._sign = shared_key_signer(self.endpoint.account, self.endpoint.secret)
        path = f"{parts.path}/{self.container}/{quote(key, safe='/~')}"
        if self.endpoint.kind == "sas":
            query = f"{query}&{self.endpoint.secret}" if query else self.endpoint.secret
        target = f"{path}?{query}" if query else path
        headers = {"x-ms-version": container.api_version, "x-ms-date": formatdate(usegmt=True), **headers}
        try:
            if self._sign is not None:
                headers = self._sign(method, origin + target, headers)
            elif self._credential is not None:
                token = await self._credential.get_token("https://storage.azure.com/.default")
                headers["Authorization"] = f"Bearer {token.token}"
            resp = await self._data.request(method, target, headers, **kwargs)
        except (ProtocolError, ConnectionError, asyncio.TimeoutError, socket.gaierror) as exc:
            refused = isinstance(exc, (ConnectionRefusedError, socket.gaierror))
            raise unreachable("Azure", self.endpoint.url, self.url(key), type(exc).__name__, key=key,
                              first_contact=refused and not self._connected) from exc
        except ClientAuthenticationError as exc:
            raise self._error(exc, key) from exc
        self._connected = True
        if resp.status >= 300 and resp.status != 416:
            reason = re.search(rb"<Message>([^<\n]*)", resp.body)
            raise self._classify(resp.status, resp.headers.get("x-ms-error-code", ""),
                                 reason[1].decode("utf-8", "replace") if reason else "", key)
        return resp

    async def _md5(self, data: Buffer) -> bytes | None:
        if not self.content_md5 or not len(data):
            return None
        if len(data) < MiB:
            return hashlib.md5(data).digest()
        return await asyncio.to_thread(lambda: hashlib.md5(data).digest())

    async def head(self, key: str) -> ObjectMeta:
        try:
            props = await self._blob(key).get_blob_properties()
        except Exception as exc:
            raise self._error(exc, key) from exc
        return ObjectMeta(key, props.size, props.last_modified.timestamp(), props.etag,
                          _decode_metadata(props.metadata))

    async def receive(self, key: str, start: int, length: int, into: Receiver) -> int:
        """One ranged Get Blob on the HTTP data path, its body received straight by ``into``."""
        if not length:
            return 0
        resp = await self.send("GET", key, "", {"x-ms-range": f"bytes={start}-{start + length - 1}"}, into=into)
        if resp.status == 416:  # start at or past the end
            return 0
        if resp.status == 200 and start:
            raise StoreError(f"{self.url(key)}: {self.endpoint.url} ignored the range")
        return resp.received

    async def put(
        self, key: str, data: Buffer, *, if_absent: bool = False, metadata: dict[str, str] | None = None
    ) -> None:
        md5 = await self._md5(data)
        extra = {"transactional_content_md5": md5} if md5 else {}
        try:
            await self._blob(key).upload_blob(
                data if isinstance(data, bytes) else bytes(data), length=len(data), overwrite=not if_absent,
                metadata=_encode_metadata(metadata), max_concurrency=1, **extra)
        except Exception as exc:
            raise self._error(exc, key, if_absent=if_absent) from exc

    async def list_page(self, prefix: str, delimiter: str | None = None, token: str | None = None) -> ListPage:
        """One List Blobs request (a hierarchical listing when ``delimiter`` is given)."""
        container = self._container()
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
                                              _decode_metadata(item.metadata)))
        except StopAsyncIteration:
            pass
        except Exception as exc:
            raise self._error(exc, None) from exc
        return ListPage(objects, prefixes, pages.continuation_token or None)

    async def delete(self, key: str) -> None:
        try:
            await self._blob(key).delete_blob()
        except Exception as exc:
            err = self._error(exc, key)
            if type(err) is not ObjectNotFoundError:
                raise err from exc

    async def delete_many(self, keys: list[str]) -> None:
        await gather_bounded([self.delete(k) for k in keys], self.max_connections)

    async def create_multipart(
        self, key: str, part_size: int, metadata: dict[str, str] | None = None, *, if_absent: bool = False
    ) -> MultipartUpload:
        return AzureUpload(self, key, dict(metadata or {}), if_absent)

    async def resume_multipart(self, key: str, upload_id: str, part_size: int, *,
                               if_absent: bool = False) -> MultipartUpload | None:
        """The blob's uncommitted blocks of this upload (their ids start with the upload id)."""
        if not re.fullmatch(r"[0-9a-f]{18}", upload_id):
            return None
        upload = AzureUpload(self, key, {}, if_absent, upload_id)
        try:
            _, uncommitted = await self._blob(key).get_block_list("uncommitted")
        except Exception as exc:
            error = self._error(exc, key)
            if type(error) is ObjectNotFoundError:
                return upload
            raise error from exc
        for block in uncommitted:
            index = block.id[len(upload_id):]
            if block.id.startswith(upload_id) and index.isdigit():
                upload.stored[int(index)] = PartInfo(int(index), block.size, block.id)
        return upload

    async def list_pending_uploads(self, prefix: str = "") -> list[PendingUpload]:
        """Blobs that have staged (uncommitted) blocks and no committed version.

        Uncommitted blocks staged over an existing committed blob are not reported: Azure lists only
        the committed blob then (they are discarded by its next commit, or after 7 days).
        """
        prefix = prefix.strip("/")
        container = self._container()
        try:
            committed = {b.name async for b in container.list_blobs(name_starts_with=prefix or None)}
            return [PendingUpload(b.name, f"uncommitted:{b.name}", b.last_modified.timestamp())
                    async for b in container.list_blobs(name_starts_with=prefix or None,
                                                        include=["uncommittedblobs"])
                    if b.name not in committed and in_prefix(b.name, prefix)]
        except Exception as exc:
            raise self._error(exc, None) from exc

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


def shared_key_signer(account: str, key: str) -> Callable[[str, str, dict[str, str]], dict[str, str]]:
    """``sign(method, url, headers) -> headers`` with Authorization added by the SDK's own shared-key policy.

    The one private SDK part this backend relies on (``azure.storage.blob._shared.authentication``); a clear
    error, not an ImportError or AttributeError, if it changes.
    """
    try:
        from azure.storage.blob._shared.authentication import SharedKeyCredentialPolicy
    except ImportError as exc:
        raise StoreError(f"azure-storage-blob {VERSION} changed shape: its SharedKeyCredentialPolicy is gone; "
                         "fastckpt needs an update") from exc
    policy = SharedKeyCredentialPolicy(account, key)
    if not callable(getattr(policy, "on_request", None)):
        raise StoreError(f"azure-storage-blob {VERSION} changed shape: SharedKeyCredentialPolicy.on_request is "
                         "gone; fastckpt needs an update")

    def sign(method: str, url: str, headers: dict[str, str]) -> dict[str, str]:
        request = PipelineRequest(HttpRequest(method, url, headers=headers), PipelineContext(None))
        policy.on_request(request)
        return dict(request.http_request.headers)

    return sign


def _redact(text: str) -> str:
    """First line of ``text`` with any SAS signature blanked."""
    return re.sub(r"sig=[^&\s'\"]+", "sig=REDACTED", text.split("\n", 1)[0])


class AzureUpload(MultipartUpload):
    """Blocks staged with fixed-length ids (upload id + 6-digit index), committed in index order."""

    def __init__(self, store: AzureStore, key: str, metadata: dict[str, str], if_absent: bool,
                 upload_id: str | None = None) -> None:
        self.key, self._store, self._metadata, self._if_absent = key, store, metadata, if_absent
        self.upload_id = upload_id or secrets.token_hex(9)
        self.stored: dict[int, PartInfo] = {}
        self._closed = False
        self._discarded = False

    def block_id(self, index: int) -> str:
        """The block id of part ``index`` (24 characters; the SDK base64-encodes it)."""
        if not 0 <= index < AzureStore.max_parts:
            raise ValueError(f"part index {index} of {self.key!r} is outside 0..{AzureStore.max_parts - 1}")
        return f"{self.upload_id}{index:06d}"

    async def put_part(self, index: int, data: Buffer) -> PartInfo:
        if self._closed:
            raise StoreError(f"multipart upload of {self._store.url(self.key)} is no longer active")
        block_id = self.block_id(index)
        md5 = await self._store._md5(data)
        headers = {"Content-Length": str(len(data))}
        if md5:
            headers["Content-MD5"] = base64.b64encode(md5).decode()
        encoded = quote(base64.b64encode(block_id.encode()).decode(), safe="")
        await self._store.send("PUT", self.key, f"comp=block&blockid={encoded}", headers, body=data)
        return PartInfo(index, len(data), block_id)

    async def complete(self, parts: list[PartInfo], metadata: dict[str, str] | None = None) -> None:
        if self._closed:
            raise StoreError(f"multipart upload of {self._store.url(self.key)} is no longer active")
        if [p.index for p in parts] != list(range(len(parts))):
            raise StoreError(f"multipart upload of {self._store.url(self.key)}: parts are not 0..n-1")
        condition = {"if_none_match": "*"} if self._if_absent else {}
        try:
            await self._store._blob(self.key).commit_block_list(
                [p.token or self.block_id(p.index) for p in parts],
                metadata=_encode_metadata(self._metadata if metadata is None else metadata), **condition)
        except Exception as exc:
            raise self._store._error(exc, self.key, if_absent=self._if_absent) from exc
        self._closed = self._discarded = True

    async def abort(self) -> None:
        self._closed = True
        if not self._discarded:
            await self._store.discard_uncommitted(self.key)
            self._discarded = True


def from_uri(uri: StorageURI, config: TransferConfig) -> AzureStore:
    """Store for ``uri``'s container, configured by ``AzureOptions``."""
    return AzureStore(uri.bucket, AzureOptions.from_uri(uri), max_connections=config.max_in_flight + 8)
