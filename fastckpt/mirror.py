"""Copies that replace or mirror, as s5cmd's ``mv`` and ``sync``: between a local folder and a store, or two stores.

``sync`` sends only what differs, judged by the XXH3 digest fastckpt recorded where there is one (a file rewritten
with the same bytes is not sent; one changed without a new size or time is), by size and time where there is not.
Commit markers are written last and removed first, so a checkpoint is never committed while half there."""

from __future__ import annotations

import mmap
import os
from dataclasses import dataclass, field

from ._loop import BackgroundLoop
from .api import upload_pairs
from .checkpoint.catalog import target_of
from .config import TransferConfig
from .engine.open_stores import store_for
from .engine.paths import local_files, paths_below
from .engine.select import Selection, has_below, split_wildcard
from .engine.stream import copy_object
from .engine.transfer import Transfer
from .errors import CopyUnsupportedError
from .integrity import FileDigest, combine, hash_chunks
from .objects import (
    Filters,
    Listed,
    at,
    chosen_below,
    delete_markers_first,
    is_marker,
    markers_of,
    prune_local,
    source_of,
)
from .objects import select as select_objects
from .stores.base import CopySource, ObjectMeta, Store
from .tasks import gather_bounded
from .threads import off_loop
from .uri import StorageURI, names_folder

LOOKUPS = 64
"""Most HEAD requests ``sync`` has in flight while it compares digests."""


def is_local(path: str) -> bool:
    """Whether ``path`` is a local path (not a store URI: ``file://`` names the local store)."""
    return "://" not in path


def markers_last(pairs: list[tuple[str, str]], rel_of: int) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """``pairs`` split into (the rest, commit markers), judged by the element ``rel_of`` of each pair."""
    markers = [p for p in pairs if is_marker(p[rel_of])]
    return [p for p in pairs if not is_marker(p[rel_of])], markers


@dataclass
class Moved:
    """What ``move`` or ``sync`` did (with ``dry_run``: would do): ``(from, to)`` of each object or file sent,
    how many were already the same at the destination, and what was deleted there (``sync(delete=True)``)."""

    sent: list[tuple[str, str]] = field(default_factory=list)
    bytes: int = 0
    unchanged: int = 0
    deleted: list[str] = field(default_factory=list)


# ------------------------------------------------------------------------------------------------------------ sync


def local_digest(path: str, chunk_size: int) -> str:
    """The file digest of ``path`` cut into ``chunk_size`` chunks (as fastckpt records it)."""
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            return combine([])
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as view:
            return combine(hash_chunks(view, chunk_size))


async def differs(store: Store, key: str, path: str, *, upload: bool) -> bool:
    """Whether the local file ``path`` and the object ``key``, of one size, hold other bytes: by the object's
    recorded digest, else (no digest) by time: the source is newer than the destination (s5cmd's rule)."""
    meta = await store.head(key)
    recorded = FileDigest.from_metadata(meta.size, meta.metadata)
    if recorded is not None and not recorded.changed:
        return await off_loop(local_digest, path, recorded.chunk_size) != recorded.digest
    local_mtime = os.stat(path).st_mtime
    return local_mtime > meta.mtime if upload else meta.mtime > local_mtime


async def to_send(store: Store, pairs: list[tuple[str, str, str]], theirs: dict[str, int], *,
                  upload: bool) -> list[tuple[str, str, str]]:
    """The ``(rel, path, key)`` of ``pairs`` whose local file and object differ (``theirs``: rel -> the object's
    size; ``upload``: the local file is the source)."""
    same = [p for p in pairs if p[0] in theirs and os.path.isfile(p[1]) and os.stat(p[1]).st_size == theirs[p[0]]]
    verdicts = await gather_bounded([differs(store, key, path, upload=upload) for _, path, key in same], LOOKUPS)
    kept = {p[0] for p, changed in zip(same, verdicts, strict=True) if not changed}
    return [p for p in pairs if p[0] not in kept]


async def sync_async(src: str, dst: str, *, delete: bool = False, filters: Filters = (), dry_run: bool = False,
                     config: TransferConfig | None = None) -> Moved:
    """Make ``dst`` hold what ``src`` holds (a local folder and a store URI, either way): send each file that is
    missing there or differs (see the module docstring); ``delete``: also remove what ``src`` lacks. ``filters``
    select on both sides (what they leave out is neither sent nor deleted)."""
    config = config or TransferConfig.from_env()
    folder, pattern = split_wildcard(src)
    selection = Selection.of(pattern, filters)
    if is_local(folder):
        return await _sync_up(folder, target_of(dst), selection, delete, dry_run, config)
    if not is_local(dst):
        raise ValueError(f"sync between two stores ({src} -> {dst}) is not supported: sync to a local folder")
    return await _sync_down(target_of(folder), dst, selection, delete, dry_run, config)


