"""Saving tensor state straight from memory: ``save`` and ``async_save`` into one committed checkpoint."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import logging
import os
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from .. import stats
from .._loop import BackgroundLoop
from ..checkpoint.barrier import Barrier
from ..checkpoint.commit import CommitResult
from ..checkpoint.retention import Retention, retain_beside
from ..checkpoint.writer import CheckpointWriter
from ..config import TransferConfig
from ..engine.layout import Layout
from ..engine.open_stores import store_for
from ..stores.base import Store
from ..threads import off_loop
from ..tier import Tier
from ..tier.directory import Drain
from ..tier.save import save_to_tier, supersede, wait_durable
from ..uri import parse_uri
from .format import Header, build_header, flatten, split_large, with_state
from .staging import Staging, byte_view, default_staging, distributed_defaults
from .tiered.peers import replica_group, replicate
from .tiered.staging import commit_staged, prepare_spares, stage_in_tier

__all__ = ["SaveHandle", "as_tier", "async_save", "rank_file", "rank_files", "save"]

log = logging.getLogger("fastckpt")


def rank_file(rank: int, part: str = "") -> str:
    """Name of rank ``rank``'s tensor file inside the checkpoint (``part="large"``: the file of its large tensors,
    in incremental saves)."""
    return f"rank-{rank:05d}{'-' + part if part else ''}.safetensors"


def rank_files(rank: int, skeleton: Any, tensors: dict[str, Any], incremental: bool) -> list[tuple[str, Header]]:
    """The files of rank ``rank``'s state and their headers (``tensors`` gains the skeleton's state tensor): one; in
    incremental saves, the large tensors in ``rank-NNNNN-large.safetensors`` (written even when empty, so that every
    rank of the save has it) and the rest in ``rank-NNNNN.safetensors`` (``split_large``)."""
    tensors.update(with_state(skeleton, {}))
    if not incremental:
        return [(rank_file(rank), build_header(tensors))]
    large, rest = split_large(tensors)
    return [(rank_file(rank, "large"), build_header(large)), (rank_file(rank), build_header(rest))]


class SaveHandle:
    """An ``async_save`` in flight: ``wait()`` returns its commit result or raises what failed it."""

    def __init__(self, future: concurrent.futures.Future[CommitResult], blocked_s: float,
                 tier: tuple[Tier, str, int] | None = None) -> None:
        self._future = future
        self._tier = tier
        self.blocked_s = blocked_s
        """Seconds the caller was blocked (staging the tensors)."""

    def done(self) -> bool:
        """Whether the save has finished: committed (or, into a tier, handed to its agent) or failed."""
        return self._future.done()

    def wait(self, timeout: float | None = None, *, durable: bool = False) -> CommitResult:
        """Wait for the commit; raises the save's exception (nothing was committed then), or TimeoutError.

        Saves to a ``tier``: once the save is safe there (the training process may die now: the node agent drains
        it): committed in the tier, or handed to the agent before that (the result then counts this rank's files
        alone; a commit in the tier that fails after the hand-off is logged and finished by the agent).
        ``durable=True`` waits on until the agents committed it at the durable URI (CheckpointError when they gave
        up, with why), ``timeout`` covering both."""
        started = time.monotonic()
        result = self._future.result(timeout)
        if not durable or self._tier is None:
            return result
        left = None if timeout is None else max(0.0, timeout - (time.monotonic() - started))
        tier, uri, rank = self._tier
        return BackgroundLoop.get().run(wait_durable(tier, parse_uri(uri), result, rank, left))

    def exception(self) -> BaseException | None:
        """The save's exception once it is done (None when it is safe); waits for it to finish."""
        return self._future.exception()


def _first_safe(safe: concurrent.futures.Future[CommitResult], result: CommitResult | None = None,
                exc: BaseException | None = None) -> None:
    """Settle ``safe`` with what made the save safe first (the hand-off, or the commit); a commit that fails after
    the hand-off is left to the agent, and logged."""
    if safe.done():
        if exc is not None:
            log.warning("the commit in the tier failed after the hand-off; the node agent finishes the save: %s", exc)
        return
    if exc is not None:
        safe.set_exception(exc)
    else:
        assert result is not None
        safe.set_result(result)


