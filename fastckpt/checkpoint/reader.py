"""Reading checkpoints: list, latest, open, download, verify and gc.

A checkpoint is a prefix holding ``.fastckpt/``; it exists for readers only when its commit marker
does, and then consists of exactly the files named in the manifests of the marker's attempt (each
manifest checked against the digest the marker records). Functions taking a storage path look at
the path itself when it is a checkpoint, else at its direct sub-prefixes.
"""

from __future__ import annotations

import os
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import TypeVar

from .._loop import run_sync
from ..config import TransferConfig
from ..engine.paths import paths_below
from ..engine.progress import ProgressCallback
from ..engine.transfer import FileResult, Transfer
from ..errors import CheckpointError, IntegrityError, ObjectNotFoundError, StoreError
from ..integrity import FileDigest
from ..stores import open_store
from ..stores.base import ObjectMeta, PendingUpload, Store
from ..tasks import gather_bounded
from ..uri import StorageURI, join_key, parse_uri
from .manifest import (
    META_DIR,
    CommitMarker,
    RankManifest,
    check_name,
    digest_of,
    marker_key,
    meta_prefix,
    parse_rank_name,
    rank_key,
)
from .storage import read_object

T = TypeVar("T")
COMMITTED, UNCOMMITTED, CORRUPT = "committed", "uncommitted", "corrupt"
_SCAN_CONCURRENCY = 16


@dataclass(frozen=True)
class CheckpointInfo:
    """One checkpoint as listed. ``state`` is committed, uncommitted or corrupt.

    For an uncommitted checkpoint the attempt, world size and totals are those of its newest attempt's
    manifests found so far.
    """

    name: str
    uri: str
    state: str
    attempt: str | None
    world_size: int | None
    files: int
    bytes: int
    committed_at: float | None


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

    def file_key(self, name: str) -> str:
        """Store key of file ``name``."""
        return join_key(self.key, name)


@dataclass(frozen=True)
class VerifyReport:
    """Outcome of re-hashing every file of a checkpoint against its manifest."""

    uri: str
    ok: bool
    files: int
    bytes: int
    bad: list[BadFile] = field(default_factory=list)


@dataclass
class GcReport:
    """What gc removed (or, with ``dry_run``, would remove)."""

    dry_run: bool
    removed: list[str] = field(default_factory=list)
    """Keys of removed objects."""
    aborted_uploads: list[str] = field(default_factory=list)
    """Keys of aborted multipart uploads."""
    bytes: int = 0
    skipped: list[str] = field(default_factory=list)
    """'name: reason' of checkpoints left alone (recent activity, corrupt)."""


def uri_of(base: StorageURI, key: str) -> str:
    """A URI string for ``key`` in ``base``'s bucket, with ``base``'s options."""
    return base.with_key(key).uri()


def _name(key: str) -> str:
    return key.rstrip("/").rsplit("/", 1)[-1]


def _target(uri: str | StorageURI) -> StorageURI:
    parsed = parse_uri(uri) if not isinstance(uri, StorageURI) else uri
    if parsed.backend == "delegate":
        raise ValueError(f"{parsed.raw!r}: scheme {parsed.scheme!r} is not a fastckpt backend")
    return parsed


# ----------------------------------------------------------------------------- scanning


async def _list(store: Store, prefix: str) -> list[ObjectMeta]:
    return [m async for m in store.list(prefix)]


async def _candidates(store: Store, base: str) -> list[tuple[str, list[ObjectMeta]]]:
    """(key, metadata objects) of the checkpoint(s) at ``base``: itself, else its direct sub-prefixes."""
    own = await _list(store, meta_prefix(base))
    if own:
        return [(base, own)]
    _, dirs = await store.list_dir(base)
    metas = await gather_bounded([_list(store, meta_prefix(d)) for d in dirs], _SCAN_CONCURRENCY)
    return [(d, m) for d, m in zip(dirs, metas, strict=True) if m]


