"""The commit protocol, the writer's half that all ranks run together: each rank's manifest to the barrier, the
root's checks and its create-if-absent commit marker, the outcome to every rank; a failure record instead when a
rank failed, so that nothing commits and the others learn why."""

from __future__ import annotations

import abc
import dataclasses
import json
import logging
from dataclasses import dataclass
from types import TracebackType
from typing import cast

from .. import stats
from ..config import TransferConfig
from ..errors import AlreadyExistsError, CheckpointError, ObjectNotFoundError
from ..integrity import FileDigest
from ..stores.base import ObjectMeta, Store
from ..tasks import gather_bounded
from ..uri import StorageURI, join_key
from .barrier import Barrier, BarrierError, BarrierTimeoutError, Rendezvous
from .documents import read_object, read_small
from .manifest import (
    REPLACED_DIR,
    CommitMarker,
    FileEntry,
    RankManifest,
    build_marker,
    marker_key,
    meta_prefix,
    rank_key,
)
from .reader import Checkpoint, load

__all__ = ["CHECK_CONCURRENCY", "Commit", "CommitResult"]

CHECK_CONCURRENCY = 64
"""Requests in flight while rank 0 checks the files before committing."""

log = logging.getLogger("fastckpt")


@dataclass(frozen=True)
class CommitResult:
    """What a successful commit produced."""

    uri: str
    attempt: str
    world_size: int
    files: int
    bytes: int
    committed_at: float
    copied: int = 0
    """Bytes of ``bytes`` the store copied from a base checkpoint (``base=``) instead of receiving them."""

    @property
    def sent(self) -> int:
        """Bytes of the files the writers sent to the store."""
        return self.bytes - self.copied


