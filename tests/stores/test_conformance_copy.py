"""Conformance suite, server-side copies: ``Store.copy`` and ``MultipartUpload.copy_part`` on every backend.

A copy happens only from the version of the source it names; a backend that cannot copy says so
(CopyUnsupportedError) and writes nothing. GCS copies whole objects only (compose); ranges are refused there.
"""

from __future__ import annotations

import os

import pytest

from fastckpt import AlreadyExistsError, ObjectNotFoundError
from fastckpt.errors import CopyUnsupportedError, SourceChangedError
from fastckpt.stores.base import CopySource

from .test_conformance import part_size_of

RANGES = {"memory", "local", "s3"}
"""Built-in backends that copy byte ranges into an upload here. Azure does (Put Block From URL), but Azurite answers
it 501 APINotImplemented, so on Azurite the engine's fallback is what runs."""


async def _source(s, key: str, data: bytes, **metadata: str) -> CopySource:
    await s.put(key, data, metadata=metadata or None)
    meta = await s.head(key)
    assert meta.etag, f"{s.name}: head reports no version to copy from"
    return CopySource(key, meta.etag, 0, len(data))


async def test_copy_whole_object(store) -> None:
    s, uri = store
    data = os.urandom(3 * part_size_of(s) + 5)
    src = await _source(s, uri.join("src"), data)
    await s.copy(uri.join("dst"), src, if_absent=True, metadata={"fastckpt-chunk": "7", "k": "v"})
    meta = await s.head(uri.join("dst"))
    assert (meta.size, meta.metadata.get("k"), meta.metadata.get("fastckpt-chunk")) == (len(data), "v", "7")
    assert await s.get_range(uri.join("dst"), 0, len(data)) == data
    assert await s.get_range(uri.join("src"), 0, len(data)) == data


async def test_copy_if_absent_keeps_what_is_there(store) -> None:
    s, uri = store
    src = await _source(s, uri.join("src"), b"new bytes")
    await s.put(uri.join("dst"), b"old")
    with pytest.raises(AlreadyExistsError):
        await s.copy(uri.join("dst"), src, if_absent=True)
    assert await s.get_range(uri.join("dst"), 0, 100) == b"old"


async def test_copy_of_a_changed_source_copies_nothing(store) -> None:
    s, uri = store
    src = await _source(s, uri.join("src"), b"version one")
    await s.put(uri.join("src"), b"version two!")
    with pytest.raises(SourceChangedError):
        await s.copy(uri.join("dst"), CopySource(src.key, src.etag, 0, 12), if_absent=True)
    with pytest.raises(ObjectNotFoundError):
        await s.head(uri.join("dst"))


async def test_copy_of_a_missing_source(store) -> None:
    s, uri = store
    src = await _source(s, uri.join("src"), b"bytes")
    await s.delete(uri.join("src"))
    with pytest.raises((ObjectNotFoundError, SourceChangedError)):
        await s.copy(uri.join("dst"), src)
    with pytest.raises(ObjectNotFoundError):
        await s.head(uri.join("dst"))


async def test_copy_parts_beside_sent_parts(store, backend: str) -> None:
    """An upload whose middle part is copied from a range of another object, the others sent."""
    s, uri = store
    part = part_size_of(s)
    old = os.urandom(3 * part)
    src = await _source(s, uri.join("src"), old)
    first, last = os.urandom(part), os.urandom(99)
    mpu = await s.create_multipart(uri.join("mixed"), part, if_absent=True)
    try:
        copied = await mpu.copy_part(1, CopySource(src.key, src.etag, part, part))
    except CopyUnsupportedError:
        await mpu.abort()
        assert backend not in RANGES, f"{backend} must copy ranges"
        return
    infos = [await mpu.put_part(0, first), copied, await mpu.put_part(2, last)]
    await mpu.complete(infos, {"k": "v"})
    assert await s.get_range(uri.join("mixed"), 0, 3 * part) == first + old[part:2 * part] + last


async def test_copy_part_of_a_changed_source(store, backend: str) -> None:
    s, uri = store
    part = part_size_of(s)
    src = await _source(s, uri.join("src"), os.urandom(2 * part))
    await s.put(uri.join("src"), os.urandom(2 * part))
    mpu = await s.create_multipart(uri.join("stale"), part)
    try:
        with pytest.raises((SourceChangedError, CopyUnsupportedError)) as caught:
            await mpu.copy_part(0, CopySource(src.key, src.etag, 0, part))
        assert backend not in RANGES or caught.type is SourceChangedError
    finally:
        await mpu.abort()
    with pytest.raises(ObjectNotFoundError):
        await s.head(uri.join("stale"))
