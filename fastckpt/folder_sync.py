"""``sync``: make a store prefix hold what a local folder holds, or the other way round, sending only what differs.

What differs is judged by the XXH3 digest fastckpt recorded with an object, where there is one: a file rewritten with
the same bytes is not sent, one changed without a new size or a newer time is. Where an object has no digest (another
tool wrote it), by size and time as s5cmd judges: the source is sent when it is newer. What a comparison learnt is kept
(``engine.sync_cache``), so that the next sync skips an unchanged file and object without a request. Commit markers are
written last and removed first."""

from __future__ import annotations

import dataclasses
import mmap
import os

from ._loop import BackgroundLoop
from .checkpoint.catalog import target_of
from .config import TransferConfig, default_state_dir
from .engine.paths import local_files, paths_below
from .engine.select import Selection, split_wildcard
from .engine.session import FileResult
from .engine.sync_cache import Known, SyncCache, local_version
from .engine.transfer import Transfer
from .integrity import FileDigest, combine, hash_chunks
from .mirror import Moved, is_local, markers_last, remove_files
from .objects import Filters, at, is_marker, opened, prune_local
from .objects import select as select_objects
from .removal import delete_markers_first
from .stores.base import ObjectMeta, Store
from .tasks import gather_bounded
from .threads import off_loop
from .uri import StorageURI

LOOKUPS = 64
"""Most HEAD requests in flight while a sync compares digests."""


def local_digest(path: str, chunk_size: int) -> str:
    """The file digest of ``path`` cut into ``chunk_size`` chunks (as fastckpt records it)."""
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            return combine([])
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as view:
            return combine(hash_chunks(view, chunk_size))


async def compare(store: Store, key: str, path: str, listed: ObjectMeta, known: Known | None, *,
                  upload: bool) -> tuple[bool, Known | None]:
    """(whether the local file ``path`` and the object ``key``, of one size, hold other bytes; what was learnt)."""
    version = local_version(path)
    if known is not None and listed.etag and known.etag == listed.etag:
        if known.local == version:
            return False, known
        same = await off_loop(local_digest, path, known.chunk_size) == known.digest
        return not same, dataclasses.replace(known, local=version) if same else None
    meta = await store.head(key)
    recorded = FileDigest.from_metadata(meta.size, meta.metadata)
    if recorded is None or recorded.changed:
        return (version[3] / 1e9 > meta.mtime) if upload else (meta.mtime > version[3] / 1e9), None
    if await off_loop(local_digest, path, recorded.chunk_size) != recorded.digest:
        return True, None
    return False, Known(meta.etag, recorded.digest, recorded.chunk_size, version) if meta.etag else None


async def to_send(store: Store, pairs: list[tuple[str, str, str]], theirs: dict[str, ObjectMeta],
                  known: dict[str, Known], *, upload: bool) -> tuple[list[tuple[str, str, str]], dict[str, Known]]:
    """The ``(rel, path, key)`` of ``pairs`` whose local file and object differ (``theirs``: what the listing said
    of the objects; ``upload``: the local file is the source), and what the comparisons learnt."""
    same = [p for p in pairs
            if p[0] in theirs and os.path.isfile(p[1]) and os.stat(p[1]).st_size == theirs[p[0]].size]
    verdicts = await gather_bounded([compare(store, key, path, theirs[rel], known.get(rel), upload=upload)
                                     for rel, path, key in same], LOOKUPS)
    learnt = {p[0]: k for p, (_, k) in zip(same, verdicts, strict=True) if k is not None}
    kept = {p[0] for p, (changed, _) in zip(same, verdicts, strict=True) if not changed}
    return [p for p in pairs if p[0] not in kept], learnt


async def learn(store: Store, sent: list[FileResult], rel_of: dict[str, str]) -> dict[str, Known]:
    """Entries for what was just sent: a HEAD of each object, kept where its recorded digest is the one sent."""

    async def one(result: FileResult) -> tuple[str, Known] | None:
        meta = await store.head(result.key)
        recorded = FileDigest.from_metadata(meta.size, meta.metadata)
        if recorded is None or recorded.digest != result.digest.digest or not meta.etag:
            return None
        return rel_of[result.key], Known(meta.etag, recorded.digest, recorded.chunk_size, local_version(result.path))

    found = await gather_bounded([one(r) for r in sent], LOOKUPS)
    return dict(f for f in found if f is not None)


