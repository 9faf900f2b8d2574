"""``sync``: make a store prefix hold what a local folder holds, or the other way round, sending only what differs.

What differs is judged by the XXH3 digest fastckpt recorded with an object, where there is one: a file rewritten with
the same bytes is not sent, one changed without a new size or a newer time is. Where an object has no digest (another
tool wrote it), by size and time as s5cmd judges: the source is sent when it is newer. What a comparison learnt is kept
(``engine.sync_cache``), so that the next sync skips an unchanged file and object without a request (a file sent up
whole is known by the MD5 S3 gives it as its ETag). Commit markers are written last and removed first."""

from __future__ import annotations

import asyncio
import bisect
import dataclasses
import hashlib
import os

from ._loop import BackgroundLoop
from .checkpoint.catalog import target_of
from .checkpoint.manifest import is_marker
from .config import TransferConfig, default_state_dir
from .engine.paths import local_files, paths_below
from .engine.select import Selection, split_wildcard
from .engine.session import FileResult
from .engine.sink import hash_file_range
from .engine.sync_cache import Known, SyncCache, local_version
from .engine.transfer import Transfer
from .integrity import FileDigest, combine
from .mirror import Moved, is_local, markers_last, remove_files
from .objects import Filters, at, opened, prune_local, stream
from .objects import select as select_objects
from .removal import SORTED, delete_markers_first
from .stores.base import ObjectMeta, Store
from .tasks import gather_bounded
from .threads import off_loop
from .uri import StorageURI

LOOKUPS = 64
"""Most HEAD requests in flight while a sync compares digests."""
STEP = 1000
"""Objects listed between two rounds of comparing and sending (a listing page)."""


def local_digest(path: str, chunk_size: int) -> str:
    """The file digest of ``path`` cut into ``chunk_size`` chunks (as fastckpt records it), read through mappings of
    bounded size (``engine.sink.hash_file_range``)."""
    with open(path, "rb") as f:
        return combine(hash_file_range(f.fileno(), 0, os.fstat(f.fileno()).st_size, chunk_size) or [])


async def compare(store: Store, key: str, path: str, listed: ObjectMeta, known: Known | None, *,
                  upload: bool) -> tuple[bool, Known | None]:
    """(whether the local file ``path`` and the object ``key``, of one size, hold other bytes; what was learnt)."""
    version = local_version(path)
    if known is not None and listed.etag and known.etag.strip('"') == listed.etag.strip('"'):
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


def sent_entries(sent: list[FileResult], rel_of: dict[str, str], whole_below: int) -> dict[str, Known]:
    """Entries for what was just sent, with no request: an object written whole (not in parts: below
    ``whole_below`` bytes) has, on S3, the MD5 of its bytes as its ETag, so a later listing that shows the MD5 of
    the local file's bytes shows that the object holds them. Where ETags are something else (parts, other clouds,
    SSE-KMS), none will ever equal it and the next sync asks with a HEAD, as for any object it has not compared."""
    return {rel_of[r.key]: Known(md5_of(r.path), r.digest.digest, r.digest.chunk_size, local_version(r.path))
            for r in sent if r.digest.size < whole_below}


