"""``rm``: removing objects without ever leaving a checkpoint committed and half there. A checkpoint that loses any
file loses its commit marker first; a prefix removed whole is deleted while it is still being listed (as s5cmd does),
each object only once the listing has passed the place of every commit marker that could cover it."""

from __future__ import annotations

import asyncio
import heapq
from dataclasses import dataclass, field

from ._loop import BackgroundLoop
from .api import checkpoints_in, is_below, source_of
from .checkpoint.manifest import is_marker, marker_key
from .config import TransferConfig
from .engine.select import relative
from .objects import Filters, Listed, at, chosen_below, opened, prune_local
from .stores.base import ObjectMeta, Store
from .uri import StorageURI

BATCH = 1000
"""Objects per delete request (S3's DeleteObjects takes 1000)."""
IN_FLIGHT = 16
"""Most delete batches at once while a listing streams."""
SORTED = ("s3", "gcs", "azure")
"""Backends whose listings come sorted by key (their APIs say so), which a streamed removal needs."""


async def markers_above(store: Store, source: StorageURI) -> list[str]:
    """The commit markers of checkpoints that hold ``source`` (its parent folders')."""
    if not source.key:
        return []
    parts = source.key.split("/")
    above = [marker_key("/".join(parts[:n])) for n in range(len(parts) - 1, -1, -1)]
    found = await asyncio.gather(*(store.exists(k) for k in above))
    return [k for k, there in zip(above, found, strict=True) if there]


async def markers_of(store: Store, source: StorageURI, listed: list[Listed], chosen: list[Listed]) -> list[str]:
    """Commit markers of the checkpoints that removing ``chosen`` (of the full listing ``listed``) would break: those
    found in the listing with a chosen object below them, and those that hold ``source`` itself."""
    markers = []
    for root in checkpoints_in([f.rel for f in listed]):
        if any(is_below(f.rel, root) for f in chosen):
            markers.append(source.join(marker_key(root)))
    return markers + (await markers_above(store, source) if chosen else [])


async def delete_markers_first(store: Store, listed: list[ObjectMeta], markers: list[str]) -> None:
    """Delete ``markers`` (their checkpoints stop being committed), then the rest of the ``listed`` objects."""
    if markers:
        await store.delete_many(markers)
    doomed = set(markers)
    await store.delete_listed([m for m in listed if m.key not in doomed])


def gate(source: StorageURI, key: str) -> str:
    """The last key a sorted listing of ``source`` must have passed before ``key`` may go: the latest place a commit
    marker of one of its folders (below ``source``) would be listed."""
    folders = relative(source.key, key).split("/")[:-1]
    return max(source.join(marker_key("/".join(folders[:n]))) for n in range(len(folders) + 1))


@dataclass
class _Streaming:
    """Deletes of one listing as it arrives: objects wait (a heap by ``gate``) until it is safe, then go in batches;
    a commit marker goes alone, and every batch released after it waits until it is gone."""

    store: Store
    source: StorageURI
    waiting: list[tuple[str, str, ObjectMeta]] = field(default_factory=list)
    ready: list[ObjectMeta] = field(default_factory=list)
    markers: list[asyncio.Task[None]] = field(default_factory=list)
    batches: set[asyncio.Task[None]] = field(default_factory=set)
    removed: list[str] = field(default_factory=list)

    async def take(self, meta: ObjectMeta, last: str) -> None:
        """``meta`` listed (``last``: the greatest key listed so far)."""
        self.removed.append(meta.key)
        if is_marker(meta.key):
            self.markers.append(asyncio.ensure_future(self.store.delete_many([meta.key])))
        else:
            heapq.heappush(self.waiting, (gate(self.source, meta.key), meta.key, meta))
        while self.waiting and self.waiting[0][0] <= last:
            self.ready.append(heapq.heappop(self.waiting)[2])
        if len(self.ready) >= BATCH:
            batch, self.ready = self.ready, []
            await self.ship(batch)

    async def ship(self, batch: list[ObjectMeta]) -> None:
        """Send ``batch`` as one request (after the markers listed so far are gone), at most ``IN_FLIGHT`` at once."""
        await asyncio.gather(*self.markers)
        while len(self.batches) >= IN_FLIGHT:
            done, _ = await asyncio.wait(self.batches, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                self.batches.discard(task)
                task.result()
        task = asyncio.ensure_future(self.store.delete_listed(batch))
        self.batches.add(task)

    async def finish(self) -> None:
        """The listing is done: everything left is safe."""
        rest = [*self.ready, *(entry[2] for entry in sorted(self.waiting))]
        self.ready, self.waiting = [], []
        for i in range(0, len(rest), BATCH):
            await self.ship(rest[i:i + BATCH])
        await asyncio.gather(*self.markers, *self.batches)

    async def abandon(self) -> None:
        """Stop: wait for what was sent (a delete cannot be recalled) and keep its error to oneself."""
        await asyncio.gather(*self.markers, *self.batches, return_exceptions=True)


async def _remove_streaming(store: Store, source: StorageURI) -> list[str]:
    """Everything below ``source``, deleted while it is listed; the keys removed. The listing must be sorted
    (``SORTED``); ValueError if it is not (what went by then stays gone, commit markers first as always)."""
    above = await markers_above(store, source)
    if above:
        await store.delete_many(above)
    stream = _Streaming(store, source)
    last = ""
    try:
        async for meta in store.list(source.key):
            if meta.key < last:
                raise ValueError(f"the listing of {source.raw} is not sorted ({meta.key!r} after {last!r})")
            last = meta.key
            await stream.take(meta, last)
        await stream.finish()
    except BaseException:
        await stream.abandon()
        raise
    return [*above, *stream.removed]


async def remove_async(uri: str | StorageURI, *, recursive: bool = False, filters: Filters = (),
                       dry_run: bool = False, config: TransferConfig | None = None) -> list[str]:
    """Remove the object ``uri`` names, or (``recursive``, or a wildcard) what the selection takes below it; where
    each removed object was (``at``; with ``dry_run``, would be). The commit marker of a checkpoint that loses any file
    goes first. A whole prefix of a paged store (S3, GCS, Azure) is deleted while it is listed."""
    source, selection = source_of(uri, filters)
    async with opened(source, config) as store:
        if recursive and selection.everything and not dry_run and source.backend in SORTED:
            keys = await _remove_streaming(store, source)
            if not keys:
                raise FileNotFoundError(f"nothing to remove at {source.raw}")
            return [at(source, k) for k in keys]
        listed, chosen = await chosen_below(store, source, selection, recursive=recursive, what="remove")
        markers = await markers_of(store, source, listed, chosen)
        keys = [*markers, *(f.key for f in chosen if f.key not in markers)]
        if not dry_run:
            await delete_markers_first(store, [f.meta for f in chosen], markers)
            prune_local(source, keys)
        return [at(source, k) for k in keys]


def remove(uri: str | StorageURI, *, recursive: bool = False, filters: Filters = (), dry_run: bool = False,
           config: TransferConfig | None = None) -> list[str]:
    """Sync twin of ``remove_async``."""
    return BackgroundLoop.get().run(remove_async(uri, recursive=recursive, filters=filters, dry_run=dry_run,
                                                 config=config))


__all__ = ["delete_markers_first", "markers_of", "remove", "remove_async"]
