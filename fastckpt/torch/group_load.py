"""Tensor state loaded by every rank of a ``torch.distributed`` process group, each byte read from storage once.

Group rank 0 reads the marker and the manifests and hands them to the others; each rank names the stored rank it
loads (``load(uri, rank=k, group=pg)``: every rank loading rank 0's state, or shard ``r % S`` of ``S``). A file that
several ranks load is cut at its chunk boundaries into one range per such rank; each range is fetched from storage by
one of them, straight into its own tensors, and checked there against the manifest's chunk digests, then sent to the
others over the group (gloo point to point, 16 MiB at a time, in one order every rank follows, so none waits on
another that waits on it). Every rank checks its whole file's digest before its state is returned; a failure on any
rank fails every rank with the same error. Tensors on a device are received on the host, then copied. Where no file
is loaded by two ranks (each rank a shard of its own), each reads its files as it would alone, and the ranks agree on
the outcome.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ..checkpoint.group import GroupCall, chunk_buffer, recv_span, send_span
from ..checkpoint.reader import open_checkpoint_async
from ..config import TransferConfig
from ..engine.layout import Layout, read_layout
from ..engine.transfer import Transfer
from ..errors import CheckpointError, IntegrityError
from ..integrity import ChunkHasher, FileDigest
from ..stores.base import Store
from ..uri import StorageURI
from .format import Header, flatten, parse_header, state_of
from .load import StoredFile, Target, check_given, destinations, file_layout, header_bytes, load_file, state_files

__all__ = ["Loading", "Range", "load_in_group", "load_shared_file", "ranges"]

Range = tuple[int, int, int]
"""(start, end, owner rank) of a part of one file."""


def ranges(size: int, chunk: int, needers: list[int]) -> list[Range]:
    """``size`` bytes cut at ``chunk`` boundaries into one range per rank of ``needers`` (fewer when the file has
    fewer chunks), the first to the first."""
    chunks = -(-size // chunk)
    count = max(1, min(chunks, len(needers)))
    bounds = [i * chunks // count * chunk for i in range(count)] + [size]
    return [(bounds[i], min(bounds[i + 1], size), needers[i]) for i in range(count)]


@dataclass(frozen=True)
class Loading:
    """Where a group load's tensors go: the store and settings they are read with, the caller's tensors to fill
    (``given``, by name), the device of new ones, and ``loaded``, which receives every tensor by name."""

    store: Store
    cfg: TransferConfig
    given: dict[str, torch.Tensor]
    device: str | torch.device | None
    loaded: dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass(frozen=True)
class _Plan:
    """What group rank 0 learnt of the checkpoint and tells the others: how many ranks saved it, and its files."""

    saved: int
    files: dict[str, StoredFile]


async def load_in_group(target: StorageURI, cfg: TransferConfig, store: Store, group: Any, state_dict: Any,
                        device: str | torch.device | None, rank: int | None, world_size: int | None) -> Any:
    """``load_async`` with ``group=``: every rank of ``group`` calls it, each for the stored rank it names."""
    call = await GroupCall.of(group, f"load of checkpoint {target.raw} by its process group")

    async def planned() -> _Plan:
        ckpt = await open_checkpoint_async(target, config=cfg, store=store)
        at = target.with_key(target.join(ckpt.root))  # the folder of the files (messages keep the URI as given)
        return _Plan(ckpt.info.world_size or 1, {n: StoredFile(at.join(n), d, ckpt.chunks.get(n), f"{at.raw}/{n}")
                                                 for n, d in ckpt.files.items() if d is not None})

    plan = await call.from_root(planned, store)
    names: list[str] = []
    error = None
    try:
        names = [n for n, _ in state_files(plan.saved, {n: f.digest for n, f in plan.files.items()}, target, rank,
                                            world_size)]
    except CheckpointError as exc:
        error = str(exc)
    await call.agree(error)
    everyone = await call.gather(names)
    counts = {len(n) for n in everyone}
    call.raise_first([None if len(counts) == 1 else
                      f"checkpoint {target.raw}: the ranks' states are in {sorted(counts)} files (saved "
                      "incrementally and not), so they cannot be loaded together"])
    into = Loading(store, cfg, flatten(state_dict)[1] if state_dict is not None else {}, device)
    if len({n for mine in everyone for n in mine}) == sum(len(mine) for mine in everyone):
        header = await _load_own(call, [plan.files[n] for n in names], into)
    else:
        for name in names:
            header = await load_shared_file(call, plan.files, name, into)
    what = plan.files[names[-1]].what
    missing = None
    try:
        check_given(into.given, into.loaded, what)
    except CheckpointError as exc:
        missing = str(exc)
    await call.agree(missing)
    return state_of(header, into.loaded, what)


async def _load_own(call: GroupCall, files: list[StoredFile], into: Loading) -> Header:
    """Where no file is loaded by two ranks (each rank a shard of its own), nothing is shared: each rank reads its
    own files as it would alone, then the ranks agree on the outcome. The last file's header is returned."""
    transfer, error = Transfer(into.store, into.cfg), None
    try:
        for f in files:
            header = await load_file(transfer, f.key, f.digest, f.what, into.given, into.device, None, into.loaded)
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
    finally:
        transfer.close()
    await call.agree(error)
    return header