def _attempts(key: str, metas: list[ObjectMeta]) -> dict[str, dict[int, ObjectMeta]]:
    """{attempt: {rank: manifest object}} found below the checkpoint's metadata prefix."""
    found: dict[str, dict[int, ObjectMeta]] = {}
    base = meta_prefix(key) + "/"
    for m in metas:
        parts = m.key[len(base):].split("/") if m.key.startswith(base) else []
        if len(parts) == 2 and (rank := parse_rank_name(parts[1])) is not None:
            found.setdefault(parts[0], {})[rank] = m
    return found


async def _info(store: Store, base: StorageURI, key: str, metas: list[ObjectMeta]) -> CheckpointInfo:
    """Listing entry of one checkpoint (cheap: the marker, or the newest attempt's manifests)."""
    uri, name = uri_of(base, key), _name(key)
    attempts = _attempts(key, metas)
    if any(m.key == marker_key(key) for m in metas):
        try:
            marker = CommitMarker.decode(await read_object(store, marker_key(key)), marker_key(key))
        except CheckpointError:
            return CheckpointInfo(name, uri, CORRUPT, None, None, 0, 0, None)
        have = attempts.get(marker.attempt, {})
        state = COMMITTED if all(r in have for r in range(marker.world_size)) else CORRUPT
        return CheckpointInfo(name, uri, state, marker.attempt, marker.world_size, marker.files, marker.bytes,
                              marker.committed_at)
    if not attempts:
        return CheckpointInfo(name, uri, UNCOMMITTED, None, None, 0, 0, None)
    attempt = max(attempts, key=lambda a: max(m.mtime for m in attempts[a].values()))
    manifests = await _manifests(store, attempts[attempt].values())
    good = [m for m in manifests if m is not None and m.error is None]
    world = next((m.world_size for m in manifests if m is not None), None)
    return CheckpointInfo(name, uri, UNCOMMITTED, attempt, world, sum(len(m.files) for m in good),
                          sum(m.bytes for m in good), None)


async def _manifests(store: Store, objects: Iterable[ObjectMeta]) -> list[RankManifest | None]:
    async def one(meta: ObjectMeta) -> RankManifest | None:
        try:
            return RankManifest.decode(await read_object(store, meta.key), meta.key)
        except (CheckpointError, ObjectNotFoundError):
            return None

    return await gather_bounded([one(m) for m in objects], _SCAN_CONCURRENCY)


# ----------------------------------------------------------------------------- opening


async def _load(store: Store, base: StorageURI, config: TransferConfig, allow_uncommitted: bool) -> Checkpoint:
    """The checkpoint at ``base``: committed (manifests checked against the marker), corrupt (with
    ``problems``), or, when allowed, uncommitted."""
    key = base.key
    try:
        raw = await read_object(store, marker_key(key))
    except ObjectNotFoundError:
        if not allow_uncommitted:
            raise CheckpointError(f"checkpoint {base.raw} is not committed (no {META_DIR}/COMMITTED); "
                                  "pass allow_uncommitted=True to read it anyway") from None
        return await _load_uncommitted(store, base, config)
    uri, name = uri_of(base, key), _name(key)
    try:
        marker = CommitMarker.decode(raw, marker_key(key))
    except CheckpointError as exc:
        info = CheckpointInfo(name, uri, CORRUPT, None, None, 0, 0, None)
        return Checkpoint(info, key, {}, (BadFile(f"{META_DIR}/COMMITTED", str(exc)),))

    async def manifest(rank: int) -> RankManifest | BadFile:
        mkey = rank_key(meta_prefix(key), marker.attempt, rank)
        rel = mkey[len(key) + 1:] if key else mkey
        try:
            data = await read_object(store, mkey)
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

    results = await gather_bounded([manifest(r) for r in range(marker.world_size)], _SCAN_CONCURRENCY)
    problems = tuple(r for r in results if isinstance(r, BadFile))
    files: dict[str, FileDigest | None] = {}
    chunks: dict[str, tuple[str, ...]] = {}
    for m in results:
        if isinstance(m, RankManifest):
            files.update({f.name: f.digest for f in m.files})
            chunks.update({f.name: f.chunks for f in m.files if f.chunks})
    state = CORRUPT if problems else COMMITTED
    info = CheckpointInfo(name, uri, state, marker.attempt, marker.world_size, marker.files, marker.bytes,
                          marker.committed_at)
    return Checkpoint(info, key, files, problems, chunks)


