"""Incremental checkpoints (``base=``) on every backend: unchanged bytes copied by the store, every checkpoint whole.

Copies are counted from the commit result (``copied``) and checked against what each backend can copy: whole objects
everywhere, parts of objects where the backend copies ranges (GCS composes whole objects only; Azurite does not
implement Put Block From URL). Every new checkpoint verifies and downloads bit-exact after its base is deleted.
"""

from __future__ import annotations

import asyncio
import logging
import os

import pytest

import fastckpt
from fastckpt import CheckpointWriter, open_store, parse_uri
from fastckpt.checkpoint.barrier_store import StoreBarrier
from fastckpt.engine.layout import Layout
from fastckpt.engine.plan import plan_upload
from fastckpt.stores.base import MultipartUpload, Store
from fastckpt.stores.memory import MemoryStore, MemoryUpload
from harness.uris import below

from ..conftest import small_config
from ..stores.test_conformance_copy import RANGES


async def part_size(uri: str) -> int:
    async with open_store(parse_uri(uri), config=small_config()) as s:
        return plan_upload(1, small_config(), s).part_size


async def save(uri: str, files: dict[str, bytes], tmp_path, base: str | None = None, **kw: object
               ) -> fastckpt.CommitResult:
    """One checkpoint: ``layout/*`` names as layouts from memory, the others as local files."""
    async with CheckpointWriter(uri, config=small_config(), base=base, **kw) as w:
        for name, data in files.items():
            if name.startswith("layout/"):
                await w.put_layout(name, Layout([data]))
            else:
                path = tmp_path / f"src-{os.urandom(4).hex()}"
                path.write_bytes(data)
                await w.put_file(path, name)
    assert w.result is not None
    return w.result


async def assert_holds(uri: str, files: dict[str, bytes], tmp_path) -> None:
    assert (await fastckpt.verify_async(uri, config=small_config())).ok
    out = tmp_path / f"out-{os.urandom(3).hex()}"
    await fastckpt.download_checkpoint_async(uri, out, config=small_config())
    assert {n: (out / n).read_bytes() for n in files} == files


async def delete_below(uri: str) -> None:
    target = parse_uri(uri)
    async with open_store(target, config=small_config()) as s:
        await s.delete_many([m.key async for m in s.list(target.key)])


def changed(data: bytes, at: int) -> bytes:
    return data[:at] + bytes([data[at] ^ 0xFF]) + data[at + 1:]


async def test_unchanged_copied_changed_sent(store_uri: str, backend: str, tmp_path) -> None:
    part = await part_size(store_uri)
    first = {"layout/model": os.urandom(4 * part + 10), "frozen.bin": os.urandom(2 * part + 3),
             "optim.bin": os.urandom(3 * part), "small.json": b"{}" * 50}
    a, b = below(store_uri, "step-1"), below(store_uri, "step-2")
    assert (await save(a, first, tmp_path)).copied == 0
    second = {**first, "layout/model": changed(first["layout/model"], part + 7),
              "optim.bin": changed(first["optim.bin"], 2 * part), "small.json": b"[]" * 50}
    result = await save(b, second, tmp_path, base="latest")
    whole = len(first["frozen.bin"])
    parts = 3 * part + 10 + 2 * part if backend in RANGES else 0  # the layout's and optim.bin's unchanged parts
    assert (result.copied, result.sent) == (whole + parts, result.bytes - whole - parts)
    await delete_below(a)
    await assert_holds(b, second, tmp_path)


def tamper(path: str) -> None:
    with open(path, "r+b") as f:
        f.write(b"tampered")


async def test_base_changed_behind_our_back(store_uri: str, tmp_path) -> None:
    """The base's file overwritten in place after its commit: never copied, its new bytes never in the new one."""
    part = await part_size(store_uri)
    first = {"layout/model": os.urandom(3 * part), "frozen.bin": os.urandom(2 * part)}
    a, b = below(store_uri, "step-1"), below(store_uri, "step-2")
    await save(a, first, tmp_path)
    target = parse_uri(a)
    async with open_store(target, config=small_config()) as s:
        path = s.local_file(target.join("frozen.bin"))
        if path is not None:  # in place: the file keeps its extended attributes, the digest of its old version
            tamper(path)
        else:
            await s.put(target.join("frozen.bin"), b"tampered" + first["frozen.bin"][8:])
        await s.put(target.join("layout/model"), os.urandom(3 * part))
    result = await save(b, first, tmp_path, base=a)
    assert result.copied == 0  # local: the file's recorded digest is of its version before the change
    await delete_below(a)
    await assert_holds(b, first, tmp_path)


