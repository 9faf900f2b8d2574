"""Standalone upload / download API (async functions and their sync twins)."""

from __future__ import annotations

import asyncio
import os
import posixpath
from collections.abc import Sequence
from dataclasses import dataclass, field

from . import stats
from ._loop import BackgroundLoop
from .checkpoint.base import base_objects
from .checkpoint.catalog import newest_committed, target_of
from .checkpoint.manifest import META_DIR, is_marker, marker_key
from .checkpoint.reader import download_checkpoint_async
from .config import TransferConfig
from .engine.open_stores import store_for
from .engine.paths import local_files, paths_below
from .engine.progress import ProgressCallback
from .engine.select import Selection, has_below, keys_below, split_wildcard
from .engine.session import FileResult
from .engine.transfer import Transfer
from .errors import ObjectNotFoundError
from .stores.base import ObjectMeta, Store
from .stores.retry import retrying
from .tier import Tier, latest_across
from .uri import StorageURI, join_key, names_folder

PathLike = str | os.PathLike[str]


@stats.summarized("upload")
async def upload_async(
    src: PathLike, dst: str | StorageURI, *, config: TransferConfig | None = None,
    progress: ProgressCallback | None = None, base: str | StorageURI | None = None,
    filters: Sequence[tuple[str, str]] = (),
) -> list[FileResult]:
    """Upload a local file or directory to ``dst``.

    Paths as ``aws s3 cp`` and s5cmd take them, on every store: a file goes to ``dst`` itself, or below it under its
    own name when ``dst`` names a folder (a URI string whose path ends with '/', or a prefix that already holds
    objects). A directory's files go below ``dst`` with their relative paths (its contents, not the directory). ``src``
    may hold wildcards (``engine.select``: ``*``, ``?``, ``**``): the matching files go below ``dst`` with their paths
    relative to the folder before the first wildcard. ``filters``: ordered ``("exclude" | "include", pattern)`` pairs
    (``engine.select.Selection``). ``base``: an earlier copy of the directory in the same bucket (a committed
    checkpoint, ``"latest"`` beside ``dst``, or any prefix whose objects carry fastckpt digests); each file that
    holds the same bytes as the base's file of the same relative name, and each part of one that holds the same
    chunk, is copied by the store instead of sent (``FileResult.copied``).
    """
    target = target_of(dst)
    config = config or TransferConfig.from_env()
    async with store_for(target, config) as store:
        with stats.stage("listing"):
            pairs = await upload_pairs(retrying(store, config), src, dst, target, filters)
        transfer = Transfer(store, config, progress)
        try:
            bases = {} if base is None else await base_objects(store, target, base, [k for _, k in pairs])
            return await transfer.upload_files(pairs, bases=bases, snapshot=True)
        finally:
            transfer.close()


async def plan_upload_async(src: PathLike, dst: str | StorageURI, *, filters: Sequence[tuple[str, str]] = (),
                            config: TransferConfig | None = None) -> list[tuple[str, str]]:
    """The ``(local path, key)`` of each file ``upload_async`` with these arguments would send, sending nothing."""
    target = target_of(dst)
    config = config or TransferConfig.from_env()
    async with store_for(target, config) as store:
        return await upload_pairs(retrying(store, config), src, dst, target, filters)


async def upload_pairs(store: Store, src: PathLike, dst: str | StorageURI, target: StorageURI,
                       filters: Sequence[tuple[str, str]]) -> list[tuple[str, str]]:
    """(local path, key) of each file an upload of ``src`` (wildcards allowed) to ``dst`` (parsed: ``target``)
    sends."""
    src, pattern = split_wildcard(os.fspath(src))
    selection = Selection.of(pattern, filters)
    into = names_folder(dst)
    if not os.path.exists(src):
        raise FileNotFoundError(f"source {src} does not exist")
    if os.path.isdir(src):
        pairs = [(path, target.join(rel)) for path, rel in local_files(src) if selection.takes(rel)]
        if not pairs and not selection.everything:
            raise FileNotFoundError(f"no file below {src} matches {selection.pattern or 'the filters'}")
        return pairs
    if selection.pattern is not None:
        raise NotADirectoryError(f"{src} is a file: a wildcard must follow a folder")
    if not selection.takes(os.path.basename(src)):
        return []
    return [(src, await object_key(store, target, into, os.path.basename(src)))]