class Commit(abc.ABC):
    """The commit protocol of one rank's writer (``CheckpointWriter``): what it needs of the writer is declared here."""

    uri: StorageURI
    rank: int
    world_size: int
    barrier: Barrier
    config: TransferConfig
    result: CommitResult | None
    _attempt: str | None
    _entries: dict[str, FileEntry | None]
    _copied: int
    _store: Store | None
    per_node: bool
    """Each rank writes into a store of its own node (a memory tier), not one store shared by all ranks: the root
    checks no other rank's files, and every rank creates the marker in its own store."""
    overwrite: bool
    """The commit may replace a committed checkpoint (whose files lie outside ``root``)."""
    root: str
    """Folder of the files relative to the checkpoint (empty: the checkpoint itself)."""
    _publish: dict[str, bytes]
    """Written at the checkpoint itself once committed, before the replaced checkpoint's files go (``publish``)."""
    metrics: tuple[tuple[str, float], ...]
    """The root's metrics, recorded in the marker (``CommitMarker.metrics``)."""

    def _key(self, name: str) -> str:
        """Store key of this checkpoint's file ``name``."""
        return self.uri.join(self.root, name)

    @property
    def attempt(self) -> str:
        """The attempt id (known once the block is entered)."""
        if self._attempt is None:
            raise CheckpointError("the attempt id is agreed on entering the writer's block")
        return self._attempt

    @property
    def _rv(self) -> Rendezvous:
        if self._store is None:
            raise CheckpointError("CheckpointWriter is used outside its 'async with' block")
        return Rendezvous(self._store, meta_prefix(self.uri.key), self.rank, self.world_size, self.config,
                          self._write_own)

    def _manifest(self, error: str | None = None) -> bytes:
        files = tuple(e for _, e in sorted(self._entries.items()) if e is not None) if error is None else ()
        copied = self._copied if error is None else 0
        return RankManifest(self.attempt, self.rank, self.world_size, files, error, copied=copied,
                            root=self.root).encode()

    @abc.abstractmethod
    async def _close(self) -> None:
        """Release what the writer holds (its transfer, the store it opened)."""

    async def _refuse_committed(self, what: str = "") -> None:
        """CheckpointError when the checkpoint is committed (by whichever writer; with ``overwrite``, by this
        attempt); ``what`` was not written."""
        key = marker_key(self.uri.key)
        try:
            if self.overwrite:
                if CommitMarker.decode(await read_object(self._rv.store, key), key).attempt != self.attempt:
                    return
            else:
                await self._rv.store.head(key)
        except ObjectNotFoundError:
            return
        raise CheckpointError(f"checkpoint {self.uri.raw} is already committed; refusing to write it again"
                              + (f" ({what} not written)" if what else "")
                              + ("" if self.overwrite else " (overwrite=True replaces it)"))

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        try:
            if exc is None:
                with stats.stage("committing"):
                    await self._commit()
            elif isinstance(exc, Exception):
                await self._report_failure(exc)
        finally:
            await self._close()

    async def _commit(self) -> None:
        rv, attempt = self._rv, self.attempt
        if any(e is None for e in self._entries.values()):
            raise CheckpointError(f"rank {self.rank} left the block with uploads still running")
        data = self._manifest()
        if not self.barrier.stores_payloads:
            await self._write_own(rank_key(rv.prefix, attempt, self.rank), data)
        if self.rank == 0:
            with stats.stage("barrier"):
                payloads = await self._root_gather(data)
            outcome, error = await self._root_decide(payloads)
            await self.barrier.broadcast(rv, attempt, json.dumps(outcome).encode())
            if error is not None:
                raise error
            outcome.pop("marker", None)
        else:
            with stats.stage("barrier"):  # a failed broadcast's look at the marker is waiting for the outcome too
                await self.barrier.gather(rv, attempt, data)
                try:
                    outcome = json.loads(await self.barrier.broadcast(rv, attempt, None))
                except BarrierError:
                    found = await self._outcome_from_marker()
                    if found is None:
                        raise
                    outcome = found
        if not outcome["ok"]:
            if outcome.get("missing"):
                raise BarrierTimeoutError(outcome["error"], outcome["missing"])
            raise CheckpointError(f"checkpoint {self.uri.raw} was not committed: {outcome['error']}")
        if "marker" in outcome:  # per-node stores: this node's copy of the marker
            await self._create_marker(outcome["marker"].encode())
        self.result = CommitResult(self.uri.raw, attempt, self.world_size, outcome["files"], outcome["bytes"],
                                   outcome["committed_at"], outcome.get("copied", 0))

    async def _write_own(self, key: str, data: bytes) -> None:
        """Create this rank's manifest (or barrier payload) ``key``; one left by a dead process of the same
        attempt is replaced, unless the checkpoint is committed."""
        store = self._rv.store
        try:
            await store.put(key, data, if_absent=True)
        except AlreadyExistsError:
            if await read_object(store, key) == data:
                return
            await self._refuse_committed(f"manifest {key}")
            await store.put(key, data)

    async def _check_files(self, manifests: list[RankManifest]) -> None:
        """Root: every file the manifests name is still there as its rank wrote it (CheckpointError if not).

        One listing of the checkpoint shows each file's size (and its digest, where a listing carries metadata);
        the files another writer noted as replaced (its notes in ``.fastckpt/.replaced/``) are read back one by
        one, so a file taken over by another writer fails the commit even when the sizes agree."""
        store, meta = self._rv.store, meta_prefix(self.uri.key)
        entries = {self._key(e.name): (m.rank, e) for m in manifests for e in m.files}
        listed: dict[str, ObjectMeta | None] = {}
        notes: list[str] = []
        async for obj in store.list(self.uri.key):
            if obj.key in entries:
                listed[obj.key] = obj
            elif obj.key.startswith(join_key(meta, REPLACED_DIR) + "/"):
                notes.append(obj.key)
        replaced: set[str] = set()
        for named in await gather_bounded([_note_keys(store, k) for k in notes], CHECK_CONCURRENCY):
            replaced.update(listed if named is None else named)

        async def read_back(key: str) -> ObjectMeta | None:
            try:
                return await store.head(key)
            except ObjectNotFoundError:
                return None

        again = [k for k in listed if k in replaced]  # only these cost a request each
        listed.update(zip(again, await gather_bounded([read_back(k) for k in again], CHECK_CONCURRENCY),
                          strict=True))
        problems = []
        for key, (rank, entry) in entries.items():
            found = listed.get(key)
            if found is None:
                problems.append(f"{entry.name!r} (written by rank {rank}) is gone")
                continue
            digest = FileDigest.from_metadata(found.size, found.metadata)
            if found.size != entry.digest.size or digest not in (None, entry.digest):
                problems.append(f"{entry.name!r} no longer holds what rank {rank} wrote (replaced by another writer)")
        if problems:
            raise CheckpointError(f"checkpoint {self.uri.raw} not committed: " + "; ".join(problems[:5]))

    async def _root_gather(self, data: bytes) -> list[bytes]:
        """Root: gather the payloads; when that fails, tell the other ranks (if the barrier can) and raise."""
        try:
            return cast(list[bytes], await self.barrier.gather(self._rv, self.attempt, data))
        except Exception as exc:
            outcome = {"ok": False, "error": str(exc), "missing": getattr(exc, "missing", None)}
            try:
                await self.barrier.announce_failure(self._rv, self.attempt, json.dumps(outcome).encode())
            except Exception as err:  # the original error is what the caller must see
                log.warning("could not tell the other ranks of %s about the failure: %s", self.uri.raw, err)
            raise

    async def _root_decide(self, payloads: list[bytes]) -> tuple[dict, Exception | None]:
        """Root: check the manifests and create the marker. Returns the outcome every rank receives,
        and the error to raise here after announcing it."""
        try:
            marker, manifests = build_marker(payloads, self.attempt, self.world_size, f"checkpoint {self.uri.raw}",
                                             self.barrier.group_size_for(self.world_size), self.root)
            if not self.per_node:
                await self._check_files(manifests)
            marker = dataclasses.replace(marker, published=tuple(sorted(self._publish)), metrics=self.metrics)
            previous = await self._replaced() if self.overwrite else None
            await self._create_marker(marker.encode())
            if self.overwrite:
                await self._after_replacing(previous)
        except CheckpointError as exc:
            return {"ok": False, "error": str(exc)}, None
        except Exception as exc:  # re-raised by the caller once the others know
            return {"ok": False, "error": f"rank 0 could not create the commit marker: {exc}"}, exc
        outcome = {"ok": True, "files": marker.files, "bytes": marker.bytes, "committed_at": marker.committed_at,
                   "copied": marker.copied}
        if self.per_node:
            outcome["marker"] = marker.encode().decode()
        return outcome, None

    async def _create_marker(self, data: bytes) -> None:
        """Create the marker; with ``overwrite``, replace one of another attempt (a single write: readers see the old
        marker or this one)."""
        key = marker_key(self.uri.key)
        store = self._rv.store
        try:
            await store.put(key, data, if_absent=True)
        except AlreadyExistsError:
            found = await read_object(store, key)
            if found == data:  # our own write, retried after a lost reply
                return
            if not self.overwrite or CommitMarker.decode(found, key).attempt == self.attempt:
                raise CheckpointError(f"checkpoint {self.uri.raw} was committed by another writer meanwhile") from None
            await store.put(key, data)

    async def _replaced(self) -> Checkpoint | None:
        """Root, before replacing the marker: the committed checkpoint being replaced (None when there is none)."""
        try:
            return await load(self._rv.store, self.uri, allow_uncommitted=False)
        except CheckpointError:
            return None

    async def _after_replacing(self, previous: Checkpoint | None) -> None:
        """Root, once the new marker is in place: write what was published, then delete the replaced checkpoint's
        files and manifests (left to ``gc`` when that fails: the new checkpoint is committed either way)."""
        store = self._rv.store
        try:
            for name, data in self._publish.items():
                await store.put(self.uri.join(name), data)
            if previous is None or previous.info.attempt in (None, self.attempt):
                return
            published = {self.uri.join(n) for n in self._publish}
            old = [k for k in map(previous.file_key, previous.files) if k not in published]
            meta = join_key(meta_prefix(self.uri.key), previous.info.attempt) + "/"
            old += [m.key async for m in store.list(meta)]
            await store.delete_many(old)
        except Exception as exc:
            log.warning("checkpoint %s is committed, but the one it replaced was not cleared (gc removes it): %s",
                        self.uri.raw, exc)

    async def _outcome_from_marker(self) -> dict[str, object] | None:
        """Non-root whose wait for the root timed out: the outcome, if the root did commit our attempt."""
        key = marker_key(self.uri.key)
        try:
            marker = CommitMarker.decode(await read_object(self._rv.store, key), key)
        except (ObjectNotFoundError, CheckpointError):
            return None
        if marker.attempt != self.attempt:
            return None
        return {"ok": True, "files": marker.files, "bytes": marker.bytes, "committed_at": marker.committed_at,
                "copied": marker.copied}

    async def _report_failure(self, exc: Exception) -> None:
        """Hand a failure record to the barrier so that nothing commits and the others learn why (where the barrier
        carries failures: through a ``HandedBarrier`` the caller reports them)."""
        if self._attempt is None or not self.barrier.reports_failures:
            return
        try:
            data = self._manifest(f"{type(exc).__name__}: {exc}")
            payloads = await self.barrier.gather(self._rv, self.attempt, data)
            if payloads is not None:  # the root: tell the others why nothing commits
                try:
                    build_marker(payloads, self.attempt, self.world_size, f"checkpoint {self.uri.raw}")
                    why = "rank 0 failed"
                except CheckpointError as err:
                    why = str(err)
                await self.barrier.broadcast(self._rv, self.attempt, json.dumps({"ok": False, "error": why}).encode())
        except Exception as err:  # the caller's exception is what propagates
            log.warning("rank %d could not report its failure to the barrier of %s: %s", self.rank, self.uri.raw, err)


async def _note_keys(store: Store, key: str) -> list[str] | None:
    """The keys a note of replaced keys names: none when it is gone (gc), None (any key) when it is unreadable."""
    try:
        keys = json.loads(await read_small(store, key))
    except ObjectNotFoundError:
        return []
    except ValueError:
        return None
    return [k for k in keys if isinstance(k, str)] if isinstance(keys, list) else None
