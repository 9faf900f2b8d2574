"""Standalone upload / download API (async functions and their sync twins)."""

from __future__ import annotations

import asyncio
import os
import posixpath

from ._loop import BackgroundLoop
from .checkpoint.base import base_objects
from .checkpoint.catalog import latest_async as catalog_latest
from .checkpoint.manifest import marker_key
from .checkpoint.reader import download_checkpoint_async
from .config import TransferConfig
from .engine.open_stores import store_for
from .engine.paths import local_files, paths_below
from .engine.progress import ProgressCallback
from .engine.session import FileResult
from .engine.transfer import Transfer
from .errors import ObjectNotFoundError
from .stores.base import ObjectMeta
from .tier import Tier, latest_across
from .uri import StorageURI, join_key, parse_uri

PathLike = str | os.PathLike[str]


def _target(uri: str | StorageURI) -> StorageURI:
    parsed = parse_uri(uri) if not isinstance(uri, StorageURI) else uri
    if parsed.backend == "delegate":
        raise ValueError(f"{parsed.raw!r}: scheme {parsed.scheme!r} is not a fastckpt backend; "
                         "use fastckpt.fs.filesystem() to reach it through pyarrow")
    return parsed


async def upload_async(
    src: PathLike, dst: str | StorageURI, *, config: TransferConfig | None = None,
    progress: ProgressCallback | None = None, base: str | StorageURI | None = None,
) -> list[FileResult]:
    """Upload a local file or directory to ``dst``.

    A file goes to ``dst`` itself, or below it when ``dst`` ends with '/'. A directory's files go below
    ``dst`` with their relative paths. ``base``: an earlier copy of the directory in the same bucket (a committed
    checkpoint, ``"latest"`` beside ``dst``, or any prefix whose objects carry fastckpt digests); each file that
    holds the same bytes as the base's file of the same relative name, and each part of one that holds the same
    chunk, is copied by the store instead of sent (``FileResult.copied``).
    """
    src = os.fspath(src)
    target = _target(dst)
    if not os.path.exists(src):
        raise FileNotFoundError(f"source {src} does not exist")
    if os.path.isdir(src):
        pairs = [(path, target.join(rel)) for path, rel in local_files(src)]
    else:
        key = target.join(os.path.basename(src)) if str(dst).endswith("/") else target.key
        pairs = [(src, key)]
    config = config or TransferConfig.from_env()
    async with store_for(target, config) as store:
        transfer = Transfer(store, config, progress)
        try:
            bases = {} if base is None else await base_objects(store, target, base, [k for _, k in pairs])
            return await transfer.upload_files(pairs, bases=bases, snapshot=True)
        finally:
            transfer.close()


async def download_async(
    src: str | StorageURI, dst: PathLike, *, config: TransferConfig | None = None,
    progress: ProgressCallback | None = None, raw: bool = False,
) -> list[FileResult]:
    """Download an object or every object below a prefix to the local path ``dst``.

    An object lands at ``dst`` (or inside it when ``dst`` is a directory or ends with '/'); a prefix's
    objects land below ``dst`` with their relative keys. A committed checkpoint at or below the prefix comes down as
    ``download_checkpoint`` brings it: its committed files only, each verified against its manifest (not fastckpt's
    ``.fastckpt/`` records, nor files of attempts that never committed or were replaced); ``raw=True`` copies every
    object as it is.
    """
    dst = os.fspath(dst)
    source = _target(src)
    config = config or TransferConfig.from_env()
    async with store_for(source, config) as store:
        transfer = Transfer(store, config, progress)
        try:
            # an object or a prefix? Both asked at once: a prefix's download does not wait a round trip for the answer
            listing = asyncio.ensure_future(transfer.keys_below(source.key))
            try:
                meta: ObjectMeta | None = await store.head(source.key) if source.key else None
            except (ObjectNotFoundError, IsADirectoryError):
                meta = None
            except BaseException:
                await _cancelled(listing)
                raise
            if meta is not None:
                await _cancelled(listing)
                path = dst
                if os.path.isdir(dst) or dst.endswith(("/", os.sep)):
                    path = os.path.join(dst, posixpath.basename(source.key))
                return await transfer.download_files([(source.key, path)], metas={source.key: meta})
            if os.path.isfile(dst):
                await _cancelled(listing)
                raise NotADirectoryError(f"destination {dst} is a file, but {source.raw} is a directory")
            found = await listing
            roots = [] if raw else checkpoints_in([rel for _, rel, _ in found])
            plain = [f for f in found if not any(_below(f[1], r) for r in roots)]
            pairs = list(zip([k for k, _, _ in plain], paths_below(dst, [rel for _, rel, _ in plain]), strict=True))
            results = await transfer.download_files(pairs, sizes={k: size for k, _, size in plain}) if pairs else []
            for rel in roots:
                results += await download_checkpoint_async(source.with_key(source.join(rel)),
                                                           os.path.join(dst, rel), config=config, progress=progress)
            return results
        finally:
            transfer.close()


def checkpoints_in(rels: list[str]) -> list[str]:
    """The committed checkpoints among relative keys (a prefix's listing): those holding a commit marker, outermost
    only ("": the prefix itself)."""
    marker = marker_key("")
    found = sorted({rel[:-len(marker)].rstrip("/") for rel in rels if rel == marker or rel.endswith("/" + marker)})
    return [r for i, r in enumerate(found) if not any(_below(r, o) for o in found[:i])]


def _below(rel: str, root: str) -> bool:
    return root == "" or rel == root or rel.startswith(root + "/")


async def _cancelled(task: asyncio.Future[object]) -> None:
    """Cancel ``task`` and wait until it is done (whatever it raised)."""
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


def upload(src: PathLike, dst: str | StorageURI, *, config: TransferConfig | None = None,
           progress: ProgressCallback | None = None, base: str | StorageURI | None = None) -> list[FileResult]:
    """Sync twin of ``upload_async``, run on fastckpt's background loop, which keeps the store open for the next
    call (``engine.open_stores``); an interrupt (Ctrl-C) cancels the transfer."""
    return BackgroundLoop.get().run(upload_async(src, dst, config=config, progress=progress, base=base))


def download(src: str | StorageURI, dst: PathLike, *, config: TransferConfig | None = None,
             progress: ProgressCallback | None = None, raw: bool = False) -> list[FileResult]:
    """Sync twin of ``download_async``, run on fastckpt's background loop, which keeps the store open for the next
    call (``engine.open_stores``); an interrupt (Ctrl-C) cancels the transfer."""
    return BackgroundLoop.get().run(download_async(src, dst, config=config, progress=progress, raw=raw))


async def latest_async(uri: str | StorageURI, *, tier: PathLike | Tier | None = None,
                       config: TransferConfig | None = None) -> str | None:
    """URI of the newest committed checkpoint at ``uri`` (by commit time, then name), or None. ``tier`` (this node's
    tier directory): its copies count too, committed there and perhaps not yet drained (``fastckpt.tier``); read the
    one returned with ``tier=`` to read the nearest copy."""
    if tier is None:
        return await catalog_latest(uri, config=config)
    return await latest_across(uri, tier if isinstance(tier, Tier) else Tier(tier), config)


def latest(uri: str | StorageURI, *, tier: PathLike | Tier | None = None,
           config: TransferConfig | None = None) -> str | None:
    """Sync twin of ``latest_async``."""
    return BackgroundLoop.get().run(latest_async(uri, tier=tier, config=config))


__all__ = ["download", "download_async", "join_key", "latest", "latest_async", "upload", "upload_async"]
