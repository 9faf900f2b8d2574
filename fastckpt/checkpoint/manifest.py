"""On-storage formats of the commit protocol: per-rank manifests and the commit marker.

Layout of one checkpoint (DESIGN.md, "The commit protocol")::

    {checkpoint}/...data files of any ranks...
    {checkpoint}/.fastckpt/{attempt}/rank-00003.json   per-rank manifest
    {checkpoint}/.fastckpt/{attempt}/group-00016.json  ranks 16.. of a large world, their manifests in one object
    {checkpoint}/.fastckpt/COMMITTED                   commit marker

The marker names the attempt and the XXH3-128 digest of every rank manifest of that attempt, so a
reader trusts exactly those manifests and nothing a dead attempt left behind. When it records a
``group_size``, readers may take the manifests from the group objects (one read per group, not per rank).
"""

from __future__ import annotations

import json
import math
import numbers
import re
import time
import uuid
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field

import xxhash

from ..errors import CheckpointError
from ..integrity import DIGEST_ALGO, FileDigest, combine
from ..uri import join_key

__all__ = [
    "FORMAT_VERSION",
    "GENERATION",
    "MARKER",
    "META_DIR",
    "REPLACED_DIR",
    "CommitMarker",
    "FileEntry",
    "RankManifest",
    "build_marker",
    "check_attempt",
    "check_metrics",
    "check_name",
    "check_root",
    "decode_group",
    "digest_of",
    "encode_group",
    "file_doc",
    "file_entry",
    "generation_root",
    "group_key",
    "is_marker",
    "marker_key",
    "meta_prefix",
    "parse_rank_name",
    "rank_key",
    "replaced_note_key",
]

FORMAT_VERSION = 1
META_DIR = ".fastckpt"
MARKER = "COMMITTED"
_MANIFEST_RE = re.compile(r"^rank-(\d{5,})\.json$")
_ATTEMPT_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
GENERATION = "v-"
"""Prefix of the folder that holds the files of a save over a committed checkpoint (``generation_root``)."""


def meta_prefix(checkpoint_key: str) -> str:
    """Key of the checkpoint's metadata directory."""
    return join_key(checkpoint_key, META_DIR)


def marker_key(checkpoint_key: str) -> str:
    """Key of the commit marker."""
    return join_key(checkpoint_key, META_DIR, MARKER)


def is_marker(key: str) -> bool:
    """Whether ``key`` (or a key relative to a listed prefix) is a checkpoint's commit marker."""
    marker = marker_key("")
    return key == marker or key.endswith("/" + marker)


def rank_key(meta: str, attempt: str, rank: int) -> str:
    """Key of ``rank``'s manifest of ``attempt`` below the metadata directory ``meta``."""
    return join_key(meta, attempt, f"rank-{rank:05d}.json")


REPLACED_DIR = ".replaced"
"""Below the metadata directory: notes of the keys a writer replaced (left by an uncommitted attempt), so that a
commit re-checks exactly those of its files (a dot: never an attempt id)."""


def replaced_note_key(meta: str) -> str:
    """Key of a new note of replaced keys below the metadata directory ``meta``."""
    return join_key(meta, REPLACED_DIR, f"{uuid.uuid4().hex}.json")


def generation_root(attempt: str) -> str:
    """The folder, relative to the checkpoint, of the files of attempt ``attempt`` when it saves over the checkpoint
    (``overwrite``): beside the files of the checkpoint it replaces, never over them."""
    return GENERATION + check_attempt(attempt)


def check_root(root: str, attempt: str, what: str) -> str:
    """``root`` when it is empty or ``attempt``'s generation folder, else CheckpointError naming ``what``."""
    if root not in ("", GENERATION + attempt):
        raise CheckpointError(f"{what}: files kept in {root!r}, not in attempt {attempt!r}'s folder")
    return root


def group_key(meta: str, attempt: str, first: int) -> str:
    """Key of the group object of ``attempt`` holding the manifests of the ranks from ``first``."""
    return join_key(meta, attempt, f"group-{first:05d}.json")