async def test_base_changed_after_it_was_read(fast_uri: str) -> None:
    """The base object replaced between the look at it and the copy: the part falls back to being sent."""
    part = await part_size(fast_uri)
    data = os.urandom(3 * part)
    a, b = below(fast_uri, "a"), below(fast_uri, "b")
    async with CheckpointWriter(a, config=small_config()) as w:
        await w.put_layout("model", Layout([data]))
    async with CheckpointWriter(b, config=small_config(), base=a) as w:
        assert w.base is not None
        obj = w.base.object("model")
        assert obj is not None and w._transfer is not None
        assert await w._transfer.reuse.version(obj) is not None  # looked at now, as the first copy would
        async with open_store(parse_uri(a), config=small_config()) as s:
            await s.put(obj.key, os.urandom(3 * part))  # a new version, metadata and all gone
        await w.put_layout("model", Layout([changed(data, 0)]))
    assert w.result is not None and w.result.copied == 0
    assert (await fastckpt.verify_async(b)).ok


class _NoCopyUpload(MemoryUpload):
    copy_part = MultipartUpload.copy_part


class NoCopyStore(MemoryStore):
    """A backend written before copies existed: the protocol's defaults (CopyUnsupportedError)."""

    copy = Store.copy

    async def create_multipart(self, key, part_size, metadata=None, *, if_absent=False):
        return _NoCopyUpload(self._b, key, part_size, dict(metadata or {}), if_absent)


async def test_backend_without_copies_falls_back(tmp_path, caplog) -> None:
    bucket = f"nocopy-{os.urandom(4).hex()}"
    store = NoCopyStore(bucket)
    files = {"layout/model": os.urandom(1 << 20), "a.bin": os.urandom(700 << 10)}
    a, b = f"memory://{bucket}/run/1", f"memory://{bucket}/run/2"
    await save(a, files, tmp_path, store=store)
    with caplog.at_level(logging.DEBUG, logger="fastckpt"):
        result = await save(b, files, tmp_path, store=store, base="latest")
    assert result.copied == 0 and result.sent == result.bytes
    assert sum("server-side copies unavailable" in r.getMessage() for r in caplog.records) == 1
    await assert_holds(b, files, tmp_path)


@pytest.mark.parametrize("backend", ["local", "s3"])
async def test_ranks_with_latest(store_uri: str, tmp_path) -> None:
    """Three ranks through the store barrier: rank 0 reads the base once and hands it to the others."""
    part = await part_size(store_uri)
    shards = {r: os.urandom(2 * part + r) for r in range(3)}

    async def job(name: str, shards: dict[int, bytes], base: str | None) -> list[fastckpt.CommitResult]:
        uri = below(store_uri, name)

        async def rank(r: int) -> fastckpt.CommitResult:
            return await save(uri, {f"layout/rank-{r}": shards[r]}, tmp_path, base=base, rank=r, world_size=3,
                              attempt=f"{name}-run", barrier=StoreBarrier(timeout=30, poll_interval=0.01))

        return await asyncio.gather(*(rank(r) for r in range(3)))

    await job("step-1", shards, None)
    later = {**shards, 1: changed(shards[1], 0)}
    results = await job("step-2", later, "latest")
    tail = part + 1 if parse_uri(store_uri).backend in RANGES else 0  # rank 1's unchanged parts
    assert {r.copied for r in results} == {len(shards[0]) + len(shards[2]) + tail}
    await delete_below(below(store_uri, "step-1"))
    out = {f"layout/rank-{r}": later[r] for r in range(3)}
    await assert_holds(below(store_uri, "step-2"), out, tmp_path)
