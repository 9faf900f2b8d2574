"""Draining one rank's tier copy to the durable checkpoint, and the durable commit once every rank's data is in.

Each node's agent uploads its ranks' files (create-if-absent, each checked against the digest its manifest records),
then the manifests as they are in the tier. After each rank, the agent lists the attempt's manifests in the durable
store; when every rank the marker names is there (each checked against the marker's digest) and every file they
name has its size, it creates the marker, the same bytes the tier holds, create-if-absent. Whichever agent finishes
last sees every manifest, so exactly one commit wins and the others find the same bytes there.
"""

from __future__ import annotations

import dataclasses
import logging

from ..checkpoint.documents import read_object
from ..checkpoint.manifest import CommitMarker, RankManifest, digest_of, marker_key, meta_prefix, rank_key
from ..config import TransferConfig
from ..engine.transfer import Transfer
from ..errors import AlreadyExistsError, CheckpointError, IntegrityError, ObjectNotFoundError
from ..stores.base import Store
from ..uri import StorageURI, join_key, parse_uri
from .layout import QueueEntry, TierStore

log = logging.getLogger("fastckpt")


async def read_copy(local: Store, copy: StorageURI, rank: int, attempt: str
                    ) -> tuple[bytes, CommitMarker, bytes, RankManifest]:
    """The tier copy's marker and rank ``rank``'s manifest (raw and decoded), checked against each other."""
    raw = await read_object(local, marker_key(copy.key))
    marker = CommitMarker.decode(raw, marker_key(copy.key))
    if marker.attempt != attempt:
        raise CheckpointError(f"tier copy {copy.raw} holds attempt {marker.attempt!r}, not {attempt!r}")
    mkey = rank_key(meta_prefix(copy.key), attempt, rank)
    data = await read_object(local, mkey)
    if rank >= marker.world_size or digest_of(data) != marker.manifests[rank]:
        raise CheckpointError(f"tier copy {copy.raw}: manifest of rank {rank} is not the one its marker names")
    return raw, marker, data, RankManifest.decode(data, mkey)


async def drain(entry: QueueEntry, store: Store, config: TransferConfig) -> bool:
    """Upload ``entry``'s rank to its durable checkpoint through ``store``; True once that checkpoint is committed
    there (by this call or another agent's), False while other ranks' data is still missing."""
    copy, durable = parse_uri(entry.copy), parse_uri(entry.durable)
    raw, marker, data, manifest = await read_copy(TierStore(), copy, entry.rank, entry.attempt)
    if await _committed(store, durable, raw):
        return True
    for f in manifest.files:
        key, path = durable.join(f.name), "/" + copy.join(f.name)
        transfer = Transfer(store, dataclasses.replace(config, part_size=f.digest.chunk_size))
        try:
            if await transfer.holds_digest(key, f.digest):
                continue
            try:
                [result] = await transfer.upload_files([(path, key)], if_absent=True)
            except AlreadyExistsError:  # left by an attempt that never committed (the marker is absent)
                log.info("agent: replacing %s, left by an uncommitted attempt", store.uri(key))
                await store.delete(key)
                [result] = await transfer.upload_files([(path, key)], if_absent=True)
        finally:
            transfer.close()
        if result.digest != f.digest:
            raise IntegrityError(f"tier copy {copy.raw}/{f.name} no longer holds what rank {entry.rank} saved")
    await _put_same(store, rank_key(meta_prefix(durable.key), entry.attempt, entry.rank), data)
    return await commit_if_complete(store, durable, marker, raw)


async def _committed(store: Store, durable: StorageURI, raw: bytes) -> bool:
    try:
        found = await read_object(store, marker_key(durable.key))
    except ObjectNotFoundError:
        return False
    if found != raw:
        raise CheckpointError(f"checkpoint {durable.raw} was committed by another writer; the tier copy of attempt "
                              f"{CommitMarker.decode(raw, durable.raw).attempt!r} is not drained there")
    return True


async def _put_same(store: Store, key: str, data: bytes) -> None:
    """Create ``key`` holding ``data``; one holding other bytes (an uncommitted attempt's) is replaced."""
    try:
        await store.put(key, data, if_absent=True)
    except AlreadyExistsError:
        if await read_object(store, key) != data:
            await store.put(key, data)


async def commit_if_complete(store: Store, durable: StorageURI, marker: CommitMarker, raw: bytes) -> bool:
    """Create the marker ``raw`` at ``durable`` when every manifest it names is there with the files they name;
    True when the checkpoint is committed (now or before)."""
    prefix = join_key(meta_prefix(durable.key), marker.attempt) + "/"
    present = {m.key async for m in store.list(prefix)}
    keys = [rank_key(meta_prefix(durable.key), marker.attempt, r) for r in range(marker.world_size)]
    if any(k not in present for k in keys):
        return await _committed(store, durable, raw)
    sizes = {m.key: m.size for m in [m async for m in store.list(durable.key)]}
    for rank, key in enumerate(keys):
        data = await read_object(store, key)
        if digest_of(data) != marker.manifests[rank]:
            return await _committed(store, durable, raw)  # another attempt's, being replaced by its agent
        for f in RankManifest.decode(data, key).files:
            if sizes.get(durable.join(f.name)) != f.digest.size:
                raise CheckpointError(f"checkpoint {durable.raw}: {f.name!r} of rank {rank} is missing or has "
                                      "another size in the durable store; not committed")
    try:
        await store.put(marker_key(durable.key), raw, if_absent=True)
    except AlreadyExistsError:
        return await _committed(store, durable, raw)
    log.info("agent: committed %s (attempt %s, %d ranks)", durable.raw, marker.attempt, marker.world_size)
    return True
