"""Loading tensor state: parallel ranged reads straight into the destination tensors, verified."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from .. import stats
from .._loop import BackgroundLoop
from ..checkpoint.reader import Checkpoint, open_checkpoint_async
from ..config import TransferConfig
from ..engine.layout import Layout, read_layout
from ..engine.open_stores import store_for
from ..engine.transfer import Transfer
from ..errors import CheckpointError, IntegrityError, ObjectNotFoundError
from ..integrity import FileDigest
from ..stores.base import Store
from ..threads import off_loop
from ..tier import Tier, nearest_copy
from ..tier.directory import TierStore
from ..tier.nearest import tier_or_group
from ..uri import StorageURI, parse_uri
from .format import Header, TensorEntry, flatten, header_length, parse_header, state_of
from .save import rank_file
from .staging import Staging, byte_view, synchronize

__all__ = ["HEAD_READ", "StoredFile", "Target", "check_given", "destinations", "file_layout", "header_bytes", "load",
           "load_async", "load_file", "rank_entry", "state_files"]

log = logging.getLogger("fastckpt")

HEAD_READ = 64 << 10
"""Bytes read first to find the header (one more request when the header is longer)."""


@dataclass(frozen=True)
class StoredFile:
    """One tensor file to load: its key in the store, its digest, the chunk digests its checkpoint's manifest
    records (None where there is none), and how errors name it."""

    key: str
    digest: FileDigest
    chunks: tuple[str, ...] | None
    what: str


@dataclass
class Target:
    """Where one stored tensor goes: ``tensor`` itself, or (when it is not contiguous) ``bounce``, then copied
    into it."""

    entry: TensorEntry
    tensor: torch.Tensor
    bounce: torch.Tensor | None = None

    @property
    def dest(self) -> torch.Tensor:
        """The contiguous tensor the bytes are written into."""
        return self.bounce if self.bounce is not None else self.tensor


def load(uri: str | StorageURI, *, state_dict: Any = None, device: str | torch.device | None = None,
         rank: int | None = None, world_size: int | None = None, config: TransferConfig | None = None,
         staging: Staging | None = None, group: Any = None, tier: str | os.PathLike[str] | Tier | None = None) -> Any:
    """Load rank ``rank``'s state from committed checkpoint ``uri``; see ``load_async``."""
    return BackgroundLoop.get().run(load_async(uri, state_dict=state_dict, device=device, rank=rank,
                                               world_size=world_size, config=config, staging=staging, group=group,
                                               tier=tier))


@stats.summarized("load")
async def load_async(uri: str | StorageURI, *, state_dict: Any = None, device: str | torch.device | None = None,
                     rank: int | None = None, world_size: int | None = None, config: TransferConfig | None = None,
                     staging: Staging | None = None, group: Any = None,
                     tier: str | os.PathLike[str] | Tier | None = None) -> Any:
    """The state rank ``rank`` saved to checkpoint ``uri`` (committed only), every byte verified against the
    manifest (IntegrityError on a mismatch).

    With ``state_dict``, each of its tensors is filled in place from the stored tensor of the same key path
    (shape and dtype must match) and is what the result holds; other tensors are created on ``device``
    (default CPU). CPU tensors receive their bytes straight from the network or file; tensors on a device
    go through ``staging`` (default: a 256 MiB pinned area), window by window, copied ``non_blocking``.
    Passing ``staging`` sends CPU tensors through it too. ``rank`` may be left out for a one-rank checkpoint.

    With ``group`` (a ``torch.distributed`` process group; every rank of it calls this, each naming the stored rank
    it loads), each byte is read from storage once for the whole group and shared over it
    (``torch.group_load``); a failure on any rank fails every rank. None: this process alone.

    ``tier`` (this node's tier directory, as given to ``async_save``; not with ``group``): read from the tier's copy
    when it holds the committed checkpoint's files of ``rank`` (verified against the same digests), else from ``uri``.
    """
    tier_or_group("load", tier, group)
    target = parse_uri(uri) if not isinstance(uri, StorageURI) else uri
    cfg = config or TransferConfig.from_env()
    if tier is not None:
        near = await nearest_copy(target, tier if isinstance(tier, Tier) else Tier(tier), [rank or 0], config=cfg)
        if near is not None:
            try:
                return await _load(TierStore(), near, target, state_dict, device, rank, world_size, cfg, staging)
            except (ObjectNotFoundError, IntegrityError) as exc:  # dropped or recycled under the read: the bucket's
                log.info("tier copy of %s changed while reading it (%s); reading %s", target.raw, exc, target.raw)
    async with store_for(target, cfg) as store:
        if group is not None:
            from .group_load import load_in_group

            return await load_in_group(target, cfg, store, group, state_dict, device, rank, world_size)
        ckpt = await open_checkpoint_async(target, config=cfg, store=store)
        return await _load(store, ckpt, target, state_dict, device, rank, world_size, cfg, staging)


