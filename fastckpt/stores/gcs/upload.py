"""Parallel composite uploads: each part a temporary object under a hidden prefix tied to the upload
(``<dir>/.fastckpt-parts/<name>.<upload_id>/<index>.<nonce>``), composed into the target on ``complete`` (at most
32 sources per compose, in several levels when there are more), then deleted; ``abort`` deletes the prefix."""

from __future__ import annotations

import asyncio
import re
import secrets
from typing import TYPE_CHECKING

from ...errors import StoreError
from ...tasks import gather_bounded
from ...transport import Buffer
from ..base import MultipartUpload, PartInfo

__all__ = ["COMPOSE_LIMIT", "PARALLEL", "PARTS_DIR", "PART_RE", "GCSUpload", "parts_prefix"]

if TYPE_CHECKING:
    from .store import GCSStore

PARTS_DIR = ".fastckpt-parts"
COMPOSE_LIMIT = 32
"""Most source objects GCS accepts in one compose request."""
PARALLEL = 16
"""Composes and deletes in flight at once."""
PART_RE = re.compile(r"^(?P<dir>(?:.*/)?)" + re.escape(PARTS_DIR) + r"/(?P<name>[^/]+)\.(?P<id>[0-9a-f]+)/[^/]+$")
"""A temporary part's key: the directory and name of its target, its upload's id."""


def parts_prefix(key: str, upload_id: str) -> str:
    """Hidden prefix (ending in '/') of the temporary part objects of upload ``upload_id`` of ``key``."""
    head, _, name = key.rpartition("/")
    return f"{head}/{PARTS_DIR}/{name}.{upload_id}/" if head else f"{PARTS_DIR}/{name}.{upload_id}/"


class GCSUpload(MultipartUpload):
    """A parallel composite upload: parts are temporary objects composed on ``complete``."""

    def __init__(self, store: GCSStore, key: str, metadata: dict[str, str], if_absent: bool,
                 upload_id: str | None = None) -> None:
        self.key, self.upload_id = key, upload_id or secrets.token_hex(8)
        self._store, self._client, self._metadata, self._if_absent = store, store.client, metadata, if_absent
        self.prefix = parts_prefix(key, self.upload_id)
        self._parts: dict[int, tuple[str, int]] = {}
        """index -> (temporary object, size) of the part stored last; a retried part gets a new name, so a
        cancelled attempt's late clean-up never deletes its successor."""
        self._cleanups: set[asyncio.Future[None]] = set()
        self._closed = False
        self.stored: dict[int, PartInfo] = {}

    def adopt(self, index: int, name: str, size: int) -> bool:
        """Take temporary object ``name`` (``size`` bytes), found by listing, as stored part ``index``; False when
        the part has one already (``name`` is then a spare copy)."""
        if index in self.stored:
            return False
        self._parts[index] = (name, size)
        self.stored[index] = PartInfo(index, size, name)
        return True

    def _check_open(self) -> None:
        if self._closed:
            raise StoreError(f"composite upload of {self._client.url(self.key)} is no longer active")

    async def put_part(self, index: int, data: Buffer) -> PartInfo:
        self._check_open()
        name = f"{self.prefix}{index}.{secrets.token_hex(4)}"
        with memoryview(data) as raw, raw.cast("B") as view:  # released: the caller's buffer goes back to a pool
            size = len(view)
            try:
                await self._client.upload_object(name, view)
            except asyncio.CancelledError:
                # The whole body may have been sent: the server can still store the part after this; delete it
                # (``abort`` waits for these deletions before clearing the prefix).
                cleanup = asyncio.ensure_future(self._store.delete_quietly([name]))
                self._cleanups.add(cleanup)
                cleanup.add_done_callback(self._cleanups.discard)
                raise
        if self._closed:  # aborted meanwhile: leave nothing behind
            await self._store.delete(name)
            self._check_open()
        replaced = self._parts.get(index)
        self._parts[index] = (name, size)
        if replaced:
            await self._store.delete_quietly([replaced[0]])
        return PartInfo(index, size, name)

    async def complete(self, parts: list[PartInfo], metadata: dict[str, str] | None = None) -> None:
        self._check_open()
        indexes = [p.index for p in parts]
        if indexes != list(range(len(parts))) or any(i not in self._parts for i in indexes):
            raise StoreError(f"composite upload of {self._client.url(self.key)}: parts {indexes} "
                             "are not 0..n-1 as uploaded")
        meta = metadata or self._metadata
        if not parts:
            await self._store.put(self.key, b"", metadata=meta, if_absent=self._if_absent)
        else:
            sources, level, temps = [self._parts[i][0] for i in indexes], 0, []
            while len(sources) > COMPOSE_LIMIT:
                groups = [sources[i : i + COMPOSE_LIMIT] for i in range(0, len(sources), COMPOSE_LIMIT)]
                names = [f"{self.prefix}c{level}-{j}" for j in range(len(groups))]
                await gather_bounded([self._client.compose(n, g) for n, g in zip(names, groups, strict=True)],
                                     PARALLEL)
                temps += names
                sources, level = names, level + 1
            if self._if_absent:
                await self._store.check_compose_if_absent(self.key)
            result = await self._client.compose(self.key, sources, meta, if_absent=self._if_absent)
            expected = sum(self._parts[i][1] for i in indexes)
            if int(result.get("size", expected)) != expected:
                raise StoreError(f"compose of {self._client.url(self.key)} made {result.get('size')} bytes, "
                                 f"its parts hold {expected}")
            await self._store.delete_quietly([name for name, _ in self._parts.values()] + temps)
        self._closed = True

    async def abort(self) -> None:
        self._closed = True
        if self._cleanups:
            await asyncio.gather(*self._cleanups, return_exceptions=True)
        await self._store.delete_prefix(self.prefix)
