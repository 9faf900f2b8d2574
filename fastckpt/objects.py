"""Commands on stored objects as s5cmd and ``aws s3`` have them: list, print, sum sizes (``removal``: rm; ``mirror``:
cp between stores, mv; ``folder_sync``: sync), and what they share: the objects a URI with wildcards and filters
(``engine.select``) takes."""

from __future__ import annotations

import contextlib
import os
import posixpath
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass

from ._loop import BackgroundLoop
from .api import source_of
from .checkpoint.catalog import target_of
from .config import TransferConfig
from .engine.open_stores import store_for
from .engine.paths import prune_empty
from .engine.select import Selection, has_below, relative
from .engine.stream import StreamReader
from .errors import ObjectNotFoundError
from .stores.base import ObjectMeta, Store
from .stores.retry import retrying
from .threads import off_loop
from .uri import StorageURI

Filters = Sequence[tuple[str, str]]


@dataclass(frozen=True)
class Listed:
    """One object a command selected: its key, its path relative to the listed folder, what the listing said."""

    key: str
    rel: str
    meta: ObjectMeta

    def taken_by(self, selection: Selection) -> bool:
        """Whether ``selection`` takes it (the object a URI names itself is judged by its name)."""
        return selection.takes(self.rel or posixpath.basename(self.key))


def at(uri: StorageURI, key: str) -> str:
    """Where ``key`` of ``uri``'s store is, as people write it: ``s3://bucket/key``, a local path (no options)."""
    return str(uri.with_key(key))


async def stream(store: Store, source: StorageURI, selection: Selection) -> AsyncIterator[Listed]:
    """The objects at or below ``source`` that ``selection`` takes, as the listing yields them."""
    async for meta in store.list(source.key):
        found = Listed(meta.key, relative(source.key, meta.key), meta)
        if found.taken_by(selection):
            yield found


async def select(store: Store, source: StorageURI, selection: Selection, *, recursive: bool = True) -> list[Listed]:
    """The objects at or below ``source`` that ``selection`` takes. Without ``recursive`` (and no wildcard), only
    the object ``source`` names: IsADirectoryError when it is a folder, ObjectNotFoundError when nothing is there."""
    if recursive or selection.pattern is not None:
        return [f async for f in stream(store, source, selection)]
    try:
        meta = await store.head(source.key)
    except (ObjectNotFoundError, IsADirectoryError):
        if source.key and await has_below(store, source.key):
            raise IsADirectoryError(f"{source.raw} is a folder: take what is below it with --recursive "
                                    "(recursive=True)") from None
        raise ObjectNotFoundError(f"{source.raw}: no such object", key=source.key) from None
    found = Listed(meta.key, "", meta)
    return [found] if found.taken_by(selection) else []


async def chosen_below(store: Store, source: StorageURI, selection: Selection, *, recursive: bool,
                       what: str) -> tuple[list[Listed], list[Listed]]:
    """(every object below ``source``, the ones ``selection`` takes), listed once; with neither ``recursive`` nor a
    wildcard, ([], the object ``source`` names). ObjectNotFoundError naming ``what`` when nothing is taken."""
    if recursive or selection.pattern is not None:
        listed = await select(store, source, Selection())
        chosen = [f for f in listed if f.taken_by(selection)]
    else:
        listed, chosen = [], await select(store, source, selection, recursive=False)
    if not chosen:
        raise ObjectNotFoundError(f"nothing to {what} at {source.raw}"
                                  + (f" matching {selection.pattern}" if selection.pattern else ""))
    return listed, chosen


@contextlib.asynccontextmanager
async def opened(uri: StorageURI, config: TransferConfig | None) -> AsyncIterator[Store]:
    """The store of ``uri`` (kept open on the background loop), its requests retried as ``config`` says."""
    config = config or TransferConfig.from_env()
    async with store_for(uri, config) as store:
        yield retrying(store, config)