async def _load_uncommitted(store: Store, base: StorageURI, config: TransferConfig) -> Checkpoint:
    """Newest attempt's manifests as found; without any, every object below the prefix."""
    key = base.key
    metas = await _list(store, meta_prefix(key))
    info = await _info(store, base, key, metas)
    files: dict[str, FileDigest | None] = {}
    attempts = _attempts(key, metas)
    if info.attempt is not None:
        for m in await _manifests(store, attempts[info.attempt].values()):
            if m is not None and m.error is None:
                files.update({f.name: f.digest for f in m.files})
    else:
        for meta in await _list(store, key):
            rel = meta.key[len(key) + 1:] if key else meta.key
            if rel and not rel.startswith(META_DIR + "/"):
                try:
                    files[check_name(rel)] = FileDigest.from_metadata(meta.size, meta.metadata)
                except ValueError as exc:
                    raise StoreError(f"refusing unsafe object name {meta.key!r}: {exc}") from None
        if not files:
            raise ObjectNotFoundError(f"no checkpoint at {base.raw}: nothing found there")
        info = CheckpointInfo(info.name, info.uri, UNCOMMITTED, None, None, len(files), 0, None)
    return Checkpoint(info, key, files)


async def _with_store(uri: str | StorageURI, config: TransferConfig | None,
                      fn: Callable[[Store, StorageURI, TransferConfig], Awaitable[T]]) -> T:
    base, cfg = _target(uri), config or TransferConfig.from_env()
    async with open_store(base, cfg) as store:
        return await fn(store, base, cfg)


async def open_checkpoint_async(uri: str | StorageURI, *, allow_uncommitted: bool = False,
                                config: TransferConfig | None = None, store: Store | None = None) -> Checkpoint:
    """Open the checkpoint at ``uri``: CheckpointError when it is uncommitted (unless allowed) or corrupt.
    ``store`` reuses an open store of ``uri``'s location (not closed here)."""
    async def run(store: Store, base: StorageURI, cfg: TransferConfig) -> Checkpoint:
        ckpt = await _load(store, base, cfg, allow_uncommitted)
        if ckpt.problems:
            raise CheckpointError(f"checkpoint {base.raw} is corrupt: "
                                  + "; ".join(f"{p.name}: {p.reason}" for p in ckpt.problems))
        return ckpt

    if store is not None:
        return await run(store, _target(uri), config or TransferConfig.from_env())
    return await _with_store(uri, config, run)


async def download_checkpoint_async(
    uri: str | StorageURI, dst: str | os.PathLike[str], *, allow_uncommitted: bool = False,
    config: TransferConfig | None = None, progress: ProgressCallback | None = None,
) -> list[FileResult]:
    """Download every file of the checkpoint at ``uri`` below local directory ``dst``, each verified
    against its manifest digest (IntegrityError on a mismatch). Files not in the manifests are skipped."""
    dst = os.fspath(dst)

    async def run(store: Store, base: StorageURI, cfg: TransferConfig) -> list[FileResult]:
        ckpt = await _load(store, base, cfg, allow_uncommitted)
        if ckpt.problems:
            raise CheckpointError(f"checkpoint {base.raw} is corrupt: "
                                  + "; ".join(f"{p.name}: {p.reason}" for p in ckpt.problems))
        names = sorted(ckpt.files)
        pairs = list(zip([ckpt.file_key(n) for n in names], paths_below(dst, names), strict=True))
        expected = {ckpt.file_key(n): d for n, d in ckpt.files.items() if d is not None}
        transfer = Transfer(store, cfg, progress)
        try:
            return await transfer.download_files(pairs, expected)
        finally:
            transfer.close()

    return await _with_store(uri, config, run)


# ----------------------------------------------------------------------------- list / latest / verify