def parse_rank_name(name: str) -> int | None:
    """The rank of a manifest file name (``rank-00003.json`` -> 3), else None."""
    match = _MANIFEST_RE.match(name)
    return int(match[1]) if match else None


def check_attempt(attempt: str) -> str:
    """``attempt`` if it is usable as one key component, else ValueError."""
    if not _ATTEMPT_RE.match(attempt) or attempt == MARKER:
        raise ValueError(f"invalid attempt id {attempt!r}: use 1-128 of A-Z a-z 0-9 . _ - (not starting with . _ -)")
    return attempt


def check_name(name: str) -> str:
    """A file name relative to the checkpoint, normalised; ValueError when unsafe or reserved."""
    parts = [p for p in name.replace("\\", "/").split("/") if p]
    if not parts or any(p in (".", "..") for p in parts):
        raise ValueError(f"invalid checkpoint file name {name!r}: empty, or a '.' or '..' path component")
    if parts[0] == META_DIR:
        raise ValueError(f"invalid checkpoint file name {name!r}: {META_DIR}/ is reserved for fastckpt")
    return "/".join(parts)


def digest_of(data: bytes) -> str:
    """Hex XXH3-128 of a manifest's bytes (what the marker records)."""
    return xxhash.xxh3_128_hexdigest(data)


@dataclass(frozen=True)
class FileEntry:
    """One data file of a rank: its name relative to the checkpoint and its digest; ``chunks``, when
    recorded, are its chunk digests (hex), so a reader of part of the file can verify what it read."""

    name: str
    digest: FileDigest
    chunks: tuple[str, ...] = ()


@dataclass(frozen=True)
class RankManifest:
    """What one rank wrote in one attempt, or why it failed (``error``)."""

    attempt: str
    rank: int
    world_size: int
    files: tuple[FileEntry, ...] = ()
    error: str | None = None
    created_at: float = field(default_factory=time.time)
    copied: int = 0
    """Bytes of ``files`` the store copied from a base checkpoint instead of receiving them."""
    root: str = ""
    """Folder of the files, relative to the checkpoint (``generation_root``; empty: the checkpoint itself)."""

    @property
    def bytes(self) -> int:
        """Total size of the rank's files."""
        return sum(f.digest.size for f in self.files)

    def encode(self) -> bytes:
        """Canonical JSON bytes."""
        doc: dict[str, object] = {
            "format": FORMAT_VERSION, "kind": "rank-manifest", "attempt": self.attempt, "rank": self.rank,
            "world_size": self.world_size, "created_at": self.created_at, "digest_algo": DIGEST_ALGO,
            "files": [file_doc(f) for f in self.files],
        }
        if self.error is not None:
            doc["error"] = self.error
        if self.copied:
            doc["copied"] = self.copied
        if self.root:
            doc["root"] = self.root
        return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()

    @classmethod
    def decode(cls, data: bytes, what: str) -> RankManifest:
        """Parse manifest bytes; CheckpointError naming ``what`` when malformed."""
        doc = _load_json(data, what, "rank-manifest")
        try:
            files = tuple(file_entry(f) for f in doc["files"])
            twice = sorted(n for n, count in Counter(f.name for f in files).items() if count > 1)
            if twice:
                raise ValueError(f"file name(s) {twice[:5]} listed more than once")
            attempt = str(doc["attempt"])
            return cls(attempt, int(doc["rank"]), int(doc["world_size"]), files, doc.get("error"),
                       float(doc["created_at"]), int(doc.get("copied", 0)),
                       check_root(str(doc.get("root", "")), attempt, what))
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(f"{what}: malformed manifest ({exc!r})") from None