async def _sync_up(folder: str, target: StorageURI, selection: Selection, delete: bool, dry_run: bool,
                   config: TransferConfig) -> Moved:
    if not os.path.isdir(folder):
        raise NotADirectoryError(f"sync takes a folder: {folder} is not one")
    ours = {rel: path for path, rel in local_files(folder) if selection.takes(rel)}
    async with store_for(target, config) as store:
        theirs = {f.rel: f.meta.size for f in await select_objects(store, target, selection) if f.rel}
        pending = await to_send(store, [(rel, path, target.join(rel)) for rel, path in ours.items()], theirs,
                                upload=True)
        gone = sorted(target.join(rel) for rel in set(theirs) - set(ours)) if delete else []
        done = Moved([(path, at(target, key)) for _, path, key in pending],
                     sum(os.stat(p).st_size for _, p, _ in pending), len(ours) - len(pending),
                     [at(target, k) for k in gone])
        if dry_run:
            return done
        rest, markers = markers_last([(path, key) for _, path, key in pending], 1)
        transfer = Transfer(store, config)
        try:
            for batch in (rest, markers):
                if batch:
                    await transfer.upload_files(batch, snapshot=True)
        finally:
            transfer.close()
        if gone:
            await delete_markers_first(store, gone, [k for k in gone if is_marker(k)])
            prune_local(target, gone)
        return done


async def _sync_down(source: StorageURI, dst: str, selection: Selection, delete: bool, dry_run: bool,
                     config: TransferConfig) -> Moved:
    if os.path.isfile(dst):
        raise NotADirectoryError(f"sync takes a folder: {dst} is a file")
    ours = {rel: path for path, rel in (local_files(dst) if os.path.isdir(dst) else [])
            if selection.takes(rel)}
    async with store_for(source, config) as store:
        theirs = {f.rel: f.meta for f in await select_objects(store, source, selection) if f.rel}
        paths = paths_below(dst, list(theirs))
        pairs = [(rel, path, source.join(rel)) for rel, path in zip(theirs, paths, strict=True)]
        pending = await to_send(store, pairs, {rel: m.size for rel, m in theirs.items()}, upload=False)
        gone = sorted(path for rel, path in ours.items() if rel not in theirs) if delete else []
        done = Moved([(at(source, key), path) for _, path, key in pending],
                     sum(theirs[rel].size for rel, _, _ in pending), len(pairs) - len(pending), gone)
        if dry_run:
            return done
        rest, markers = markers_last([(key, path) for _, path, key in pending], 0)
        sizes = {source.join(rel): meta.size for rel, meta in theirs.items()}
        transfer = Transfer(store, config)
        try:
            for batch in (rest, markers):
                if batch:
                    await transfer.download_files(batch, sizes=sizes)
        finally:
            transfer.close()
    _remove_files(gone, dst)
    return done


def _remove_files(paths: list[str], top: str) -> None:
    """Remove local files (commit markers first), then the folders below ``top`` that this left empty."""
    for path in sorted(paths, key=lambda p: not is_marker(p.replace(os.sep, "/"))):
        os.remove(path)
    for folder in sorted({os.path.dirname(p) for p in paths}, key=len, reverse=True):
        while len(folder) > len(top.rstrip(os.sep)) and folder.startswith(top):
            try:
                os.rmdir(folder)
            except OSError:
                break
            folder = os.path.dirname(folder)


# ------------------------------------------------------------------------------------------------------------ move


async def move_async(src: str, dst: str, *, filters: Filters = (), dry_run: bool = False,
                     config: TransferConfig | None = None) -> Moved:
    """Move an object, a folder's contents, or what a wildcard matches to ``dst`` (paths as ``api.upload``): copied
    (server-side within one store), then the source deleted once every copy is done (a checkpoint loses its commit
    marker first)."""
    config = config or TransferConfig.from_env()
    if is_local(src):
        return await _move_up(src, dst, filters, dry_run, config)
    source, selection = source_of(src, filters)
    async with store_for(source, config) as store:
        listed, chosen = await chosen_below(store, source, selection, recursive=True, what="move")
        if is_local(dst):
            done = await _move_down(store, source, chosen, dst, config, dry_run)
        else:
            done = await _copy_across(store, source, chosen, dst, config, dry_run)
        if not dry_run:
            keys = [f.key for f in chosen]
            await delete_markers_first(store, keys, await markers_of(store, source, listed, chosen))
            prune_local(source, keys)
        return done


