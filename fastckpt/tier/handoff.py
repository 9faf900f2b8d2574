"""A rank's save handed to the node agent as soon as its bytes are in the tier: the save is safe from then on.

Hashing the bytes and committing them in the tier with the other ranks takes a while after the copy; a trainer that
dies meanwhile must not lose the save. So the saving process first writes a record of what it staged (the files, their
partial and final names, the attempt) to ``.agent/handoff/`` and holds a POSIX lock on it while it commits. A commit
that completes queues the copy as usual and removes the record. A record nobody holds any more (the process died, or
its commit failed) is the agent's: it hashes and publishes what the process had not, writes the rank's manifest
(``finish``), and queues the copy as handed. Such a copy has no marker in its tier when the other ranks never agreed
there, so its drain commits from the durable manifests once every rank's are in (``drain.commit_if_complete``).

POSIX locks belong to the process (a child forked by the trainer does not keep one alive) and go with any descriptor
of the file it closes: a process opens each record once.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import json
import mmap
import os
import secrets
import time
from dataclasses import dataclass

from ..checkpoint.documents import read_object
from ..checkpoint.manifest import CommitMarker, FileEntry, RankManifest, marker_key, meta_prefix, rank_key
from ..config import TransferConfig
from ..engine.layout import Layout, hash_layout
from ..engine.plan import plan_upload
from ..errors import AlreadyExistsError, CheckpointError, ObjectNotFoundError
from ..integrity import FileDigest, combine
from ..threads import off_loop
from ..uri import StorageURI, parse_uri
from .directory import NO_DRAIN, Drain, Tier, TierStore, encode_record, names_rank, record_name

__all__ = ["Handoff", "Held", "StagedFile", "drop_stale_temporaries", "finish", "hand_off", "handed", "handoff_dir",
           "handoffs", "hashed_entry", "part_size", "take_orphan"]


def part_size(size: int, config: TransferConfig) -> int:
    """The part size a tier file of ``size`` bytes is hashed in (the one its drain uploads in)."""
    return plan_upload(size, config, TierStore()).part_size


async def hashed_entry(name: str, view: memoryview, part: int) -> FileEntry:
    """The manifest entry of file ``name`` holding ``view``, hashed in parts of ``part`` bytes."""
    chunks = await hash_layout(Layout([view]), part)
    return FileEntry(name, FileDigest(len(view), part, combine(chunks)), tuple(c.hex() for c in chunks))


@dataclass(frozen=True)
class StagedFile:
    """One file of a handed save: written under ``tmp`` and published as ``final`` (paths), hashed in ``part``."""

    name: str
    tmp: str
    final: str
    size: int
    part: int


@dataclass(frozen=True)
class Handoff:
    """What a rank staged in its tier for durable checkpoint ``durable``, for the agent to finish."""

    durable: str
    copy: str
    attempt: str
    rank: int
    world_size: int
    keep: int
    files: tuple[StagedFile, ...]
    drain: Drain = NO_DRAIN

    def encode(self) -> bytes:
        """JSON bytes."""
        return encode_record(self)

    @classmethod
    def decode(cls, data: bytes, where: str) -> Handoff:
        """Parse a record (CheckpointError naming ``where`` when it is not one)."""
        try:
            doc = json.loads(data)
            files = tuple(StagedFile(str(f["name"]), str(f["tmp"]), str(f["final"]), int(f["size"]), int(f["part"]))
                          for f in doc["files"])
            return cls(str(doc["durable"]), str(doc["copy"]), str(doc["attempt"]), int(doc["rank"]),
                       int(doc["world_size"]), int(doc["keep"]), files, Drain.from_doc(doc))
        except (ValueError, KeyError, TypeError) as exc:
            raise CheckpointError(f"tier hand-off record {where} is malformed: {exc}") from None


def handoff_dir(tier: Tier) -> str:
    """Where ``tier`` keeps the records of saves handed to its agent."""
    return os.path.join(tier.agent_dir, "handoff")


class Held:
    """A record this process holds locked: ``done()`` once the save is queued (the record goes), ``release()`` to
    leave it to the agent."""

    def __init__(self, path: str, fd: int) -> None:
        self.path, self._fd = path, fd

    def done(self) -> None:
        """The save is queued as usual: remove the record, then let go of it."""
        with contextlib.suppress(FileNotFoundError):
            os.remove(self.path)
        self.release()

    def read(self) -> Handoff:
        """The record (read through the held descriptor: opening the file again would risk the lock)."""
        return Handoff.decode(os.pread(self._fd, os.fstat(self._fd).st_size, 0), self.path)

    def release(self) -> None:
        """Let go of the record (the agent takes it over when it is still there)."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def hand_off(tier: Tier, handoff: Handoff) -> Held:
    """Write ``handoff`` into ``tier``'s records, locked by this process until ``done()`` or ``release()`` (or its
    death). The record appears under its name already locked."""
    durable = parse_uri(handoff.durable)
    path = os.path.join(handoff_dir(tier), record_name(durable, handoff.rank))
    os.makedirs(handoff_dir(tier), exist_ok=True)
    tmp = f"{path}.{secrets.token_hex(4)}.tmp"
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, handoff.encode())
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.rename(tmp, path)
    except BaseException:
        os.close(fd)
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)
        raise
    return Held(path, fd)