async def _load(store: Store, ckpt: Checkpoint, target: StorageURI, state_dict: Any, device: str | torch.device | None,
                rank: int | None, world_size: int | None, cfg: TransferConfig, staging: Staging | None) -> Any:
    """Rank ``rank``'s state from opened checkpoint ``ckpt`` (of ``target``) in ``store``."""
    given = flatten(state_dict)[1] if state_dict is not None else {}
    loaded: dict[str, torch.Tensor] = {}
    transfer = Transfer(store, cfg)
    try:
        for name, digest in state_files(ckpt.info.world_size or 1, ckpt.files, target, rank, world_size):
            what = f"{target.raw}/{name}"
            header = await load_file(transfer, ckpt.file_key(name), digest, what, given, device, staging, loaded)
    finally:
        transfer.close()
    check_given(given, loaded, what)
    return state_of(header, loaded, what)


async def load_file(transfer: Transfer, key: str, digest: FileDigest, what: str, given: dict[str, torch.Tensor],
                    device: str | torch.device | None, staging: Staging | None, loaded: dict[str, torch.Tensor]
                    ) -> Header:
    """The tensors of file ``key`` (``what`` in errors) into ``loaded`` by name (into ``given``'s where it has them),
    every chunk checked against ``digest`` (one without a recorded digest, ``digest.digest == ""``: its size and
    header checked only); the file's header."""
    header = parse_header(await header_bytes(transfer, key, digest.size, what), digest.size, what)
    if header.size != digest.size:
        raise CheckpointError(f"{what}: header describes {header.size} bytes, the manifest {digest.size}")
    targets = destinations(header, given, torch.device(device or "cpu"), what)
    if staging is not None or any(t.dest.device.type != "cpu" for t in targets):
        chunks = await _read_staged(transfer, key, header, targets, digest, staging or Staging(256 << 20))
    else:
        chunks = await _read_direct(transfer, key, header, targets, digest)
    if digest.digest:
        digest.check(chunks, what)
    for t in targets:
        if t.bounce is not None:
            t.tensor.copy_(t.bounce)
    loaded.update((t.entry.name, t.tensor) for t in targets)
    return header


async def header_bytes(transfer: Transfer, key: str, size: int, what: str) -> bytes:
    """The header of tensor file ``key`` (``size`` bytes): its first ``HEAD_READ`` bytes, and more when it is longer."""
    head = await transfer.store.get_range(key, 0, min(HEAD_READ, size))
    need = header_length(head, what)
    if need > len(head):
        head = await transfer.store.get_range(key, 0, need)
    return bytes(head[:need])


def rank_entry(saved: int, files: Mapping[str, FileDigest | None], target: StorageURI, rank: int | None,
               world_size: int | None) -> tuple[str, FileDigest]:
    """The name and digest of ``rank``'s tensor file among ``files`` of a checkpoint ``saved`` ranks wrote (``rank``
    may be left out of a one-rank checkpoint)."""
    if world_size is not None and world_size != saved:
        raise CheckpointError(f"checkpoint {target.raw} was saved by {saved} rank(s), not {world_size}; "
                              "load each saved rank's state, or save through fastckpt.torch.dcp to reshard")
    if rank is None:
        if saved != 1:
            raise CheckpointError(f"checkpoint {target.raw} was saved by {saved} ranks: pass rank=")
        rank = 0
    name = rank_file(rank)
    digest = files.get(name)
    if digest is None:
        raise CheckpointError(f"checkpoint {target.raw} holds no tensor state of rank {rank} ({name})")
    return name, digest


def state_files(saved: int, files: Mapping[str, FileDigest | None], target: StorageURI, rank: int | None,
                world_size: int | None) -> list[tuple[str, FileDigest]]:
    """The files of ``rank``'s state (``rank_entry``): its large tensors' file first where an incremental save wrote
    one, the file with the skeleton last."""
    name, digest = rank_entry(saved, files, target, rank, world_size)
    large = name.replace(".safetensors", "-large.safetensors")
    found = files.get(large)
    return ([(large, found)] if found is not None else []) + [(name, digest)]


