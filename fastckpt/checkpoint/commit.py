"""The commit protocol, the writer's half that all ranks run together: each rank's manifest to the barrier, the
root's checks and its create-if-absent commit marker, the outcome to every rank; a failure record instead when a
rank failed, so that nothing commits and the others learn why."""

from __future__ import annotations

import abc
import json
import logging
from dataclasses import dataclass
from types import TracebackType
from typing import cast

from ..config import TransferConfig
from ..errors import AlreadyExistsError, CheckpointError, ObjectNotFoundError
from ..integrity import FileDigest
from ..stores.base import Store
from ..tasks import gather_bounded
from ..uri import StorageURI
from .barrier import Barrier, BarrierError, BarrierTimeoutError, Rendezvous
from .documents import read_object
from .manifest import CommitMarker, FileEntry, RankManifest, build_marker, marker_key, meta_prefix, rank_key

CHECK_CONCURRENCY = 64
"""HEAD requests in flight while rank 0 checks the files before committing."""

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
    _store: Store | None

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
        return RankManifest(self.attempt, self.rank, self.world_size, files, error).encode()

    @abc.abstractmethod
    async def _close(self) -> None:
        """Release what the writer holds (its transfer, the store it opened)."""

    async def _refuse_committed(self, what: str = "") -> None:
        """CheckpointError when the checkpoint is committed (by whichever writer); ``what`` was not written."""
        key = marker_key(self.uri.key)
        try:
            await self._rv.store.head(key)
        except ObjectNotFoundError:
            return
        raise CheckpointError(f"checkpoint {self.uri.raw} is already committed; refusing to write it again"
                              + (f" ({what} not written)" if what else ""))

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        try:
            if exc is None:
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
            outcome, error = await self._root_decide(await self._root_gather(data))
            await self.barrier.broadcast(rv, attempt, json.dumps(outcome).encode())
            if error is not None:
                raise error
        else:
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
        self.result = CommitResult(self.uri.raw, attempt, self.world_size, outcome["files"], outcome["bytes"],
                                   outcome["committed_at"])

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

    async def _check_files(self, payloads: list[bytes]) -> None:
        """Root: every file named by the manifests still holds what its rank recorded (CheckpointError if not)."""
        store = self._rv.store
        manifests = [RankManifest.decode(p, f"manifest of rank {r}") for r, p in enumerate(payloads)]
        entries = [(m.rank, e) for m in manifests for e in m.files]

        async def check(rank: int, entry: FileEntry) -> str | None:
            try:
                meta = await store.head(self.uri.join(entry.name))
            except ObjectNotFoundError:
                return f"{entry.name!r} (written by rank {rank}) is gone"
            found = FileDigest.from_metadata(meta.size, meta.metadata)
            if meta.size != entry.digest.size or found not in (None, entry.digest):
                return f"{entry.name!r} no longer holds what rank {rank} wrote (replaced by another writer)"
            return None

        problems = [p for p in await gather_bounded((check(r, e) for r, e in entries), CHECK_CONCURRENCY) if p]
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
            marker = build_marker(payloads, self.attempt, self.world_size, f"checkpoint {self.uri.raw}")
            await self._check_files(payloads)
            await self._create_marker(marker)
        except CheckpointError as exc:
            return {"ok": False, "error": str(exc)}, None
        except Exception as exc:  # re-raised by the caller once the others know
            return {"ok": False, "error": f"rank 0 could not create the commit marker: {exc}"}, exc
        return {"ok": True, "files": marker.files, "bytes": marker.bytes, "committed_at": marker.committed_at}, None

    async def _create_marker(self, marker: CommitMarker) -> None:
        key, data = marker_key(self.uri.key), marker.encode()
        store = self._rv.store
        try:
            await store.put(key, data, if_absent=True)
        except AlreadyExistsError:
            if await read_object(store, key) != data:  # not our own write, retried after a lost reply
                raise CheckpointError(f"checkpoint {self.uri.raw} was committed by another writer meanwhile") from None

    async def _outcome_from_marker(self) -> dict[str, object] | None:
        """Non-root whose wait for the root timed out: the outcome, if the root did commit our attempt."""
        key = marker_key(self.uri.key)
        try:
            marker = CommitMarker.decode(await read_object(self._rv.store, key), key)
        except (ObjectNotFoundError, CheckpointError):
            return None
        if marker.attempt != self.attempt:
            return None
        return {"ok": True, "files": marker.files, "bytes": marker.bytes, "committed_at": marker.committed_at}

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
