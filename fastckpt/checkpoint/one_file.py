"""A checkpoint that is one file at its own path (a framework's own format, such as a Lightning ``.ckpt``), replaced
atomically by each save to that path, verified by every load through fastckpt.

The file is an ordinary object at the key the framework names, so every tool that expects a file reads it. What
fastckpt knows of it lives beside it in a hidden sidecar, ``.{name}.fastckpt`` (one small JSON object): one record
(size, chunk size, digest and chunk digests) per save whose bytes may be in the file. A save records its bytes
first, then writes the file (one atomic switch: a local rename, an object store's single put or upload
completion), then drops the records of the bytes it replaced. So the file holds the bytes of a recorded save at any
moment: a save that dies leaves the old file and its record, a reader that meets a switch in flight reads the
sidecar again, and a file no fastckpt save wrote (or changed since) matches no record and is refused.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass

from ..engine.layout import Layout, hash_layout, read_layout, upload_layout
from ..engine.plan import plan_upload
from ..engine.transfer import Transfer
from ..errors import CheckpointError, IntegrityError, ObjectNotFoundError
from ..integrity import FileDigest, combine, hash_chunks
from ..stores.base import Store
from ..uri import join_key
from .attempt import new_attempt_id
from .documents import read_object

__all__ = [
    "FORMAT",
    "READS",
    "SUFFIX",
    "Record",
    "decode_records",
    "encode_records",
    "load_one_file",
    "load_unverified",
    "read_records",
    "remove_one_file",
    "save_one_file",
    "sidecar_key",
]

FORMAT = "fastckpt.one-file/1"
SUFFIX = ".fastckpt"
READS = 3
"""Reads of a file whose sidecar changed meanwhile (a save replacing it) before a load gives up."""


def sidecar_key(key: str) -> str:
    """Key of the sidecar of the file at ``key``: ``.{name}.fastckpt`` beside it."""
    parent, _, name = key.rpartition("/")
    return join_key(parent, f".{name}{SUFFIX}") if parent else f".{name}{SUFFIX}"


@dataclass(frozen=True)
class Record:
    """The bytes one save wrote to the file: size, chunk size, digest, chunk digests (hex)."""

    save: str
    size: int
    chunk_size: int
    digest: str
    chunks: tuple[str, ...]
    saved_at: float

    @property
    def file_digest(self) -> FileDigest:
        """The record as a ``FileDigest``."""
        return FileDigest(self.size, self.chunk_size, self.digest)

    def matches(self, data: memoryview, chunks: list[bytes], chunk_size: int) -> bool:
        """Whether ``data`` (whose ``chunk_size`` digests are ``chunks``) is what this save wrote."""
        if len(data) != self.size:
            return False
        mine = chunks if chunk_size == self.chunk_size else hash_chunks(data, self.chunk_size)
        return combine(mine) == self.digest


def decode_records(raw: bytes, key: str) -> list[Record]:
    """The records of sidecar ``key`` (CheckpointError naming it when it is not one)."""
    try:
        doc = json.loads(raw)
        if doc.get("format") != FORMAT:
            raise ValueError(f"format {doc.get('format')!r}, expected {FORMAT!r}")
        return [Record(r["save"], int(r["size"]), int(r["chunk_size"]), str(r["digest"]), tuple(r["chunks"]),
                       float(r["saved_at"])) for r in doc["records"]]
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CheckpointError(f"{key} is not a fastckpt sidecar: {exc}") from None


def encode_records(records: list[Record]) -> bytes:
    """The sidecar's bytes."""
    return json.dumps({"format": FORMAT, "records": [asdict(r) for r in records]}).encode()


async def read_records(store: Store, key: str) -> list[Record] | None:
    """The records beside the file at ``key``, newest first; None when it has no sidecar."""
    side = sidecar_key(key)
    try:
        raw = await read_object(store, side)
    except ObjectNotFoundError:
        return None
    return sorted(decode_records(raw, side), key=lambda r: r.saved_at, reverse=True)


async def save_one_file(transfer: Transfer, key: str, layout: Layout) -> Record:
    """Write ``layout`` as the file at ``key``, replacing what is there atomically; returns its record."""
    store = transfer.store
    chunk_size = plan_upload(layout.size, transfer.config, store).part_size
    chunks = await hash_layout(layout, chunk_size)
    record = Record(new_attempt_id(), layout.size, chunk_size, combine(chunks), tuple(c.hex() for c in chunks),
                    time.time())
    side = sidecar_key(key)
    before = await read_records(store, key) or []
    await store.put(side, encode_records([record, *before]))
    await upload_layout(transfer, layout, key, chunks=chunks)
    await store.put(side, encode_records([record]))  # the bytes the earlier records named are gone
    return record


async def load_one_file(transfer: Transfer, key: str) -> bytearray:
    """The bytes of the file at ``key``, checked against its sidecar: CheckpointError when it has none (not saved
    through fastckpt), IntegrityError when they are not the bytes of a recorded save."""
    store = transfer.store
    records = await read_records(store, key)
    for _ in range(READS):
        if not records:
            raise CheckpointError(f"{key} has no fastckpt record beside it ({sidecar_key(key)}): it was not saved "
                                  "through fastckpt, or its save never finished")
        data, chunks = await _read(transfer, key, records[0].chunk_size)
        if any(r.matches(memoryview(data), chunks, records[0].chunk_size) for r in records):
            return data
        again = await read_records(store, key)
        if again == records:  # no save in flight: the file changed outside fastckpt
            newest = next((r for r in records if r.size == len(data)), records[0])
            if newest.size != len(data):
                raise IntegrityError(f"{key}: {len(data)} bytes, but its last fastckpt save wrote {newest.size} "
                                     "(changed after it was written)")
            newest.file_digest.check(hash_chunks(data, newest.chunk_size), f"{key} (changed after it was written)")
        records = again
    raise CheckpointError(f"{key}: replaced by other saves while it was read, {READS} times; try again")


async def load_unverified(transfer: Transfer, key: str) -> bytearray:
    """The bytes of the file at ``key`` as they are (a file written by another tool)."""
    return (await _read(transfer, key, transfer.config.part_size))[0]


async def _read(transfer: Transfer, key: str, chunk_size: int) -> tuple[bytearray, list[bytes]]:
    """The whole file at ``key`` and its ``chunk_size`` chunk digests."""
    data = bytearray((await transfer.store.head(key)).size)
    return data, (await read_layout(transfer, key, 0, Layout([data]), chunk_size) if data else [])


async def remove_one_file(store: Store, key: str) -> None:
    """Delete the file at ``key`` and its sidecar (the sidecar first: from then on no load takes the file)."""
    await store.delete(sidecar_key(key))
    await store.delete(key)
