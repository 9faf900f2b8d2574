"""Which objects or files a command takes: wildcards in a source (``*``, ``?``, ``**``) and include / exclude filters.

One dialect everywhere: ``*`` and ``?`` match within one path part (any run of characters but '/', one character
but '/'), ``**`` matches across parts (``a/**/b`` also matches ``a/b``). A pattern selects a path when it matches the
path or one of its leading folders, so ``run/step-*`` selects every object below ``run/step-1/`` too.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence
from dataclasses import dataclass
from urllib.parse import unquote

from ..errors import ObjectNotFoundError, StoreError
from ..stores.base import Store

__all__ = ["WILDCARDS", "Selection", "glob_match", "has_below", "keys_below", "relative", "split_wildcard"]

WILDCARDS = "*?"
_OPTIONS = re.compile(r"^[A-Za-z_][\w.-]*=[^&]*(?:&[A-Za-z_][\w.-]*=[^&]*)*$")


def split_wildcard(text: str) -> tuple[str, str | None]:
    """``text`` (a URI or a local path) as (the literal folder to list, the pattern below it, or None).

    A '?' starts the URI's options only where all that follows reads as ``name=value&...``; any other '?' is a
    wildcard. The options stay on the folder: ``s3://b/ck/*.bin?endpoint_override=...`` gives
    (``s3://b/ck?endpoint_override=...``, ``*.bin``)."""
    query = ""
    at = text.rfind("?")
    if at >= 0 and _OPTIONS.match(text[at + 1:]):
        text, query = text[:at], text[at:]
    remote = "://" in text
    start = text.index("://") + 3 if remote else 0
    first = min((i for i in (text.find(c, start) for c in WILDCARDS) if i >= 0), default=-1)
    if first < 0:
        return text + query, None
    cut = text.rfind("/", 0, first)
    if remote and cut < start:
        raise ValueError(f"{text!r}: a wildcard cannot stand in the bucket or container name")
    pattern = unquote(text[cut + 1:]) if remote else text[cut + 1:]
    return (text[:cut] if cut > 0 else "/" if cut == 0 else ".") + query, pattern


@functools.lru_cache(maxsize=256)
def _compile(pattern: str) -> re.Pattern[str]:
    """The regular expression of a glob ``pattern`` (see the module docstring)."""
    if not pattern or pattern.startswith("/") or "//" in pattern:
        raise ValueError(f"invalid pattern {pattern!r}: empty, or an empty path part")
    out, i = [], 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out.append("(?:.*/)?")
            i += 3
        elif pattern.startswith("**", i):
            out.append(".*")
            i += 2
        elif pattern[i] == "*":
            out.append("[^/]*")
            i += 1
        elif pattern[i] == "?":
            out.append("[^/]")
            i += 1
        else:
            out.append(re.escape(pattern[i]))
            i += 1
    return re.compile("".join(out))


def glob_match(pattern: str, rel: str, *, anywhere: bool = False) -> bool:
    """Whether ``pattern`` selects the '/'-path ``rel``: it matches ``rel`` or one of its leading folders;
    ``anywhere``: a pattern without '/' may match those at any depth (as a .gitignore line does)."""
    regex = _compile(pattern)
    parts = rel.split("/")
    if anywhere and "/" not in pattern:
        return any(regex.fullmatch(p) for p in parts)
    return any(regex.fullmatch("/".join(parts[:n])) for n in range(len(parts), 0, -1))


@dataclass(frozen=True)
class Selection:
    """A source's wildcard pattern (relative to the listed folder) and ordered filters: every path is taken by
    default, ``("exclude", p)`` drops what ``p`` selects, ``("include", p)`` takes it back; later filters win (as
    ``aws s3 cp --exclude/--include``)."""

    pattern: str | None = None
    filters: tuple[tuple[str, str], ...] = ()

    @classmethod
    def of(cls, pattern: str | None, filters: Sequence[tuple[str, str]] = ()) -> Selection:
        """Checked: each filter is ("include" | "exclude", a valid pattern)."""
        for kind, pat in [*filters, *([("include", pattern)] if pattern else [])]:
            if kind not in ("include", "exclude"):
                raise ValueError(f"unknown filter {kind!r}: include or exclude")
            _compile(pat)
        return cls(pattern, tuple(filters))

    @property
    def everything(self) -> bool:
        """Whether it takes every path (no wildcard, no filter)."""
        return self.pattern is None and not self.filters

    def takes(self, rel: str) -> bool:
        """Whether the path ``rel`` (relative to the listed folder) is selected."""
        if self.pattern is not None and not glob_match(self.pattern, rel):
            return False
        taken = True
        for kind, pat in self.filters:
            if glob_match(pat, rel, anywhere=True):
                taken = kind == "include"
        return taken


async def has_below(store: Store, key: str) -> bool:
    """Whether objects lie below ``key`` (a folder): one listing request on a paged store."""
    base = key.strip("/")
    if store.paged:
        page = await store.list_page(base + "/" if base else "", "/")  # a backend's hidden keys group into prefixes
        return any(not store.is_hidden(k) for k in [*(m.key for m in page.objects), *page.prefixes])
    async for meta in store.list(base):
        if meta.key != base:
            return True
    return False


def relative(prefix: str, key: str) -> str:
    """``key``'s path below the folder ``prefix`` ("" for the object named ``prefix`` itself)."""
    return key[len(prefix):].lstrip("/") if prefix else key


async def keys_below(store: Store, prefix: str) -> list[tuple[str, str, int]]:
    """(key, path relative to ``prefix``, size) of every object below ``prefix``; error when none, or when a name
    has an empty, '.' or '..' part (it could not become a local path)."""
    prefix = prefix.strip("/")
    found = []
    async for meta in store.list(prefix):
        rel = relative(prefix, meta.key)
        if not rel:
            continue
        if any(part in ("", ".", "..") for part in rel.split("/")):
            raise StoreError(f"refusing unsafe object name {meta.key!r}")
        found.append((meta.key, rel, meta.size))
    if not found:
        raise ObjectNotFoundError(f"nothing found below {prefix!r} in {store.name}")
    return found
