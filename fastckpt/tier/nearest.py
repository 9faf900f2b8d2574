"""Reading from the nearest copy: this node's tier when it holds the committed checkpoint's files, else the durable
store; and the newest committed checkpoint across both."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable

from ..checkpoint.catalog import COMMITTED, candidates, checkpoint_name, list_checkpoints_async
from ..checkpoint.documents import read_object
from ..checkpoint.manifest import CommitMarker, digest_of, marker_key, meta_prefix, rank_key
from ..checkpoint.reader import Checkpoint, open_checkpoint_async
from ..config import TransferConfig
from ..errors import CheckpointError, ObjectNotFoundError
from ..stores.base import Store
from ..uri import StorageURI, parse_uri
from .layout import Tier, TierStore


async def _marker(store: Store, key: str) -> tuple[bytes, CommitMarker] | None:
    with contextlib.suppress(ObjectNotFoundError, CheckpointError):
        raw = await read_object(store, marker_key(key))
        return raw, CommitMarker.decode(raw, marker_key(key))
    return None


async def nearest_copy(durable: str | StorageURI, tier: Tier, ranks: Iterable[int] | None,
                       config: TransferConfig | None = None) -> Checkpoint | None:
    """``tier``'s copy of committed checkpoint ``durable``, opened for ``ranks`` (None: every rank), when it holds
    every manifest they need; None when the durable store must serve the read. A copy whose marker differs from the
    durable one (another attempt committed there) is not used."""
    uri = parse_uri(durable) if not isinstance(durable, StorageURI) else durable
    copy, local = tier.copy_of(uri), TierStore()
    found = await _marker(local, copy.key)
    if found is None:
        return None
    _, marker = found
    wanted = range(marker.world_size) if ranks is None else [r for r in ranks if r < marker.world_size]
    for rank in wanted:
        try:
            data = await read_object(local, rank_key(meta_prefix(copy.key), marker.attempt, rank))
        except ObjectNotFoundError:
            return None
        if digest_of(data) != marker.manifests[rank]:
            return None
    return await open_checkpoint_async(copy, config=config, store=local, ranks=None if ranks is None else wanted)


async def latest_across(parent: str | StorageURI, tier: Tier, config: TransferConfig | None = None) -> str | None:
    """The durable URI of the newest committed checkpoint below ``parent`` in ``tier`` (this node's copies, committed
    there and perhaps not yet drained) or in the durable store (by commit time, then name); None when neither has
    one. Read it with ``tier=`` to read the nearest copy."""
    uri = parse_uri(parent) if not isinstance(parent, StorageURI) else parent
    copy, local = tier.copy_of(uri), TierStore()
    found = [(i.committed_at or 0.0, i.name, i.uri) for i in await list_checkpoints_async(uri, config=config)
             if i.state == COMMITTED]
    for key, _ in await candidates(local, copy.key):
        marker = await _marker(local, key)
        if marker is not None:
            rel = key[len(copy.key):].strip("/")
            found.append((marker[1].committed_at, checkpoint_name(key), uri.with_key(uri.join(rel)).uri()))
    return max(found)[2] if found else None
