"""The checkpoints at a storage path, as listed: each one's state from its marker or its newest attempt's manifests;
the newest committed. A checkpoint is a prefix holding ``.fastckpt/``; functions taking a storage path look at the
path itself when it is a checkpoint, else at its direct sub-prefixes."""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import TypeVar

from ..config import TransferConfig
from ..errors import CheckpointError, ObjectNotFoundError
from ..stores import open_store
from ..stores.base import ObjectMeta, Store
from ..tasks import gather_bounded
from ..uri import StorageURI, parse_uri
from .documents import read_object
from .manifest import CommitMarker, RankManifest, marker_key, meta_prefix, parse_rank_name

__all__ = [
    "SCAN_CONCURRENCY",
    "CheckpointInfo",
    "attempts_of",
    "candidates",
    "checkpoint_name",
    "committed_keys",
    "info_of",
    "list_checkpoints_async",
    "list_objects",
    "newest_committed",
    "read_manifests",
    "target_of",
    "uri_of",
    "with_store",
]

T = TypeVar("T")
COMMITTED, UNCOMMITTED, CORRUPT = "committed", "uncommitted", "corrupt"
SCAN_CONCURRENCY = 16
_STEP = re.compile(r"(\d+)$")


@dataclass(frozen=True)
class CheckpointInfo:
    """One checkpoint as listed. ``state`` is committed, uncommitted or corrupt.

    For an uncommitted checkpoint the attempt, world size and totals are those of its newest attempt's
    manifests found so far.
    """

    name: str
    uri: str
    state: str
    attempt: str | None
    world_size: int | None
    files: int
    bytes: int
    committed_at: float | None
    metrics: dict[str, float] = field(default_factory=dict)
    """The metrics recorded at save time (committed checkpoints)."""

    @property
    def step(self) -> int | None:
        """The number that ends the checkpoint's name (``step-0100``: 100), or None."""
        match = _STEP.search(self.name)
        return int(match[1]) if match else None


def uri_of(target: StorageURI, key: str) -> str:
    """A URI string for ``key`` in ``target``'s bucket, with ``target``'s options."""
    return target.with_key(key).uri()


def checkpoint_name(key: str) -> str:
    return key.rstrip("/").rsplit("/", 1)[-1]


def target_of(uri: str | StorageURI) -> StorageURI:
    """``uri`` parsed; ValueError when its scheme is not a fastckpt backend."""
    parsed = parse_uri(uri) if not isinstance(uri, StorageURI) else uri
    if parsed.backend == "delegate":
        raise ValueError(f"{parsed.raw!r}: scheme {parsed.scheme!r} is not a fastckpt backend; "
                         "use fastckpt.fs.filesystem() to reach it through pyarrow")
    return parsed


async def with_store(uri: str | StorageURI, config: TransferConfig | None,
                     fn: Callable[[Store, StorageURI, TransferConfig], Awaitable[T]]) -> T:
    target, cfg = target_of(uri), config or TransferConfig.from_env()
    async with open_store(target, config=cfg) as store:
        return await fn(store, target, cfg)


async def list_objects(store: Store, prefix: str) -> list[ObjectMeta]:
    return [m async for m in store.list(prefix)]


async def candidates(store: Store, target: str) -> list[tuple[str, list[ObjectMeta]]]:
    """(key, metadata objects) of the checkpoint(s) at ``target``: itself, else its direct sub-prefixes."""
    own = await list_objects(store, meta_prefix(target))
    if own:
        return [(target, own)]
    _, dirs = await store.list_dir(target)
    metas = await gather_bounded([list_objects(store, meta_prefix(d)) for d in dirs], SCAN_CONCURRENCY)
    return [(d, m) for d, m in zip(dirs, metas, strict=True) if m]


