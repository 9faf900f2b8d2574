"""A checkpoint downloaded by every rank of a ``torch.distributed`` process group, each byte read from storage once.

Group rank 0 reads the marker and the manifests and hands the file list to the others over the group. Each file is
fetched and verified by one rank (the files spread over the ranks by size, largest first to the rank with the fewest
bytes), then sent to the others over the group's gloo collectives a bounded chunk at a time; every receiver checks
what it got against the manifest's digest before the file takes its name. A failure on any rank (a missing object, a
digest mismatch) fails the call on every rank with the same error; a rank that dies fails the others' collectives
within the group's timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import os
from typing import Any

import torch
import torch.distributed as dist

from ..config import TransferConfig
from ..engine.partial import open_partial
from ..engine.paths import paths_below
from ..engine.progress import ProgressCallback
from ..engine.session import FileResult
from ..engine.transfer import Transfer
from ..errors import CheckpointError, IntegrityError
from ..fileio import read_exact, write_at
from ..integrity import ChunkHasher, FileDigest, combine
from ..stores.base import Store
from ..uri import StorageURI
from .barrier_torch import gloo_group
from .reader import corrupt_error, load

CHUNK = 16 << 20
"""Bytes sent over the group at once: each rank holds one such buffer, whatever the checkpoint's size."""

Planned = tuple[str, int, int, str, int]
"""(name, size, chunk size, digest, owner rank) of one file."""


async def download_in_group(store: Store, base: StorageURI, cfg: TransferConfig, dst: str, group: Any,
                            allow_uncommitted: bool, progress: ProgressCallback | None) -> list[FileResult]:
    """``download_checkpoint_async`` with ``group=``: every rank of ``group`` calls it, and each ends with the
    whole checkpoint below its own ``dst``."""
    gloo = await asyncio.to_thread(gloo_group, group)
    rank, world = dist.get_rank(gloo), dist.get_world_size(gloo)
    plan: dict[str, Any] = {}
    if rank == 0:
        try:
            plan = {"files": await _plan(store, base, allow_uncommitted, world)}
        except Exception as exc:  # every rank raises it, once they have it
            plan = {"error": f"{type(exc).__name__}: {exc}"}
    plan = await _collective(gloo, rank, base, lambda: _broadcast(plan, gloo))
    if "error" in plan:
        raise CheckpointError(f"download of checkpoint {base.raw} by its process group failed on rank 0: "
                              f"{plan['error']}")
    files: list[Planned] = [tuple(f) for f in plan["files"]]  # type: ignore[misc]
    paths = dict(zip([f[0] for f in files], paths_below(dst, [f[0] for f in files]), strict=True))
    mine = [f for f in files if f[4] == rank]
    transfer = Transfer(store, cfg, progress)
    error = None
    try:
        await transfer.download_files([(base.join(f[0]), paths[f[0]]) for f in mine],
                                      {base.join(f[0]): FileDigest(f[1], f[2], f[3]) for f in mine if f[3]})
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
    finally:
        transfer.close()
    await _agree(gloo, rank, base, error)
    received = await _collective(gloo, rank, base, lambda: _exchange(gloo, rank, files, paths, cfg.fsync))
    await _agree(gloo, rank, base, received if isinstance(received, str) else None)
    digests: dict[str, list[bytes]] = received if isinstance(received, dict) else {}
    return [FileResult(base.join(name), paths[name],
                       FileDigest(size, chunk, digest) if name not in digests else
                       FileDigest(size, chunk, combine(digests[name])))
            for name, size, chunk, digest, _ in files]


async def _plan(store: Store, base: StorageURI, allow_uncommitted: bool, world: int) -> list[Planned]:
    """Rank 0: the checkpoint's files with their digests, each given an owner."""
    ckpt = await load(store, base, allow_uncommitted)
    if ckpt.problems:
        raise corrupt_error(base, ckpt)
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
    return sorted(planned)


def _broadcast(value: dict[str, Any], gloo: Any) -> dict[str, Any]:
    box = [value]
    dist.broadcast_object_list(box, src=dist.get_global_rank(gloo, 0), group=gloo)
    return box[0]


async def _collective(gloo: Any, rank: int, base: StorageURI, run: Any) -> Any:
    """``run()`` (blocking collectives) on a worker thread; a broken group as a CheckpointError."""
    try:
        return await asyncio.to_thread(run)
    except RuntimeError as exc:  # a rank died or timed out: the collective itself failed
        raise CheckpointError(f"download of checkpoint {base.raw} by its process group failed: rank {rank} lost "
                              f"the group ({' '.join(str(exc).split())[:300]})") from exc


async def _agree(gloo: Any, rank: int, base: StorageURI, error: str | None) -> None:
    """Every rank tells the others how its part went; the first failure is raised on every rank."""
    errors: list[str | None] = [None] * dist.get_world_size(gloo)
    await _collective(gloo, rank, base, lambda: dist.all_gather_object(errors, error, group=gloo))
    failed = next(((r, e) for r, e in enumerate(errors) if e), None)
    if failed is not None:
        raise CheckpointError(f"download of checkpoint {base.raw} by its process group failed on rank {failed[0]}: "
                              f"{failed[1]}")


def _exchange(gloo: Any, rank: int, files: list[Planned], paths: dict[str, str], fsync: bool
              ) -> dict[str, list[bytes]] | str:
    """On a worker thread: each file sent by its owner to every other rank, a chunk at a time; the chunk digests of
    what this rank received, or what went wrong here (the rank goes on taking part, so no collective hangs)."""
    buf = bytearray(CHUNK)
    view, tensor = memoryview(buf), torch.frombuffer(buf, dtype=torch.uint8)
    dirs: set[str] = set()
    received: dict[str, list[bytes]] = {}
    error: str | None = None
    for name, size, chunk, digest, owner in files:
        path, mine = paths[name], owner == rank
        fd, tmp, hasher = -1, "", ChunkHasher(chunk or CHUNK)
        try:
            if mine:
                fd = os.open(path, os.O_RDONLY)
            else:
                tmp, fd, _ = open_partial(path, dirs, None)
        except OSError as exc:
            error = error or f"{name}: {exc}"
        try:
            for offset in range(0, size, CHUNK):
                piece = view[:min(CHUNK, size - offset)]
                if mine and fd >= 0:
                    read_exact(fd, offset, piece)
                dist.broadcast(tensor[:len(piece)], src=dist.get_global_rank(gloo, owner), group=gloo)
                if not mine and fd >= 0:
                    write_at(fd, offset, piece)
                    hasher.update(piece)
            if not mine and fd >= 0:
                got = hasher.finish()
                if digest and combine(got) != digest:
                    raise IntegrityError(f"{name}: digest mismatch after it came from rank {owner}")
                if fsync:
                    os.fsync(fd)
                os.close(fd)
                fd = -1
                os.replace(tmp, path)
                received[name] = got
        except (OSError, EOFError) as exc:
            error = error or f"{name}: {exc}"
        finally:
            if fd >= 0:
                os.close(fd)
            if tmp and name not in received:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp)
    return error if error is not None else received