async def list_checkpoints_async(uri: str | StorageURI, *, config: TransferConfig | None = None
                                 ) -> list[CheckpointInfo]:
    """Checkpoints at ``uri`` (itself, or its direct sub-prefixes), sorted by name."""
    async def run(store: Store, base: StorageURI, cfg: TransferConfig) -> list[CheckpointInfo]:
        found = await _candidates(store, base.key)
        infos = await gather_bounded([_info(store, base, k, metas) for k, metas in found], _SCAN_CONCURRENCY)
        return sorted(infos, key=lambda i: i.name)

    return await _with_store(uri, config, run)


async def latest_async(uri: str | StorageURI, *, config: TransferConfig | None = None) -> str | None:
    """URI of the newest committed checkpoint at ``uri`` (by commit time, then name), or None."""
    committed = [i for i in await list_checkpoints_async(uri, config=config) if i.state == COMMITTED]
    return max(committed, key=lambda i: (i.committed_at or 0.0, i.name)).uri if committed else None


async def verify_async(uri: str | StorageURI, *, allow_uncommitted: bool = False,
                       config: TransferConfig | None = None, progress: ProgressCallback | None = None
                       ) -> VerifyReport:
    """Re-read every file of the checkpoint at ``uri`` and check it against its manifest digest.

    Corrupt metadata and bad files are reported, not raised; an uncommitted checkpoint raises
    CheckpointError unless ``allow_uncommitted``.
    """
    async def run(store: Store, base: StorageURI, cfg: TransferConfig) -> VerifyReport:
        ckpt = await _load(store, base, cfg, allow_uncommitted)
        transfer = Transfer(store, cfg, progress)

        async def check(name: str, digest: FileDigest | None) -> BadFile | int:
            try:
                return (await transfer.verify_object(ckpt.file_key(name), digest)).size
            except ObjectNotFoundError:
                return BadFile(name, "missing")
            except (IntegrityError, StoreError) as exc:
                return BadFile(name, str(exc))

        try:
            results = await gather_bounded([check(n, d) for n, d in sorted(ckpt.files.items())], _SCAN_CONCURRENCY)
        finally:
            transfer.close()
        bad = list(ckpt.problems) + [r for r in results if isinstance(r, BadFile)]
        return VerifyReport(uri_of(base, base.key), not bad, len(ckpt.files),
                            sum(r for r in results if isinstance(r, int)), bad)

    return await _with_store(uri, config, run)


# ----------------------------------------------------------------------------- gc


async def gc_async(uri: str | StorageURI, older_than_s: float = 24 * 3600.0, dry_run: bool = False, *,
                   config: TransferConfig | None = None) -> GcReport:
    """Remove what no reader will ever use, once it is older than ``older_than_s`` seconds.

    - an uncommitted checkpoint whose newest object and upload are older: all of it, and its multipart
      uploads are aborted;
    - in a committed checkpoint: manifests of other attempts, data files its manifests do not name, and
      stale multipart uploads;
    - below a sub-prefix without ``.fastckpt/``: only stale multipart uploads;
    - anywhere below the prefix: the backend's bookkeeping that no object uses any more (S3's digest records
      of objects deleted or replaced by other tools).
    Corrupt checkpoints are left alone. With ``dry_run`` nothing is removed. Like the rest of gc, meant for
    what nobody is writing to any more.
    """
    async def run(store: Store, base: StorageURI, cfg: TransferConfig) -> GcReport:
        report = GcReport(dry_run)
        now = time.time()
        found = dict(await _candidates(store, base.key))
        pending: dict[str, list[PendingUpload]] = {}
        for up in await store.list_pending_uploads(base.key):
            # an upload of an object directly below the prefix (a killed ``cp``) counts on its own
            root = base.key if base.key in found else _child_of(base.key, up.key) or up.key
            pending.setdefault(root, []).append(up)
        for key in sorted(set(found) | set(pending)):
            await _gc_one(store, base, key, key in found, pending.get(key, []), now - older_than_s, cfg, report)
        orphans = await store.list_orphans(base.key, now - older_than_s)
        report.removed.extend(orphans)
        if orphans and not dry_run:
            await store.delete_many(orphans)
        return report

    return await _with_store(uri, config, run)


