"""Reading one checkpoint: open (its files and the digests to check them against), download, verify.

A checkpoint exists for readers only when its commit marker does, and then consists of exactly the files named in
the manifests of the marker's attempt (each manifest checked against the digest the marker records).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from .. import stats
from ..config import TransferConfig
from ..engine.paths import paths_below
from ..engine.progress import ProgressCallback
from ..engine.session import FileResult
from ..engine.transfer import Transfer
from ..errors import CheckpointError, IntegrityError, ObjectNotFoundError, StoreError
from ..integrity import FileDigest
from ..stores.base import Store
from ..tasks import gather_bounded
from ..uri import StorageURI, join_key
from .catalog import (
    COMMITTED,
    CORRUPT,
    SCAN_CONCURRENCY,
    UNCOMMITTED,
    CheckpointInfo,
    attempts_of,
    checkpoint_name,
    info_of,
    list_objects,
    read_manifests,
    target_of,
    uri_of,
    with_store,
)
from .documents import read_object, read_small
from .manifest import (
    META_DIR,
    CommitMarker,
    RankManifest,
    check_name,
    decode_group,
    digest_of,
    group_key,
    marker_key,
    meta_prefix,
    rank_key,
)

__all__ = ["BadFile", "Checkpoint", "VerifyReport", "corrupt_error", "download_checkpoint_async", "load",
           "open_checkpoint_async", "verify_async"]


@dataclass(frozen=True)
class BadFile:
    """A file (or metadata object) that failed verification, and why."""

    name: str
    reason: str


@dataclass(frozen=True)
class Checkpoint:
    """An opened checkpoint: its listing entry and its files with the digests to check them against.

    A digest is None only for files of an uncommitted checkpoint without manifests (then the object's
    own digest metadata is used when present).
    """

    info: CheckpointInfo
    key: str
    files: dict[str, FileDigest | None]
    problems: tuple[BadFile, ...] = ()
    chunks: dict[str, tuple[str, ...]] = field(default_factory=dict)
    """Chunk digests (hex) of the files whose manifests record them."""
    root: str = ""
    """Folder of the files relative to the checkpoint (a save over a committed checkpoint keeps its files in one of
    their own, ``manifest.generation_root``); empty: the checkpoint itself."""
    published: tuple[str, ...] = ()
    """Objects at the checkpoint itself that the commit wrote for other tools (not files of the checkpoint)."""

    def file_key(self, name: str) -> str:
        """Store key of file ``name``."""
        return join_key(self.key, self.root, name)


@dataclass(frozen=True)
class VerifyReport:
    """Outcome of re-hashing every file of a checkpoint against its manifest."""

    uri: str
    ok: bool
    files: int
    bytes: int
    bad: list[BadFile] = field(default_factory=list)


async def load(store: Store, target: StorageURI, allow_uncommitted: bool, ranks: Iterable[int] | None = None
               ) -> Checkpoint:
    """The checkpoint at ``target``: committed (manifests checked against the marker), corrupt (with
    ``problems``), or, when allowed, uncommitted. ``ranks``: read only these ranks' manifests (a tier copy holds
    its node's)."""
    key = target.key
    try:
        raw = await read_object(store, marker_key(key))
    except ObjectNotFoundError:
        if not allow_uncommitted:
            raise CheckpointError(f"checkpoint {target.raw} is not committed (no {META_DIR}/COMMITTED); "
                                  "pass allow_uncommitted=True to read it anyway") from None
        return await _load_uncommitted(store, target)
    uri, name = uri_of(target, key), checkpoint_name(key)
    try:
        marker = CommitMarker.decode(raw, marker_key(key))
    except CheckpointError as exc:
        info = CheckpointInfo(name, uri, CORRUPT, None, None, 0, 0, None)
        return Checkpoint(info, key, {}, (BadFile(f"{META_DIR}/COMMITTED", str(exc)),))

    grouped = await _grouped_manifests(store, key, marker)

    async def manifest(rank: int) -> RankManifest | BadFile:
        mkey = rank_key(meta_prefix(key), marker.attempt, rank)
        rel = mkey[len(key) + 1:] if key else mkey
        try:
            data = grouped[rank] if rank in grouped else await read_object(store, mkey)
        except ObjectNotFoundError:
            return BadFile(rel, "manifest named by the commit marker is missing")
        if digest_of(data) != marker.manifests[rank]:
            return BadFile(rel, f"manifest digest {digest_of(data)} differs from the marker's {marker.manifests[rank]}")
        try:
            m = RankManifest.decode(data, mkey)
        except CheckpointError as exc:
            return BadFile(rel, str(exc))
        if (m.rank, m.attempt, m.error) != (rank, marker.attempt, None):
            return BadFile(rel, f"manifest is rank {m.rank} of attempt {m.attempt!r}, not rank {rank} of "
                                f"{marker.attempt!r}, or records a failure")
        return m

    wanted = range(marker.world_size) if ranks is None else sorted(r for r in set(ranks) if r < marker.world_size)
    results = await gather_bounded([manifest(r) for r in wanted], SCAN_CONCURRENCY)
    problems = tuple(r for r in results if isinstance(r, BadFile))
    files: dict[str, FileDigest | None] = {}
    chunks: dict[str, tuple[str, ...]] = {}
    for m in results:
        if isinstance(m, RankManifest):
            files.update({f.name: f.digest for f in m.files})
            chunks.update({f.name: f.chunks for f in m.files if f.chunks})
    state = CORRUPT if problems else COMMITTED
    info = CheckpointInfo(name, uri, state, marker.attempt, marker.world_size, marker.files, marker.bytes,
                          marker.committed_at, dict(marker.metrics))
    return Checkpoint(info, key, files, problems, chunks, marker.root, marker.published)


