"""``gc``: remove what no reader of a checkpoint will ever use (uncommitted attempts, stale uploads, orphans)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from ..config import TransferConfig
from ..deprecation import keywords_only
from ..errors import CheckpointError
from ..stores.base import ObjectMeta, PendingUpload, Store
from ..uri import StorageURI, join_key
from .catalog import candidates, checkpoint_name, list_objects, with_store
from .manifest import marker_key, meta_prefix
from .reader import load
from .retention import Retention, not_kept, remove_committed

__all__ = ["GcReport", "gc_async"]


@dataclass
class GcReport:
    """What gc removed (or, with ``dry_run``, would remove)."""

    dry_run: bool
    removed: list[str] = field(default_factory=list)
    """Keys of removed objects."""
    aborted_uploads: list[str] = field(default_factory=list)
    """Keys of aborted multipart uploads."""
    bytes: int = 0
    skipped: list[str] = field(default_factory=list)
    """'name: reason' of checkpoints left alone (recent activity, corrupt)."""


@keywords_only(1, "older_than", "dry_run", renamed={"older_than_s": "older_than"})
async def gc_async(uri: str | StorageURI, *, older_than: float = 24 * 3600.0, dry_run: bool = False,
                   config: TransferConfig | None = None, keep_last: int | None = None,
                   retention: Retention | None = None) -> GcReport:
    """Remove what no reader will ever use, once it is older than ``older_than`` seconds.

    - an uncommitted checkpoint whose newest object and upload are older: all of it, and its multipart
      uploads are aborted;
    - in a committed checkpoint: manifests of other attempts, data files its manifests do not name, and
      stale multipart uploads;
    - below a sub-prefix without ``.fastckpt/``: only stale multipart uploads;
    - anywhere below the prefix: the backend's bookkeeping that no object uses any more (S3's digest records
      of objects deleted or replaced by other tools).
    Corrupt checkpoints are left alone. With ``dry_run`` nothing is removed. Like the rest of gc, meant for
    what nobody is writing to any more.

    ``retention`` (a ``Retention``): then the committed checkpoints at ``uri`` (itself or its direct sub-prefixes)
    that it does not keep are removed as well, whatever their age: each one's commit marker first (no reader takes
    it from then on; a removal cut short leaves an uncommitted checkpoint that gc takes later), then its other
    objects. ``keep_last=K`` (at least 1) is ``retention=Retention(keep_last=K, grace=0)``.
    """
    if keep_last is not None and keep_last < 1:
        raise ValueError(f"keep_last={keep_last}: gc never removes the newest committed checkpoint (use 1 or more)")
    if keep_last is not None and retention is not None:
        raise ValueError("gc takes keep_last= or retention=, not both (keep_last=K is Retention(keep_last=K))")
    policy = Retention(keep_last=keep_last, grace=0.0) if keep_last is not None else retention

    async def run(store: Store, target: StorageURI, cfg: TransferConfig) -> GcReport:
        report = GcReport(dry_run)
        now = time.time()
        found = dict(await candidates(store, target.key))
        pending: dict[str, list[PendingUpload]] = {}
        for up in await store.list_pending_uploads(target.key):
            # an upload of an object directly below the prefix (a killed ``cp``) counts on its own
            root = target.key if target.key in found else _child_of(target.key, up.key) or up.key
            pending.setdefault(root, []).append(up)
        for key in sorted(set(found) | set(pending)):
            await _gc_one(store, target, key, key in found, pending.get(key, []), now - older_than, report)
        orphans = await store.list_orphans(target.key, now - older_than)
        report.removed.extend(orphans)
        if orphans and not dry_run:
            await store.delete_many(orphans)
        if policy is not None:
            await _retain(store, target, policy, report)
        return report

    return await with_store(uri, config, run)


async def _retain(store: Store, target: StorageURI, policy: Retention, report: GcReport) -> None:
    """Remove the committed checkpoints at ``target`` that ``policy`` does not keep: marker first, then the rest."""
    for key in await not_kept(store, target, policy):
        objects = await list_objects(store, key)
        report.removed.extend(m.key for m in objects)
        report.bytes += sum(m.size for m in objects)
        if not report.dry_run:
            await remove_committed(store, key)


def _child_of(target: str, key: str) -> str | None:
    rel = key[len(target) + 1:] if target else key
    if (target and not key.startswith(target + "/")) or "/" not in rel:
        return None
    return join_key(target, rel.split("/", 1)[0])


async def _gc_one(store: Store, target: StorageURI, key: str, is_checkpoint: bool, uploads: list[PendingUpload],
                  cutoff: float, report: GcReport) -> None:
    name = checkpoint_name(key)
    old_uploads = [u for u in uploads if u.started <= cutoff]
    doomed: list[ObjectMeta] = []
    if is_checkpoint:
        objects = await list_objects(store, key)
        try:
            ckpt = await load(store, target.with_key(key), allow_uncommitted=False)
        except CheckpointError:
            ckpt = None
        if ckpt is None:
            newest = max([m.mtime for m in objects] + [u.started for u in uploads], default=0.0)
            if newest > cutoff:
                report.skipped.append(f"{name}: uncommitted, written to recently")
                return
            doomed, old_uploads = objects, uploads
        elif ckpt.problems:
            report.skipped.append(f"{name}: corrupt ({ckpt.problems[0].reason})")
            return
        else:
            keep = {ckpt.file_key(n) for n in ckpt.files} | {join_key(key, n) for n in ckpt.published}
            keep.add(marker_key(key))
            live = join_key(meta_prefix(key), ckpt.info.attempt or "") + "/"
            doomed = [m for m in objects if m.key not in keep and not m.key.startswith(live) and m.mtime <= cutoff]
    # data first and metadata last, so that an interrupted gc still finds the checkpoint next time
    doomed.sort(key=lambda m: (m.key.startswith(meta_prefix(key) + "/"), m.key))
    report.removed.extend(m.key for m in doomed)
    report.aborted_uploads.extend(u.key for u in old_uploads)
    report.bytes += sum(m.size for m in doomed)
    if report.dry_run:
        return
    for up in old_uploads:
        await store.abort_pending_upload(up)
    if doomed:
        await store.delete_many([m.key for m in doomed])
