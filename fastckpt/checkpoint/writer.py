"""CheckpointWriter: every rank writes its files, then all commit together or not at all.

On leaving the block without an exception, each rank uploads its manifest (files, sizes, chunk size,
digests) for the attempt, the barrier gathers them at rank 0, rank 0 checks them (no rank failed, no
file written twice, every file still holds the bytes its rank recorded) and creates the commit marker
with create-if-absent, and announces the outcome to every rank. Leaving with an exception hands a
failure record to the barrier instead: nothing commits, and the other ranks raise CheckpointError
naming the failed rank.

A committed checkpoint is never changed. Data files and manifests are written create-if-absent, so no
writer replaces a file blindly. A file found under a name this rank is about to write is a leftover of
an uncommitted attempt (a dead run): it is deleted first, unless the checkpoint is committed, in which
case the writer fails before writing anything. A file created by another writer between that check
and this rank's write fails the write (two jobs writing one checkpoint at once), and a file replaced
after its rank wrote it fails the commit, so the marker only ever names the bytes its manifests hold.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from types import TracebackType
from typing import cast

from .._loop import BackgroundLoop
from ..config import TransferConfig
from ..engine.memory import Layout, hash_layout, upload_layout
from ..engine.paths import local_files
from ..engine.plan import plan_upload
from ..engine.progress import ProgressCallback
from ..engine.transfer import FileResult, Transfer
from ..errors import AlreadyExistsError, CheckpointError, ObjectNotFoundError
from ..integrity import FileDigest, combine
from ..stores import open_store
from ..stores.base import Store
from ..stores.retry import retrying
from ..tasks import gather_bounded
from ..uri import StorageURI, parse_uri
from .barrier import Barrier, BarrierError, BarrierTimeoutError, Rendezvous, default_barrier
from .manifest import (
    CommitMarker,
    FileEntry,
    RankManifest,
    build_marker,
    check_attempt,
    check_name,
    marker_key,
    meta_prefix,
    rank_key,
)
from .storage import read_object

CHECK_CONCURRENCY = 64
"""HEAD requests in flight while rank 0 checks the files before committing."""

log = logging.getLogger("fastckpt")
ATTEMPT_TAG = "attempt"


def attempt_from_env(env: Mapping[str, str] | None = None) -> str | None:
    """An attempt id shared by all ranks of one job run, from the environment, else None.

    ``FASTCKPT_ATTEMPT`` as is; else torchelastic's run id plus its restart count; else SLURM's job
    id plus its restart count. (torchrun's default run id ``none`` is not unique and is ignored.)
    """
    env = os.environ if env is None else env
    if env.get("FASTCKPT_ATTEMPT"):
        return check_attempt(env["FASTCKPT_ATTEMPT"])
    run = env.get("TORCHELASTIC_RUN_ID", "")
    if run and run != "none":
        return _safe(f"{run}-r{env.get('TORCHELASTIC_RESTART_COUNT', '0')}")
    if env.get("SLURM_JOB_ID"):
        return _safe(f"slurm-{env['SLURM_JOB_ID']}-r{env.get('SLURM_RESTART_COUNT', '0')}")
    return None


def _safe(text: str) -> str:
    return check_attempt(re.sub(r"[^A-Za-z0-9._-]", "-", text).lstrip("._-")[:128] or "attempt")


def _dir_files(src: str) -> list[tuple[str, str]]:
    if not os.path.isdir(src):
        raise NotADirectoryError(f"source {src} is not a directory")
    return local_files(src)


def new_attempt_id() -> str:
    """A fresh, unique attempt id (time + random)."""
    return f"{time.strftime('%Y%m%dT%H%M%S', time.gmtime())}-{secrets.token_hex(6)}"


@dataclass(frozen=True)
class CommitResult:
    """What a successful commit produced."""

    uri: str
    attempt: str
    world_size: int
    files: int
    bytes: int
    committed_at: float


class CheckpointWriter:
    """Writes one rank's share of a checkpoint; use ``async with`` on every rank of the job.

    ``uri`` is the checkpoint itself (``s3://bucket/run/step-100``). ``barrier`` defaults to a
    ``StoreBarrier``. ``attempt`` names this run of the job and must be the same on every rank and
    new on every restart; by default it comes from the environment (``attempt_from_env``), else rank
    0 draws one and sends it through the barrier (not possible with the store barrier, which needs
    it given). ``store`` reuses an open store (not closed here).
    """

    def __init__(
        self,
        uri: str | StorageURI,
        *,
        rank: int = 0,
        world_size: int = 1,
        barrier: Barrier | None = None,
        attempt: str | None = None,
        config: TransferConfig | None = None,
        store: Store | None = None,
        progress: ProgressCallback | None = None,
    ) -> None:
        self.uri = parse_uri(uri) if not isinstance(uri, StorageURI) else uri
        if self.uri.backend == "delegate":
            raise ValueError(f"{self.uri.raw!r}: scheme {self.uri.scheme!r} is not a fastckpt backend")
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} / world size {world_size}: need 0 <= rank < world_size")
        self.rank, self.world_size = rank, world_size
        self.barrier = barrier or default_barrier()
        self.config = config or TransferConfig.from_env()
        self._attempt = check_attempt(attempt) if attempt else None
        self._store, self._own_store = store, store is None
        self._progress = progress
        self._transfer: Transfer | None = None
        self._entries: dict[str, FileEntry | None] = {}
        self._existing: set[str] | None = None
        self._closed = False
        self.result: CommitResult | None = None
        """Set on every rank once the checkpoint is committed."""

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

    async def __aenter__(self) -> CheckpointWriter:
        if self._transfer is not None or self._closed:
            raise CheckpointError("a CheckpointWriter writes one checkpoint once; create a new one")
        self._store = open_store(self.uri, self.config) if self._store is None else retrying(self._store, self.config)
        try:
            self.barrier.check_world(self._rv)
            await self._refuse_committed()
            self._attempt = self._attempt or attempt_from_env() or await self._agree_attempt()
            self._transfer = Transfer(self._store, self.config, self._progress)
        except BaseException as exc:
            if isinstance(exc, Exception):  # the other ranks learn of it now, not at their barrier timeout
                await self._report_failure(exc)
            await self._close()
            raise
        return self

    async def _refuse_committed(self, what: str = "") -> None:
        """CheckpointError when the checkpoint is committed (by whichever writer); ``what`` was not written."""
        key = marker_key(self.uri.key)
        try:
            await self._rv.store.head(key)
        except ObjectNotFoundError:
            return
        raise CheckpointError(f"checkpoint {self.uri.raw} is already committed; refusing to write it again"
                              + (f" ({what} not written)" if what else ""))

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
        files = await asyncio.to_thread(_dir_files, src)
        return await self._put([(p, f"{base}/{rel}" if base else rel) for p, rel in files])

    async def _put(self, pairs: list[tuple[str, str]]) -> list[FileResult]:
        transfer = self._active()
        names = []
        try:
            for _, name in pairs:
                names.append(self._reserve(name))
            todo = [(p, self.uri.join(n)) for (p, _), n in zip(pairs, names, strict=True)]
            paths = {k: p for p, k in todo}
            kept = await self._clear_leftovers(list(paths), lambda k: transfer.holds_file(paths[k], k))
            async with self._not_replacing():
                sent = iter(await transfer.upload_files([pk for pk in todo if pk[1] not in kept], if_absent=True))
            results = [kept[k] if k in kept else next(sent) for _, k in todo]
        except BaseException:
            self._unreserve(names)
            raise
        for name, res in zip(names, results, strict=True):
            self._entries[name] = FileEntry(name, res.digest)
        return results

    async def put_layout(self, name: str, layout: Layout) -> FileResult:
        """Upload ``layout`` (bytes in memory, e.g. a tensor file's header and tensors) as file ``name``; its
        chunk digests go into the manifest, so readers of part of it verify what they read."""
        transfer = self._active()
        name = self._reserve(name)
        key = self.uri.join(name)
        try:
            part_size = plan_upload(layout.size, self.config, transfer.store).part_size
            chunks = await hash_layout(layout, part_size)
            digest = FileDigest(layout.size, part_size, combine(chunks))

            async def holds(k: str) -> FileResult | None:
                return FileResult(k, "", digest) if await transfer.holds_digest(k, digest) else None

            if key not in await self._clear_leftovers([key], holds):
                async with self._not_replacing():
                    await upload_layout(transfer, layout, key, if_absent=True, chunks=chunks)
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

    def _unreserve(self, names: list[str]) -> None:
        for n in names:
            if self._entries.get(n) is None:
                self._entries.pop(n, None)

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        try:
            if exc is None:
                await self._commit()
            elif isinstance(exc, Exception):
                await self._report_failure(exc)
        finally:
            await self._close()

    def record_written(self, entries: tuple[FileEntry, ...]) -> None:
        """Count files this rank wrote through an earlier writer of the same attempt that handed off (the
        commit still checks that each holds what ``entries`` record)."""
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

    def _manifest(self, error: str | None = None) -> bytes:
        files = tuple(e for _, e in sorted(self._entries.items()) if e is not None) if error is None else ()
        return RankManifest(self.attempt, self.rank, self.world_size, files, error).encode()

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
        """Hand a failure record to the barrier so that nothing commits and the others learn why."""
        if self._attempt is None:
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


class SyncCheckpointWriter:
    """Sync twin of ``CheckpointWriter`` (``with`` block, blocking ``put_file`` / ``put_dir``).

    Runs on fastckpt's background event loop, so it also works on threads that run a loop.
    """

    def __init__(
        self,
        uri: str | StorageURI,
        *,
        rank: int = 0,
        world_size: int = 1,
        barrier: Barrier | None = None,
        attempt: str | None = None,
        config: TransferConfig | None = None,
        store: Store | None = None,
        progress: ProgressCallback | None = None,
    ) -> None:
        self._writer = CheckpointWriter(uri, rank=rank, world_size=world_size, barrier=barrier, attempt=attempt,
                                        config=config, store=store, progress=progress)
        self._loop = BackgroundLoop.get()

    @property
    def attempt(self) -> str:
        """The attempt id (known once the block is entered)."""
        return self._writer.attempt

    @property
    def result(self) -> CommitResult | None:
        """Set once the checkpoint is committed."""
        return self._writer.result

    def __enter__(self) -> SyncCheckpointWriter:
        self._loop.run(self._writer.__aenter__())
        return self

    def put_file(self, path: str | os.PathLike[str], name: str | None = None) -> FileResult:
        """Upload local file ``path`` as ``name`` inside the checkpoint."""
        return self._loop.run(self._writer.put_file(path, name))

    def put_dir(self, path: str | os.PathLike[str], prefix: str = "") -> list[FileResult]:
        """Upload every file below local directory ``path``."""
        return self._loop.run(self._writer.put_dir(path, prefix))

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._loop.run(self._writer.__aexit__(exc_type, exc, tb))
