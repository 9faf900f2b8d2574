"""Draining one rank's tier copy to the durable checkpoint, and the durable commit once every rank's data is in.

Each node's agent uploads its ranks' files (create-if-absent, each checked against the digest its manifest records),
then the manifests as they are in the tier. After each rank, the agent lists the attempt's manifests in the durable
store; when every rank the marker names is there (each checked against the marker's digest) and every file they
name has its size, it creates the marker, the same bytes the tier holds, create-if-absent. Whichever agent finishes
last sees every manifest, so exactly one commit wins and the others find the same manifests committed there. A rank
handed to the agent before its tier commit (``handoff``) has no marker in its tier: its agent builds the marker from
the durable manifests, checked as the ranks' root checks them. A node whose tier has no marker otherwise (a DCP save
commits on the coordinator's node alone) waits for the durable one and adopts it, so that its copy is committed
there too; every agent keeps its entry queued until the durable commit.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Callable

from ..checkpoint.base import BaseCheckpoint, resolve_base
from ..checkpoint.documents import read_object
from ..checkpoint.manifest import (
    CommitMarker,
    RankManifest,
    build_marker,
    digest_of,
    marker_key,
    meta_prefix,
    rank_key,
)
from ..checkpoint.retention import retain_beside
from ..config import TransferConfig
from ..engine.transfer import Transfer
from ..errors import AlreadyExistsError, CheckpointError, IntegrityError, ObjectNotFoundError
from ..stores.base import Store
from ..uri import StorageURI, join_key, parse_uri
from .directory import QueueEntry, TierStore

__all__ = ["commit_if_complete", "drain", "read_copy"]

log = logging.getLogger("fastckpt")


async def read_copy(local: Store, copy: StorageURI, rank: int, attempt: str
                    ) -> tuple[tuple[bytes, CommitMarker] | None, bytes, RankManifest]:
    """The tier copy's marker (None where this node has none: a DCP save commits on the coordinator's node alone)
    and rank ``rank``'s manifest (raw and decoded), checked against each other and ``attempt``."""
    marker = None
    with contextlib.suppress(ObjectNotFoundError):
        raw = await read_object(local, marker_key(copy.key))
        marker = raw, CommitMarker.decode(raw, marker_key(copy.key))
    mkey = rank_key(meta_prefix(copy.key), attempt, rank)
    data = await read_object(local, mkey)
    manifest = RankManifest.decode(data, mkey)
    if (manifest.attempt, manifest.rank, manifest.error) != (attempt, rank, None):
        raise CheckpointError(f"tier copy {copy.raw}: the manifest of rank {rank} is not one of attempt {attempt!r}")
    if marker is not None:
        if marker[1].attempt != attempt:
            raise CheckpointError(f"tier copy {copy.raw} holds attempt {marker[1].attempt!r}, not {attempt!r}")
        if rank >= marker[1].world_size or digest_of(data) != marker[1].manifests[rank]:
            raise CheckpointError(f"tier copy {copy.raw}: manifest of rank {rank} is not the one its marker names")
    return marker, data, manifest


async def drain(entry: QueueEntry, store: Store, config: TransferConfig, queued: Callable[[], bool],
                upload: bool = True) -> bool:
    """Upload ``entry``'s rank to its durable checkpoint through ``store`` (unless ``upload`` is False: done
    already), and commit it there when every rank's data is in, this node holds the marker and the entry is still
    ``queued`` (not superseded by a new save of the same checkpoint meanwhile). True once the checkpoint is committed
    there (by whichever agent); the tier copy then holds the marker too."""
    copy, durable = parse_uri(entry.copy), parse_uri(entry.durable)
    local = TierStore()
    try:
        marker, data, manifest = await read_copy(local, copy, entry.rank, entry.attempt)
    except ObjectNotFoundError as exc:  # nothing to wait for: the copy is not coming back
        raise CheckpointError(f"tier copy {copy.raw} of rank {entry.rank} is gone ({exc})") from None
    if await _adopt(store, durable, local, copy, entry.attempt):
        return True
    if upload:
        base = None if entry.drain.base is None else await resolve_base(store, durable, entry.drain.base)
        await _upload(store, config, copy, durable, manifest, base)
        await _put_same(store, rank_key(meta_prefix(durable.key), entry.attempt, entry.rank), data)
    if not queued():
        return False
    if marker is not None:
        if await commit_if_complete(store, durable, entry.attempt, manifest.world_size, marker[1]):
            await retain_beside(store, durable, entry.drain.retention)
            return True
    elif entry.handed:  # no marker agreed here: commit from the durable manifests, then adopt what is committed
        await commit_if_complete(store, durable, entry.attempt, manifest.world_size, None)
    return await _adopt(store, durable, local, copy, entry.attempt)