def attempts_of(key: str, metas: list[ObjectMeta]) -> dict[str, dict[int, ObjectMeta]]:
    """{attempt: {rank: manifest object}} found below the checkpoint's metadata prefix."""
    found: dict[str, dict[int, ObjectMeta]] = {}
    target = meta_prefix(key) + "/"
    for m in metas:
        parts = m.key[len(target):].split("/") if m.key.startswith(target) else []
        if len(parts) == 2 and (rank := parse_rank_name(parts[1])) is not None:
            found.setdefault(parts[0], {})[rank] = m
    return found


async def info_of(store: Store, target: StorageURI, key: str, metas: list[ObjectMeta]) -> CheckpointInfo:
    """Listing entry of one checkpoint (cheap: the marker, or the newest attempt's manifests)."""
    uri, name = uri_of(target, key), checkpoint_name(key)
    attempts = attempts_of(key, metas)
    if any(m.key == marker_key(key) for m in metas):
        try:
            marker = CommitMarker.decode(await read_object(store, marker_key(key)), marker_key(key))
        except CheckpointError:
            return CheckpointInfo(name, uri, CORRUPT, None, None, 0, 0, None)
        have = attempts.get(marker.attempt, {})
        state = COMMITTED if all(r in have for r in range(marker.world_size)) else CORRUPT
        return CheckpointInfo(name, uri, state, marker.attempt, marker.world_size, marker.files, marker.bytes,
                              marker.committed_at, dict(marker.metrics))
    if not attempts:
        return CheckpointInfo(name, uri, UNCOMMITTED, None, None, 0, 0, None)
    attempt = max(attempts, key=lambda a: max(m.mtime for m in attempts[a].values()))
    manifests = await read_manifests(store, attempts[attempt].values())
    good = [m for m in manifests if m is not None and m.error is None]
    world = next((m.world_size for m in manifests if m is not None), None)
    return CheckpointInfo(name, uri, UNCOMMITTED, attempt, world, sum(len(m.files) for m in good),
                          sum(m.bytes for m in good), None)


async def read_manifests(store: Store, objects: Iterable[ObjectMeta]) -> list[RankManifest | None]:
    async def one(meta: ObjectMeta) -> RankManifest | None:
        try:
            return RankManifest.decode(await read_object(store, meta.key), meta.key)
        except (CheckpointError, ObjectNotFoundError):
            return None

    return await gather_bounded([one(m) for m in objects], SCAN_CONCURRENCY)


async def committed_keys(store: Store, target: StorageURI, key: str) -> list[str]:
    """Keys of the committed checkpoints at ``key`` (itself, or its direct sub-prefixes), oldest first (by commit
    time, then name)."""
    found = await candidates(store, key)
    infos = await gather_bounded([info_of(store, target, k, metas) for k, metas in found], SCAN_CONCURRENCY)
    return [k for _, _, k in sorted((i.committed_at or 0.0, i.name, k) for i, (k, _) in zip(infos, found, strict=True)
                                    if i.state == COMMITTED)]


async def list_checkpoints_async(uri: str | StorageURI, *, config: TransferConfig | None = None
                                 ) -> list[CheckpointInfo]:
    """Checkpoints at ``uri`` (itself, or its direct sub-prefixes), sorted by name."""
    async def run(store: Store, target: StorageURI, cfg: TransferConfig) -> list[CheckpointInfo]:
        found = await candidates(store, target.key)
        infos = await gather_bounded([info_of(store, target, k, metas) for k, metas in found], SCAN_CONCURRENCY)
        return sorted(infos, key=lambda i: i.name)

    return await with_store(uri, config, run)


async def newest_committed(uri: str | StorageURI, *, config: TransferConfig | None = None) -> str | None:
    """URI of the newest committed checkpoint at ``uri`` (by commit time, then name), or None."""
    committed = [i for i in await list_checkpoints_async(uri, config=config) if i.state == COMMITTED]
    return max(committed, key=lambda i: (i.committed_at or 0.0, i.name)).uri if committed else None