def check_given(given: dict[str, torch.Tensor], loaded: dict[str, torch.Tensor], what: str) -> None:
    """Every tensor of the caller's ``state_dict`` was loaded (CheckpointError naming those that were not)."""
    missing = sorted(set(given) - set(loaded))
    if missing:
        raise CheckpointError(f"{what}: no stored tensor for {missing[:5]}" + (" ..." if len(missing) > 5 else ""))


def destinations(header: Header, given: dict[str, torch.Tensor], device: torch.device, what: str) -> list[Target]:
    """Destination tensors in file order: the caller's of the same names (``given``, checked) or new ones on
    ``device``."""
    out = []
    for entry in sorted(header.tensors.values(), key=lambda e: e.start):
        tensor = given.get(entry.name)
        if tensor is None:
            tensor = torch.empty(entry.shape, dtype=entry.dtype, device=device)
        elif (tuple(tensor.shape), tensor.dtype) != (entry.shape, entry.dtype):
            raise CheckpointError(f"{what}: tensor {entry.name!r} is stored as {entry.dtype}{list(entry.shape)}, "
                                  f"the state_dict has {tensor.dtype}{list(tensor.shape)}")
        bounce = None if tensor.is_contiguous() else torch.empty_like(tensor, memory_format=torch.contiguous_format)
        out.append(Target(entry, tensor, bounce))
    return out


def file_layout(header: Header, targets: list[Target], head: bytearray) -> Layout:
    """The whole file as views: the header, then each tensor's memory; gaps go to scratch buffers."""
    views: list[memoryview | bytearray] = [head]
    pos = 0
    for t in targets:
        if t.entry.start > pos:
            views.append(bytearray(t.entry.start - pos))
        if t.entry.nbytes:
            views.append(byte_view(t.dest))
        pos = max(pos, t.entry.end)
    return Layout(views)


async def _read_direct(transfer: Transfer, key: str, header: Header, targets: list[Target],
                       digest: FileDigest) -> list[bytes]:
    head = bytearray(header.data_start)
    chunks = await read_layout(transfer, key, 0, file_layout(header, targets, head), digest.chunk_size)
    _same_header(head, header, key)
    return chunks


async def _read_staged(transfer: Transfer, key: str, header: Header, targets: list[Target], digest: FileDigest,
                       staging: Staging) -> list[bytes]:
    """Read the file window by window into ``staging`` and copy each tensor's share to it (``non_blocking``)."""
    chunk = digest.chunk_size
    if staging.capacity is not None and staging.capacity < chunk:
        raise ValueError(f"staging area of {staging.capacity} bytes is smaller than one chunk of {key} "
                         f"({chunk} bytes)")
    window = staging.capacity // chunk * chunk if staging.capacity else 8 * chunk
    area = staging.buffer(min(window, digest.size))
    chunks: list[bytes] = []
    for start in range(0, digest.size, window):
        length = min(window, digest.size - start)
        view = area[:length]
        chunks += await read_layout(transfer, key, start, Layout([byte_view(view)]), chunk)
        if start < header.data_start:
            _same_header(bytes(byte_view(view[:min(length, header.data_start - start)])),
                         header, key, start)
        await off_loop(_scatter, view, start, header.data_start, targets)
    return chunks


def _scatter(window: torch.Tensor, start: int, data_start: int, targets: list[Target]) -> None:
    """Copy each target's share of the file window at ``start`` into it (device copies ``non_blocking``, then
    waited for: the window is overwritten next)."""
    devices: set[torch.device] = set()
    end = start + window.numel()
    for t in targets:
        lo, hi = max(t.entry.start + data_start, start), min(t.entry.end + data_start, end)
        if lo < hi:
            dst = t.dest.reshape(-1).view(torch.uint8)
            offset = lo - data_start - t.entry.start
            on_device = dst.device.type != "cpu"
            dst[offset:offset + hi - lo].copy_(window[lo - start:hi - start], non_blocking=on_device)
            if on_device:
                devices.add(dst.device)
    synchronize(devices)


def _same_header(found: bytes | bytearray, header: Header, key: str, start: int = 0) -> None:
    if bytes(found) != header.raw[start:start + len(found)]:
        raise IntegrityError(f"{key}: header changed between reads")