@dataclass(frozen=True)
class CommitMarker:
    """The commit marker: which attempt is the checkpoint and the digest of each of its manifests."""

    attempt: str
    world_size: int
    manifests: tuple[str, ...]
    files: int
    bytes: int
    committed_at: float = field(default_factory=time.time)
    group_size: int = 0
    """Ranks per group object (0: no group objects, each manifest is read on its own)."""
    copied: int = 0
    """Bytes of the files that the store copied from a base checkpoint."""
    root: str = ""
    """Folder of the files, relative to the checkpoint (a save over a committed one: ``generation_root``)."""
    published: tuple[str, ...] = ()
    """Objects written at the checkpoint itself, outside ``root``, for other tools (``CheckpointWriter.publish``)."""
    metrics: tuple[tuple[str, float], ...] = ()
    """(name, value) of the metrics recorded at save time (``CheckpointWriter(metrics=)``), by name: what a
    ``Retention`` keeps the best checkpoints by."""

    def encode(self) -> bytes:
        """Canonical JSON bytes."""
        doc: dict[str, object] = {
            "format": FORMAT_VERSION, "kind": "commit", "attempt": self.attempt, "world_size": self.world_size,
            "digest_algo": DIGEST_ALGO, "manifests": list(self.manifests), "files": self.files,
            "bytes": self.bytes, "committed_at": self.committed_at,
        }
        if self.group_size:
            doc["group_size"] = self.group_size
        if self.copied:
            doc["copied"] = self.copied
        if self.root:
            doc["root"] = self.root
        if self.published:
            doc["published"] = list(self.published)
        if self.metrics:
            doc["metrics"] = dict(self.metrics)
        return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()

    @classmethod
    def decode(cls, data: bytes, what: str) -> CommitMarker:
        """Parse marker bytes; CheckpointError naming ``what`` when malformed."""
        doc = _load_json(data, what, "commit")
        try:
            attempt = check_attempt(str(doc["attempt"]))
            marker = cls(attempt, int(doc["world_size"]), tuple(str(d) for d in doc["manifests"]),
                         int(doc["files"]), int(doc["bytes"]), float(doc["committed_at"]),
                         int(doc.get("group_size", 0)), int(doc.get("copied", 0)),
                         check_root(str(doc.get("root", "")), attempt, what),
                         tuple(check_name(str(n)) for n in doc.get("published", ())),
                         check_metrics(dict(doc.get("metrics", {}))))
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(f"{what}: malformed commit marker ({exc!r})") from None
        if len(marker.manifests) != marker.world_size:
            raise CheckpointError(f"{what}: marker lists {len(marker.manifests)} manifests for "
                                  f"world size {marker.world_size}")
        if marker.group_size < 0:
            raise CheckpointError(f"{what}: negative group size {marker.group_size}")
        if not 0 <= marker.copied <= marker.bytes:
            raise CheckpointError(f"{what}: {marker.copied} bytes copied of {marker.bytes}")
        return marker


def encode_group(attempt: str, first: int, payloads: list[bytes | None]) -> bytes:
    """The group object of ranks ``first``.. of ``attempt``: each rank's manifest bytes as they are (None for a
    rank that never arrived), so that the marker's digests check them."""
    return json.dumps({
        "format": FORMAT_VERSION, "kind": "rank-group", "digest_algo": DIGEST_ALGO, "attempt": attempt,
        "first": first, "manifests": [None if p is None else p.decode() for p in payloads],
    }, sort_keys=True, separators=(",", ":")).encode()


def decode_group(data: bytes, what: str, attempt: str, first: int) -> list[bytes | None]:
    """The manifests (bytes, None where missing) of a group object; CheckpointError naming ``what`` when it is
    malformed or not the group of ranks ``first``.. of ``attempt``."""
    doc = _load_json(data, what, "rank-group")
    try:
        found = (str(doc["attempt"]), int(doc["first"]))
        payloads = [None if p is None else str(p).encode() for p in doc["manifests"]]
    except (KeyError, TypeError, ValueError, UnicodeEncodeError) as exc:
        raise CheckpointError(f"{what}: malformed group object ({exc!r})") from None
    if found != (attempt, first):
        raise CheckpointError(f"{what}: group of ranks {found[1]}.. of attempt {found[0]!r}, expected ranks "
                              f"{first}.. of {attempt!r}")
    return payloads


def file_doc(entry: FileEntry) -> dict[str, object]:
    d = entry.digest
    doc: dict[str, object] = {"name": entry.name, "size": d.size, "chunk_size": d.chunk_size, "digest": d.digest}
    if entry.chunks:
        doc["chunks"] = list(entry.chunks)
    return doc


