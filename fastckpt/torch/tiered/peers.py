"""Peer replicas of tier copies: with ``replicas=1`` each rank's committed tier copy also goes, over the job's gloo
group, into the tier of the rank one node over (``LOCAL_WORLD_SIZE`` ranks on; 1 when unset), whose agent drains it
if the rank's own node has not committed the checkpoint ``FASTCKPT_REPLICA_GRACE`` seconds later; ``restore_tier``
brings a lost node's copies back from its peers, so its ranks restore from memory, not from the bucket.

A copy travels as a header (the rank, its manifest, the marker, its files' names and sizes) then each file's bytes,
received straight into files of the receiving tier (``tier.spare``); the receiver checks the manifest against the
marker and every chunk against the manifest before the files take their names.
"""

from __future__ import annotations

import json
import logging
import os
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ...checkpoint.barrier import Barrier
from ...checkpoint.barrier_torch import TorchBarrier, gloo_group
from ...checkpoint.manifest import CommitMarker, RankManifest, digest_of, marker_key, meta_prefix, rank_key
from ...config import env_count, env_seconds
from ...errors import CheckpointError, IntegrityError, ObjectNotFoundError
from ...fileio import write_whole
from ...integrity import hash_chunks
from ...tier import Tier, TierFullError, held_files
from ...tier.spare import claim
from ...uri import StorageURI, parse_uri
from .staging import mapped

__all__ = ["REPLICA_GRACE_S", "TIMEOUT", "held_ranks", "ranks_per_node", "replica_group", "replicate", "restore_tier"]

log = logging.getLogger("fastckpt")

TIMEOUT = timedelta(seconds=600)
"""Longest wait for one transfer between peers."""
REPLICA_GRACE_S = 60.0
"""Seconds a peer's agent leaves a replica to its own node's agent before draining it itself (then it finds the
checkpoint committed, one read, or the other node lost and drains the replica)."""


def ranks_per_node() -> int:
    """Ranks on each node (``LOCAL_WORLD_SIZE``, as torchrun sets it; 1 when unset)."""
    return env_count("LOCAL_WORLD_SIZE", 1)


def replica_group(barrier: Barrier | None) -> Any:
    """The gloo group replicas travel on: the commit barrier's (a ``TorchBarrier``)."""
    if not isinstance(barrier, TorchBarrier):
        raise ValueError("replicas= needs the commit to run through torch.distributed (a TorchBarrier, the default "
                         "when the process group is initialised)")
    return barrier.gloo()


def _read(path: str) -> bytes | None:
    try:
        with open(path, "rb") as f:
            return f.read()
    except FileNotFoundError:
        return None


def held_ranks(tier: Tier, durable: StorageURI) -> tuple[bytes | None, dict[int, bytes]]:
    """The tier's copy of ``durable``: its marker, and the manifests of the ranks whose files it holds whole."""
    copy = tier.copy_of(durable)
    raw = _read("/" + marker_key(copy.key))
    if raw is None:
        return None, {}
    marker = CommitMarker.decode(raw, copy.raw)
    held = {}
    for rank, want in enumerate(marker.manifests):
        data = _read("/" + rank_key(meta_prefix(copy.key), marker.attempt, rank))
        if data is None or digest_of(data) != want:
            continue
        files = {f.name: f.digest for f in RankManifest.decode(data, copy.raw).files}
        if len(held_files(files, copy)) == len(files):
            held[rank] = data
    return raw, held


def _outgoing(tier: Tier, durable: StorageURI, rank: int) -> tuple[bytes, list[tuple[str, int]]]:
    """The header of stored rank ``rank``'s copy in ``tier`` (its manifest, the marker, its files) and its files."""
    copy = tier.copy_of(durable)
    marker, held = held_ranks(tier, durable)
    if marker is None or rank not in held:
        raise ObjectNotFoundError(f"tier {tier.root} holds no committed copy of rank {rank} of {durable.raw}")
    files = [(f.name, f.digest.size) for f in RankManifest.decode(held[rank], copy.raw).files]
    return json.dumps({"rank": rank, "manifest": held[rank].decode(), "marker": marker.decode(),
                       "files": files}).encode(), files


def _send_header(group: Any, dst: int, header: bytes) -> list[Any]:
    size = torch.tensor([len(header)], dtype=torch.int64)
    return [dist.isend(size, dst, group=group), dist.isend(torch.frombuffer(bytearray(header), dtype=torch.uint8),
                                                           dst, group=group)]


def _recv_header(group: Any, src: int) -> dict[str, Any]:
    size = torch.zeros(1, dtype=torch.int64)
    dist.irecv(size, src, group=group).wait(TIMEOUT)
    raw = torch.zeros(int(size.item()), dtype=torch.uint8)
    dist.irecv(raw, src, group=group).wait(TIMEOUT)
    return dict(json.loads(bytes(raw.numpy())))


def _accepts(tier: Tier, header: dict[str, Any]) -> bool:
    """Whether ``tier`` has room for the copy ``header`` announces (else the copy is not sent: logged, not fatal)."""
    try:
        tier.check_room([int(n) for _, n in header["files"]])
    except TierFullError as exc:
        log.warning("no room for the copy of rank %s in tier %s: %s", header["rank"], tier.root, exc)
        return False
    return True


def _answer(group: Any, peer: int, yes: bool) -> Any:
    return dist.isend(torch.tensor([int(yes)], dtype=torch.int64), peer, group=group)


