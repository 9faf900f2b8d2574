"""Where and as whom to connect to Azure Blob Storage, from the URI's options and the ``AZURE_STORAGE_*``
environment: the only place the Azure backend reads the environment.

Credentials, first match wins: ``?anonymous``; ``AZURE_STORAGE_CONNECTION_STRING``; an account key
(``AZURE_STORAGE_ACCOUNT_KEY`` / ``AZURE_STORAGE_KEY``); a SAS (``AZURE_STORAGE_SAS_TOKEN``); the emulator's
published key for ``devstoreaccount1`` behind an ``endpoint_override``; ``azure-identity``'s
``DefaultAzureCredential`` when installed.
"""

from __future__ import annotations

import importlib.util
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import ClassVar
from urllib.parse import urlsplit

from azure.core.credentials import AzureNamedKeyCredential

from ...config import env_flag
from ...errors import AccessDeniedError
from ...uri import StorageURI, check_options, parse_flag
from .controls import AzureControls

__all__ = ["EMULATOR_ACCOUNT", "EMULATOR_KEY", "AzureOptions", "parse_connection_string", "resolve_endpoint"]

EMULATOR_ACCOUNT = "devstoreaccount1"
# Azurite's and the storage emulator's published well-known key (public; used only for devstoreaccount1).
EMULATOR_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="


@dataclass(frozen=True)
class AzureOptions:
    """Where and as whom to connect. ``kind`` is ``key``, ``sas``, ``anonymous`` or ``default``
    (``DefaultAzureCredential``, created in the running loop); ``secret`` is never shown."""

    QUERY: ClassVar[frozenset[str]] = frozenset({"account", "endpoint_override", "endpoint_suffix", "anonymous",
                                                 *AzureControls.QUERY})
    account: str
    url: str
    kind: str
    source: str
    """Where the credential came from, for error messages (never the secret itself)."""
    secret: str = field(default="", repr=False)
    content_md5: bool = True
    controls: AzureControls = field(default_factory=AzureControls)
    """Encryption and container policies every request honours (``stores.azure.controls``)."""

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
                 else self.url, **self.controls.query()}
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
    return AzureOptions(account, url, kind, source, secret, env_flag("FASTCKPT_AZURE_CONTENT_MD5", True, env),
                        AzureControls.from_options(options, env))
