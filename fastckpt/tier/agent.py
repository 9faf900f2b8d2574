"""The node agent: a process of its own that drains a tier's queue to the durable stores and outlives the training
processes that filled it.

One agent runs per tier directory (it holds ``.agent/lock``); ``ensure_agent`` starts one, detached from the caller
(its own session: a SIGKILL of the trainer, or of the trainer's process group, leaves it running), unless one holds
the lock. The agent takes the queue oldest first, a few entries at a time; an entry leaves the queue only once its
checkpoint is committed in the durable store (``drain``), so a killed agent leaves the queue as the next one resumes
it. A save whose process handed it over (``handoff``) and let go of it, by dying or after its commit failed, is
finished here and queued. A drain that cannot succeed (the copy damaged, the checkpoint committed by another writer,
the other ranks' data missing for ``FASTCKPT_AGENT_COMMIT_WAIT`` seconds) is recorded in ``.agent/failed`` and the
copy kept; other failures (the store unreachable) are retried with a growing pause. The agent exits after ``idle``
seconds with an empty queue and no save handed to it.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import subprocess
import sys
import time

from .. import otel, stats
from ..config import TransferConfig, env_seconds
from ..deprecation import keywords_only
from ..engine.open_stores import store_for
from ..errors import CheckpointError, IntegrityError
from ..uri import parse_uri
from .directory import QueueEntry, Tier
from .drain import drain
from .handoff import Held, drop_stale_temporaries, finish, handoffs, take_orphan

__all__ = ["COMMIT_POLL_S", "COMMIT_WAIT_S", "DRAINED", "DRAINS", "IDLE_S", "POLL_S", "RETRY_S", "agent_pid",
           "agent_running", "ensure_agent", "oldest_queued_s", "resume_drains", "run_agent"]

log = logging.getLogger("fastckpt")

IDLE_S = 60.0
"""Seconds an agent waits with an empty queue before it exits (``FASTCKPT_AGENT_IDLE`` for the agents started by
saves)."""
POLL_S = 0.05
"""Seconds between looks at the queue."""
RETRY_S = (1.0, 30.0)
"""First and longest pause before retrying a drain that failed for a reason that may pass."""
DRAINS = 4
"""Queue entries drained at once."""
DRAINED = {"bytes": 0, "checkpoints": 0}
"""What this process's agent drained so far: file bytes sent to durable stores, checkpoints committed there."""
COMMIT_POLL_S = (0.1, 1.0)
"""First and longest pause between looks at the durable store while other ranks' data is still missing."""
COMMIT_WAIT_S = 3600.0
"""Seconds an agent waits for the other ranks' data before it gives up on a checkpoint (the copy is kept)."""