async def copy_async(src: str, dst: str, *, filters: Filters = (), dry_run: bool = False,
                     config: TransferConfig | None = None) -> Moved:
    """Copy from one store URI to another (``fastckpt cp s3://... gs://...``): by the store itself within one store
    (digests kept), else streamed through this process, verified on the way; commit markers last."""
    config = config or TransferConfig.from_env()
    source, selection = source_of(src, filters)
    async with store_for(source, config) as store:
        _, chosen = await chosen_below(store, source, selection, recursive=True, what="copy")
        return await _copy_across(store, source, chosen, dst, config, dry_run)


async def _move_up(src: str, dst: str, filters: Filters, dry_run: bool, config: TransferConfig) -> Moved:
    folder, pattern = split_wildcard(src)
    target = target_of(dst)
    async with store_for(target, config) as store:
        pairs = await upload_pairs(store, folder, target, names_folder(dst), Selection.of(pattern, filters))
        done = Moved([(p, at(target, k)) for p, k in pairs], sum(os.stat(p).st_size for p, _ in pairs))
        if dry_run or not pairs:
            return done
        transfer = Transfer(store, config)
        try:
            for batch in markers_last(pairs, 1):
                if batch:
                    await transfer.upload_files(batch, snapshot=True)
        finally:
            transfer.close()
    _remove_files([p for p, _ in pairs], folder if os.path.isdir(folder) else os.path.dirname(folder))
    if os.path.isdir(folder) and pattern is None and not os.listdir(folder):
        os.rmdir(folder)
    return done


async def _move_down(store: Store, source: StorageURI, chosen: list[Listed], dst: str, config: TransferConfig,
                     dry_run: bool) -> Moved:
    if len(chosen) == 1 and not chosen[0].rel:
        into = os.path.isdir(dst) or dst.endswith(("/", os.sep))
        paths = [os.path.join(dst, os.path.basename(chosen[0].key)) if into else dst]
    else:
        paths = paths_below(dst, [f.rel for f in chosen])
    pairs = [(f.key, p) for f, p in zip(chosen, paths, strict=True)]
    done = Moved([(at(source, k), p) for k, p in pairs], sum(f.meta.size for f in chosen))
    if not dry_run:
        transfer = Transfer(store, config)
        try:
            for batch in markers_last(pairs, 0):
                if batch:
                    await transfer.download_files(batch, sizes={f.key: f.meta.size for f in chosen})
        finally:
            transfer.close()
    return done


async def _copy_across(store: Store, source: StorageURI, chosen: list[Listed], dst: str, config: TransferConfig,
                       dry_run: bool) -> Moved:
    target = target_of(dst)
    async with store_for(target, config) as into:
        if len(chosen) == 1 and not chosen[0].rel:
            folder = names_folder(dst) or await has_below(into, target.key)
            keys = [target.join(chosen[0].key.rsplit("/", 1)[-1]) if folder else target.key]
        else:
            keys = [target.join(f.rel) for f in chosen]
        pairs = [(f.key, k) for f, k in zip(chosen, keys, strict=True)]
        done = Moved([(at(source, a), at(target, b)) for a, b in pairs], sum(f.meta.size for f in chosen))
        if dry_run:
            return done
        metas = {f.key: f.meta for f in chosen}
        same = into.location == store.location
        for batch in markers_last(pairs, 0):
            await gather_bounded([_copy(store, into, a, b, metas[a], config, same) for a, b in batch], LOOKUPS)
        return done


async def _copy(store: Store, into: Store, key: str, to: str, listed: ObjectMeta, config: TransferConfig,
                same: bool) -> None:
    """One object copied: by the store itself within one store (its metadata, digests included, kept), else
    streamed through this process (verified on the way, digests recorded anew)."""
    if same and listed.size > 0:
        meta = await store.head(key)
        try:
            await store.copy(to, CopySource(key, meta.etag or "", 0, meta.size), metadata=meta.metadata)
            return
        except CopyUnsupportedError:
            pass
    await copy_object(store, key, into, to, config)


def sync(src: str, dst: str, *, delete: bool = False, filters: Filters = (), dry_run: bool = False,
         config: TransferConfig | None = None) -> Moved:
    """Sync twin of ``sync_async``."""
    return BackgroundLoop.get().run(sync_async(src, dst, delete=delete, filters=filters, dry_run=dry_run,
                                               config=config))


def move(src: str, dst: str, *, filters: Filters = (), dry_run: bool = False,
         config: TransferConfig | None = None) -> Moved:
    """Sync twin of ``move_async``."""
    return BackgroundLoop.get().run(move_async(src, dst, filters=filters, dry_run=dry_run, config=config))


def copy(src: str, dst: str, *, filters: Filters = (), dry_run: bool = False,
         config: TransferConfig | None = None) -> Moved:
    """Sync twin of ``copy_async``."""
    return BackgroundLoop.get().run(copy_async(src, dst, filters=filters, dry_run=dry_run, config=config))


__all__ = ["Moved", "copy", "copy_async", "move", "move_async", "sync", "sync_async"]

