"""How one store talks to S3: the data path (``stores.datapath``), its requests addressed and signed with SigV4
for the bucket's region, and aiobotocore's client for the requests off it; every failure translated
(``stores.s3.errors``).

On a path-style endpoint of the user's own the data path is addressed without botocore's client, so a restore
never builds one (~0.2 CPU-s); on AWS botocore's endpoint rules place the bucket. aiobotocore's own retries are off
(``stores.retry`` retries); botocore, aiobotocore and aiohttp are imported on first use.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar
from urllib.parse import quote, urlsplit

from ... import stats
from ...errors import StoreError
from ...http import Response
from ...transport import Buffer, FileRange, Pieces, Receiver
from ..controls import hide_in_logs
from ..datapath import DataPath
from .answers import timestamp
from .controls import S3Controls, operation_of
from .errors import S3Errors, request_failure
from .options import S3Options, env_credentials
from .sigv4 import UNSIGNED_PAYLOAD, S3Signer

__all__ = ["S3Client"]

if TYPE_CHECKING:
    from aiobotocore.session import AioSession

T = TypeVar("T")


class S3Client:
    """The connections of one bucket's store; made on first use, inside the loop that drives the store."""

    def __init__(self, bucket: str, options: S3Options, *, max_pool_connections: int) -> None:
        self.bucket, self.options = bucket, options
        self.addressing_style = options.addressing_style or ("path" if options.endpoint_url else "auto")
        self.max_pool_connections = max_pool_connections
        self.data = DataPath("S3", options.shown, limit=max_pool_connections, connect_timeout=options.connect_timeout)
        self.errors = S3Errors(bucket, options, self.data)
        self._sdk: Any = None
        self._session: AioSession | None = None
        self._sdk_clients = contextlib.AsyncExitStack()
        self._signing: tuple[str, Any, S3Signer] | None = None  # (bucket's path, credentials, signer)
        self._sdk_lock, self._path_lock = asyncio.Lock(), asyncio.Lock()
        self.bucket_ok = False
        """Whether the bucket is known to exist (a 404 then names the object, not the bucket)."""
        self._region: str | None = None
        """The bucket's region as another process found it (``assume``): no HeadBucket to find it again."""

    @property
    def sends_files(self) -> bool:
        """Whether part bodies may be sent from their files: the data path is plain HTTP, and payloads are not
        signed (signing would read the bytes)."""
        return (self.data.sends_files and self._signing is not None
                and (self.options.payload_signing is False or self._signing[1] is None))

    async def send(self, method: str, key: str, query: dict[str, str], headers: dict[str, str], *,
                   body: Buffer | FileRange | Pieces | None = None, into: Receiver | None = None,
                   if_absent: bool = False) -> Response:
        """A request on the data path; errors as fastckpt errors (a 2xx or 416 answer is returned, a 206 or 200 with
        its body received by ``into``)."""
        path = (await self._data_path())[0]
        headers = {**headers, **self.options.controls.headers(operation_of(method, key, query, headers))}
        target = path + quote(key, safe="/~")
        if query:
            target += "?" + "&".join(f"{k}={quote(v, safe='-_.~')}" if v else k for k, v in query.items())
        resp = await self._translating(lambda: self._sign_and_send(method, target, headers, body, into, key), key,
                                       if_absent)
        if not 200 <= resp.status < 300 and resp.status != 416:
            raise self.errors.answer(resp, key, if_absent)
        return resp

    async def call(self, op: str, key: str, *, if_absent: bool = False, **params: Any) -> Any:
        """Run aiobotocore operation ``op`` on this bucket; its errors as fastckpt errors."""
        client = await self.sdk()
        try:
            resp = await getattr(client, op)(Bucket=self.bucket, **params)
        except Exception as exc:
            if not request_failure(exc):
                raise
            raise self.errors.translate(exc, key, if_absent=if_absent) from exc
        self.data.answered()
        return resp

    async def close(self) -> None:
        self._sdk = self._signing = None
        await self.data.close()
        clients, self._sdk_clients = self._sdk_clients, contextlib.AsyncExitStack()
        await clients.aclose()

    # ----------------------------------------------------------------------------- aiobotocore

    async def sdk(self) -> Any:
        """The aiobotocore S3 client (created on first use, in the running loop)."""
        if self._sdk is None:
            async with self._sdk_lock:
                if self._sdk is None:
                    self._sdk = await self._translating(lambda: self._open_sdk(self._configured_region()))
                    self._sdk.meta.events.register("before-sign.s3.DeleteObjects", _content_md5)
        return self._sdk

    def _aio_session(self) -> AioSession:
        if self._session is None:
            from aiobotocore.session import AioSession

            self._session = AioSession(profile=self.options.profile)
            # listings of many uploads: ISO 8601 times parsed by datetime, not dateutil
            self._session.get_component("response_parser_factory").set_parser_defaults(timestamp_parser=timestamp)
        return self._session

    def _configured_region(self) -> str:
        return self.options.region or self._aio_session().get_config_variable("region") or "us-east-1"

    async def _open_sdk(self, region: str) -> Any:
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
        client = await self._sdk_clients.enter_async_context(self._aio_session().create_client(
            "s3", region_name=region, endpoint_url=opts.endpoint_url, use_ssl=opts.use_ssl, config=config))
        client.meta.events.register("before-send.s3", _counted)
        if opts.controls != S3Controls():
            client.meta.events.register("before-sign.s3", self._controlled)
            if opts.controls.sse_customer_key:  # botocore's debug lines show the headers it signs and sends
                hide_in_logs(opts.controls.sse_customer_key, ("botocore.auth", "botocore.endpoint"))
        return client

    def _controlled(self, request: Any, operation_name: str, **_: Any) -> None:
        """The bucket's controls on a request of the SDK, as on the data path's (``stores.s3.controls``)."""
        for name, value in self.options.controls.headers(operation_name).items():
            request.headers[name] = value

    async def _translating(self, start: Callable[[], Awaitable[T]], key: str = "", if_absent: bool = False) -> T:
        """``await start()``, a failed request (a botocore one included) raised as a fastckpt error."""
        try:
            return await start()
        except StoreError:
            raise
        except Exception as exc:
            if not request_failure(exc):
                raise
            raise self.errors.translate(exc, key, if_absent=if_absent) from exc

    # ----------------------------------------------------------------------------- the data path

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

    def learned(self) -> dict[str, Any]:
        """The bucket's region (and that it exists) once the data path found them; ``assume`` takes them."""
        if self._signing is None:
            return {}
        return {"s3": (self.bucket, self.options.endpoint_url), "region": self._signing[2].region,
                "bucket_ok": self.bucket_ok}

    def assume(self, learned: dict[str, Any]) -> None:
        """Start the data path from the region another process's client of this bucket ``learned``."""
        if learned.get("s3") == (self.bucket, self.options.endpoint_url) and isinstance(learned.get("region"), str):
            self._region, self.bucket_ok = learned["region"], self.bucket_ok or learned.get("bucket_ok") is True

    async def _start_data_path(self) -> None:
        opts = self.options
        credentials = None
        if not opts.anonymous:  # the keys in the environment come first, as in botocore's chain (unless ?profile=)
            credentials = (None if opts.profile else env_credentials()) or await self._aio_session().get_credentials()
            if credentials is None:
                raise self.errors.no_credentials("")
        own_endpoint = bool(opts.endpoint_url) and self.addressing_style == "path"
        if own_endpoint:
            endpoint = urlsplit(opts.endpoint_url)
            origin, path = f"{endpoint.scheme}://{endpoint.netloc}", f"{endpoint.path.rstrip('/')}/{self.bucket}/"
            region = self._region or self._configured_region()
        else:
            client = await self.sdk()
            region = self._region or await self._bucket_region(client) or client.meta.region_name
            addressing = client if region == client.meta.region_name else await self._open_sdk(region)
            origin, path = await self._address(addressing)
        self.data.open(origin)
        self._signing = (path, credentials, S3Signer(self.data.client.host_header, region))
        if own_endpoint and self._region is None:
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
            self.bucket_ok = True
        except ClientError as exc:
            answer = exc.response
        except Exception as exc:
            if not request_failure(exc):
                raise
            return None
        return answer.get("ResponseMetadata", {}).get("HTTPHeaders", {}).get("x-amz-bucket-region")

    async def _follow_bucket_region(self) -> None:
        """HeadBucket on the data path: requests are signed for the region it names (``x-amz-bucket-region``,
        sent whatever the answer's status), as botocore follows a bucket to its region."""
        assert self._signing is not None
        path, credentials, signer = self._signing
        try:
            resp = await self._sign_and_send("HEAD", path, self.options.controls.headers("Bucket"), None, None, "")
        except StoreError:
            return  # the requests that follow report it
        self.bucket_ok = 200 <= resp.status < 300
        region = resp.headers.get("x-amz-bucket-region")
        if region and region != signer.region:
            self._signing = (path, credentials, S3Signer(self.data.client.host_header, region))

    async def _sign_and_send(self, method: str, target: str, headers: dict[str, str],
                             body: Buffer | FileRange | Pieces | None, into: Receiver | None, key: str) -> Response:
        """Sign with SigV4 as botocore would (``stores.s3.sigv4``), then send."""
        assert self._signing is not None
        _, credentials, signer = self._signing
        if credentials is not None:
            payload = UNSIGNED_PAYLOAD if self.options.payload_signing is False else _sha256(body)
            signer.sign(method, target, headers, await credentials.get_frozen_credentials(), payload)
        return await self.data.request(method, target, headers, where=self.errors.where(key), key=key or None,
                                       body=body, into=into)


def _sha256(body: Buffer | Pieces | None) -> str:
    """Hex SHA-256 of a signed payload (None: the SDK's default, signed; empty)."""
    h = hashlib.sha256()
    for piece in body if isinstance(body, tuple) else (body if body is not None else b"",):
        h.update(piece)
    return h.hexdigest()


def _content_md5(request: Any, **_: Any) -> None:
    """Add Content-MD5 to DeleteObjects: MinIO-based servers (the JuiceFS gateway) refuse it without,
    and botocore's newer defaults send only a CRC."""
    body = request.body if isinstance(request.body, bytes) else None
    if body is not None and "Content-MD5" not in request.headers:
        request.headers["Content-MD5"] = base64.b64encode(hashlib.md5(body).digest()).decode()


def _counted(request: Any, **_: Any) -> None:
    """Count a request of the SDK in ``fastckpt.stats`` (as the data path counts its own)."""
    body = request.body
    stats.request(request.method, "S3", len(body) if isinstance(body, (bytes, bytearray)) else 0)