async def _grouped_manifests(store: Store, key: str, marker: CommitMarker) -> dict[int, bytes]:
    """Where the marker records group objects, the manifests they hold that the marker's digests confirm (by rank);
    each rank missing from them (a group object lost or damaged) is read from its own manifest instead."""
    if not marker.group_size:
        return {}

    async def group(first: int) -> list[tuple[int, bytes]]:
        gkey = group_key(meta_prefix(key), marker.attempt, first)
        try:
            payloads = decode_group(await read_small(store, gkey), gkey, marker.attempt, first)
        except (ObjectNotFoundError, CheckpointError):
            return []
        return [(first + i, p) for i, p in enumerate(payloads)
                if p is not None and first + i < marker.world_size and digest_of(p) == marker.manifests[first + i]]

    firsts = range(0, marker.world_size, marker.group_size)
    return dict(pair for found in await gather_bounded([group(f) for f in firsts], SCAN_CONCURRENCY) for pair in found)


async def _load_uncommitted(store: Store, target: StorageURI) -> Checkpoint:
    """Newest attempt's manifests as found; without any, every object below the prefix."""
    key = target.key
    metas = await list_objects(store, meta_prefix(key))
    info = await info_of(store, target, key, metas)
    files: dict[str, FileDigest | None] = {}
    attempts = attempts_of(key, metas)
    root = ""
    if info.attempt is not None:
        for m in await read_manifests(store, attempts[info.attempt].values()):
            if m is not None and m.error is None:
                files.update({f.name: f.digest for f in m.files})
                root = m.root or root
    else:
        for meta in await list_objects(store, key):
            rel = meta.key[len(key) + 1:] if key else meta.key
            if rel and not rel.startswith(META_DIR + "/"):
                try:
                    files[check_name(rel)] = FileDigest.from_metadata(meta.size, meta.metadata)
                except ValueError as exc:
                    raise StoreError(f"refusing unsafe object name {meta.key!r}: {exc}") from None
        if not files:
            raise ObjectNotFoundError(f"no checkpoint at {target.raw}: nothing found there")
        info = CheckpointInfo(info.name, info.uri, UNCOMMITTED, None, None, len(files), 0, None)
    return Checkpoint(info, key, files, root=root)