async def sync_async(src: str, dst: str, *, delete: bool = False, filters: Filters = (), dry_run: bool = False,
                     config: TransferConfig | None = None) -> Moved:
    """Make ``dst`` hold what ``src`` holds (a local folder and a store URI, either way): send each file that is
    missing there or differs (see the module docstring); ``delete``: also remove what ``src`` lacks. ``filters``
    select on both sides (what they leave out is neither sent nor deleted)."""
    config = config or TransferConfig.from_env()
    folder, pattern = split_wildcard(src)
    selection = Selection.of(pattern, filters)
    if is_local(folder):
        if not os.path.isdir(folder):
            raise NotADirectoryError(f"sync takes a folder: {folder} is not one")
        return await _sync(target_of(dst), folder, selection, delete, dry_run, config, upload=True)
    if not is_local(dst):
        raise ValueError(f"sync between two stores ({src} -> {dst}) is not supported: sync to a local folder")
    if os.path.isfile(dst):
        raise NotADirectoryError(f"sync takes a folder: {dst} is a file")
    return await _sync(target_of(folder), dst, selection, delete, dry_run, config, upload=False)


async def _sync(remote: StorageURI, folder: str, selection: Selection, delete: bool, dry_run: bool,
                config: TransferConfig, *, upload: bool) -> Moved:
    """One sync between the prefix ``remote`` and the local ``folder`` (``upload``: the folder is the source)."""
    ours = {rel: path for path, rel in (local_files(folder) if os.path.isdir(folder) else []) if selection.takes(rel)}
    async with opened(remote, config) as store:
        cache = SyncCache(config.state_dir or default_state_dir(), store.location, remote.key)
        theirs = {f.rel: f.meta for f in await select_objects(store, remote, selection) if f.rel}
        source = ours if upload else dict(zip(theirs, paths_below(folder, list(theirs)), strict=True))
        pairs = [(rel, path, remote.join(rel)) for rel, path in source.items()]
        pending, learnt = await to_send(store, pairs, theirs, cache.load(), upload=upload)
        if upload:
            gone_remote = [theirs[rel] for rel in sorted(set(theirs) - set(ours))] if delete else []
            gone = [at(remote, m.key) for m in gone_remote]
            sent = [(path, at(remote, key)) for _, path, key in pending]
            size = sum(os.stat(path).st_size for _, path, _ in pending)
        else:
            gone_remote, gone = [], sorted(path for rel, path in ours.items() if rel not in theirs) if delete else []
            sent = [(at(remote, key), path) for _, path, key in pending]
            size = sum(theirs[rel].size for rel, _, _ in pending)
        done = Moved(sent, size, len(pairs) - len(pending), gone)
        if dry_run:
            return done
        results = await _send(store, remote, pending, theirs, config, upload=upload)
        learnt.update(await learn(store, results, {key: rel for rel, _, key in pending}))
        cache.save(learnt)
        if gone_remote:
            await delete_markers_first(store, gone_remote, [m.key for m in gone_remote if is_marker(m.key)])
            prune_local(remote, [m.key for m in gone_remote])
    if not upload:
        remove_files(gone, folder)
    return done


async def _send(store: Store, remote: StorageURI, pending: list[tuple[str, str, str]], theirs: dict[str, ObjectMeta],
                config: TransferConfig, *, upload: bool) -> list[FileResult]:
    """Transfer the ``(rel, path, key)`` of ``pending``, commit markers last."""
    results: list[FileResult] = []
    transfer = Transfer(store, config)
    try:
        if upload:
            for batch in markers_last([(path, key) for _, path, key in pending], 1):
                results += await transfer.upload_files(batch, snapshot=True) if batch else []
        else:
            sizes = {remote.join(rel): meta.size for rel, meta in theirs.items()}
            for batch in markers_last([(key, path) for _, path, key in pending], 0):
                results += await transfer.download_files(batch, sizes=sizes) if batch else []
    finally:
        transfer.close()
    return results


def sync(src: str, dst: str, *, delete: bool = False, filters: Filters = (), dry_run: bool = False,
         config: TransferConfig | None = None) -> Moved:
    """Sync twin of ``sync_async``."""
    return BackgroundLoop.get().run(sync_async(src, dst, delete=delete, filters=filters, dry_run=dry_run,
                                               config=config))


__all__ = ["sync", "sync_async"]