async def object_key(store: Store, target: StorageURI, into: bool, name: str) -> str:
    """The key one file or object named ``name`` is written to at ``target``: below it under that name when ``into``
    (the destination was written as a folder) or when objects lie below it, else ``target`` itself."""
    return target.join(name) if into or await has_below(store, target.key) else target.key


def file_path(dst: str, name: str) -> str:
    """The local path one object named ``name`` lands at: inside ``dst`` when it is a folder or ends with '/'."""
    return os.path.join(dst, name) if os.path.isdir(dst) or dst.endswith(("/", os.sep)) else dst


@stats.summarized("download")
async def download_async(
    src: str | StorageURI, dst: PathLike, *, config: TransferConfig | None = None,
    progress: ProgressCallback | None = None, raw: bool = False, filters: Sequence[tuple[str, str]] = (),
) -> list[FileResult]:
    """Download an object or every object below a prefix to the local path ``dst``.

    An object lands at ``dst`` (or inside it when ``dst`` is a directory or ends with '/'); a prefix's
    objects land below ``dst`` with their relative keys. A committed checkpoint at or below the prefix comes down as
    ``download_checkpoint`` brings it: its committed files only, each verified against its manifest (not fastckpt's
    ``.fastckpt/`` records, nor files of attempts that never committed or were replaced); ``raw=True`` copies every
    object as it is. ``src`` may hold wildcards and ``filters`` select as in ``upload_async``: then the matching
    objects come down one by one, each verified against its own digests (``.fastckpt/`` records only with ``raw``).
    """
    config = config or TransferConfig.from_env()
    source, selection = source_of(src, filters)
    async with store_for(source, config) as store:
        with stats.stage("listing"):
            plan = await _plan_download(store, source, os.fspath(dst), selection, raw)
        transfer = Transfer(store, config, progress)
        try:
            results = await transfer.download_files(plan.pairs, sizes=plan.sizes, metas=plan.metas) \
                if plan.pairs else []
        finally:
            transfer.close()
        for uri, path in plan.checkpoints:
            results += await download_checkpoint_async(uri, path, config=config, progress=progress)
        return results


@dataclass(frozen=True)
class DownloadPlan:
    """What a download does: the objects it copies (``(key, path)``, with what their listing or HEAD said), and the
    committed checkpoints it brings as ``download_checkpoint`` does (``(uri, path)``)."""

    pairs: list[tuple[str, str]]
    sizes: dict[str, int] = field(default_factory=dict)
    metas: dict[str, ObjectMeta] = field(default_factory=dict)
    checkpoints: list[tuple[StorageURI, str]] = field(default_factory=list)


async def plan_download_async(src: str | StorageURI, dst: PathLike, *, raw: bool = False,
                              filters: Sequence[tuple[str, str]] = (),
                              config: TransferConfig | None = None) -> DownloadPlan:
    """What ``download_async`` with these arguments would do, doing none of it (``fastckpt cp --dry-run``)."""
    source, selection = source_of(src, filters)
    async with store_for(source, config or TransferConfig.from_env()) as store:
        return await _plan_download(store, source, os.fspath(dst), selection, raw)


def source_of(src: str | StorageURI, filters: Sequence[tuple[str, str]]) -> tuple[StorageURI, Selection]:
    """The folder (or object) a command lists, and what it takes there (the wildcards in ``src``, ``filters``)."""
    text, pattern = split_wildcard(src) if isinstance(src, str) else (src, None)
    return target_of(text), Selection.of(pattern, filters)