def _child_of(base: str, key: str) -> str | None:
    rel = key[len(base) + 1:] if base else key
    if (base and not key.startswith(base + "/")) or "/" not in rel:
        return None
    return join_key(base, rel.split("/", 1)[0])


async def _gc_one(store: Store, base: StorageURI, key: str, is_checkpoint: bool, uploads: list[PendingUpload],
                  cutoff: float, cfg: TransferConfig, report: GcReport) -> None:
    name = _name(key)
    old_uploads = [u for u in uploads if u.started <= cutoff]
    doomed: list[ObjectMeta] = []
    if is_checkpoint:
        objects = await _list(store, key)
        try:
            ckpt = await _load(store, base.with_key(key), cfg, allow_uncommitted=False)
        except CheckpointError:
            ckpt = None
        if ckpt is None:
            newest = max([m.mtime for m in objects] + [u.started for u in uploads], default=0.0)
            if newest > cutoff:
                report.skipped.append(f"{name}: uncommitted, written to recently")
                return
            doomed, old_uploads = objects, uploads
        elif ckpt.problems:
            report.skipped.append(f"{name}: corrupt ({ckpt.problems[0].reason})")
            return
        else:
            keep = {ckpt.file_key(n) for n in ckpt.files} | {marker_key(key)}
            live = join_key(meta_prefix(key), ckpt.info.attempt or "") + "/"
            doomed = [m for m in objects if m.key not in keep and not m.key.startswith(live) and m.mtime <= cutoff]
    # data first and metadata last, so that an interrupted gc still finds the checkpoint next time
    doomed.sort(key=lambda m: (m.key.startswith(meta_prefix(key) + "/"), m.key))
    report.removed.extend(m.key for m in doomed)
    report.aborted_uploads.extend(u.key for u in old_uploads)
    report.bytes += sum(m.size for m in doomed)
    if report.dry_run:
        return
    for up in old_uploads:
        await store.abort_pending_upload(up)
    if doomed:
        await store.delete_many([m.key for m in doomed])


# ----------------------------------------------------------------------------- sync twins


def open_checkpoint(uri: str | StorageURI, *, allow_uncommitted: bool = False,
                    config: TransferConfig | None = None) -> Checkpoint:
    """Sync twin of ``open_checkpoint_async``."""
    return run_sync(open_checkpoint_async(uri, allow_uncommitted=allow_uncommitted, config=config))


def download_checkpoint(uri: str | StorageURI, dst: str | os.PathLike[str], *, allow_uncommitted: bool = False,
                        config: TransferConfig | None = None, progress: ProgressCallback | None = None
                        ) -> list[FileResult]:
    """Sync twin of ``download_checkpoint_async``."""
    return run_sync(download_checkpoint_async(uri, dst, allow_uncommitted=allow_uncommitted, config=config,
                                              progress=progress))


def list_checkpoints(uri: str | StorageURI, *, config: TransferConfig | None = None) -> list[CheckpointInfo]:
    """Sync twin of ``list_checkpoints_async``."""
    return run_sync(list_checkpoints_async(uri, config=config))


def latest(uri: str | StorageURI, *, config: TransferConfig | None = None) -> str | None:
    """Sync twin of ``latest_async``."""
    return run_sync(latest_async(uri, config=config))


def verify(uri: str | StorageURI, *, allow_uncommitted: bool = False, config: TransferConfig | None = None,
           progress: ProgressCallback | None = None) -> VerifyReport:
    """Sync twin of ``verify_async``."""
    return run_sync(verify_async(uri, allow_uncommitted=allow_uncommitted, config=config, progress=progress))


def gc(uri: str | StorageURI, older_than_s: float = 24 * 3600.0, dry_run: bool = False, *,
       config: TransferConfig | None = None) -> GcReport:
    """Sync twin of ``gc_async``."""
    return run_sync(gc_async(uri, older_than_s, dry_run, config=config))