def md5_of(path: str) -> str:
    """The MD5 of the file at ``path``, in hex (what S3 answers as the ETag of an object of these bytes)."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "md5").hexdigest()


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
        transfer = None if dry_run else Transfer(store, config)
        try:
            if upload:
                theirs, pending, learnt, results = await _up(store, remote, selection, ours, cache.load(), transfer)
                compared = len(ours)
            else:
                theirs = {f.rel: f.meta for f in await select_objects(store, remote, selection) if f.rel}
                pairs = [(rel, path, remote.join(rel))
                         for rel, path in zip(theirs, paths_below(folder, list(theirs)), strict=True)]
                pending, learnt = await to_send(store, pairs, theirs, cache.load(), upload=False)
                results = [] if transfer is None else await _down(transfer, remote, pending, theirs)
                compared = len(pairs)
        finally:
            if transfer is not None:
                transfer.close()
        if upload:
            gone_remote = [theirs[rel] for rel in sorted(set(theirs) - set(ours))] if delete else []
            gone = [at(remote, m.key) for m in gone_remote]
            sent = [(path, at(remote, key)) for _, path, key in pending]
            size = sum(os.stat(path).st_size for _, path, _ in pending)
        else:
            gone_remote, gone = [], sorted(path for rel, path in ours.items() if rel not in theirs) if delete else []
            sent = [(at(remote, key), path) for _, path, key in pending]
            size = sum(theirs[rel].size for rel, _, _ in pending)
        done = Moved(sent, size, compared - len(pending), gone)
        if dry_run:
            return done
        learnt.update(sent_entries(results, {key: rel for rel, _, key in pending}, config.multipart_threshold))
        cache.save(learnt)
        if gone_remote:
            await delete_markers_first(store, gone_remote, [m.key for m in gone_remote if is_marker(m.key)])
            prune_local(remote, [m.key for m in gone_remote])
    if not upload:
        remove_files(gone, folder)
    return done


async def _up(store: Store, remote: StorageURI, selection: Selection, ours: dict[str, str], known: dict[str, Known],
              transfer: Transfer | None) -> tuple[dict[str, ObjectMeta], list[tuple[str, str, str]], dict[str, Known],
                                                 list[FileResult]]:
    """The upload side, sent while the prefix is still listed: where the listing comes sorted (``SORTED``), each
    ``STEP`` objects the local files whose names it has passed are compared and those that differ sent (with no
    ``transfer``, a dry run: only compared); commit markers after all the rest. (what is there, what differed, what
    was learnt, what was sent)."""
    theirs: dict[str, ObjectMeta] = {}
    order, settled = sorted(ours), 0
    pending: list[tuple[str, str, str]] = []
    learnt: dict[str, Known] = {}
    results: list[FileResult] = []
    markers: list[tuple[str, str]] = []

    async def settle(rels: list[str]) -> None:
        differ, found = await to_send(store, [(rel, ours[rel], remote.join(rel)) for rel in rels], theirs, known,
                                      upload=True)
        pending.extend(differ)
        learnt.update(found)
        if transfer is not None:
            rest, marks = markers_last([(path, key) for _, path, key in differ], 1)
            markers.extend(marks)
            results.extend(await transfer.upload_files(rest, snapshot=True) if rest else [])

    def passed(last: str | None) -> list[str]:
        nonlocal settled
        upto = len(order) if last is None else bisect.bisect_right(order, last, lo=settled)
        rels, settled = order[settled:upto], upto
        return rels

    tasks: list[asyncio.Future[None]] = []
    try:
        async for f in stream(store, remote, selection):
            if f.rel:
                theirs[f.rel] = f.meta
            if remote.backend in SORTED and len(theirs) % STEP == 0 and f.rel:
                tasks.append(asyncio.ensure_future(settle(passed(f.rel))))
        tasks.append(asyncio.ensure_future(settle(passed(None))))
        await asyncio.gather(*tasks)
        if markers and transfer is not None:
            results.extend(await transfer.upload_files(markers, snapshot=True))
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
    return theirs, pending, learnt, results


async def _down(transfer: Transfer, remote: StorageURI, pending: list[tuple[str, str, str]],
                theirs: dict[str, ObjectMeta]) -> list[FileResult]:
    """Download the ``(rel, path, key)`` of ``pending``, commit markers last."""
    sizes = {remote.join(rel): meta.size for rel, meta in theirs.items()}
    results: list[FileResult] = []
    for batch in markers_last([(key, path) for _, path, key in pending], 0):
        results += await transfer.download_files(batch, sizes=sizes) if batch else []
    return results


def sync(src: str, dst: str, *, delete: bool = False, filters: Filters = (), dry_run: bool = False,
         config: TransferConfig | None = None) -> Moved:
    """Sync twin of ``sync_async``."""
    return BackgroundLoop.get().run(sync_async(src, dst, delete=delete, filters=filters, dry_run=dry_run,
                                               config=config))


__all__ = ["sync", "sync_async"]
