"""Every Azure failure as a fastckpt error, one line naming the account and container, never a secret: the SDK's
exceptions and the data path's error answers, through one table."""

from __future__ import annotations

import asyncio
import re

import aiohttp
from azure.core.exceptions import (
    ClientAuthenticationError,
    HttpResponseError,
    ServiceRequestError,
    ServiceResponseError,
)

from ...errors import AccessDeniedError, StoreError
from ..classify import ErrorTable, classify, unreachable
from ..datapath import DataPath
from .options import AzureOptions

__all__ = ["ERRORS", "AzureErrors"]

ERRORS = ErrorTable(
    "azure",
    bucket_missing=frozenset({"ContainerNotFound"}),
    not_found=frozenset({"BlobNotFound"}),
    conflict=frozenset({"BlobAlreadyExists", "ConditionNotMet"}),
    denied=frozenset({"AuthenticationFailed", "AuthorizationFailure", "AuthorizationPermissionMismatch"}),
    transient=frozenset({"OperationTimedOut", "InternalError", "Md5Mismatch", "Crc64Mismatch"}),
    throttling=frozenset({"ServerBusy"}),
)


class AzureErrors:
    """The translation for one container."""

    def __init__(self, container: str, options: AzureOptions, data: DataPath) -> None:
        self.container, self.options, self.data = container, options, data

    def url(self, key: str) -> str:
        """Human-readable location of ``key`` (for messages)."""
        return f"azure://{self.options.account}/{self.container}/{key}"

    def translate(self, exc: Exception, key: str | None, *, if_absent: bool = False) -> Exception:
        """The fastckpt error for an SDK exception."""
        where = self.url(key) if key is not None else \
            f"container {self.container!r} of account {self.options.account!r}"
        if isinstance(exc, (ServiceRequestError, ServiceResponseError, asyncio.TimeoutError, aiohttp.ClientError)):
            refused = isinstance(getattr(exc, "inner_exception", exc), aiohttp.ClientConnectorError)
            return unreachable("Azure", self.options.url, where, type(exc).__name__, key=key,
                               first_contact=refused and not self.data.connected)
        if isinstance(exc, ClientAuthenticationError) and exc.response is None:
            return AccessDeniedError(f"{where}: could not get a token from {self.options.source}", key=key,
                                     backend="azure")
        if not isinstance(exc, HttpResponseError):
            return StoreError(f"{where}: {type(exc).__name__}: {_redact(str(exc))}", key=key, backend="azure")
        code = getattr(exc, "error_code", None) or (exc.response.headers.get("x-ms-error-code", "")
                                                    if exc.response is not None else "")
        return self.answer(exc.status_code or 0, str(getattr(code, "value", code)), exc.reason or "", key, if_absent)

    def answer(self, status: int, code: str, reason: str, key: str | None, if_absent: bool = False) -> Exception:
        """The fastckpt error for an error the service answered."""
        where = self.url(key) if key is not None else f"container {self.container!r}"
        return classify(ERRORS, status, code, place=where, key=key, bucket=f"Azure container {self.container!r}",
                        if_absent=if_absent, detail=reason,
                        at=f" in storage account {self.options.account!r} ({self.options.url})",
                        denied_hint=f"check the credentials ({self.options.source}) and their permissions")


def _redact(text: str) -> str:
    """First line of ``text`` with any SAS signature blanked."""
    return re.sub(r"sig=[^&\s'\"]+", "sig=REDACTED", text.split("\n", 1)[0])
