"""Copies between stores and moves, as s5cmd's ``cp`` and ``mv``: between a local folder and a store, or two stores.
Commit markers are written last and removed first, so a checkpoint is never committed while half there."""

from __future__ import annotations

import os
import posixpath
from dataclasses import dataclass, field

from ._loop import BackgroundLoop
from .api import file_path, object_key, source_of, upload_pairs
from .checkpoint.catalog import target_of
from .checkpoint.manifest import is_marker
from .config import TransferConfig
from .engine.paths import paths_below, prune_empty
from .engine.select import split_wildcard
from .engine.stream import copy_object
from .engine.transfer import Transfer
from .errors import CopyUnsupportedError
from .objects import (
    Filters,
    Listed,
    at,
    chosen_below,
    opened,
    prune_local,
)
from .removal import delete_markers_first, markers_of
from .stores.base import CopySource, ObjectMeta, Store
from .tasks import gather_bounded
from .uri import StorageURI, names_folder

COPIES = 64
"""Most objects copied at once from one store to another."""


def is_local(path: str) -> bool:
    """Whether ``path`` is a local path (not a store URI: ``file://`` names the local store)."""
    return "://" not in path


def markers_last(pairs: list[tuple[str, str]], rel_of: int) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """``pairs`` split into (the rest, commit markers), judged by the element ``rel_of`` of each pair."""
    markers = [p for p in pairs if is_marker(p[rel_of])]
    return [p for p in pairs if not is_marker(p[rel_of])], markers


@dataclass
class Moved:
    """What ``copy``, ``move`` or ``folder_sync.sync`` did (with ``dry_run``: would do): ``(from, to)`` of each object
    or file sent, its bytes, how many were already the same at the destination, and what was deleted there
    (``sync(delete=True)``)."""

    sent: list[tuple[str, str]] = field(default_factory=list)
    bytes: int = 0
    unchanged: int = 0
    deleted: list[str] = field(default_factory=list)


def remove_files(paths: list[str], top: str, *, keep_top: bool = True) -> None:
    """Remove local files (commit markers first), then the folders below ``top`` that this left empty (``top`` too
    unless ``keep_top``)."""
    for path in sorted(paths, key=lambda p: not is_marker(p.replace(os.sep, "/"))):
        os.remove(path)
    prune_empty((os.path.dirname(p) for p in paths), top, keep_top=keep_top)


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
    async with opened(source, config) as store:
        listed, chosen = await chosen_below(store, source, selection, recursive=True, what="move")
        if is_local(dst):
            done = await _move_down(store, source, chosen, dst, config, dry_run)
        else:
            done = await _copy_across(store, source, chosen, dst, config, dry_run)
        if not dry_run:
            await delete_markers_first(store, [f.meta for f in chosen], await markers_of(store, source, listed, chosen))
            prune_local(source, [f.key for f in chosen])
        return done


async def copy_async(src: str, dst: str, *, filters: Filters = (), dry_run: bool = False,
                     config: TransferConfig | None = None) -> Moved:
    """Copy from one store URI to another (``fastckpt cp s3://... gs://...``): by the store itself within one store
    (digests kept), else streamed through this process, verified on the way; commit markers last."""
    config = config or TransferConfig.from_env()
    source, selection = source_of(src, filters)
    async with opened(source, config) as store:
        _, chosen = await chosen_below(store, source, selection, recursive=True, what="copy")
        return await _copy_across(store, source, chosen, dst, config, dry_run)


async def _move_up(src: str, dst: str, filters: Filters, dry_run: bool, config: TransferConfig) -> Moved:
    folder, pattern = split_wildcard(src)
    target = target_of(dst)
    async with opened(target, config) as store:
        pairs = await upload_pairs(store, src, dst, target, filters)
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
    top = folder if os.path.isdir(folder) else os.path.dirname(folder)
    remove_files([p for p, _ in pairs], top, keep_top=top != folder or pattern is not None)  # a folder moved whole goes
    return done


async def _move_down(store: Store, source: StorageURI, chosen: list[Listed], dst: str, config: TransferConfig,
                     dry_run: bool) -> Moved:
    if len(chosen) == 1 and not chosen[0].rel:
        paths = [file_path(dst, posixpath.basename(chosen[0].key))]
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
    async with opened(target, config) as into:
        if len(chosen) == 1 and not chosen[0].rel:
            keys = [await object_key(into, target, names_folder(dst), posixpath.basename(chosen[0].key))]
        else:
            keys = [target.join(f.rel) for f in chosen]
        pairs = [(f.key, k) for f, k in zip(chosen, keys, strict=True)]
        done = Moved([(at(source, a), at(target, b)) for a, b in pairs], sum(f.meta.size for f in chosen))
        if dry_run:
            return done
        metas = {f.key: f.meta for f in chosen}
        same = into.location == store.location
        for batch in markers_last(pairs, 0):
            await gather_bounded([_copy(store, into, a, b, metas[a], config, same) for a, b in batch], COPIES)
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


def move(src: str, dst: str, *, filters: Filters = (), dry_run: bool = False,
         config: TransferConfig | None = None) -> Moved:
    """Sync twin of ``move_async``."""
    return BackgroundLoop.get().run(move_async(src, dst, filters=filters, dry_run=dry_run, config=config))


def copy(src: str, dst: str, *, filters: Filters = (), dry_run: bool = False,
         config: TransferConfig | None = None) -> Moved:
    """Sync twin of ``copy_async``."""
    return BackgroundLoop.get().run(copy_async(src, dst, filters=filters, dry_run=dry_run, config=config))


__all__ = ["Moved", "copy", "copy_async", "move", "move_async"]