def prune_local(source: StorageURI, keys: list[str]) -> None:
    """On the local store: remove the folders that deleting ``keys`` left empty, up to ``source``'s own."""
    if source.backend == "local":
        prune_empty((os.path.dirname("/" + k) for k in keys), "/" + source.key, keep_top=False)


async def cat_async(uri: str | StorageURI, write: Callable[[memoryview], object], *,
                    config: TransferConfig | None = None) -> int:
    """Pass the object's bytes to ``write`` in order (parts read ahead in parallel, verified against its digests:
    a mismatch raises IntegrityError after the last part was read, before it is written); its size."""
    source = target_of(uri)
    config = config or TransferConfig.from_env()
    async with opened(source, config) as store:
        meta = (await select(store, source, Selection(), recursive=False))[0].meta
        reader = StreamReader(store, meta, config)
        try:
            for index in range(reader.count):
                await off_loop(write, await reader.part(index, reader.count - index))
        finally:
            await reader.close()
        return meta.size


@dataclass(frozen=True)
class Usage:
    """Objects and bytes below one folder (``name``: its path relative to the listed one; "." for the objects
    directly in it)."""

    name: str
    objects: int
    bytes: int


async def disk_usage_async(uri: str | StorageURI, *, filters: Filters = (),
                           config: TransferConfig | None = None) -> list[Usage]:
    """Sizes below ``uri`` per sub-folder (sorted by name), then the total (``name`` ""), as ``du -d 1``."""
    source, selection = source_of(uri, filters)
    async with opened(source, config) as store:
        chosen = await select(store, source, selection)
    groups: dict[str, list[int]] = {}
    for f in chosen:
        name = f.rel.split("/", 1)[0] if "/" in f.rel else "."
        group = groups.setdefault(name, [0, 0])
        group[0] += 1
        group[1] += f.meta.size
    rows = [Usage(name, n, size) for name, (n, size) in sorted(groups.items())]
    return [*rows, Usage("", sum(r.objects for r in rows), sum(r.bytes for r in rows))]


def _empty_folder(source: StorageURI) -> bool:
    """Whether ``source`` is an empty folder of the local store (object stores have no empty folders)."""
    return source.backend == "local" and os.path.isdir("/" + source.key)


async def list_async(uri: str | StorageURI, *, recursive: bool = False, filters: Filters = (),
                     config: TransferConfig | None = None) -> tuple[list[ObjectMeta], list[str]]:
    """(objects, sub-folder keys) at ``uri``: one level, as ``ls``; every object below with ``recursive`` or a
    wildcard (no folders then); the object itself when ``uri`` names one."""
    source, selection = source_of(uri, filters)
    async with opened(source, config) as store:
        if recursive or selection.pattern is not None:
            return [f.meta for f in await select(store, source, selection)], []
        objects, folders = await store.list_dir(source.key)
        if not objects and not folders and source.key and not _empty_folder(source):
            objects = [f.meta for f in await select(store, source, selection, recursive=False)]
        return [m for m in objects if selection.takes(posixpath.basename(m.key))], folders


def cat(uri: str | StorageURI, write: Callable[[memoryview], object], *, config: TransferConfig | None = None) -> int:
    """Sync twin of ``cat_async``."""
    return BackgroundLoop.get().run(cat_async(uri, write, config=config))


def disk_usage(uri: str | StorageURI, *, filters: Filters = (), config: TransferConfig | None = None) -> list[Usage]:
    """Sync twin of ``disk_usage_async``."""
    return BackgroundLoop.get().run(disk_usage_async(uri, filters=filters, config=config))


def list_objects(uri: str | StorageURI, *, recursive: bool = False, filters: Filters = (),
                 config: TransferConfig | None = None) -> tuple[list[ObjectMeta], list[str]]:
    """Sync twin of ``list_async``."""
    return BackgroundLoop.get().run(list_async(uri, recursive=recursive, filters=filters, config=config))


__all__ = ["Listed", "Usage", "cat", "cat_async", "disk_usage", "disk_usage_async", "list_async", "list_objects"]
