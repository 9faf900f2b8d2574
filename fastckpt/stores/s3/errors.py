"""Every S3 failure as a fastckpt error, one line and never a credential: the service's answers (from the data
path's XML or from botocore), botocore's and aiohttp's own failures, and requests that got no answer."""

from __future__ import annotations

import re
import socket
import ssl

from ...errors import AccessDeniedError, StoreError, TransientStoreError
from ...http import Response
from ..classify import ErrorTable, classify, unreachable
from ..datapath import NO_ANSWER, DataPath
from .options import S3Options

__all__ = ["ERRORS", "LAZY_IMPORTS", "NO_CONDITIONAL", "NoSuchUpload", "S3Errors", "request_failure"]

ERRORS = ErrorTable(
    "s3",
    bucket_missing=frozenset({"NoSuchBucket"}),
    not_found=frozenset({"NoSuchKey", "NotFound"}),
    conflict=frozenset({"PreconditionFailed", "ConditionalRequestConflict"}),
    denied=frozenset({"AccessDenied", "AllAccessDisabled", "AccountProblem", "InvalidAccessKeyId",
                      "SignatureDoesNotMatch", "ExpiredToken", "InvalidToken", "TokenRefreshRequired"}),
    transient=frozenset({"RequestTimeout", "RequestTimeTooSkewed", "InternalError", "OperationAborted",
                         "RequestTimeoutException", "BadDigest"}),
    throttling=frozenset({"SlowDown", "ServiceUnavailable", "Throttling", "ThrottlingException", "RequestThrottled",
                          "TooManyRequests", "PriorRequestNotComplete"}),
    hints={"InvalidAccessKeyId": "access key id not recognised; check AWS_ACCESS_KEY_ID or the profile",
           "SignatureDoesNotMatch": "secret key does not match the access key; "
                                    "check AWS_SECRET_ACCESS_KEY or the profile",
           **dict.fromkeys(("ExpiredToken", "InvalidToken", "TokenRefreshRequired"),
                           "session token rejected; refresh credentials")},
)
NO_CONDITIONAL = frozenset({"NotImplemented", "InvalidArgument", "InvalidRequest", "UnsupportedOperation"})
"""Codes of a server that does not know ``If-None-Match`` on a write."""
LAZY_IMPORTS = ("aiobotocore", "botocore", "aiohttp")
"""Imported on first use only (~0.45 s): a restore from an endpoint of one's own with the keys in the environment
never needs them (``fastckpt doctor`` checks they are installed)."""
_SDKS = frozenset(LAZY_IMPORTS)


class NoSuchUpload(StoreError):
    """The multipart upload was completed or aborted already."""


def request_failure(exc: BaseException) -> bool:
    """Whether ``exc`` is a failed request: one that got no answer, or one of the SDKs' errors."""
    return isinstance(exc, NO_ANSWER) or type(exc).__module__.partition(".")[0] in _SDKS


class S3Errors:
    """The translation for one bucket: messages name ``s3://bucket/key`` and the endpoint."""

    def __init__(self, bucket: str, options: S3Options, data: DataPath) -> None:
        self.bucket, self.options, self.data = bucket, options, data

    def where(self, key: str) -> str:
        """``s3://bucket/key`` for messages (``s3://bucket`` without a key)."""
        return f"s3://{self.bucket}/{key}" if key else f"s3://{self.bucket}"

    def translate(self, exc: BaseException, key: str, *, if_absent: bool = False) -> StoreError:
        """The error for a failed request (``request_failure``)."""
        error: StoreError | None = None
        if type(exc).__module__.partition(".")[0] in _SDKS:
            error = self._sdk(exc, key, if_absent)
        elif isinstance(exc, NO_ANSWER):
            error = self.data.failure(exc, self.where(key), key or None)
        if error is None:
            error = StoreError(f"{self.where(key)}: {type(exc).__name__} at endpoint {self.options.shown}: "
                               + " ".join(str(exc).split()))
        error.key, error.backend = error.key or key or None, "s3"
        return error

    def answer(self, resp: Response, key: str, if_absent: bool) -> StoreError:
        """The error for an S3 error answer on the data path (its XML Code and Message)."""
        def field(name: str) -> str:
            found = re.search(rf"<{name}>([^<]*)</{name}>".encode(), resp.body)
            return found[1].decode("utf-8", "replace") if found else ""

        return self.service(resp.status, field("Code") or str(resp.status), field("Message"), key, if_absent)

    def service(self, status: int, code: str, message: str, key: str, if_absent: bool) -> StoreError:
        """The error for an error the S3 service answered (``code``, from its XML or botocore)."""
        self.data.answered()
        where = self.where(key)
        if code == "NoSuchUpload":
            return NoSuchUpload(f"multipart upload of {where} no longer exists (completed or aborted)")
        return classify(ERRORS, status, code, place=where, bucket=f"bucket {self.bucket!r}",
                        at=f" at endpoint {self.options.shown}", key=key or None, if_absent=if_absent,
                        detail=" ".join(message.split()))

    def no_credentials(self, key: str) -> AccessDeniedError:
        return AccessDeniedError(f"no AWS credentials found for {self.where(key)}: set AWS_ACCESS_KEY_ID and "
                                 "AWS_SECRET_ACCESS_KEY, AWS_PROFILE, or use ?anonymous=true", key=key or None,
                                 backend="s3")

    def _sdk(self, exc: BaseException, key: str, if_absent: bool) -> StoreError | None:
        """The error for a botocore or aiohttp failure (raised by the SDK, so it is imported); None for one without
        a meaning of its own."""
        import aiohttp
        from botocore import exceptions as bx

        where = self.where(key)
        if isinstance(exc, bx.ClientError):
            error = exc.response.get("Error", {})
            status = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
            return self.service(status, str(error.get("Code", "")), str(error.get("Message", "")), key, if_absent)
        if isinstance(exc, bx.NoCredentialsError):
            return self.no_credentials(key)
        if isinstance(exc, (bx.PartialCredentialsError, bx.CredentialRetrievalError)):
            return AccessDeniedError(f"AWS credentials for {where} are incomplete or unavailable: {exc}")
        if isinstance(exc, bx.ProfileNotFound):
            return StoreError(f"AWS profile {self.options.profile or self.options.env_profile!r} not found "
                              f"(needed for {where})")
        if isinstance(exc, bx.SSLError):
            return self.data.failure(ssl.SSLError(str(exc)), where, key or None)
        if isinstance(exc, (bx.EndpointConnectionError, bx.ConnectTimeoutError)):
            cause = exc.kwargs.get("error", exc)
            refused = isinstance(exc, bx.ConnectTimeoutError) or isinstance(
                cause, (aiohttp.ClientConnectorError, socket.gaierror))  # not a reset after connecting
            return unreachable("S3", self.options.shown, where, " ".join(str(cause).split()),
                               first_contact=refused and not self.data.connected)
        if isinstance(exc, (bx.ReadTimeoutError, bx.HTTPClientError, bx.IncompleteReadError, aiohttp.ClientError)):
            return TransientStoreError(f"{where}: {type(exc).__name__} talking to {self.options.shown}")
        return None