async def open_checkpoint_async(uri: str | StorageURI, *, allow_uncommitted: bool = False,
                                config: TransferConfig | None = None, store: Store | None = None,
                                ranks: Iterable[int] | None = None) -> Checkpoint:
    """Open the checkpoint at ``uri``: CheckpointError when it is uncommitted (unless allowed) or corrupt.
    ``store`` reuses an open store of ``uri``'s location (not closed here); ``ranks``: only these ranks' files."""
    async def run(store: Store, target: StorageURI, cfg: TransferConfig) -> Checkpoint:
        ckpt = await load(store, target, allow_uncommitted, ranks)
        if ckpt.problems:
            raise corrupt_error(target, ckpt)
        return ckpt

    if store is not None:
        return await run(store, target_of(uri), config or TransferConfig.from_env())
    return await with_store(uri, config, run)


@stats.summarized("download_checkpoint")
async def download_checkpoint_async(
    uri: str | StorageURI, dst: str | os.PathLike[str], *, allow_uncommitted: bool = False,
    config: TransferConfig | None = None, progress: ProgressCallback | None = None, group: Any = None,
) -> list[FileResult]:
    """Download every file of the checkpoint at ``uri`` below local directory ``dst``, each verified
    against its manifest digest (IntegrityError on a mismatch). Files not in the manifests are skipped.

    With ``group`` (a ``torch.distributed`` process group; every rank of it calls this, each with its own ``dst``),
    each byte is read from storage once for the whole group and the ranks exchange the rest over it
    (``checkpoint.group_download``); a failure on any rank fails every rank. None: this process alone."""
    dst = os.fspath(dst)

    async def run(store: Store, target: StorageURI, cfg: TransferConfig) -> list[FileResult]:
        if group is not None:
            from .group_download import download_in_group  # torch is optional

            return await download_in_group(store, target, cfg, dst, group, allow_uncommitted, progress)
        ckpt = await load(store, target, allow_uncommitted)
        if ckpt.problems:
            raise corrupt_error(target, ckpt)
        names = sorted(ckpt.files)
        pairs = list(zip([ckpt.file_key(n) for n in names], paths_below(dst, names), strict=True))
        expected = {ckpt.file_key(n): d for n, d in ckpt.files.items() if d is not None}
        transfer = Transfer(store, cfg, progress)
        try:
            return await transfer.download_files(pairs, expected)
        finally:
            transfer.close()

    return await with_store(uri, config, run)


def corrupt_error(target: StorageURI, ckpt: Checkpoint) -> CheckpointError:
    """The error for a checkpoint whose metadata failed its checks (``ckpt.problems``)."""
    return CheckpointError(f"checkpoint {target.raw} is corrupt: " + "; ".join(f"{p.name}: {p.reason}"
                                                                             for p in ckpt.problems))


@stats.summarized("verify")
async def verify_async(uri: str | StorageURI, *, allow_uncommitted: bool = False,
                       config: TransferConfig | None = None, progress: ProgressCallback | None = None
                       ) -> VerifyReport:
    """Re-read every file of the checkpoint at ``uri`` and check it against its manifest digest.

    Corrupt metadata and bad files are reported, not raised; an uncommitted checkpoint raises
    CheckpointError unless ``allow_uncommitted``.
    """
    async def run(store: Store, target: StorageURI, cfg: TransferConfig) -> VerifyReport:
        ckpt = await load(store, target, allow_uncommitted)
        transfer = Transfer(store, cfg, progress)

        async def check(name: str, digest: FileDigest | None) -> BadFile | int:
            try:
                return (await transfer.verify_object(ckpt.file_key(name), digest)).size
            except ObjectNotFoundError:
                return BadFile(name, "missing")
            except (IntegrityError, StoreError) as exc:
                return BadFile(name, str(exc))

        try:
            results = await gather_bounded([check(n, d) for n, d in sorted(ckpt.files.items())], SCAN_CONCURRENCY)
        finally:
            transfer.close()
        bad = list(ckpt.problems) + [r for r in results if isinstance(r, BadFile)]
        return VerifyReport(uri_of(target, target.key), not bad, len(ckpt.files),
                            sum(r for r in results if isinstance(r, int)), bad)

    return await with_store(uri, config, run)
