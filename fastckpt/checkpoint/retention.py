"""Retention: which committed checkpoints below a prefix are kept, as Orbax's ``CheckpointManager`` options, Ray's
``CheckpointConfig(num_to_keep=)`` and Lightning's ``save_top_k`` keep them; the others are removed, each one's commit
marker first (no reader takes it from then on; a removal cut short leaves an uncommitted checkpoint that ``gc``
takes later).

A policy keeps the union of what its rules keep, and always the newest committed checkpoint:

- ``keep_last``: the newest K by commit time;
- ``keep_every_steps``: those whose step (the number ending the name, ``step-0100``) is a multiple of N;
- ``keep_every``: the first committed in each window of T seconds of commit time;
- ``best`` with ``metric`` and ``mode``: the best K by a metric recorded at save time (``metrics=``); checkpoints
  without it are not ranked;
- ``grace``: a checkpoint that was the newest less than ``grace`` seconds ago, which a ``latest()`` caller may be
  reading still.

Every copy a checkpoint holds is its own: an incremental save's unchanged bytes are copied by the store (or, on a local
directory, `copy_file_range`: a reflink where the filesystem has them), never referenced in its base, so removing a base
leaves its children whole.
"""

from __future__ import annotations

import itertools
import logging
import posixpath
import time
from dataclasses import dataclass
from typing import Literal

from ..config import TransferConfig
from ..stores.base import Store
from ..tasks import gather_bounded
from ..uri import StorageURI
from .catalog import COMMITTED, SCAN_CONCURRENCY, CheckpointInfo, candidates, info_of, list_objects, with_store
from .manifest import marker_key

log = logging.getLogger("fastckpt")

__all__ = ["Retention", "apply_retention_async", "not_kept", "remove_committed", "retain_beside"]


@dataclass(frozen=True)
class Retention:
    """Which committed checkpoints below a prefix to keep (see the module; no rule at all: the newest only, and those
    within ``grace``); ValueError naming a value it cannot take."""

    keep_last: int | None = None
    keep_every_steps: int | None = None
    keep_every: float | None = None
    """Seconds of commit time per kept checkpoint."""
    best: int | None = None
    metric: str | None = None
    mode: Literal["min", "max"] = "min"
    grace: float = 300.0
    """Seconds a checkpoint is kept after it stopped being the newest."""

    def __post_init__(self) -> None:
        for name in ("keep_last", "keep_every_steps", "best"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"Retention({name}={value!r}): a whole number of 1 or more (the newest committed "
                                 "checkpoint is always kept)")
        if self.keep_every is not None and not self.keep_every > 0:
            raise ValueError(f"Retention(keep_every={self.keep_every!r}): seconds, more than 0")
        if (self.best is None) != (self.metric is None):
            raise ValueError("Retention(best=, metric=) go together: the best K checkpoints by that metric")
        if self.mode not in ("min", "max"):
            raise ValueError(f"Retention(mode={self.mode!r}): 'min' (lower is better, as a loss) or 'max'")
        if not self.grace >= 0:
            raise ValueError(f"Retention(grace={self.grace!r}): seconds, 0 or more")

    def kept(self, committed: list[CheckpointInfo], now: float) -> set[str]:
        """The names of ``committed`` (committed checkpoints at one prefix) this policy keeps at time ``now``."""
        order = sorted(committed, key=lambda i: (i.committed_at or 0.0, i.name))
        if not order:
            return set()
        keep = {order[-1].name}
        if self.keep_last:
            keep |= {i.name for i in order[-self.keep_last:]}
        if self.keep_every_steps:
            keep |= {i.name for i in order if i.step is not None and i.step % self.keep_every_steps == 0}
        if self.keep_every:
            windows: dict[int, str] = {}
            for i in order:
                windows.setdefault(int((i.committed_at or 0.0) // self.keep_every), i.name)
            keep |= set(windows.values())
        if self.best and self.metric:
            ranked = [i for i in order if self.metric in i.metrics]
            ranked.sort(key=lambda i: i.metrics[self.metric], reverse=self.mode == "max")  # stable: older first
            keep |= {i.name for i in ranked[:self.best]}
        for older, newer in itertools.pairwise(order):
            if (newer.committed_at or 0.0) > now - self.grace:
                keep.add(older.name)
        return keep


async def apply_retention_async(uri: str | StorageURI, policy: Retention, *, dry_run: bool = False,
                                config: TransferConfig | None = None) -> list[str]:
    """Remove the committed checkpoints at ``uri`` (itself, or its direct sub-prefixes) that ``policy`` does not
    keep (``dry_run``: only name them); the URIs of those removed, oldest first."""
    async def run(store: Store, target: StorageURI, cfg: TransferConfig) -> list[str]:
        return [target.with_key(k).uri() for k in await _remove_not_kept(store, target, policy, dry_run)]

    return await with_store(uri, config, run)


async def not_kept(store: Store, target: StorageURI, policy: Retention) -> list[str]:
    """Keys of the committed checkpoints at ``target`` that ``policy`` does not keep, oldest first."""
    found = await candidates(store, target.key)
    infos = await gather_bounded([info_of(store, target, k, metas) for k, metas in found], SCAN_CONCURRENCY)
    committed = [(i, k) for i, (k, _) in zip(infos, found, strict=True) if i.state == COMMITTED]
    keep = policy.kept([i for i, _ in committed], time.time())
    return [k for i, k in sorted(committed, key=lambda c: (c[0].committed_at or 0.0, c[0].name)) if i.name not in keep]


async def retain_beside(store: Store, target: StorageURI, policy: Retention | None) -> list[str]:
    """After ``target`` committed: apply ``policy`` to the checkpoints beside it (its parent prefix) in ``store``; the
    keys removed. A failure is logged, not raised: the new checkpoint is committed whatever happens here, and the next
    save or ``gc`` tries again."""
    if policy is None:
        return []
    parent = target.with_key(posixpath.dirname(target.key.rstrip("/")))
    try:
        return await _remove_not_kept(store, parent, policy)
    except Exception as exc:
        log.warning("retention after the commit of %s failed (the next save or gc tries again): %s", target.raw, exc)
        return []


async def _remove_not_kept(store: Store, target: StorageURI, policy: Retention, dry_run: bool = False) -> list[str]:
    """Remove the committed checkpoints at ``target`` that ``policy`` does not keep (``dry_run``: none); their keys,
    oldest first."""
    doomed = await not_kept(store, target, policy)
    if not dry_run:
        for key in doomed:
            await remove_committed(store, key)
    return doomed


async def remove_committed(store: Store, key: str) -> None:
    """Remove the checkpoint at ``key``: its marker first, then every other object below it."""
    objects = await list_objects(store, key)
    marker = marker_key(key)
    await store.delete(marker)
    await store.delete_many([m.key for m in objects if m.key != marker])
