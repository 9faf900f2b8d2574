"""The base of an incremental checkpoint: a committed checkpoint whose unchanged bytes a new one has the store copy.

``resolve_base`` reads the base once (its marker and manifests; ``"latest"``: the newest committed checkpoint beside
the new one) into a ``BaseCheckpoint``, which travels to the other ranks as bytes (the barrier's broadcast, or a DCP
plan). Nothing of the new checkpoint refers to the base: the copies are its own objects under its own names.
"""

from __future__ import annotations

import json
import posixpath
from dataclasses import dataclass

from ..engine.reuse import BaseObject
from ..errors import CheckpointError
from ..integrity import FileDigest
from ..stores.base import Store
from ..tasks import gather_bounded
from ..uri import StorageURI, join_key, parse_uri
from .catalog import SCAN_CONCURRENCY, committed_keys
from .manifest import GENERATION, MARKER, META_DIR, FileEntry, file_doc, file_entry
from .reader import load

__all__ = ["LATEST", "BaseCheckpoint", "base_objects", "encode_none", "resolve_base"]

LATEST = "latest"
_KIND = "fastckpt-base"


@dataclass(frozen=True)
class BaseCheckpoint:
    """A committed checkpoint's files (name -> what its manifests record), read once for a new checkpoint."""

    uri: str
    key: str
    files: dict[str, FileEntry]
    root: str = ""
    """Folder of the files relative to the checkpoint (``Checkpoint.root``)."""

    def object(self, name: str) -> BaseObject | None:
        """File ``name`` of the base, when it has one."""
        entry = self.files.get(name)
        if entry is None:
            return None
        return BaseObject(join_key(self.key, self.root, name), entry.digest,
                          tuple(bytes.fromhex(c) for c in entry.chunks))

    def encode(self) -> bytes:
        """Bytes for the other ranks."""
        return json.dumps({"kind": _KIND, "uri": self.uri, "key": self.key, "root": self.root,
                           "files": [file_doc(e) for e in self.files.values()]}, separators=(",", ":")).encode()

    @classmethod
    def decode(cls, data: bytes, what: str) -> BaseCheckpoint | None:
        """The base ``encode`` wrote (None: no base); CheckpointError with the root's error, or when malformed."""
        try:
            doc = json.loads(data)
            if doc.get("kind") != _KIND:
                raise ValueError("not a base document")
            if "error" in doc:
                raise CheckpointError(f"{what}: {doc['error']}")
            if doc.get("uri") is None:
                return None
            files = [file_entry(f) for f in doc["files"]]
            root = str(doc.get("root", ""))
            if root and not root.startswith(GENERATION):
                raise ValueError(f"files kept in {root!r}")
            return cls(str(doc["uri"]), str(doc["key"]), {f.name: f for f in files}, root)
        except (AttributeError, KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(f"{what}: malformed base document ({exc!r})") from None


def encode_none(error: str | None = None) -> bytes:
    """The document for the other ranks when there is no base (``error``: resolving it failed)."""
    doc: dict[str, object] = {"kind": _KIND, "uri": None}
    if error is not None:
        doc["error"] = error
    return json.dumps(doc).encode()


async def resolve_base(store: Store, target: StorageURI, base: str | StorageURI, *, overwrite: bool = False
                       ) -> BaseCheckpoint | None:
    """The committed checkpoint ``base`` names for a new checkpoint at ``target`` on ``store``: a URI in the same
    bucket, or ``"latest"`` (the newest committed checkpoint beside ``target``; None when there is none yet).
    ``overwrite`` (the new checkpoint replaces the one at ``target``): ``target`` itself may be the base."""
    if isinstance(base, str) and base == LATEST:
        found = await _latest_beside(store, target)
        if found is None:
            return None
        where = target.with_key(found)
    else:
        where = parse_uri(base) if isinstance(base, str) else base
        _same_bucket(where, target)
    if where.key.strip("/") == target.key.strip("/") and not overwrite:
        raise ValueError(f"base {where.raw} is the checkpoint being written")
    ckpt = await load(store, where, allow_uncommitted=False)
    if ckpt.problems:
        raise CheckpointError(f"base checkpoint {where.raw} is corrupt: {ckpt.problems[0].name}: "
                              f"{ckpt.problems[0].reason}")
    files = {name: FileEntry(name, digest, ckpt.chunks.get(name, ()))
             for name, digest in ckpt.files.items() if digest is not None}
    return BaseCheckpoint(where.uri(), ckpt.key, files, ckpt.root)


async def _latest_beside(store: Store, target: StorageURI) -> str | None:
    """Key of the newest committed checkpoint in ``target``'s parent, ``target`` itself excluded."""
    parent = posixpath.dirname(target.key.strip("/"))
    found = [k for k in await committed_keys(store, target, parent) if k.strip("/") != target.key.strip("/")]
    return found[-1] if found else None

async def base_objects(store: Store, target: StorageURI, base: str | StorageURI, keys: list[str]
                       ) -> dict[str, BaseObject]:
    """For an upload of ``keys`` below ``target``: the objects of ``base`` at the same relative names (by key). A
    committed checkpoint's come from its manifests (with chunk digests); a plain prefix's from the digests its
    objects carry."""
    rels = {k: k[len(target.key):].lstrip("/") for k in keys}
    where = parse_uri(base) if isinstance(base, str) and base != LATEST else base
    if isinstance(where, StorageURI):
        _same_bucket(where, target)
        if not await store.exists(join_key(where.key, META_DIR, MARKER)):
            return await _prefix_objects(store, where.key, rels)
    ckpt = await resolve_base(store, target, base)
    if ckpt is None:
        return {}
    return {k: obj for k, rel in rels.items() if (obj := ckpt.object(rel)) is not None}


async def _prefix_objects(store: Store, prefix: str, rels: dict[str, str]) -> dict[str, BaseObject]:
    """The objects below ``prefix`` at the relative names ``rels`` holds (by the key they are for) that carry a
    digest."""
    listed = {m.key async for m in store.list(prefix)}
    wanted = [(k, join_key(prefix, rel)) for k, rel in rels.items() if join_key(prefix, rel) in listed]
    metas = await gather_bounded([store.head(src) for _, src in wanted], SCAN_CONCURRENCY)
    found = {k: (src, FileDigest.from_metadata(m.size, m.metadata)) for (k, src), m in zip(wanted, metas, strict=True)}
    return {k: BaseObject(src, digest) for k, (src, digest) in found.items() if digest is not None}


def _same_bucket(where: StorageURI, target: StorageURI) -> None:
    if (where.backend, where.bucket) != (target.backend, target.bucket):
        raise ValueError(f"base {where.raw} is not in the bucket of {target.raw}: a store copies only within itself")