async def _upload(store: Store, config: TransferConfig, copy: StorageURI, durable: StorageURI,
                  manifest: RankManifest, base: BaseCheckpoint | None) -> None:
    """The manifest's files from the tier copy to the durable checkpoint, each checked against its digest; the
    bytes they share with ``base``'s file of the same name copied by the store."""
    for f in manifest.files:
        key, path = durable.join(f.name), "/" + copy.join(f.name)
        transfer = Transfer(store, dataclasses.replace(config, part_size=f.digest.chunk_size))
        bases = {} if base is None or (found := base.object(f.name)) is None else {key: found}
        try:
            if await transfer.holds_digest(key, f.digest):
                continue
            try:
                [result] = await transfer.upload_files([(path, key)], if_absent=True, bases=bases)
            except AlreadyExistsError:  # left by an attempt that never committed (the marker is absent)
                log.info("agent: replacing %s, left by an uncommitted attempt", store.uri(key))
                await store.delete(key)
                [result] = await transfer.upload_files([(path, key)], if_absent=True, bases=bases)
        finally:
            transfer.close()
        if result.digest != f.digest:
            raise IntegrityError(f"tier copy {copy.raw}/{f.name} no longer holds what rank {manifest.rank} saved")


async def _adopt(store: Store, durable: StorageURI, local: Store, copy: StorageURI, attempt: str) -> bool:
    """Whether ``durable`` is committed by ``attempt`` (CheckpointError when by another); if so, the tier copy gets
    its marker (where it had none) and is committed on this node too."""
    try:
        raw = await read_object(store, marker_key(durable.key))
    except ObjectNotFoundError:
        return False
    found = CommitMarker.decode(raw, marker_key(durable.key))
    if found.attempt != attempt:
        raise CheckpointError(f"checkpoint {durable.raw} was committed by another writer (attempt {found.attempt!r});"
                              f" the tier copy of attempt {attempt!r} is not drained there")
    with contextlib.suppress(AlreadyExistsError):
        await local.put(marker_key(copy.key), raw, if_absent=True)
    return True


async def _put_same(store: Store, key: str, data: bytes) -> None:
    """Create ``key`` holding ``data``; one holding other bytes (an uncommitted attempt's) is replaced."""
    try:
        await store.put(key, data, if_absent=True)
    except AlreadyExistsError:
        if await read_object(store, key) != data:
            await store.put(key, data)


async def commit_if_complete(store: Store, durable: StorageURI, attempt: str, world_size: int,
                             marker: CommitMarker | None) -> bool:
    """Create the commit marker of ``attempt`` at ``durable`` when every manifest is there with the files it names;
    True when it did (or found one committing the same manifests). ``marker``: the one the ranks agreed on in the
    tier, else (None: a handed save) one built from the durable manifests, checked as the ranks' root checks them."""
    keys = [rank_key(meta_prefix(durable.key), attempt, r) for r in range(world_size)]
    present = {m.key async for m in store.list(join_key(meta_prefix(durable.key), attempt) + "/")}
    if any(k not in present for k in keys):
        return False
    payloads = [await read_object(store, key) for key in keys]
    if marker is None:
        marker, manifests = build_marker(payloads, attempt, world_size, f"checkpoint {durable.raw}")
    elif any(digest_of(data) != marker.manifests[rank] for rank, data in enumerate(payloads)):
        return False  # another attempt's, being replaced by its agent
    else:
        manifests = [RankManifest.decode(data, key) for data, key in zip(payloads, keys, strict=True)]
    sizes = {m.key: m.size for m in [m async for m in store.list(durable.key)]}
    for m in manifests:
        for f in m.files:
            if sizes.get(durable.join(f.name)) != f.digest.size:
                raise CheckpointError(f"checkpoint {durable.raw}: {f.name!r} of rank {m.rank} is missing or has "
                                      "another size in the durable store; not committed")
    try:
        await store.put(marker_key(durable.key), marker.encode(), if_absent=True)
    except AlreadyExistsError:  # by another node's agent: the same manifests, or another writer's
        there = CommitMarker.decode(await read_object(store, marker_key(durable.key)), marker_key(durable.key))
        if (there.attempt, there.manifests) != (marker.attempt, marker.manifests):
            raise CheckpointError(f"checkpoint {durable.raw} was committed by another writer meanwhile") from None
    log.info("agent: committed %s (attempt %s, %d ranks)", durable.raw, attempt, world_size)
    return True
