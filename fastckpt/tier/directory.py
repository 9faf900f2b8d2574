"""Where a tier keeps things, and what it keeps.

Layout of a tier directory ``T`` (one per node and user; ``/dev/shm/fastckpt`` or a local NVMe directory)::

    T/data/{scheme}/{bucket}/{key}/...        the copy of durable checkpoint {scheme}://{bucket}/{key}: a committed
                                              checkpoint of the local store (this node's ranks' files and manifests,
                                              peers' replicas, and the marker every rank agreed on)
    T/.agent/queue/{ns}-{rank}-{id}.json      one rank's copy waiting to be drained (removed once the checkpoint is
                                              committed in the durable store)
    T/.agent/handoff/{ns}-{rank}-{id}.json    one rank's save staged in the tier, locked by its process while it
                                              commits; the agent's to finish once unlocked (``handoff``)
    T/.agent/failed/{same name}               why a drain gave up (the copy is kept)
    T/.agent/copies/{id}.json                 each committed copy: its durable URI and commit time (for pruning)
    T/.agent/spare/{name}.{token}             files of dropped copies, written into by the next saves (``spare``)
    T/.agent/lock, agent.log                  held by the running agent (flock; its process id inside), its log

A copy is dropped only once no queue entry or failure record names it, and only beyond the newest ``keep``.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import time
from dataclasses import asdict, dataclass
from typing import Any

from ..checkpoint.manifest import META_DIR
from ..checkpoint.retention import Retention
from ..errors import CheckpointError
from ..fileio import write_whole
from ..stores.local import LocalStore
from ..uri import StorageURI, parse_uri
from .spare import retire, spare_files

__all__ = [
    "KEEP",
    "NO_DRAIN",
    "Drain",
    "QueueEntry",
    "Tier",
    "TierFullError",
    "TierStore",
    "checkpoint_id",
    "names_rank",
    "record_name",
]

KEEP = 1
"""Committed copies a tier keeps by default (older ones are dropped once drained, their files recycled)."""


class TierFullError(CheckpointError):
    """A save would not fit in the tier (after dropping the copies that may be dropped)."""


class TierStore(LocalStore):
    """The local store of a tier: no fsync (a tier survives the training process, not the node), and parts planned
    as the strictest object store plans them, so a drained file's chunk digests are the ones its manifest records."""

    min_part_size = 5 << 20
    max_part_size = 4000 << 20
    max_parts = 10_000

    def __init__(self) -> None:
        super().__init__("/", fsync=False)


@dataclass(frozen=True)
class Drain:
    """What a save asks of the agent beyond copying its files: ``base`` (the save's ``base=``: a committed
    checkpoint's URI, or ``"latest"``), resolved in the durable store when the agent drains, so that the store copies
    the base's unchanged bytes instead of the agent sending them; ``retention``, applied beside the durable
    checkpoint once it is committed there."""

    base: str | None = None
    retention: Retention | None = None

    @classmethod
    def from_doc(cls, doc: dict) -> Drain:
        """Read back from a record ``encode_record`` wrote (or one written before retention, with ``base`` alone)."""
        kept = doc.get("retention")
        return cls(None if doc.get("base") is None else str(doc["base"]),
                   None if kept is None else Retention(**kept))


NO_DRAIN = Drain()
"""A plain drain: every byte sent, nothing removed."""


def encode_record(record: Any) -> bytes:
    """A queue entry or hand-off record as JSON bytes, its ``drain`` fields at the top level (where records written
    before ``Drain`` kept ``base``)."""
    doc = asdict(record)
    doc.update(doc.pop("drain"))
    return json.dumps(doc).encode()


