"""A rank's save into its node's tier (committed there with the other ranks, then queued for the agent), and the
wait until the agents committed it at the durable URI."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
import weakref
from collections.abc import Awaitable, Callable, Mapping

from ..checkpoint.attempt import attempt_from_env, new_attempt_id
from ..checkpoint.barrier import Barrier
from ..checkpoint.commit import CommitResult
from ..checkpoint.documents import read_object
from ..checkpoint.manifest import CommitMarker, marker_key
from ..checkpoint.writer import CheckpointWriter
from ..config import TransferConfig
from ..engine.layout import Layout
from ..engine.open_stores import store_for
from ..errors import CheckpointError, ObjectNotFoundError
from ..threads import off_loop
from ..uri import StorageURI
from .agent import ensure_agent
from .directory import NO_DRAIN, Drain, Tier, TierStore
from .handoff import handed

__all__ = ["POLL_S", "commit_in_tier", "known_attempt", "save_to_tier", "supersede", "wait_durable"]

log = logging.getLogger("fastckpt")

POLL_S = (0.02, 0.25)
"""First and longest pause between looks at the tier's queue while waiting for the durable commit."""

_agreed: weakref.WeakKeyDictionary[Barrier, str] = weakref.WeakKeyDictionary()
"""The attempt the ranks of each barrier agreed on at their first tier save in this process."""


def known_attempt(attempt: str | None, world_size: int, barrier: Barrier | None) -> str | None:
    """The attempt of a tier save, when it is known before the ranks meet: given, from the environment, drawn here
    for a single rank, or agreed at an earlier save through the same barrier (one run of a job is one attempt);
    else None (the ranks agree on it as they commit)."""
    if attempt:
        return attempt
    if (found := attempt_from_env()) is not None:
        return found
    if world_size == 1:
        return new_attempt_id()
    try:
        return None if barrier is None else _agreed.get(barrier)
    except TypeError:  # a barrier that cannot be a weak key (unhashable, or no weak references)
        return None


async def commit_in_tier(tier: Tier, durable: StorageURI, write: Callable[[CheckpointWriter], Awaitable[None]],
                         rank: int, world_size: int, barrier: Barrier | None, attempt: str | None,
                         config: TransferConfig, drain: Drain = NO_DRAIN,
                         metrics: Mapping[str, float] | None = None) -> CommitResult:
    """Commit rank ``rank``'s share of ``durable`` into ``tier`` (``write`` puts its files through the writer) with
    the other ranks, each in its own node's tier (``metrics`` in the marker the agents copy to the durable store);
    then queue it for the node agent (which drains it as ``drain`` says), started if none runs. The result names the
    tier's copy."""
    writer = CheckpointWriter(tier.copy_of(durable), rank=rank, world_size=world_size, barrier=barrier,
                              attempt=attempt, config=config, store=TierStore(), per_node=True, metrics=metrics)
    async with writer:
        await write(writer)
    result = writer.result
    assert result is not None
    if barrier is not None and world_size > 1:
        with contextlib.suppress(TypeError):
            _agreed[barrier] = result.attempt
    await off_loop(functools.partial(tier.enqueue, durable, result.attempt, rank, result.committed_at, drain=drain))
    await off_loop(ensure_agent, tier)
    return result


def supersede(tier: Tier, durable: StorageURI) -> None:
    """``tier.supersede(durable)``, logged."""
    if tier.supersede(durable):
        log.info("tier %s: the copy of %s an earlier run committed here and never drained is superseded by this save",
                 tier.root, durable.raw)


async def save_to_tier(tier: Tier, durable: StorageURI, files: list[tuple[str, Layout]], rank: int, world_size: int,
                       barrier: Barrier | None, attempt: str | None, config: TransferConfig, drain: Drain = NO_DRAIN,
                       metrics: Mapping[str, float] | None = None) -> CommitResult:
    """``commit_in_tier`` of ``files`` (bytes in memory, written through the tier's store), over a copy an earlier
    run left undrained (``Tier.supersede``)."""
    await off_loop(supersede, tier, durable)
    await off_loop(tier.check_room, [layout.size for _, layout in files])

    async def write(writer: CheckpointWriter) -> None:
        for name, layout in files:
            await writer.put_layout(name, layout)

    return await commit_in_tier(tier, durable, write, rank, world_size, barrier, attempt, config, drain, metrics)


async def wait_durable(tier: Tier, durable: StorageURI, result: CommitResult, rank: int, timeout: float | None,
                       config: TransferConfig | None = None) -> CommitResult:
    """Wait until the checkpoint of rank ``rank``'s tier save ``result`` is committed at ``durable``; its result
    there (from the marker). The wait watches the tier's queue and hand-off records (the agent takes the rank's entry
    off once the checkpoint is committed in the bucket), so a thousand waiting ranks cost the bucket one read each.
    CheckpointError when an agent gave up on it (or another attempt committed there), TimeoutError after ``timeout``
    seconds. An agent that died meanwhile is started again."""
    deadline = None if timeout is None else time.monotonic() + timeout
    pause = POLL_S[0]
    async with store_for(durable, config or TransferConfig.from_env()) as store:
        while True:
            why = await off_loop(tier.failure, durable, result.attempt)
            if why is not None:
                raise CheckpointError(f"the node agent could not drain {durable.raw} from tier {tier.root}: {why}")
            queued = await off_loop(tier.queued, durable, rank) or await off_loop(handed, tier, durable, rank)
            if not queued:
                try:
                    raw = await read_object(store, marker_key(durable.key))
                except ObjectNotFoundError:
                    pass
                else:
                    found = CommitMarker.decode(raw, marker_key(durable.key))
                    if found.attempt != result.attempt:
                        raise CheckpointError(f"checkpoint {durable.raw} was committed by attempt "
                                              f"{found.attempt!r}, not by this save's {result.attempt!r}")
                    return CommitResult(durable.raw, found.attempt, found.world_size, found.files, found.bytes,
                                        found.committed_at, found.copied)
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"checkpoint {durable.raw} is not committed yet (still draining from "
                                   f"tier {tier.root})")
            if queued:
                await off_loop(ensure_agent, tier)
            await asyncio.sleep(pause)
            pause = min(POLL_S[1], pause * 1.5)
