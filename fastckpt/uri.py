"""Parse storage URIs into a backend name, a bucket (or container) and a key prefix."""

from __future__ import annotations

import functools
import os
import re
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from urllib.parse import parse_qsl, unquote, urlencode, urlsplit

from .config import parse_bool

__all__ = ["BACKEND_OF_SCHEME", "ENTRY_POINTS", "StorageURI", "check_options", "join_key", "names_folder",
           "option_text", "parse_flag", "parse_uri", "plugin_schemes", "redact", "with_options"]

BACKEND_OF_SCHEME = {
    "s3": "s3",
    "s3a": "s3",
    "gs": "gcs",
    "gcs": "gcs",
    "abfss": "azure",
    "abfs": "azure",
    "az": "azure",
    "azure": "azure",
    "file": "local",
    "local": "local",
    "memory": "memory",
    "mem": "memory",
}

ENTRY_POINTS = "fastckpt.stores"
"""Entry-point group of third-party backends: name = URI scheme, value = ``module:factory`` where
``factory(uri: StorageURI, config: TransferConfig) -> Store`` (built-in schemes take precedence)."""

_BUCKET_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,254}$")
_AZURE_HOST_RE = re.compile(
    r"^(?P<account>[a-z0-9]+)\.(?:dfs|blob)\.(?P<suffix>core\.(?:windows\.net|chinacloudapi\.cn|usgovcloudapi\.net))$")


@dataclass(frozen=True)
class StorageURI:
    """A parsed storage location.

    ``backend`` is one of s3, gcs, azure, local, memory or ``delegate`` (a scheme fastckpt does not
    implement, handed to pyarrow). ``key`` is the key prefix inside the bucket, without leading or
    trailing slashes; for ``local`` it is the absolute path and ``bucket`` is empty.
    """

    raw: str
    scheme: str
    backend: str
    bucket: str
    key: str
    options: dict[str, str] = field(default_factory=dict, compare=False, hash=False)

    def join(self, *parts: str) -> str:
        """Key of ``parts`` below this URI's prefix."""
        return join_key(self.key, *parts)

    def with_key(self, key: str) -> StorageURI:
        """The same location with another key prefix."""
        return StorageURI(self.raw, self.scheme, self.backend, self.bucket, key.strip("/"), self.options)

    def uri(self) -> str:
        """A URI string that parses back to this location, options included."""
        if self.backend == "local" or not self.options:
            return str(self)
        return f"{self}?{urlencode(self.options, safe=':/')}"

    def flag(self, name: str) -> bool | None:
        """Boolean option ``name``; None when absent (see ``parse_flag``)."""
        return parse_flag(name, self.options.get(name), f"storage URI {self.raw!r}")

    def __str__(self) -> str:
        if self.backend == "local":
            return "/" + self.key
        key = self.key.replace("%", "%25").replace("#", "%23").replace("?", "%3F")  # parses back to self.key
        scheme = "az" if self.backend == "azure" and self.scheme in ("http", "https") else self.scheme
        return f"{scheme}://{self.bucket}/{key}".rstrip("/")


def option_text(value: object) -> str:
    """A value as a URI option writes it: booleans as ``true``/``false``, anything else as ``str`` gives it."""
    return str(value).lower() if isinstance(value, bool) else str(value)


def with_options(uri: str, options: Mapping[str, object]) -> str:
    """``uri`` with ``options`` added to its query (``option_text``; None left out)."""
    given = {k: option_text(v) for k, v in options.items() if v is not None}
    return uri + ("&" if "?" in uri else "?") + urlencode(given) if given else uri


def names_folder(uri: str | os.PathLike[str] | StorageURI) -> bool:
    """Whether ``uri``, as written, names a folder: its path ends with '/' (before any '?options'), as a destination
    of ``aws s3 cp`` or s5cmd does. A parsed ``StorageURI`` never does (its key has no trailing slash)."""
    if isinstance(uri, StorageURI):
        return False
    text = os.fspath(uri)
    if "://" not in text:
        return text.endswith(("/", os.sep))
    return urlsplit(text).path.endswith("/") or text.endswith("/")


def parse_flag(name: str, value: str | None, where: str) -> bool | None:
    """A boolean option (``config.parse_bool``: the same rule on every backend); None when absent."""
    return None if value is None else parse_bool(value, f"{where}: option {name}")


_SECRET_PARAM = re.compile(r"(?i)([?&](?:sig|signature|sas|token|[a-z0-9_-]*(?:key|secret|password|credential|"
                           r"security-token))=)[^&#]*")


def redact(text: str) -> str:
    """``text`` (a URI) with the values of secret-looking query parameters (a SAS ``sig``, keys, tokens) and
    a password in the user info replaced by ``REDACTED``: what messages may show."""
    text = re.sub(r"^([A-Za-z][A-Za-z0-9+.-]*://[^/@:]*):[^/@]*@", r"\1:REDACTED@", text)
    return _SECRET_PARAM.sub(r"\1REDACTED", text)


def check_options(uri: StorageURI, known: frozenset[str]) -> dict[str, str]:
    """``uri``'s options; ValueError naming any that its backend (which takes ``known``) does not."""
    unknown = set(uri.options) - known
    if unknown:
        raise ValueError(f"invalid storage URI {uri.raw!r}: unknown option(s) {sorted(unknown)}; "
                         f"{uri.backend} takes {sorted(known)}")
    return uri.options


