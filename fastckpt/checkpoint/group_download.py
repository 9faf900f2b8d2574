"""A checkpoint downloaded by every rank of a ``torch.distributed`` process group, each byte read from storage once.

Group rank 0 reads the marker and the manifests and hands the file list to the others over the group. Each file is
fetched and verified by one rank (the files spread over the ranks by size, largest first to the rank with the fewest
bytes), then sent to the others over the group's gloo collectives a bounded chunk at a time; every receiver checks
what it got against the manifest's digest before the file takes its name. A failure on any rank (a missing object, a
digest mismatch) fails the call on every rank with the same error; a rank that dies fails the others' collectives
within the group's timeout.
"""

from __future__ import annotations

import contextlib
import heapq
import os
from dataclasses import dataclass
from typing import Any

from ..config import TransferConfig
from ..engine.partial import open_partial
from ..engine.paths import paths_below
from ..engine.progress import ProgressCallback
from ..engine.session import FileResult
from ..engine.transfer import Transfer
from ..errors import IntegrityError
from ..fileio import read_exact, write_at
from ..integrity import ChunkHasher, FileDigest, combine
from ..stores.base import Store
from ..uri import StorageURI
from .group import CHUNK, GroupCall, broadcast_span, chunk_buffer
from .reader import corrupt_error, load

__all__ = ["Planned", "download_in_group"]

Planned = tuple[str, int, int, str, int]
"""(name, size, chunk size, digest, owner rank) of one file."""


async def download_in_group(store: Store, target: StorageURI, cfg: TransferConfig, dst: str, group: Any,
                            allow_uncommitted: bool, progress: ProgressCallback | None) -> list[FileResult]:
    """``download_checkpoint_async`` with ``group=``: every rank of ``group`` calls it, and each ends with the
    whole checkpoint below its own ``dst``."""
    call = await GroupCall.of(group, f"download of checkpoint {target.raw} by its process group")
    planned, root = await call.from_root(lambda: _plan(store, target, allow_uncommitted, call.size), store)
    files: list[Planned] = [tuple(f) for f in planned]  # type: ignore[misc]
    target = target.with_key(target.join(root))  # the folder of the files (messages keep the URI as given)
    paths = dict(zip([f[0] for f in files], paths_below(dst, [f[0] for f in files]), strict=True))
    mine = [f for f in files if f[4] == call.rank]
    transfer = Transfer(store, cfg, progress)
    error = None
    try:
        await transfer.download_files([(target.join(f[0]), paths[f[0]]) for f in mine],
                                      {target.join(f[0]): FileDigest(f[1], f[2], f[3]) for f in mine if f[3]})
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
    finally:
        transfer.close()
    await call.agree(error)
    received = await call.run(lambda: _exchange(call, files, paths, cfg.download_fsync))
    await call.agree(received if isinstance(received, str) else None)
    digests: dict[str, list[bytes]] = received if isinstance(received, dict) else {}
    return [FileResult(target.join(name), paths[name],
                       FileDigest(size, chunk, digest) if name not in digests else
                       FileDigest(size, chunk, combine(digests[name])))
            for name, size, chunk, digest, _ in files]


async def _plan(store: Store, target: StorageURI, allow_uncommitted: bool, world: int) -> tuple[list[Planned], str]:
    """Rank 0: the checkpoint's files with their digests, each given an owner; the folder they lie in."""
    ckpt = await load(store, target, allow_uncommitted)
    if ckpt.problems:
        raise corrupt_error(target, ckpt)
    sizes: dict[str, FileDigest] = {}
    for name, digest in ckpt.files.items():  # an uncommitted checkpoint without manifests: the objects' own
        meta = await store.head(ckpt.file_key(name)) if digest is None else None
        sizes[name] = digest or FileDigest.from_metadata(meta.size, meta.metadata) or FileDigest(meta.size, 0, "")
    loads = [(0, r) for r in range(world)]
    planned = []
    for name in sorted(sizes, key=lambda n: (-sizes[n].size, n)):
        held, owner = heapq.heappop(loads)
        heapq.heappush(loads, (held + sizes[name].size, owner))
        digest = sizes[name]
        planned.append((name, digest.size, digest.chunk_size, digest.digest, owner))
    return sorted(planned), ckpt.root


def _exchange(call: GroupCall, files: list[Planned], paths: dict[str, str], fsync: bool
              ) -> dict[str, list[bytes]] | str:
    """On a worker thread: each file sent by its owner to every other rank, a chunk at a time; the chunk digests of
    what this rank received, or what went wrong here. A rank whose file fails it goes on taking part in every
    broadcast (an owner sending what its buffer holds, a receiver no longer writing), so no collective falls out of
    step; the caller's ``agree`` then fails every rank."""
    buffer = chunk_buffer()
    dirs: set[str] = set()
    received: dict[str, list[bytes]] = {}
    error: str | None = None
    for name, size, chunk, digest, owner in files:
        end = _End(name, ChunkHasher(chunk or CHUNK))
        tmp = ""
        try:
            if owner == call.rank:
                end.fd = os.open(paths[name], os.O_RDONLY)
            else:
                tmp, end.fd, _ = open_partial(paths[name], dirs, None)
        except OSError as exc:
            end.fail(exc)
        try:
            broadcast_span(call, owner, size, end.fill, end.take, buffer)
            if owner != call.rank and end.fd >= 0:
                got = end.hasher.finish()
                if digest and combine(got) != digest:
                    raise IntegrityError(f"digest mismatch after it came from rank {owner}")
                if fsync:
                    os.fsync(end.fd)
                end.fd = _close(end.fd)
                os.replace(tmp, paths[name])
                received[name] = got
        except OSError as exc:
            end.fail(exc)
        finally:
            _close(end.fd)
            if tmp and name not in received:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp)
        error = error or end.error
    return error if error is not None else received


@dataclass
class _End:
    """This rank's end of one file's broadcast: the file it reads (its owner) or writes (the others), the digests of
    what it wrote, and what went wrong (from then on it only takes part, so that the ranks stay in step)."""

    name: str
    hasher: ChunkHasher
    fd: int = -1
    error: str | None = None

    def fill(self, offset: int, piece: memoryview) -> None:
        if self.fd >= 0:
            try:
                read_exact(self.fd, offset, piece)
            except (OSError, EOFError) as exc:
                self.fail(exc)

    def take(self, offset: int, piece: memoryview) -> None:
        if self.fd >= 0:
            try:
                write_at(self.fd, offset, piece)
                self.hasher.update(piece)
            except OSError as exc:
                self.fail(exc)

    def fail(self, exc: BaseException) -> None:
        self.fd, self.error = _close(self.fd), self.error or f"{self.name}: {exc}"


def _close(fd: int) -> int:
    """Close ``fd`` when it is open; -1."""
    if fd >= 0:
        os.close(fd)
    return -1