def _answered(group: Any, peer: int) -> bool:
    flag = torch.zeros(1, dtype=torch.int64)
    dist.irecv(flag, peer, group=group).wait(TIMEOUT)
    return bool(flag.item())


def _send_files(group: Any, dst: int, tier: Tier, durable: StorageURI, files: list[tuple[str, int]]) -> list[Any]:
    copy = tier.copy_of(durable)
    return [dist.isend(mapped("/" + copy.join(name), n), dst, group=group) for name, n in files if n]


def _recv_files(group: Any, src: int, tier: Tier, durable: StorageURI, header: dict[str, Any]) -> int:
    """Receive the files ``header`` announces from group rank ``src`` into ``tier``, checked; the stored rank."""
    rank, manifest, marker_raw = int(header["rank"]), header["manifest"].encode(), header["marker"].encode()
    marker = CommitMarker.decode(marker_raw, f"marker from rank {src}")
    if rank >= marker.world_size or digest_of(manifest) != marker.manifests[rank]:
        raise IntegrityError(f"the copy of rank {rank} from rank {src}: its manifest is not the one its marker names")
    entries = {f.name: f for f in RankManifest.decode(manifest, f"manifest from rank {src}").files}
    copy = tier.copy_of(durable)
    landed: list[tuple[str, str, torch.Tensor]] = []
    try:
        for name, n in header["files"]:
            tmp = claim(tier.root, "/" + copy.join(name), int(n))
            landed.append((name, tmp, mapped(tmp, int(n)) if n else torch.empty(0, dtype=torch.uint8)))
        for _, _, area in landed:
            if area.numel():
                dist.irecv(area, src, group=group).wait(TIMEOUT)
        for name, _, area in landed:
            entry = entries[name]
            got = hash_chunks(memoryview(area.numpy()), entry.digest.chunk_size) if area.numel() else []
            if tuple(d.hex() for d in got) != entry.chunks:
                raise IntegrityError(f"the copy of {name} from rank {src} does not match its manifest")
        for name, tmp, _ in landed:
            os.replace(tmp, "/" + copy.join(name))
    finally:
        for _, tmp, _ in landed:
            if os.path.exists(tmp):
                os.remove(tmp)
    write_whole("/" + rank_key(meta_prefix(copy.key), marker.attempt, rank), manifest)
    if not os.path.exists("/" + marker_key(copy.key)):
        write_whole("/" + marker_key(copy.key), marker_raw)
    return rank


def replicate(group: Any, tier: Tier, durable: StorageURI, rank: int, world_size: int) -> int | None:
    """Every rank: send this rank's committed tier copy to the rank one node over and receive the copy of the rank
    one node back (queued for this node's agent, after ``REPLICA_GRACE_S``), each only where the receiving tier has
    room; the stored rank received (None: none, or one node)."""
    step = ranks_per_node()
    if world_size <= step:
        return None
    dst, src = (rank + step) % world_size, (rank - step) % world_size
    header, files = _outgoing(tier, durable, rank)
    works = _send_header(group, dst, header)
    incoming = _recv_header(group, src)
    accept = _accepts(tier, incoming)
    works.append(_answer(group, src, accept))
    if _answered(group, dst):
        works += _send_files(group, dst, tier, durable, files)
    got = _recv_files(group, src, tier, durable, incoming) if accept else None
    for work in works:
        work.wait(TIMEOUT)
    if got is not None:
        marker = CommitMarker.decode(incoming["marker"].encode(), durable.raw)
        tier.enqueue(durable, marker.attempt, got, marker.committed_at,
                     env_seconds("FASTCKPT_REPLICA_GRACE", REPLICA_GRACE_S))
    return got


def restore_tier(uri: str | StorageURI, tier: str | os.PathLike[str] | Tier, *, group: Any = None) -> list[int]:
    """Every rank of ``group`` (default: the world) calls this after a restart: each rank whose node's tier lacks its
    own rank's copy of committed checkpoint ``uri`` receives it from a rank whose tier holds it (a peer replica, see
    ``async_save(replicas=)``), so that ``load(uri, tier=...)`` then reads it from memory. Returns the stored ranks
    this rank received. A rank no peer holds, or whose tier has no room, is left to the bucket."""
    durable = parse_uri(uri) if not isinstance(uri, StorageURI) else uri
    local = tier if isinstance(tier, Tier) else Tier(tier)
    g = gloo_group(group)
    me, world = dist.get_rank(g), dist.get_world_size(g)
    marker, held = held_ranks(local, durable)
    views: list[Any] = [None] * world
    dist.all_gather_object(views, {"marker": digest_of(marker) if marker else None, "held": sorted(held)}, group=g)
    markers = {v["marker"] for v in views if v["marker"]}
    if len(markers) > 1:
        raise CheckpointError(f"the ranks' tiers hold copies of different attempts of {durable.raw}; not restored")
    plan = [(k, next(h for h, v in enumerate(views) if k in v["held"])) for k in range(world)
            if k not in views[k]["held"] and any(k in v["held"] for v in views)]
    received = []
    for k, holder in plan:  # one transfer at a time, in the same order on every rank
        if me == holder:
            header, files = _outgoing(local, durable, k)
            works = _send_header(g, k, header)
            if _answered(g, k):
                works += _send_files(g, k, local, durable, files)
            for work in works:
                work.wait(TIMEOUT)
        elif me == k:
            incoming = _recv_header(g, holder)
            accept = _accepts(local, incoming)
            _answer(g, holder, accept).wait(TIMEOUT)
            if accept:
                received.append(_recv_files(g, holder, local, durable, incoming))
    return received