def _try_lock(tier: Tier) -> int | None:
    """A descriptor holding ``tier``'s agent lock, or None when an agent holds it."""
    fd = os.open(os.path.join(tier.agent_dir, "lock"), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def agent_running(tier: Tier) -> bool:
    """Whether an agent holds ``tier``'s lock now."""
    fd = _try_lock(tier)
    if fd is not None:
        os.close(fd)
    return fd is None


def agent_pid(tier: Tier) -> int | None:
    """The process id of the agent serving ``tier`` now (None: none runs)."""
    if not agent_running(tier):
        return None
    with contextlib.suppress(OSError, ValueError), open(os.path.join(tier.agent_dir, "lock")) as f:
        return int(f.read())
    return None


def ensure_agent(tier: Tier, idle: float | None = None) -> None:
    """Start an agent for ``tier`` unless one runs. The lock is taken here and handed to the agent, so two callers
    never start two agents."""
    idle = env_seconds("FASTCKPT_AGENT_IDLE", IDLE_S) if idle is None else idle
    fd = _try_lock(tier)
    if fd is None:
        return
    try:
        with open(os.path.join(tier.agent_dir, "agent.log"), "ab") as out:
            subprocess.Popen([sys.executable, "-m", "fastckpt.cli", "agent", tier.root, "--keep", str(tier.keep),
                              "--idle", str(idle), "--lock-fd", str(fd), "--log-level", "info", "--json"],
                             stdin=subprocess.DEVNULL, stdout=out, stderr=out, start_new_session=True, pass_fds=(fd,))
    finally:
        os.close(fd)


def resume_drains(tier: Tier) -> None:
    """Start ``tier``'s agent when saves wait in its queue (or in a handoff) and none runs: what a killed agent left
    drains without a new save on this node (called by the restore paths that look at a tier)."""
    if os.path.isdir(tier.agent_dir) and (tier.pending() or handoffs(tier)):
        ensure_agent(tier)


def oldest_queued_s(tier: Tier) -> float | None:
    """Seconds the oldest queue entry has waited (None: the queue is empty)."""
    pending = tier.pending()
    return max(0.0, time.time() - min(_queued_at(p) for p in pending)) if pending else None


@keywords_only(1, "idle", "config", "lock_fd")
def run_agent(tier: Tier, *, idle: float = IDLE_S, config: TransferConfig | None = None, lock_fd: int | None = None
              ) -> bool:
    """Drain ``tier``'s queue until it has been empty for ``idle`` seconds; False when another agent runs.
    ``lock_fd``: the tier's lock, taken already by whoever started this agent."""
    fd = _try_lock(tier) if lock_fd is None else lock_fd
    if fd is None:
        return False
    os.ftruncate(fd, 0)
    os.pwrite(fd, str(os.getpid()).encode(), 0)
    try:
        asyncio.run(_serve(tier, idle, config or TransferConfig.from_env(), fd))
    finally:
        os.close(fd)
    if os.path.isdir(tier.queue_dir) and (tier.pending() or handoffs(tier)):  # queued or handed after the last look,
        run_agent(tier, idle=idle, config=config)  # by a saver that saw the lock held
    return True


def _still_ours(tier: Tier, fd: int) -> bool:
    """Whether the tier's lock file is still the one ``fd`` locks (not wiped, or made anew, under the agent)."""
    try:
        return os.stat(os.path.join(tier.agent_dir, "lock")).st_ino == os.fstat(fd).st_ino
    except FileNotFoundError:
        return False


async def _serve(tier: Tier, idle: float, config: TransferConfig, fd: int) -> None:
    otel.gauge("fastckpt.agent.queue.depth", "{checkpoint}", "Saves waiting in the tier's queue",
               lambda: len(tier.pending()))
    otel.gauge("fastckpt.agent.queue.oldest_age", "s", "Seconds the oldest queued save has waited",
               lambda: oldest_queued_s(tier))
    running: dict[str, asyncio.Task[None]] = {}
    waits: dict[str, _Wait] = {}
    last_busy = time.monotonic()
    while _still_ours(tier, fd):
        now = time.monotonic()
        for path in tier.pending():
            wait = waits.setdefault(path, _Wait())
            if path in running or len(running) >= DRAINS or wait.until > now:
                continue
            try:
                entry = tier.entry(path)
            except FileNotFoundError:
                continue
            except CheckpointError as exc:
                tier.record_failure(path, None, exc)
                continue
            if entry.not_before > time.time():
                continue
            running[path] = asyncio.create_task(_drain_entry(tier, path, entry, config, wait))
        for path in handoffs(tier):
            wait = waits.setdefault(path, _Wait())
            if path in running or len(running) >= DRAINS or wait.until > now:
                continue
            held = take_orphan(path)  # its process died, or left it after its commit failed
            if held is not None:
                running[path] = asyncio.create_task(_finish_handoff(tier, held, wait))
        for path in [p for p, t in running.items() if t.done()]:
            running.pop(path).result()
            if not os.path.exists(path):
                waits.pop(path, None)
        if running or tier.pending() or handoffs(tier):
            last_busy = now
        elif now - last_busy > idle:
            return
        else:
            drop_stale_temporaries(tier)
        await asyncio.sleep(POLL_S)


class _Wait:
    """One queue entry's state in this agent: uploaded already, when to look again, the last pause."""

    def __init__(self) -> None:
        self.uploaded = False
        self.until = 0.0
        self.pause = 0.0

    def again(self, first: float, longest: float) -> float:
        """Look again after a pause growing from ``first`` to ``longest``; returns it."""
        self.pause = min(longest, max(first, 2 * self.pause))
        self.until = time.monotonic() + self.pause
        return self.pause


async def _drain_entry(tier: Tier, path: str, entry: QueueEntry, config: TransferConfig, wait: _Wait) -> None:
    """Drain one queue entry; it leaves the queue once its checkpoint is committed in the durable store (and drained
    copies beyond the newest ``keep`` go)."""
    try:
        with stats.observe("drain", quiet=False) as summary:
            async with store_for(parse_uri(entry.durable), config) as store:
                committed = await drain(entry, store, config, lambda: os.path.exists(path),
                                        upload=not wait.uploaded)
        DRAINED["bytes"] += summary.file_bytes
    except (CheckpointError, IntegrityError) as exc:
        log.error("agent: giving up on %s: %s", path, exc)
        tier.record_failure(path, entry, exc)
        return
    except Exception as exc:
        log.warning("agent: draining %s failed (%s); retrying in %.0f s", path, exc, wait.again(*RETRY_S))
        return
    if not committed:
        wait.uploaded = True
        commit_wait = env_seconds("FASTCKPT_AGENT_COMMIT_WAIT", COMMIT_WAIT_S)
        if time.time() - _queued_at(path) > commit_wait:
            tier.record_failure(path, entry, CheckpointError(
                f"not every rank's data reached {entry.durable} within {commit_wait:.0f} s of this rank's"))
        else:
            wait.again(*COMMIT_POLL_S)
        return
    with contextlib.suppress(FileNotFoundError):
        os.remove(path)
    DRAINED["checkpoints"] += 1
    log.info("agent: rank %d of %s drained and committed", entry.rank, entry.durable)
    tier.prune(entry.keep)


async def _finish_handoff(tier: Tier, held: Held, wait: _Wait) -> None:
    """Finish the save recorded in ``held`` (``handoff.finish``) and drop the record; a failure that cannot pass is
    recorded as a drain's is (the copy kept), others are retried."""
    try:
        handoff = held.read()
    except CheckpointError as exc:
        tier.record_failure(held.path, None, exc)
        held.release()
        return
    try:
        await finish(tier, handoff)
    except CheckpointError as exc:
        log.error("agent: giving up on %s: %s", held.path, exc)
        tier.record_failure(held.path, QueueEntry(handoff.durable, handoff.copy, handoff.attempt, handoff.rank,
                                                  handoff.keep), exc)
        held.release()
        return
    except Exception as exc:
        log.warning("agent: finishing %s failed (%s); retrying in %.0f s", held.path, exc, wait.again(*RETRY_S))
        held.release()
        return
    log.info("agent: rank %d of %s handed over by its process: queued", handoff.rank, handoff.durable)
    held.done()


def _queued_at(path: str) -> float:
    try:
        return os.stat(path).st_mtime
    except FileNotFoundError:
        return time.time()