@functools.cache
def plugin_schemes() -> frozenset[str]:
    """URI schemes that installed third-party backends register (entry-point group ``ENTRY_POINTS``)."""
    import importlib.metadata  # only for schemes fastckpt does not know (it costs ~20 ms to import)

    return frozenset(ep.name.lower() for ep in importlib.metadata.entry_points(group=ENTRY_POINTS)
                     if ep.name.lower() not in BACKEND_OF_SCHEME)


def join_key(*parts: str) -> str:
    """Join key parts with '/', dropping empty parts and duplicate slashes."""
    return "/".join(p.strip("/") for p in parts if p and p.strip("/"))


def parse_uri(uri: str | os.PathLike[str]) -> StorageURI:
    """Parse ``uri``; raise ``ValueError`` naming the URI and the problem when it is malformed."""
    text = os.fspath(uri)
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"invalid storage URI {text!r}: empty")
    shown = redact(text)  # what messages and ``raw`` show
    if "://" not in text:
        if re.match(r"^[A-Za-z][A-Za-z0-9+.-]*:", text) and not re.match(r"^[A-Za-z]:[\\/]", text):
            raise ValueError(f"invalid storage URI {shown!r}: expected scheme://..., e.g. s3://bucket/prefix")
        path = os.path.abspath(os.path.expanduser(text))
        return StorageURI(shown, "file", "local", "", path.strip("/"))
    parts = urlsplit(text)
    if "#" in text:
        # urlsplit moves everything after '#' (query included) into the fragment: never drop it silently.
        raise ValueError(f"invalid storage URI {shown!r}: '#' starts a URL fragment, which a storage URI cannot "
                         "honour (everything after it would be ignored); write a '#' in a key as %23")
    scheme = parts.scheme.lower()
    backend = BACKEND_OF_SCHEME.get(scheme)
    if backend is None and scheme in ("http", "https") and _AZURE_HOST_RE.match((parts.hostname or "").lower()):
        backend = "azure"
    pairs = parse_qsl(parts.query, keep_blank_values=True)
    options = dict(pairs)
    if len(options) != len(pairs):
        repeated = sorted(k for k, n in Counter(k for k, _ in pairs).items() if n > 1)
        raise ValueError(f"invalid storage URI {shown!r}: option(s) {repeated} given more than once")
    if backend is None:
        backend = scheme if scheme in plugin_schemes() else "delegate"
        return StorageURI(shown, scheme, backend, parts.netloc, unquote(parts.path).strip("/"), options)
    path = unquote(parts.path)
    if backend != "local" and any(p in (".", "..") or "\0" in p for p in path.split("/")):
        raise ValueError(f"invalid storage URI {shown!r}: a key cannot hold a '.' or '..' part or a NUL byte "
                         "(it would be stored as written, then refused by every download)")
    if backend == "local":
        if parts.netloc not in ("", "localhost"):
            raise ValueError(f"invalid storage URI {shown!r}: file:// URIs take no host, use file:///abs/path")
        return StorageURI(shown, scheme, backend, "", os.path.abspath(path or "/").strip("/"), options)
    if backend == "memory":
        return StorageURI(shown, scheme, backend, parts.netloc, path.strip("/"), options)
    if backend == "azure":
        return _parse_azure(shown, scheme, parts.netloc, path, options)
    bucket = parts.netloc
    if not bucket:
        raise ValueError(f"invalid storage URI {shown!r}: missing bucket name ({scheme}://BUCKET/prefix)")
    if not _BUCKET_RE.match(bucket):
        raise ValueError(f"invalid storage URI {shown!r}: {bucket!r} is not a valid bucket name")
    return StorageURI(shown, scheme, backend, bucket, path.strip("/"), options)


def _parse_azure(text: str, scheme: str, netloc: str, path: str, options: dict[str, str]) -> StorageURI:
    """``abfss://container@account.dfs.core.windows.net/p``, ``az://container/p`` or
    ``https://account.blob.core.windows.net/container/p``.

    The account named by the host lands in ``options["account"]`` (unless ``?account=`` is given), and a
    sovereign-cloud host suffix (e.g. ``core.chinacloudapi.cn``) in ``options["endpoint_suffix"]``.
    """
    if scheme in ("http", "https"):
        host = netloc
        container, _, path = path.lstrip("/").partition("/")
    elif "@" in netloc:
        container, host = netloc.split("@", 1)
    else:
        container, host = netloc, ""
    match = _AZURE_HOST_RE.match(host.lower())
    if match:
        options = {**options, "account": options.get("account", match["account"])}
        if match["suffix"] != "core.windows.net":
            options["endpoint_suffix"] = match["suffix"]
    elif host:
        options = {**options, "account": options.get("account", host.split(".")[0])}
    if not container:
        raise ValueError(f"invalid storage URI {text!r}: missing container name")
    if not re.match(r"^[a-z0-9](?:[a-z0-9-]{1,61}[a-z0-9])?$|^\$root$", container):
        raise ValueError(f"invalid storage URI {text!r}: {container!r} is not a valid Azure container name")
    return StorageURI(text, scheme, "azure", container, path.strip("/"), options)