def _settled_by(safe: concurrent.futures.Future[CommitResult]) -> Callable[[concurrent.futures.Future[CommitResult]],
                                                                            None]:
    """A done-callback for the commit's future that settles ``safe`` (``_first_safe``)."""
    def done(commit: concurrent.futures.Future[CommitResult]) -> None:
        if commit.cancelled():
            _first_safe(safe, exc=concurrent.futures.CancelledError())
        elif commit.exception() is not None:
            _first_safe(safe, exc=commit.exception())
        else:
            _first_safe(safe, commit.result())

    return done


def save(state_dict: Any, uri: str, *, rank: int | None = None, world_size: int | None = None, group: Any = None,
         barrier: Barrier | None = None, attempt: str | None = None, config: TransferConfig | None = None,
         store: Store | None = None, base: str | None = None, tier: str | os.PathLike[str] | Tier | None = None,
         replicas: int = 0, overwrite: bool = False, metrics: Mapping[str, float] | None = None,
         retention: Retention | None = None) -> CommitResult:
    """Save ``state_dict`` (this rank's share) to checkpoint ``uri`` and commit it with the other ranks.

    CPU tensors are uploaded straight from their memory (no copy, no local file); the call returns once
    the checkpoint is committed. Device tensors go through a temporary host staging area. ``group`` (a
    ``torch.distributed`` process group, every rank of which saves its share) gives the rank, the world size and the
    commit's collectives; without it they are the default group's when ``torch.distributed`` is initialised (else
    rank 0 of 1). ``barrier``: another kind of barrier (a ``StoreBarrier``), not with ``group``. ``base`` (a
    committed checkpoint's URI, or ``"latest"``) makes the save incremental: the tensors of 1 MiB and more go to a
    file of their own (``rank_files``), and a file or part of one that holds the same bytes as the base's is copied
    by the store, not sent (``CheckpointWriter``); the result's ``copied`` and ``sent`` say how much. ``tier`` (a
    directory on this node, or a ``Tier``): commit into the tier and return; its node agent drains it to ``uri``
    (see ``async_save``, also for ``replicas``). ``overwrite``: a checkpoint committed at ``uri`` is replaced
    atomically (``CheckpointWriter``), else refused. ``metrics`` (name: number): recorded in the commit marker (rank
    0's). ``retention`` (a ``fastckpt.Retention``): once committed, rank 0 removes the checkpoints beside ``uri`` that
    it does not keep (with ``tier``: the agent, once committed at ``uri``).
    """
    rank, world_size, barrier = distributed_defaults(rank, world_size, barrier, group)
    place = _place(uri, rank, world_size, barrier, attempt, config, store, base, tier, overwrite, metrics, retention)
    skeleton, tensors = flatten(state_dict)
    if tier is not None or any(t.device.type != "cpu" for t in tensors.values()):
        # committed (in the tier) when this returns: not just handed to the agent
        return _start(state_dict, place, None if tier else Staging(), "wait", replicas, hand_off=False).wait()
    files = [(name, Layout([header.raw] + [byte_view(tensors[n].detach().contiguous()) for n in header.tensors]))
             for name, header in rank_files(rank, skeleton, tensors, base is not None)]
    return BackgroundLoop.get().run(_commit(files, place))


