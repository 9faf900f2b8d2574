"""Reading from the nearest copy: this node's tier when it holds the committed checkpoint's files, else the durable
store; and the newest committed checkpoint across both."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable

from ..checkpoint.catalog import COMMITTED, candidates, checkpoint_name, list_checkpoints_async
from ..checkpoint.documents import read_object
from ..checkpoint.manifest import CommitMarker, marker_key
from ..checkpoint.reader import Checkpoint, open_checkpoint_async
from ..config import TransferConfig
from ..deprecation import keywords_only
from ..errors import CheckpointError, ObjectNotFoundError
from ..integrity import FileDigest
from ..stores.base import Store
from ..threads import off_loop
from ..uri import StorageURI, parse_uri
from .agent import resume_drains
from .directory import Tier, TierStore

__all__ = ["held_files", "latest_across", "nearest_copy", "tier_checkpoint", "tier_or_group"]


async def _marker(store: Store, key: str) -> tuple[bytes, CommitMarker] | None:
    with contextlib.suppress(ObjectNotFoundError, CheckpointError):
        raw = await read_object(store, marker_key(key))
        return raw, CommitMarker.decode(raw, marker_key(key))
    return None


def tier_or_group(what: str, tier: object, group: object) -> None:
    """The one refusal of a read given both ``tier=`` and ``group=`` (ValueError naming ``what``)."""
    if tier is not None and group is not None:
        raise ValueError(f"{what} takes tier= or group=, not both: each node's tier holds its own ranks' files, "
                         "while a group read shares one read of the store among the ranks")


@keywords_only(3, "config")
async def tier_checkpoint(durable: StorageURI, tier: Tier, ranks: Iterable[int] | None, *,
                          config: TransferConfig | None = None) -> Checkpoint | None:
    """``tier``'s copy of committed checkpoint ``durable`` opened for ``ranks`` (None: every rank): committed there,
    with their manifests as the marker names them; its files may be elsewhere (``held_files``). None if not. Saves
    left queued by a killed agent start draining again (``resume_drains``)."""
    await off_loop(resume_drains, tier)
    copy = tier.copy_of(durable)
    if not os.path.isdir("/" + copy.key):
        return None
    try:
        return await open_checkpoint_async(copy, config=config, store=TierStore(), ranks=ranks)
    except (CheckpointError, ObjectNotFoundError):
        return None


def held_files(files: dict[str, FileDigest | None], copy: StorageURI) -> set[str]:
    """The names of ``files`` that the tier's copy ``copy`` holds at their recorded sizes (a DCP rank's node holds
    its own rank's files; their bytes are checked against the digests when read)."""
    held = set()
    for name, digest in files.items():
        with contextlib.suppress(FileNotFoundError):
            if digest is not None and os.path.getsize("/" + copy.join(name)) == digest.size:
                held.add(name)
    return held


@keywords_only(3, "config")
async def nearest_copy(durable: str | StorageURI, tier: Tier, ranks: Iterable[int] | None, *,
                       config: TransferConfig | None = None) -> Checkpoint | None:
    """``tier``'s copy of committed checkpoint ``durable``, opened for ``ranks`` (None: every rank), when it holds
    every manifest and file they need; None when the durable store must serve the read."""
    uri = parse_uri(durable) if not isinstance(durable, StorageURI) else durable
    ckpt = await tier_checkpoint(uri, tier, ranks, config=config)
    if ckpt is None or len(await off_loop(held_files, ckpt.files, tier.copy_of(uri))) != len(ckpt.files):
        return None
    return ckpt


@keywords_only(2, "config")
async def latest_across(parent: str | StorageURI, tier: Tier, *, config: TransferConfig | None = None) -> str | None:
    """The durable URI of the newest committed checkpoint below ``parent`` in ``tier`` (this node's copies, committed
    there and perhaps not yet drained) or in the durable store (by commit time, then name); None when neither has
    one. Read it with ``tier=`` to read the nearest copy."""
    uri = parse_uri(parent) if not isinstance(parent, StorageURI) else parent
    await off_loop(resume_drains, tier)
    copy, local = tier.copy_of(uri), TierStore()
    found = [(i.committed_at or 0.0, i.name, i.uri) for i in await list_checkpoints_async(uri, config=config)
             if i.state == COMMITTED]
    for key, _ in await candidates(local, copy.key):
        marker = await _marker(local, key)
        if marker is not None:
            rel = key[len(copy.key):].strip("/")
            found.append((marker[1].committed_at, checkpoint_name(key), uri.with_key(uri.join(rel)).uri()))
    return max(found)[2] if found else None
