"""How one store talks to Azure Blob Storage: ``azure-storage-blob``'s asyncio client (metadata, listing, deletes,
block lists; its own retries off: the engine retries) and the shared HTTP data path (ranged reads and staged
blocks, signed as the SDK signs), with the metadata names both carry."""

from __future__ import annotations

import asyncio
import hashlib
import re
from collections.abc import Callable, Mapping
from datetime import datetime, timedelta, timezone
from email.utils import formatdate
from typing import Any
from urllib.parse import quote, urlsplit

import aiohttp
from azure.core.exceptions import ClientAuthenticationError
from azure.core.pipeline import PipelineContext, PipelineRequest
from azure.core.pipeline.transport import AioHttpTransport, HttpRequest
from azure.storage.blob import BlobSasPermissions, generate_blob_sas
from azure.storage.blob import __version__ as VERSION
from azure.storage.blob.aio import BlobClient, ContainerClient

from ...errors import CopyUnsupportedError, StoreError
from ...http import Response
from ...threads import off_loop
from ...transport import Buffer
from ..datapath import DataPath, counting_trace
from .errors import AzureErrors
from .options import AzureOptions

__all__ = [
    "MAX_PUT_BLOB",
    "AzureClient",
    "MiB",
    "decode_metadata",
    "decode_metadata_key",
    "encode_metadata",
    "encode_metadata_key",
    "shared_key_signer",
]

MiB = 1 << 20
MAX_PUT_BLOB = 5000 * MiB


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


def encode_metadata(metadata: Mapping[str, str] | None) -> dict[str, str]:
    return {encode_metadata_key(k): v for k, v in (metadata or {}).items()}


def decode_metadata(metadata: Mapping[str, str] | None) -> dict[str, str]:
    return {decode_metadata_key(k): v for k, v in (metadata or {}).items()}


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


class AzureClient:
    """The connections of one container's store; the SDK client is made on first use, in the loop that drives the
    store."""

    def __init__(self, container: str, options: AzureOptions, *, max_connections: int,
                 connection_timeout: float = 20, read_timeout: float = 60) -> None:
        self.container, self.options = container, options
        self.max_connections = max_connections
        parts = urlsplit(options.url)
        self._origin, self._path = f"{parts.scheme}://{parts.netloc}", parts.path
        self.data = DataPath("Azure", options.url, limit=max_connections, connect_timeout=connection_timeout,
                             origin=self._origin)
        self.errors = AzureErrors(container, options, self.data)
        self._timeouts = (connection_timeout, read_timeout)
        self._client: ContainerClient | None = None
        self.sign: Callable[[str, str, dict[str, str]], dict[str, str]] | None = None
        """The shared-key signer of the data path's requests (made on first use, with an account key)."""
        self._session: aiohttp.ClientSession | None = None
        self._credential: Any = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def container_client(self) -> ContainerClient:
        loop = asyncio.get_running_loop()
        if self._client is not None:
            if loop is not self._loop:
                raise StoreError(f"AzureStore({self.options.url}/{self.container}) is bound to another event loop; "
                                 "open one store per loop")
            return self._client
        credential = self.options.credential
        if credential == "default":
            from azure.identity.aio import DefaultAzureCredential

            credential = self._credential = DefaultAzureCredential()
        connector = aiohttp.TCPConnector(limit=self.max_connections, limit_per_host=0)
        self._session = aiohttp.ClientSession(connector=connector, auto_decompress=False, trust_env=True,
                                              trace_configs=[counting_trace("Azure")])
        transport = AioHttpTransport(session=self._session, session_owner=False,
                                     connection_timeout=self._timeouts[0], read_timeout=self._timeouts[1])
        self._client = ContainerClient(self.options.url, self.container, credential=credential,
                                       transport=transport, retry_total=0, max_single_put_size=MAX_PUT_BLOB,
                                       raw_response_hook=lambda _: self.data.answered())
        self._loop = loop
        return self._client

    def blob(self, key: str) -> BlobClient:
        return self.container_client().get_blob_client(key)

    async def md5(self, data: Buffer) -> bytes | None:
        """The Content-MD5 the service checks (None when turned off, or for no bytes)."""
        if not self.options.content_md5 or not len(data):
            return None
        if len(data) < MiB:
            return hashlib.md5(data).digest()
        return await off_loop(lambda: hashlib.md5(data).digest())

    async def send(self, method: str, key: str, query: str, headers: dict[str, str], **kwargs: Any) -> Response:
        """A request on the HTTP data path for blob ``key`` (``query``: its URL query, without the SAS), signed
        as the SDK signs (shared key, SAS, or a token of the SDK's credential; a Content-Length in ``headers`` is
        signed too); an error answer (other than 416) raises the fastckpt error."""
        container = self.container_client()
        opts = self.options
        if self.sign is None and opts.kind == "key":
            self.sign = shared_key_signer(opts.account, opts.secret)
        path = f"{self._path}/{self.container}/{quote(key, safe='/~')}"
        if opts.kind == "sas":
            query = f"{query}&{opts.secret}" if query else opts.secret
        target = f"{path}?{query}" if query else path
        headers = {"x-ms-version": container.api_version, "x-ms-date": formatdate(usegmt=True), **headers}
        try:
            if self.sign is not None:
                headers = self.sign(method, self._origin + target, headers)
            elif self._credential is not None:
                token = await self._credential.get_token("https://storage.azure.com/.default")
                headers["Authorization"] = f"Bearer {token.token}"
        except ClientAuthenticationError as exc:
            raise self.errors.translate(exc, key) from exc
        resp = await self.data.request(method, target, headers, where=self.errors.url(key), key=key, **kwargs)
        if resp.status >= 300 and resp.status != 416:
            reason = re.search(rb"<Message>([^<\n]*)", resp.body)
            raise self.errors.answer(resp.status, resp.headers.get("x-ms-error-code", ""),
                                     reason[1].decode("utf-8", "replace") if reason else "", key)
        return resp

    async def copy_source(self, key: str) -> dict[str, str]:
        """Headers that name blob ``key`` of this container as the source of a copy the service makes, with what
        authorizes the service to read it: a SAS (the one given, or one signed here with the account key), or the
        credential's token."""
        url = f"{self.options.url}/{self.container}/{quote(key, safe='/~')}"
        opts = self.options
        if opts.controls.customer_key:
            raise CopyUnsupportedError(f"{self.errors.url(key)} is encrypted with a customer-provided key, which the "
                                       "service cannot read as the source of a copy", key=key, backend="azure")
        if opts.kind == "sas":
            return {"x-ms-copy-source": f"{url}?{opts.secret}"}
        if opts.kind == "key":
            sas = generate_blob_sas(opts.account, self.container, key, account_key=opts.secret,
                                    permission=BlobSasPermissions(read=True),
                                    expiry=datetime.now(timezone.utc) + timedelta(hours=1))
            return {"x-ms-copy-source": f"{url}?{sas}"}
        if self._credential is not None:
            token = await self._credential.get_token("https://storage.azure.com/.default")
            return {"x-ms-copy-source": url, "x-ms-copy-source-authorization": f"Bearer {token.token}"}
        return {"x-ms-copy-source": url}

    async def close(self) -> None:
        await self.data.close()
        client, self._client = self._client, None
        if client is not None:
            await client.close()
        if self._session is not None:
            await self._session.close()
            self._session = None
        if self._credential is not None:
            await self._credential.close()
            self._credential = None