def async_save(state_dict: Any, uri: str, *, rank: int | None = None, world_size: int | None = None,
               group: Any = None, barrier: Barrier | None = None, attempt: str | None = None,
               config: TransferConfig | None = None, store: Store | None = None, staging: Staging | None = None,
               if_busy: Literal["wait", "error"] = "wait", base: str | None = None,
               tier: str | os.PathLike[str] | Tier | None = None, replicas: int = 0,
               overwrite: bool = False, metrics: Mapping[str, float] | None = None,
               retention: Retention | None = None) -> SaveHandle:
    """Copy ``state_dict``'s tensors into host staging memory, then upload and commit in the background.

    The caller is blocked only for the copies (device tensors: ``non_blocking`` into pinned memory, one
    synchronize); training may change the tensors as soon as this returns. ``staging`` (default: one per
    process, grown to the largest state saved) is reused by every save; while an earlier save from the
    same staging is still uploading, ``if_busy="wait"`` waits for it and ``"error"`` raises RuntimeError.
    The upload runs on fastckpt's background loop; the handle's ``wait()`` surfaces its outcome. ``group``,
    ``barrier`` and ``base``: as for ``save`` (the comparison with the base happens in the background, after the
    copies).

    ``tier`` (a directory on this node such as ``/dev/shm/fastckpt``, or a ``fastckpt.tier.Tier``): the save commits
    into the tier (every rank into its own node's; the barrier must not be a store barrier), and the node agent (a
    process of its own, started when none runs) drains it to ``uri`` and commits it there once every rank's data is
    in. ``wait()`` returns once it is safe in the tier, ``wait(durable=True)`` once it is committed at ``uri``. CPU
    tensors are copied straight into the tier's files, whose pages are recycled save after save (the first save into
    a tier goes through ``staging`` and readies those files); device tensors go through ``staging``. ``config`` does
    not reach the agent: it opens ``uri`` from the environment it was started in. ``replicas=1``: each rank's copy
    also goes to the tier of the rank one node over (``tiered.peers``), before ``wait()`` returns. ``overwrite``: as
    for ``save`` (not with ``tier``: a tier save commits each step to a URI of its own). ``metrics`` and
    ``retention``: as for ``save``.
    """
    rank, world_size, barrier = distributed_defaults(rank, world_size, barrier, group)
    place = _place(uri, rank, world_size, barrier, attempt, config, store, base, tier, overwrite, metrics, retention)
    return _start(state_dict, place, staging, if_busy, replicas, hand_off=True)


def _place(uri: str, rank: int, world_size: int, barrier: Barrier | None, attempt: str | None,
           config: TransferConfig | None, store: Store | None, base: str | None,
           tier: str | os.PathLike[str] | Tier | None, overwrite: bool, metrics: Mapping[str, float] | None,
           retention: Retention | None) -> _Place:
    """Where and how a save commits; ValueError for what cannot go together."""
    if overwrite and tier is not None:
        raise ValueError("overwrite=True goes without tier= (a tier save commits each step to a URI of its own)")
    return _Place(uri, rank, world_size, barrier, attempt, config, store, base, as_tier(tier, store), overwrite,
                  metrics, retention)


def _start(state_dict: Any, place: _Place, staging: Staging | None, if_busy: Literal["wait", "error"],
           replicas: int, hand_off: bool) -> SaveHandle:
    """Stage ``state_dict`` and start its commit in the background (``async_save``); ``hand_off``: a tier save is
    safe once handed to the node agent, before its commit in the tier (else only once committed there)."""
    after = _replicas(place, replicas)
    started = time.perf_counter()
    skeleton, tensors = flatten(state_dict)
    headers = rank_files(place.rank, skeleton, tensors, place.base is not None)
    spares: list[tuple[str, int]] = []
    if place.tier is not None and all(t.device.type == "cpu" for t in tensors.values()):
        target = parse_uri(place.uri)
        supersede(place.tier, target)
        staged = stage_in_tier(place.tier, place.tier.copy_of(target), headers, tensors)
        if staged is not None:
            safe: concurrent.futures.Future[CommitResult] = concurrent.futures.Future()
            handed = functools.partial(_first_safe, safe) if hand_off and after is None else None
            coro = commit_staged(place.tier, target, staged, place.rank, place.world_size, place.barrier,
                                 place.attempt, place.config or TransferConfig.from_env(), after, handed,
                                 Drain(place.base, place.retention), place.metrics)
            asyncio.run_coroutine_threadsafe(coro, BackgroundLoop.get().loop).add_done_callback(_settled_by(safe))
            return SaveHandle(safe, time.perf_counter() - started, (place.tier, place.uri, place.rank))
        spares = [(name, h.size) for name, h in headers]
    staging = staging or default_staging(place.rank)
    with staging.claim(if_busy):
        data = staging.stage([h for _, h in headers], tensors)
        files = [(name, Layout([h.raw, d])) for (name, h), d in zip(headers, data, strict=True)]
        future = asyncio.run_coroutine_threadsafe(_commit(files, place, spares, after), BackgroundLoop.get().loop)
        staging.track(future)
    return SaveHandle(future, time.perf_counter() - started,
                      None if place.tier is None else (place.tier, place.uri, place.rank))