def file_entry(doc: dict) -> FileEntry:
    digest = FileDigest(int(doc["size"]), int(doc["chunk_size"]), str(doc["digest"]))
    chunks = tuple(str(c) for c in doc.get("chunks", ()))
    if chunks and (len(chunks) != -(-digest.size // digest.chunk_size)
                   or combine([bytes.fromhex(c) for c in chunks]) != digest.digest):
        raise ValueError(f"chunk digests of {doc['name']!r} do not make up its digest")
    return FileEntry(check_name(doc["name"]), digest, chunks)


def check_metrics(metrics: Mapping[str, object]) -> tuple[tuple[str, float], ...]:
    """``metrics`` as a marker records them, sorted by name; ValueError naming a name that is not a string or a value
    that is not a finite number."""
    out = []
    for name, value in metrics.items():
        if not isinstance(name, str) or not name:
            raise ValueError(f"metric name {name!r}: a non-empty string is needed")
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
            raise ValueError(f"metric {name!r} = {value!r}: a finite number is needed")
        out.append((name, float(value)))
    return tuple(sorted(out))


def _load_json(data: bytes, what: str, kind: str) -> dict:
    try:
        doc = json.loads(data)
    except (UnicodeDecodeError, ValueError) as exc:
        raise CheckpointError(f"{what}: not valid JSON ({exc})") from None
    if not isinstance(doc, dict) or doc.get("kind") != kind:
        raise CheckpointError(f"{what}: not a fastckpt {kind} document")
    if doc.get("format") != FORMAT_VERSION:
        raise CheckpointError(f"{what}: format version {doc.get('format')!r} is not supported "
                              f"(this fastckpt reads {FORMAT_VERSION})")
    if doc.get("digest_algo") != DIGEST_ALGO:
        raise CheckpointError(f"{what}: digest algorithm {doc.get('digest_algo')!r} is not supported")
    return doc


def build_marker(payloads: list[bytes], attempt: str, world_size: int, where: str, group_size: int = 0,
                 root: str = "") -> tuple[CommitMarker, list[RankManifest]]:
    """The marker that commits the manifests ``payloads`` (index = rank) of ``attempt`` (stored in group objects of
    ``group_size`` ranks as well, when not 0), and the manifests decoded.

    CheckpointError when a rank failed, belongs to another attempt or world size, or when two ranks
    wrote the same file name.
    """
    manifests = [RankManifest.decode(p, f"{where}: manifest of rank {r}") for r, p in enumerate(payloads)]
    failed = [m for m in manifests if m.error is not None]
    if failed:
        raise CheckpointError(f"{where}: " + "; ".join(f"rank {m.rank} failed: {m.error}" for m in failed))
    owners: dict[str, int] = {}
    clashes: list[str] = []
    for rank, m in enumerate(manifests):
        if m.rank != rank or m.attempt != attempt or m.world_size != world_size:
            raise CheckpointError(f"{where}: manifest of rank {rank} is for rank {m.rank} of attempt "
                                  f"{m.attempt!r} (world size {m.world_size}), expected attempt {attempt!r} "
                                  f"(world size {world_size})")
        if m.files and m.root != root:
            raise CheckpointError(f"{where}: rank {rank} wrote its files in {m.root or 'the checkpoint'!r}, the "
                                  f"others in {root or 'the checkpoint'!r} (a save over the checkpoint on some ranks "
                                  "only: give every rank the same overwrite)")
        for f in m.files:
            if f.name in owners:
                clashes.append(f"{f.name!r} by ranks {owners[f.name]} and {rank}")
            owners.setdefault(f.name, rank)
    if clashes:
        raise CheckpointError(f"{where}: the same file was written by two ranks: " + ", ".join(clashes))
    marker = CommitMarker(attempt, world_size, tuple(digest_of(p) for p in payloads),
                          sum(len(m.files) for m in manifests), sum(m.bytes for m in manifests), group_size=group_size,
                          copied=sum(m.copied for m in manifests), root=root)
    return marker, manifests