@dataclass(frozen=True)
class QueueEntry:
    """One rank's copy waiting to be drained to its durable checkpoint."""

    durable: str
    copy: str
    attempt: str
    rank: int
    keep: int
    not_before: float = 0.0
    """Epoch seconds before which the agent leaves it alone (a peer's replica: its own node drains it first)."""
    handed: bool = False
    """Finished by the agent for a process that handed it over (``handoff``): no marker in the tier unless the
    ranks committed there, so the drain commits from the durable manifests."""
    drain: Drain = NO_DRAIN

    def encode(self) -> bytes:
        """JSON bytes."""
        return encode_record(self)

    @classmethod
    def decode(cls, data: bytes, where: str) -> QueueEntry:
        """Parse a queue entry (CheckpointError naming ``where`` when it is not one)."""
        try:
            doc = json.loads(data)
            return cls(str(doc["durable"]), str(doc["copy"]), str(doc["attempt"]), int(doc["rank"]), int(doc["keep"]),
                       float(doc.get("not_before", 0.0)), bool(doc.get("handed", False)), Drain.from_doc(doc))
        except (ValueError, KeyError, TypeError) as exc:
            raise CheckpointError(f"tier queue entry {where} is malformed: {exc}") from None


def _free_bytes(root: str) -> int:
    """Bytes ``root``'s filesystem can take; on tmpfs also what memory can hold (a tmpfs may be larger than the
    memory left, and its pages are never reclaimed: past that, the kernel kills processes)."""
    free = shutil.disk_usage(root).free
    if _on_tmpfs(root):
        with open("/proc/meminfo") as f:
            info = {k: int(v.split()[0]) * 1024 for k, v in (line.split(":", 1) for line in f)}
        reserve = min(2 << 30, info.get("MemTotal", 0) // 10)
        free = min(free, info.get("MemAvailable", free) - reserve)
    return free


def _on_tmpfs(path: str) -> bool:
    """Whether ``path`` is on a tmpfs mount (Linux; False where that cannot be told)."""
    best, fstype = "", ""
    with contextlib.suppress(OSError), open("/proc/mounts") as f:
        for line in f:
            parts = line.split()
            if len(parts) > 2 and (path == parts[1] or path.startswith(parts[1].rstrip("/") + "/")) \
                    and len(parts[1]) > len(best):
                best, fstype = parts[1], parts[2]
    return fstype == "tmpfs"


def _bytes_below(path: str) -> int:
    total = 0
    for top, _, names in os.walk(path):
        for name in names:
            with contextlib.suppress(FileNotFoundError):
                total += os.lstat(os.path.join(top, name)).st_size
    return total


def checkpoint_id(durable: StorageURI) -> str:
    """A short name for durable checkpoint ``durable`` in the tier's records."""
    return hashlib.sha256(f"{durable.backend}|{durable.bucket}|{durable.key}".encode()).hexdigest()[:20]


def record_name(durable: StorageURI, rank: int) -> str:
    """A new name for a record of rank ``rank``'s copy of ``durable`` (a queue entry, a hand-off): the time first,
    so that names sort oldest first."""
    return f"{time.time_ns():020d}-{rank:05d}-{checkpoint_id(durable)}.json"


def names_rank(path: str, durable: StorageURI, rank: int) -> bool:
    """Whether record ``path`` (named by ``record_name``) is one of rank ``rank``'s copy of ``durable``."""
    return path.endswith(f"-{rank:05d}-{checkpoint_id(durable)}.json")


class Tier:
    """The tier directory ``root`` (created when missing); ``keep``: committed copies kept once drained;
    ``capacity``: bytes its copies may take in all (None: what its filesystem has free)."""

    def __init__(self, root: str | os.PathLike[str], keep: int = KEEP, capacity: int | None = None) -> None:
        if keep < 1:
            raise ValueError(f"a tier keeps at least one checkpoint, not {keep}")
        if capacity is not None and capacity < 1:
            raise ValueError(f"tier capacity must be positive, not {capacity}")
        self.root = os.path.abspath(os.fspath(root))
        self.keep, self.capacity = keep, capacity
        self.agent_dir = os.path.join(self.root, ".agent")
        """The agent's directory (queue, failures, records, lock, log)."""
        self.queue_dir = os.path.join(self.agent_dir, "queue")
        """Queue entries, one per rank's copy not yet drained."""
        self.failed_dir = os.path.join(self.agent_dir, "failed")
        """Why drains gave up."""
        self.copies_dir = os.path.join(self.agent_dir, "copies")
        """One record per committed copy."""
        for d in (self.queue_dir, self.failed_dir, self.copies_dir):
            os.makedirs(d, exist_ok=True)

    def copy_of(self, durable: str | StorageURI) -> StorageURI:
        """Where this tier keeps its copy of durable checkpoint ``durable`` (a local path)."""
        uri = parse_uri(durable) if not isinstance(durable, StorageURI) else durable
        path = os.path.join(self.root, "data", uri.scheme, uri.bucket or "_", *uri.key.split("/"))
        return parse_uri(path)

    def used(self) -> int:
        """Bytes the tier's copies take (spare files not counted)."""
        return _bytes_below(os.path.join(self.root, "data"))

    def check_room(self, sizes: list[int]) -> None:
        """Make room for files of ``sizes`` bytes (dropping drained copies beyond the newest ``keep``, then spare
        files no file of the save fits in, if need be), or TierFullError: a save that does not fit (in the filesystem,
        in ``capacity``, and on tmpfs in the memory left) is refused, and an undrained copy is never dropped."""
        self.prune(self.keep)
        spare = sorted(spare_files(self.root), key=lambda ps: ps[1])
        fresh = 0
        for size in sorted(sizes, reverse=True):  # the spare files the save will write into, as ``claim`` picks
            fit = next((ps for ps in spare if ps[1] >= size), None)
            if fit is None:
                fresh += size
            else:
                spare.remove(fit)
        nbytes, free, data = sum(sizes), _free_bytes(self.root), self.used()
        unused = sum(size for _, size in spare)
        if fresh > free or (self.capacity is not None and data + nbytes + unused > self.capacity):
            for path, size in spare:  # no file of this save fits in these
                with contextlib.suppress(FileNotFoundError):
                    os.remove(path)
                    free += size
        room = free if self.capacity is None else min(free, self.capacity - data)
        if fresh > free or (self.capacity is not None and nbytes > self.capacity - data):
            raise TierFullError(f"tier {self.root} has room for {max(room, 0)} more bytes, the save needs {nbytes}: "
                                f"raise its capacity, lower keep= (now {self.keep}), or let the agent drain older "
                                "copies")

    def enqueue(self, durable: StorageURI, attempt: str, rank: int, committed_at: float, delay: float = 0.0,
                handed: bool = False, drain: Drain = NO_DRAIN) -> None:
        """Record rank ``rank``'s committed copy of ``durable`` and queue it for the agent (after ``delay`` seconds:
        a peer's replica, drained here only if its own node has not committed the checkpoint by then; ``handed``,
        ``drain``: see ``QueueEntry``)."""
        copy = self.copy_of(durable)
        cid = checkpoint_id(durable)
        record = {"durable": durable.uri(), "copy": "/" + copy.key, "attempt": attempt, "committed_at": committed_at}
        write_whole(os.path.join(self.copies_dir, f"{cid}.json"), json.dumps(record).encode())
        entry = QueueEntry(durable.uri(), "/" + copy.key, attempt, rank, self.keep, time.time() + delay, handed, drain)
        write_whole(os.path.join(self.queue_dir, record_name(durable, rank)), entry.encode())

    def supersede(self, durable: StorageURI) -> bool:
        """Before a save of ``durable`` writes here: drop this node's copy of it when an earlier run committed it here
        and it never reached the durable store (still queued, or its drain gave up), since a tier is a cache of the
        durable store: its queue entries and failure records go, its files become spare files, and the new attempt
        writes it afresh. True when there was one. A copy drained (committed in the durable store) stays, and the
        save is refused as before. Under a lock, so that of several ranks on the node one drops it before any of
        them writes the new copy."""
        copy = "/" + self.copy_of(durable).key
        cid = checkpoint_id(durable)
        fd = os.open(os.path.join(self.agent_dir, "supersede.lock"), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            if not os.path.exists(os.path.join(copy, META_DIR, "COMMITTED")):
                return False
            records = [os.path.join(folder, name) for folder in (self.queue_dir, self.failed_dir)
                       for name in os.listdir(folder) if name.endswith(f"-{cid}.json")]
            if not records:
                return False
            for path in records:
                with contextlib.suppress(FileNotFoundError):
                    os.remove(path)
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(self.copies_dir, f"{cid}.json"))
            trash = os.path.join(self.agent_dir, f"superseded-{time.time_ns()}")
            os.rename(copy, trash)
            retire(self.root, trash, _bytes_below(trash))
            return True
        finally:
            os.close(fd)

    def pending(self) -> list[str]:
        """Queue entry paths, oldest first."""
        with contextlib.suppress(FileNotFoundError):
            return [os.path.join(self.queue_dir, n) for n in sorted(os.listdir(self.queue_dir)) if n.endswith(".json")]
        return []

    def queued(self, durable: StorageURI, rank: int) -> bool:
        """Whether rank ``rank``'s copy of ``durable`` is still queued (its checkpoint not yet committed there)."""
        return any(names_rank(p, durable, rank) for p in self.pending())

    def entry(self, path: str) -> QueueEntry:
        """The queue entry at ``path`` (FileNotFoundError once taken off the queue)."""
        with open(path, "rb") as f:
            return QueueEntry.decode(f.read(), path)

    def failures(self) -> list[dict[str, object]]:
        """The records of the drains that gave up."""
        out = []
        for name in sorted(os.listdir(self.failed_dir)):
            with contextlib.suppress(OSError, ValueError), open(os.path.join(self.failed_dir, name)) as f:
                out.append(json.load(f))
        return out

    def failure(self, durable: StorageURI, attempt: str) -> str | None:
        """Why the agent gave up draining ``durable``'s copy of ``attempt`` (None: it has not)."""
        copy = "/" + self.copy_of(durable).key
        return next((str(doc.get("error")) for doc in self.failures()
                     if doc.get("attempt") == attempt and self._copy_named(doc) == copy), None)

    def record_failure(self, entry_path: str, entry: QueueEntry | None, error: BaseException) -> None:
        """The drain of ``entry`` (None: unreadable) gave up: say why, and take it off the queue (the copy stays)."""
        doc: dict[str, object] = {"error": f"{type(error).__name__}: {error}"}
        if entry is not None:
            doc.update(durable=entry.durable, attempt=entry.attempt, rank=entry.rank)
        write_whole(os.path.join(self.failed_dir, os.path.basename(entry_path)), json.dumps(doc).encode())
        with contextlib.suppress(FileNotFoundError):
            os.remove(entry_path)

    def copies(self) -> list[dict[str, object]]:
        """The records of the committed copies, newest first."""
        out = []
        for name in os.listdir(self.copies_dir):
            with contextlib.suppress(OSError, ValueError):
                with open(os.path.join(self.copies_dir, name)) as f:
                    doc = json.load(f)
                doc["record"] = os.path.join(self.copies_dir, name)
                out.append(doc)
        return sorted(out, key=lambda d: float(d.get("committed_at", 0)), reverse=True)  # type: ignore[arg-type]

    def undrained(self) -> set[str]:
        """Copies (paths) that some queue entry still names."""
        out = set()
        for path in self.pending():
            with contextlib.suppress(OSError, CheckpointError):
                out.add(self.entry(path).copy)
        return out

    def prune(self, keep: int) -> list[str]:
        """Drop drained copies beyond the newest ``keep`` (a copy still queued, or whose drain failed, stays);
        returns the copies dropped."""
        undrained = self.undrained() | self._failed_copies()
        copies = self.copies()
        cap = _bytes_below(str(copies[0]["copy"])) if copies else 0
        dropped = []
        for doc in copies[keep:]:
            copy = str(doc["copy"])
            if copy in undrained:
                continue
            retire(self.root, copy, cap)
            with contextlib.suppress(FileNotFoundError):
                os.remove(str(doc["record"]))
            dropped.append(copy)
        return dropped

    def _failed_copies(self) -> set[str]:
        return {copy for doc in self.failures() if (copy := self._copy_named(doc)) is not None}

    def _copy_named(self, record: dict[str, object]) -> str | None:
        """The copy (path) a failure record names (None: an unreadable entry's record names none)."""
        durable = record.get("durable")
        return "/" + self.copy_of(str(durable)).key if durable else None