def handed(tier: Tier, durable: StorageURI, rank: int) -> bool:
    """Whether a record of rank ``rank``'s save of ``durable`` is there (held by its process, or not yet finished
    by the agent)."""
    return any(names_rank(p, durable, rank) for p in handoffs(tier))


def handoffs(tier: Tier) -> list[str]:
    """Record paths, oldest first (held or not)."""
    with contextlib.suppress(FileNotFoundError):
        return [os.path.join(handoff_dir(tier), n) for n in sorted(os.listdir(handoff_dir(tier)))
                if n.endswith(".json")]
    return []


def take_orphan(path: str) -> Held | None:
    """Record ``path`` locked by this process when no other holds it and it is still there, else None. Call it once
    per record and process (a second descriptor of the file would drop the lock when closed)."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        if os.fstat(fd).st_nlink == 0:  # done meanwhile
            raise FileNotFoundError(path)
    except (BlockingIOError, PermissionError, FileNotFoundError):
        os.close(fd)
        return None
    return Held(path, fd)


def drop_stale_temporaries(tier: Tier, older_than: float = 60.0) -> None:
    """Remove records a process died writing (their temporary names, unlocked, older than ``older_than`` seconds)."""
    with contextlib.suppress(FileNotFoundError):
        for name in os.listdir(handoff_dir(tier)):
            path = os.path.join(handoff_dir(tier), name)
            with contextlib.suppress(FileNotFoundError):
                if name.endswith(".tmp") and time.time() - os.stat(path).st_mtime > older_than:
                    held = take_orphan(path)
                    if held is not None:
                        held.done()


async def finish(tier: Tier, handoff: Handoff) -> None:
    """Finish a save its process handed over and left: hash and publish the files it had not published, write its
    manifest where it had not, and queue the copy (as handed, unless the ranks did commit it in the tier)."""
    copy, durable, local = parse_uri(handoff.copy), parse_uri(handoff.durable), TierStore()
    try:
        found = CommitMarker.decode(await read_object(local, marker_key(copy.key)), marker_key(copy.key))
    except ObjectNotFoundError:
        found = None
    if found is not None and found.attempt != handoff.attempt:
        raise CheckpointError(f"tier copy {copy.raw} holds attempt {found.attempt!r}, not {handoff.attempt!r}")
    mkey = rank_key(meta_prefix(copy.key), handoff.attempt, handoff.rank)
    if found is None:
        try:
            await read_object(local, mkey)
        except ObjectNotFoundError:  # the process died before writing it: nothing can name this rank's files yet
            entries = [await _publish(f) for f in handoff.files]
            manifest = RankManifest(handoff.attempt, handoff.rank, handoff.world_size,
                                    tuple(sorted(entries, key=lambda e: e.name)))
            with contextlib.suppress(AlreadyExistsError):
                await local.put(mkey, manifest.encode(), if_absent=True)
    if not await off_loop(tier.queued, durable, handoff.rank):
        ranks = Tier(tier.root, keep=handoff.keep, capacity=tier.capacity)  # the saver's keep
        await off_loop(functools.partial(ranks.enqueue, durable, handoff.attempt, handoff.rank, time.time(),
                                         handed=found is None, drain=handoff.drain))


async def _publish(f: StagedFile) -> FileEntry:
    """File ``f`` hashed where it is (its partial name, or its final one when its process published it) and
    published under its final name."""
    path = f.tmp if os.path.exists(f.tmp) else f.final
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        raise CheckpointError(f"tier file {f.final} of a handed save is gone") from None
    try:
        if os.fstat(fd).st_size < f.size:
            raise CheckpointError(f"tier file {path} holds {os.fstat(fd).st_size} bytes, the save staged {f.size}")
        data = mmap.mmap(fd, f.size, prot=mmap.PROT_READ) if f.size else b""  # unmapped once its views are gone
        entry = await hashed_entry(f.name, memoryview(data), f.part)
    finally:
        os.close(fd)
    if path == f.tmp:
        await off_loop(os.replace, f.tmp, f.final)
    return entry