_readying: set[asyncio.Task[None]] = set()
"""``prepare_spares`` running in the background (kept referenced until done)."""


def _readied(task: asyncio.Task[None]) -> None:
    _readying.discard(task)
    if not task.cancelled() and task.exception() is not None:
        log.warning("could not ready tier files for the next save: %s", task.exception())


def _replicas(place: _Place, replicas: int) -> Callable[[], Awaitable[None]] | None:
    """What sends a tier save's replicas (``tiered.peers.replicate``) once it is committed; None for none."""
    if replicas not in (0, 1):
        raise ValueError(f"replicas={replicas}: 0 or 1 peer replicas are supported")
    if not replicas:
        return None
    if place.tier is None:
        raise ValueError("replicas= goes with tier= (the replica lands in a peer node's tier)")
    group, tier, target = replica_group(place.barrier), place.tier, parse_uri(place.uri)

    async def after() -> None:
        try:
            await asyncio.to_thread(replicate, group, tier, target, place.rank, place.world_size)
        except Exception as exc:  # the save is committed in this node's tier; the agent still drains it
            log.warning("rank %d: the peer replica of %s failed: %s", place.rank, place.uri, exc)

    return after


def as_tier(tier: str | os.PathLike[str] | Tier | None, store: Store | None) -> Tier | None:
    """The ``Tier`` a save commits into (None: straight to its URI); ValueError for what a tier save cannot take."""
    if tier is None:
        return None
    if store is not None:
        raise ValueError("a save into a tier takes no store= (the agent opens the URI itself)")
    return tier if isinstance(tier, Tier) else Tier(tier)


@dataclass(frozen=True)
class _Place:
    """Where and how one rank's save commits."""

    uri: str
    rank: int
    world_size: int
    barrier: Barrier | None
    attempt: str | None
    config: TransferConfig | None
    store: Store | None
    base: str | None
    tier: Tier | None
    overwrite: bool = False
    metrics: Mapping[str, float] | None = None
    retention: Retention | None = None


@stats.summarized("save")
async def _commit(files: list[tuple[str, Layout]], p: _Place, spares: list[tuple[str, int]] | None = None,
                  after: Callable[[], Awaitable[None]] | None = None) -> CommitResult:
    """Commit ``files``; into a tier, then ``after()`` (the replicas), and ready ``spares`` (name, size) for the next
    save in the background (``prepare_spares``)."""
    target, cfg = parse_uri(p.uri), p.config or TransferConfig.from_env()
    if p.tier is not None:
        result = await save_to_tier(p.tier, target, files, p.rank, p.world_size, p.barrier, p.attempt, cfg,
                                    Drain(p.base, p.retention), p.metrics)
        if after is not None:
            await after()
        if spares:  # after the result: the files are for the next save, not this one
            _readying.add(task := asyncio.get_running_loop().create_task(
                off_loop(prepare_spares, p.tier, spares, p.tier.copy_of(target))))
            task.add_done_callback(_readied)
        return result
    async with contextlib.AsyncExitStack() as stack:
        store = p.store
        if store is None:
            store = await stack.enter_async_context(store_for(target, cfg))
        writer = CheckpointWriter(target, rank=p.rank, world_size=p.world_size, barrier=p.barrier, attempt=p.attempt,
                                  config=cfg, store=store, base=p.base, overwrite=p.overwrite, metrics=p.metrics)
        async with writer:
            for name, layout in files:
                await writer.put_layout(name, layout)
        if p.rank == 0:
            await retain_beside(store, target, p.retention)
    assert writer.result is not None
    return writer.result
