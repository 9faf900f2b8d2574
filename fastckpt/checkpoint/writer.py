"""CheckpointWriter: every rank writes its files, then all commit together or not at all.

On leaving the block without an exception, each rank uploads its manifest (files, sizes, chunk size,
digests) for the attempt, the barrier gathers them at rank 0, rank 0 checks them (no rank failed, no
file written twice, every file still holds the bytes its rank recorded) and creates the commit marker
with create-if-absent, and announces the outcome to every rank. Leaving with an exception hands a
failure record to the barrier instead: nothing commits, and the other ranks raise CheckpointError
naming the failed rank.

A committed checkpoint is never changed (``overwrite`` replaces it with a new one, whose files lie beside its own).
Data files and manifests are written create-if-absent, so no
writer replaces a file blindly. A file found under a name this rank is about to write is a leftover of
an uncommitted attempt (a dead run): it is deleted first, unless the checkpoint is committed, in which
case the writer fails before writing anything. A file created by another writer between that check
and this rank's write fails the write (two jobs writing one checkpoint at once), and a file replaced
after its rank wrote it fails the commit, so the marker only ever names the bytes its manifests hold.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any

from ..config import TransferConfig
from ..engine.layout import Layout, hash_layout, upload_layout
from ..engine.paths import local_files
from ..engine.plan import plan_upload
from ..engine.progress import ProgressCallback
from ..engine.session import FileResult
from ..engine.transfer import Transfer
from ..errors import AlreadyExistsError, CheckpointError
from ..integrity import FileDigest, combine
from ..stores import open_store
from ..stores.base import Store
from ..stores.retry import retrying
from ..threads import off_loop
from ..uri import StorageURI, parse_uri
from .attempt import ATTEMPT_TAG, attempt_from_env, new_attempt_id
from .barrier import Barrier
from .barrier_store import StoreBarrier, default_barrier
from .base import BaseCheckpoint, encode_none, resolve_base
from .commit import Commit, CommitResult
from .manifest import (
    FileEntry,
    check_attempt,
    check_metrics,
    check_name,
    generation_root,
    meta_prefix,
    rank_key,
    replaced_note_key,
)

__all__ = ["CheckpointWriter"]

log = logging.getLogger("fastckpt")


def _dir_files(src: str) -> list[tuple[str, str]]:
    if not os.path.isdir(src):
        raise NotADirectoryError(f"source {src} is not a directory")
    return local_files(src)


class CheckpointWriter(Commit):
    """Writes one rank's share of a checkpoint; use ``async with`` on every rank of the job.

    ``uri`` is the checkpoint itself (``s3://bucket/run/step-100``). ``group`` (a ``torch.distributed`` process group
    whose every rank writes its share) gives ``rank``, ``world_size`` and the barrier (a ``TorchBarrier``); without
    it they default to rank 0 of 1, and ``barrier`` to a ``StoreBarrier``. ``attempt`` names this run of the job and
    must be the same on every rank and new on every restart; by default it comes from the environment
    (``attempt_from_env``), else rank 0 draws one and sends it through the barrier (not possible with the store
    barrier, which needs it given). ``store`` reuses an open store (not closed here).

    ``base`` makes the checkpoint incremental: a committed checkpoint in the same bucket (a URI, ``"latest"``: the
    newest committed one beside ``uri``, or a ``BaseCheckpoint`` read already); files and parts of files that hold
    the same bytes as the base's file of the same name are copied by the store instead of sent. Rank 0 reads the
    base and hands it to the others through the barrier. The new checkpoint stays whole on its own.

    ``per_node``: each rank's ``store`` is its own node's (a memory tier, ``fastckpt.tier``): the barrier must not be
    a store barrier, the root checks only the manifests, and every rank creates the marker in its own store.

    ``overwrite``: the checkpoint may be committed already, and this one replaces it. Its files go into a folder of
    their own beside the old ones (``generation_root``), the commit replaces the marker in one write (a reader sees
    the old checkpoint or the new one, never a mix; a writer that dies before leaves the old one whole), and the old
    files are deleted after it. Without it, a committed checkpoint is refused (CheckpointError).

    ``metrics`` (name: number, such as ``{"eval_loss": 0.31}``): recorded in the commit marker by the root rank, for
    ``list_checkpoints`` and for a ``Retention`` that keeps the best checkpoints by one of them.
    """

    def __init__(
        self,
        uri: str | StorageURI,
        *,
        rank: int | None = None,
        world_size: int | None = None,
        group: Any = None,
        barrier: Barrier | None = None,
        attempt: str | None = None,
        config: TransferConfig | None = None,
        store: Store | None = None,
        progress: ProgressCallback | None = None,
        base: str | StorageURI | BaseCheckpoint | None = None,
        per_node: bool = False,
        overwrite: bool = False,
        metrics: Mapping[str, float] | None = None,
    ) -> None:
        self.uri = parse_uri(uri) if not isinstance(uri, StorageURI) else uri
        if self.uri.backend == "delegate":
            raise ValueError(f"{self.uri.raw!r}: scheme {self.uri.scheme!r} is not a fastckpt backend")
        if group is not None:
            if barrier is not None:
                raise ValueError("CheckpointWriter takes group= (a torch.distributed process group) or barrier= "
                                 "(another kind of barrier), not both")
            from .barrier_torch import TorchBarrier, group_place

            rank, world_size = group_place(group, rank, world_size)
            barrier = TorchBarrier(group)
        rank, world_size = (0 if rank is None else rank), (1 if world_size is None else world_size)
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} / world size {world_size}: need 0 <= rank < world_size")
        self.rank, self.world_size = rank, world_size
        self.barrier = barrier or default_barrier()
        self.per_node, self.overwrite = per_node, overwrite
        if per_node and overwrite:
            raise ValueError("a checkpoint written per node (into tiers) cannot overwrite: save each step to a URI "
                             "of its own")
        self.root = ""
        """Folder of this checkpoint's files relative to it (``overwrite``: ``generation_root``), once agreed."""
        self._publish: dict[str, bytes] = {}
        self.metrics = check_metrics(metrics or {})
        if per_node and world_size > 1 and isinstance(self.barrier, StoreBarrier):
            raise ValueError(f"{type(self.barrier).__name__} meets in the store, which is not shared when every node "
                             "writes its own (per_node): use a TorchBarrier, RayBarrier or InProcessBarrier")
        self.config = config or TransferConfig.from_env()
        self._attempt = check_attempt(attempt) if attempt else None
        self._store, self._own_store = store, store is None
        self._progress = progress
        self._transfer: Transfer | None = None
        self._entries: dict[str, FileEntry | None] = {}
        self._existing: set[str] | None = None
        self._base_arg = base
        self.base: BaseCheckpoint | None = None
        """The base checkpoint, once agreed (None: every byte is sent)."""
        self._handed_copied = 0
        self._closed = False
        self.result: CommitResult | None = None
        """Set on every rank once the checkpoint is committed."""

    async def __aenter__(self) -> CheckpointWriter:
        if self._transfer is not None or self._closed:
            raise CheckpointError("a CheckpointWriter writes one checkpoint once; create a new one")
        self._store = (open_store(self.uri, config=self.config) if self._store is None
                       else retrying(self._store, self.config))
        try:
            self.barrier.check_world(self._rv)
            if not self.overwrite:
                await self._refuse_committed()
            self._attempt = self._attempt or attempt_from_env() or await self._agree_attempt()
            self.root = generation_root(self.attempt) if self.overwrite else ""
            self.base = await self._agree_base()
            self._transfer = Transfer(self._store, self.config, self._progress)
        except BaseException as exc:
            if isinstance(exc, Exception):  # the other ranks learn of it now, not at their barrier timeout
                await self._report_failure(exc)
            await self._close()
            raise
        return self

    async def _clear_leftovers(self, keys: list[str], holds: Callable[[str], Awaitable[FileResult | None]]
                               ) -> dict[str, FileResult]:
        """Objects at ``keys`` left by an uncommitted attempt: kept when ``holds(key)`` finds one holding exactly
        what this rank is about to write there (a rerun after a crash re-uses it; returned by key), deleted
        otherwise. Refuses if the checkpoint is committed. The checkpoint's objects are listed once per writer.
        """
        store = self._rv.store
        if self._existing is None:
            meta = meta_prefix(self.uri.key) + "/"
            self._existing = {m.key async for m in store.list(self.uri.key) if not m.key.startswith(meta)}
        found = [k for k in keys if k in self._existing]
        if not found:
            return {}
        await self._refuse_committed(", ".join(found[:3]) + (f" and {len(found) - 3} more" if len(found) > 3 else ""))
        held = [await holds(k) for k in found]
        kept = {r.key: r for r in held if r is not None}
        stale = [k for k in found if k not in kept]
        log.info("rank %d: %d file(s) of %s left by an uncommitted attempt: %d re-used, %d replaced", self.rank,
                 len(found), self.uri.raw, len(kept), len(stale))
        if stale:  # noted first: a writer whose files these were checks them again before it commits
            await store.put(replaced_note_key(meta_prefix(self.uri.key)), json.dumps(stale).encode())
            await store.delete_many(stale)
        self._existing.difference_update(found)
        return kept

    async def _agree_attempt(self) -> str:
        if self.world_size == 1:
            return new_attempt_id()
        if not self.barrier.fresh:
            raise CheckpointError(
                f"{type(self.barrier).__name__} cannot agree on an attempt id for {self.uri.raw}: pass attempt= "
                "(the same on every rank, new for every run of the job) or set FASTCKPT_ATTEMPT")
        proposal = new_attempt_id().encode() if self.rank == 0 else None
        return check_attempt((await self.barrier.broadcast(self._rv, ATTEMPT_TAG, proposal)).decode())

    async def _agree_base(self) -> BaseCheckpoint | None:
        """The base checkpoint: read by rank 0 and handed to the others (a failure there fails every rank)."""
        base = self._base_arg
        if base is None or isinstance(base, BaseCheckpoint):
            return base
        if self.world_size == 1:
            return await resolve_base(self._rv.store, self.uri, base, overwrite=self.overwrite)
        tag = f"{self.attempt}/base"
        if self.rank != 0:
            return BaseCheckpoint.decode(await self.barrier.broadcast(self._rv, tag, None),
                                         f"base of checkpoint {self.uri.raw} (from rank 0)")
        try:
            found = await resolve_base(self._rv.store, self.uri, base, overwrite=self.overwrite)
        except Exception as exc:
            with contextlib.suppress(Exception):  # the others learn it now; the error itself is raised here
                await self.barrier.broadcast(self._rv, tag, encode_none(f"rank 0 could not read the base: {exc}"))
            raise
        await self.barrier.broadcast(self._rv, tag, found.encode() if found is not None else encode_none())
        return found

    @property
    def _copied(self) -> int:
        """Bytes of this rank's files the store copied from the base."""
        return self._handed_copied + (self._transfer.reuse.total if self._transfer is not None else 0)

    def _active(self) -> Transfer:
        if self._transfer is None or self._closed:
            raise CheckpointError("CheckpointWriter is used outside its 'async with' block")
        return self._transfer

    def _reserve(self, name: str) -> str:
        name = check_name(name)
        if name in self._entries:
            raise CheckpointError(f"rank {self.rank} writes {name!r} twice to {self.uri.raw}")
        self._entries[name] = None
        return name

    async def put_file(self, path: str | os.PathLike[str], name: str | None = None) -> FileResult:
        """Upload local file ``path`` as ``name`` (default: its base name) inside the checkpoint."""
        return (await self._put([(os.fspath(path), name or os.path.basename(os.fspath(path)))]))[0]

    async def put_dir(self, path: str | os.PathLike[str], prefix: str = "") -> list[FileResult]:
        """Upload every file below local directory ``path``, named ``prefix/relative path``."""
        src, base = os.fspath(path), prefix.strip("/")
        files = await off_loop(_dir_files, src)
        return await self._put([(p, f"{base}/{rel}" if base else rel) for p, rel in files])

    async def _put(self, pairs: list[tuple[str, str]]) -> list[FileResult]:
        transfer = self._active()
        names = []
        try:
            for _, name in pairs:
                names.append(self._reserve(name))
            todo = [(p, self._key(n)) for (p, _), n in zip(pairs, names, strict=True)]
            paths = {k: p for p, k in todo}
            kept = await self._clear_leftovers(list(paths), lambda k: transfer.holds_file(paths[k], k))
            bases = {} if self.base is None else {k: b for n, (_, k) in zip(names, todo, strict=True)
                                                  if (b := self.base.object(n)) is not None}
            async with self._not_replacing():
                sent = iter(await transfer.upload_files([pk for pk in todo if pk[1] not in kept], if_absent=True,
                                                        bases=bases))
            results = [kept[k] if k in kept else next(sent) for _, k in todo]
        except BaseException:
            self._unreserve(names)
            raise
        for name, res in zip(names, results, strict=True):
            self._entries[name] = FileEntry(name, res.digest, tuple(c.hex() for c in res.chunks))
        return results

    async def put_layout(self, name: str, layout: Layout) -> FileResult:
        """Upload ``layout`` (bytes in memory, e.g. a tensor file's header and tensors) as file ``name``; its
        chunk digests go into the manifest, so readers of part of it verify what they read."""
        transfer = self._active()
        name = self._reserve(name)
        key = self._key(name)
        try:
            part_size = plan_upload(layout.size, self.config, transfer.store).part_size
            chunks = await hash_layout(layout, part_size)
            digest = FileDigest(layout.size, part_size, combine(chunks))

            async def holds(k: str) -> FileResult | None:
                return FileResult(k, "", digest) if await transfer.holds_digest(k, digest) else None

            if key not in await self._clear_leftovers([key], holds):
                async with self._not_replacing():
                    base = self.base.object(name) if self.base is not None else None
                    await upload_layout(transfer, layout, key, if_absent=True, chunks=chunks, base=base)
        except BaseException:
            self._unreserve([name])
            raise
        self._entries[name] = FileEntry(name, digest, tuple(c.hex() for c in chunks))
        return FileResult(key, "", digest)

    @contextlib.asynccontextmanager
    async def _not_replacing(self) -> AsyncIterator[None]:
        """An object created at one of our keys meanwhile (by another writer) fails the write clearly."""
        try:
            yield
        except AlreadyExistsError as exc:
            await self._refuse_committed()
            raise CheckpointError(f"{exc}: created meanwhile by another writer of checkpoint {self.uri.raw} "
                                  "(another rank writing the same name, or another job); not replaced") from exc

    def publish(self, name: str, data: bytes) -> None:
        """With ``overwrite``: once the new checkpoint is committed, and before the old one's files go, write ``data``
        at ``name`` in the checkpoint itself, outside the new files' folder (an index another tool reads at a fixed
        name, such as DCP's ``.metadata``). Not a file of the checkpoint: no manifest names it."""
        if not self.overwrite:
            raise CheckpointError("publish() goes with overwrite=True (without it, write the file with put_layout)")
        self._publish[check_name(name)] = data

    def _unreserve(self, names: list[str]) -> None:
        for n in names:
            if self._entries.get(n) is None:
                self._entries.pop(n, None)

    def record_written(self, entries: tuple[FileEntry, ...], copied: int = 0) -> None:
        """Count files this rank wrote other than through this writer (through an earlier writer of the same attempt
        that handed off, or straight into a tier's files), ``copied`` of their bytes by the store; the commit still
        checks that each holds what ``entries`` record."""
        self._handed_copied += copied
        for entry in entries:
            self._reserve(entry.name)
            self._entries[entry.name] = entry

    async def hand_off(self, error: BaseException | None = None) -> bytes:
        """Leave without taking part in the commit: store this rank's manifest (a failure record when
        ``error`` is given) so ``gc`` finds the attempt, and return it for a root that commits it with a
        ``HandedBarrier`` (the other ranks' manifests reach the root through the caller's own collectives)."""
        try:
            if error is None and any(e is None for e in self._entries.values()):
                raise CheckpointError(f"rank {self.rank} hands off with uploads still running")
            data = self._manifest(None if error is None else f"{type(error).__name__}: {error}")
            await self._write_own(rank_key(self._rv.prefix, self.attempt, self.rank), data)
            return data
        finally:
            await self._close()

    async def _close(self) -> None:
        self._closed = True
        if self._transfer is not None:
            self._transfer.close()
        if self._own_store and self._store is not None:
            await self._store.close()
