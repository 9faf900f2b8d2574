"""Bytes a new object shares with a base object, copied by the store instead of sent (incremental checkpoints).

A file whose digest equals its base's is copied whole; a part whose chunk digest equals the base's chunk at the
same index (same chunk size, same length) is copied into the upload (``MultipartUpload.copy_part``). A copy is
trusted only from the base object's version whose recorded digest matches what the base's manifest holds: ``head``
reports the version (an S3 ETag, a GCS generation, an Azure ETag, a local file's inode, size and modification time)
and the digest recorded for it, and the copy is conditional on that version. Anything else (a backend or server that
cannot copy, a base changed or gone since) sends the bytes.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from ..errors import CopyUnsupportedError, ObjectNotFoundError, SourceChangedError
from ..integrity import FileDigest
from ..stores.base import CopySource, MultipartUpload, PartInfo, Store

__all__ = ["NOT_COPIED", "BaseObject", "Reuse", "same_parts"]

log = logging.getLogger("fastckpt")
NOT_COPIED = (CopyUnsupportedError, SourceChangedError, ObjectNotFoundError)
"""What makes a copy fall back to sending the bytes."""


@dataclass(frozen=True)
class BaseObject:
    """An object of the base checkpoint: its key and what its manifest recorded (``chunks``: chunk digests, when
    recorded)."""

    key: str
    digest: FileDigest
    chunks: tuple[bytes, ...] = ()

    def chunk(self, index: int, chunk_size: int, length: int) -> bytes | None:
        """The digest of the base's part ``index`` when it has parts of ``chunk_size`` and that part is ``length``
        bytes long; None otherwise."""
        d = self.digest
        if d.chunk_size != chunk_size or index >= len(self.chunks) or min(chunk_size, d.size - index * chunk_size) \
                != length:
            return None
        return self.chunks[index]


class Reuse:
    """The base objects of one transfer session and what it copied from them."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.copied: dict[str, int] = {}
        """Bytes the store copied, by the key it copied them to."""
        self._versions: dict[str, asyncio.Future[str | None]] = {}
        self._stale: set[str] = set()
        self._said_unsupported = False

    @property
    def total(self) -> int:
        """Bytes the store copied in this session."""
        return sum(self.copied.values())

    async def version(self, base: BaseObject) -> str | None:
        """The version of ``base`` a copy may take (looked up once, however many parts ask at once): None when its
        recorded digest is not the manifest's, it is gone, or a copy found it changed."""
        if base.key not in self._versions:
            self._versions[base.key] = asyncio.ensure_future(self._look_up(base))
        version = await asyncio.shield(self._versions[base.key])
        return None if base.key in self._stale else version

    async def _look_up(self, base: BaseObject) -> str | None:
        try:
            meta = await self.store.head(base.key)
        except ObjectNotFoundError:
            meta = None
        if meta is None or not meta.etag or FileDigest.from_metadata(meta.size, meta.metadata) != base.digest:
            log.info("base object %s is not what its checkpoint recorded: its bytes are sent", self.store.uri(base.key))
            return None
        return meta.etag

    def not_copied(self, base: BaseObject, exc: Exception) -> None:
        """Note a copy that fell back to sending: a base found changed is not copied from again; an unsupported copy
        is logged once per session at debug level."""
        if isinstance(exc, CopyUnsupportedError):
            if not self._said_unsupported:
                self._said_unsupported = True
                log.debug("%s: server-side copies unavailable (%s); bytes are sent", self.store.name, exc)
        else:
            log.info("base object %s changed or vanished: its bytes are sent (%s)", self.store.uri(base.key), exc)
            self._stale.add(base.key)

    async def copy_whole(self, key: str, base: BaseObject, digest: FileDigest, *, if_absent: bool,
                         metadata: dict[str, str] | None) -> bool:
        """``key`` written as the store's copy of ``base`` (which holds ``digest``); False: not copied, send it."""
        version = await self.version(base)
        if version is None or base.digest != digest or not digest.size:
            return False
        try:
            await self.store.copy(key, CopySource(base.key, version, 0, digest.size), if_absent=if_absent,
                                  metadata=metadata)
        except NOT_COPIED as exc:
            self.not_copied(base, exc)
            return False
        self.copied[key] = self.copied.get(key, 0) + digest.size
        return True

    async def copy_part(self, mpu: MultipartUpload, base: BaseObject, index: int, offset: int, length: int,
                        digest: bytes, chunk_size: int) -> PartInfo | None:
        """Part ``index`` (``length`` bytes at ``offset``, chunk digest ``digest``) copied from ``base`` where it
        holds the same chunk there; None: send it."""
        if base.chunk(index, chunk_size, length) != digest:
            return None
        version = await self.version(base)
        if version is None:
            return None
        try:
            info = await mpu.copy_part(index, CopySource(base.key, version, offset, length))
        except NOT_COPIED as exc:
            self.not_copied(base, exc)
            return None
        self.copied[mpu.key] = self.copied.get(mpu.key, 0) + length
        return info


def same_parts(base: BaseObject | None, digest: FileDigest, chunks: list[bytes]) -> BaseObject | None:
    """``base`` with its chunk digests known where the whole file is the same (a manifest that recorded only the
    file's digest); ``base`` as it is otherwise."""
    if base is not None and not base.chunks and base.digest == digest:
        return BaseObject(base.key, base.digest, tuple(chunks))
    return base