async def load_shared_file(call: GroupCall, stored: dict[str, StoredFile], name: str, into: Loading) -> Header:
    """One file of ``stored`` that this rank loads, read once for the group (every rank calls this the same number of
    times, each for its own file ``name``); its tensors go into ``into.loaded``, its header is returned."""
    wanted = await call.gather(name)
    digest, key, what = stored[name].digest, stored[name].key, stored[name].what
    needers = [r for r, n in enumerate(wanted) if n == name]
    parts = ranges(digest.size, digest.chunk_size, needers)
    transfer = Transfer(into.store, into.cfg)
    try:
        raw, error = await _header(transfer, key, digest, what) if needers[0] == call.rank else (b"", None)
        headers = await call.gather((raw, error))
        call.raise_first([e for _, e in headers])
        got: dict[int, list[bytes]] = {}
        error = None
        try:  # a state_dict that does not match fails here: recorded, so that every rank raises it
            header = parse_header(headers[needers[0]][0], digest.size, what)
            targets = [Target(t.entry, t.tensor, t.bounce if t.dest.device.type == "cpu" else
                              torch.empty(t.entry.shape, dtype=t.entry.dtype))
                       for t in destinations(header, into.given, torch.device(into.device or "cpu"), what)]
            head = bytearray(header.data_start)
            layout = file_layout(header, targets, head)
            for start, end, owner in parts:
                if owner == call.rank:
                    got[start] = await read_layout(transfer, key, start, Layout(layout.pieces(start, end - start)),
                                                   digest.chunk_size)
                    _check_chunks(got[start], stored[name].chunks, start // digest.chunk_size, what, call.rank)
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
        await call.agree(error)
    finally:
        transfer.close()
    loaders = {n: [r for r, w in enumerate(wanted) if w == n] for n in sorted(set(wanted))}
    plans = {n: (ranks, ranges(stored[n].digest.size, stored[n].digest.chunk_size, ranks))
             for n, ranks in loaders.items()}
    received = await call.run(lambda: _exchange(call, plans, layout, digest.chunk_size))
    got.update(received)
    error = None
    try:
        if digest.digest:  # a file without recorded digests: its size and header checked only
            digest.check([d for start in sorted(got) for d in got[start]], what)
        if bytes(head) != header.raw:
            raise IntegrityError(f"{what}: the header received differs from the one parsed")
    except IntegrityError as exc:
        error = str(exc)
    await call.agree(error)
    for t in targets:
        if t.bounce is not None:
            t.tensor.copy_(t.bounce)
    into.loaded.update((t.entry.name, t.tensor) for t in targets)
    return header


async def _header(transfer: Transfer, key: str, digest: FileDigest, what: str) -> tuple[bytes, str | None]:
    """The file's header bytes, read by the rank that fetches its first range (or what went wrong)."""
    try:
        return await header_bytes(transfer, key, digest.size, what), None
    except Exception as exc:
        return b"", f"{type(exc).__name__}: {exc}"


def _check_chunks(found: list[bytes], recorded: tuple[str, ...] | None, first: int, what: str, rank: int) -> None:
    """The chunks fetched here are those the manifest records (verified where they were fetched)."""
    if recorded is not None and tuple(d.hex() for d in found) != recorded[first:first + len(found)]:
        raise IntegrityError(f"{what}: chunks from {first} fetched by rank {rank} differ from the manifest's")


def _exchange(call: GroupCall, plans: dict[str, tuple[list[int], list[Range]]], layout: Layout, chunk: int
              ) -> dict[int, list[bytes]]:
    """On a worker thread: every range sent by its owner to each other rank that loads its file, in the same order on
    every rank; the chunk digests of the ranges this rank received, by start."""
    buffer = chunk_buffer()
    received: dict[int, list[bytes]] = {}
    for loaders, parts in plans.values():
        for start, end, owner in parts:
            for peer in loaders:
                if peer == owner or call.rank not in (owner, peer):
                    continue
                if call.rank == owner:
                    send_span(call, peer, start, end - start, layout.gather, buffer)
                    continue
                hasher = ChunkHasher(chunk)

                def take(offset: int, piece: memoryview, hasher: ChunkHasher = hasher) -> None:
                    layout.scatter(offset, piece)
                    hasher.update(piece)

                recv_span(call, owner, start, end - start, take, buffer)
                received[start] = hasher.finish()
    return received