async def _plan_download(store: Store, source: StorageURI, dst: str, selection: Selection,
                         raw: bool) -> DownloadPlan:
    # an object or a prefix? Both asked at once: a prefix's download does not wait a round trip for the answer
    listing = asyncio.ensure_future(keys_below(store, source.key))
    try:
        meta: ObjectMeta | None = (await store.head(source.key)
                                   if source.key and selection.pattern is None else None)
    except (ObjectNotFoundError, IsADirectoryError):
        meta = None
    except BaseException:
        await _cancelled(listing)
        raise
    if meta is not None:
        await _cancelled(listing)
        if not selection.takes(posixpath.basename(source.key)):
            return DownloadPlan([])
        return DownloadPlan([(source.key, file_path(dst, posixpath.basename(source.key)))], metas={source.key: meta})
    if os.path.isfile(dst):
        await _cancelled(listing)
        raise NotADirectoryError(f"destination {dst} is a file, but {source.raw} is a directory")
    found = await listing
    if not selection.everything:
        found = [f for f in found if selection.takes(f[1]) and (raw or not is_record(f[1]))]
        if not found:
            raise ObjectNotFoundError(f"nothing below {source.raw} matches {selection.pattern or 'the filters'}")
    roots = [] if raw or not selection.everything else checkpoints_in([rel for _, rel, _ in found])
    plain = [f for f in found if not any(is_below(f[1], r) for r in roots)]
    pairs = list(zip([k for k, _, _ in plain], paths_below(dst, [rel for _, rel, _ in plain]), strict=True))
    return DownloadPlan(pairs, {k: size for k, _, size in plain}, {},
                        [(source.with_key(source.join(rel)), os.path.join(dst, rel)) for rel in roots])


def is_record(rel: str) -> bool:
    """Whether the relative key lies in a checkpoint's ``.fastckpt/`` records."""
    return META_DIR in rel.split("/")[:-1]


def checkpoints_in(rels: list[str]) -> list[str]:
    """The committed checkpoints among relative keys (a prefix's listing): those holding a commit marker, outermost
    only ("": the prefix itself)."""
    marker = marker_key("")
    found = sorted({rel[:-len(marker)].rstrip("/") for rel in rels if is_marker(rel)})
    return [r for i, r in enumerate(found) if not any(is_below(r, o) for o in found[:i])]


def is_below(rel: str, root: str) -> bool:
    """Whether the relative key ``rel`` lies at or below ``root`` ("": everything)."""
    return root == "" or rel == root or rel.startswith(root + "/")


async def _cancelled(task: asyncio.Future[object]) -> None:
    """Cancel ``task`` and wait until it is done (whatever it raised)."""
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


def upload(src: PathLike, dst: str | StorageURI, *, config: TransferConfig | None = None,
           progress: ProgressCallback | None = None, base: str | StorageURI | None = None,
           filters: Sequence[tuple[str, str]] = ()) -> list[FileResult]:
    """Sync twin of ``upload_async``, run on fastckpt's background loop, which keeps the store open for the next
    call (``engine.open_stores``); an interrupt (Ctrl-C) cancels the transfer."""
    return BackgroundLoop.get().run(upload_async(src, dst, config=config, progress=progress, base=base,
                                                 filters=filters))


def download(src: str | StorageURI, dst: PathLike, *, config: TransferConfig | None = None,
             progress: ProgressCallback | None = None, raw: bool = False,
             filters: Sequence[tuple[str, str]] = ()) -> list[FileResult]:
    """Sync twin of ``download_async``, run on fastckpt's background loop, which keeps the store open for the next
    call (``engine.open_stores``); an interrupt (Ctrl-C) cancels the transfer."""
    return BackgroundLoop.get().run(download_async(src, dst, config=config, progress=progress, raw=raw,
                                                   filters=filters))


async def latest_async(uri: str | StorageURI, *, tier: PathLike | Tier | None = None,
                       config: TransferConfig | None = None) -> str | None:
    """URI of the newest committed checkpoint at ``uri`` (by commit time, then name), or None. ``tier`` (this node's
    tier directory): its copies count too, committed there and perhaps not yet drained (``fastckpt.tier``); read the
    one returned with ``tier=`` to read the nearest copy."""
    if tier is None:
        return await newest_committed(uri, config=config)
    return await latest_across(uri, tier if isinstance(tier, Tier) else Tier(tier), config=config)


def latest(uri: str | StorageURI, *, tier: PathLike | Tier | None = None,
           config: TransferConfig | None = None) -> str | None:
    """Sync twin of ``latest_async``."""
    return BackgroundLoop.get().run(latest_async(uri, tier=tier, config=config))


__all__ = ["download", "download_async", "join_key", "latest", "latest_async", "upload", "upload_async"]
