"""Conformance suite: every backend must pass all of it (store protocol + engine round-trips)."""

from __future__ import annotations

import asyncio
import os
import time

import pytest

from fastckpt import AlreadyExistsError, ObjectNotFoundError, open_store, parse_uri
from fastckpt.engine.plan import plan_upload
from fastckpt.engine.transfer import Transfer
from fastckpt.integrity import FileDigest

from ..conftest import small_config


def part_size_of(store) -> int:
    """The part size the engine uses on this store with the test config."""
    return plan_upload(1, small_config(), store).part_size


async def roundtrip(store, uri, tmp_path, name: str, size: int) -> bytes:
    data = os.urandom(size)
    src = tmp_path / "src" / name.replace("/", "_")
    src.parent.mkdir(exist_ok=True)
    src.write_bytes(data)
    transfer = Transfer(store, small_config())
    up = await transfer.upload_file(str(src), uri.join(name))
    out = tmp_path / "out" / name.replace("/", "_")
    down = await transfer.download_file(uri.join(name), str(out))
    transfer.close()
    assert out.read_bytes() == data
    assert up.digest == down.digest
    meta = await store.head(uri.join(name))
    assert meta.size == size
    assert FileDigest.from_metadata(size, meta.metadata) == up.digest
    return data


@pytest.mark.parametrize("shape", ["empty", "one_byte", "one_part", "part_plus_one", "multi_part"])
async def test_roundtrip_sizes(store, tmp_path, shape: str) -> None:
    s, uri = store
    part = part_size_of(s)
    size = {"empty": 0, "one_byte": 1, "one_part": part, "part_plus_one": part + 1,
            "multi_part": 3 * part + 12345}[shape]
    await roundtrip(s, uri, tmp_path, f"f-{shape}.bin", size)


async def test_directory_roundtrip_nested_unicode(store, tmp_path) -> None:
    import fastckpt

    s, uri = store
    src = tmp_path / "ckpt"
    files = {"model-00001-of-00002.safetensors": 3000, "optim/rank_03.pt": 70000,
             "deep/a/b/c/état-😀.json": 10, "space name.txt": 5, "plus+pct%41&eq=~.bin": 6}
    for rel, size in files.items():
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_bytes(os.urandom(size))
    dst = uri.raw.split("?")[0].rstrip("/") + "/ckpt"
    query = "?" + uri.raw.split("?", 1)[1] if "?" in uri.raw else ""
    results = await fastckpt.upload_async(src, dst + query, config=small_config())
    assert sorted(r.key for r in results) == sorted(uri.join("ckpt", rel) for rel in files)
    listed = sorted([m.key async for m in s.list(uri.join("ckpt"))])
    assert listed == sorted(uri.join("ckpt", rel) for rel in files)
    out = tmp_path / "restored"
    await fastckpt.download_async(dst + query, out, config=small_config())
    for rel in files:
        assert (out / rel).read_bytes() == (src / rel).read_bytes()


@pytest.mark.parametrize("name", ["plain.bin", "sp ace/ünï #1?x=%41.bin"])
async def test_uri_round_trip(store, name: str) -> None:
    """parse(uri_of(store)) == store: the URI a store hands back opens an equal store, naming the same key."""
    s, uri = store
    key = uri.join(name)
    await s.put(key, b"round trip")
    parsed = parse_uri(s.uri(key))
    async with open_store(parsed, config=small_config()) as again:
        assert again.location == s.location
        assert parsed.key == key
        assert await again.get_range(parsed.key, 0, 100) == b"round trip"


async def test_a_store_taking_what_another_learned_works_alike(store) -> None:
    """``learned`` / ``assume`` (a group read's root hands its store's findings to the other ranks): a store of the
    same location that takes what this one learned reads, lists and writes as this one does."""
    s, uri = store
    await s.put(uri.join("learn/a"), b"learned")
    learned = s.learned()
    assert isinstance(learned, dict)
    async with open_store(parse_uri(s.uri(uri.join("learn"))), config=small_config()) as again:
        again.assume(learned)
        assert await again.get_range(uri.join("learn/a"), 0, 7) == b"learned"
        assert [m.key async for m in again.list(uri.join("learn"))] == [uri.join("learn/a")]
        await again.put(uri.join("learn/b"), b"too")
        with pytest.raises(ObjectNotFoundError):
            await again.head(uri.join("learn/absent"))
    assert await s.get_range(uri.join("learn/b"), 0, 3) == b"too"


async def test_list_and_list_dir(store) -> None:
    s, uri = store
    for key in ["a/1", "a/2", "a/sub/3", "ab/4", "b"]:
        await s.put(uri.join(key), key.encode())
    keys = sorted([m.key async for m in s.list(uri.join("a"))])
    assert keys == [uri.join("a/1"), uri.join("a/2"), uri.join("a/sub/3")]  # not "ab/4"
    objects, dirs = await s.list_dir(uri.join("a"))
    assert sorted(o.key for o in objects) == [uri.join("a/1"), uri.join("a/2")]
    assert dirs == [uri.join("a/sub")]
    assert [m.size async for m in s.list(uri.join("b"))] == [1]
    assert [m async for m in s.list(uri.join("nothing-here"))] == []


async def test_delete(store) -> None:
    s, uri = store
    await s.put(uri.join("x"), b"123")
    await s.delete(uri.join("x"))
    with pytest.raises(ObjectNotFoundError):
        await s.head(uri.join("x"))
    await s.delete(uri.join("x"))  # absent: no error
    await s.put(uri.join("m/1"), b"1")
    await s.put(uri.join("m/2"), b"2")
    await s.delete_many([uri.join("m/1"), uri.join("m/2")])
    assert [m async for m in s.list(uri.join("m"))] == []


async def test_delete_listed(store) -> None:
    """What a listing reported is deleted, with what the backend keeps beside it (S3: a multipart object's digest
    record; no orphan left), whatever the key's characters."""
    s, uri = store
    part = part_size_of(s)
    for name in ("whole", "a b & <c>.bin", "ünï/côdé"):
        await s.put(uri.join(f"d/{name}"), b"x" * 10)
    mpu = await s.create_multipart(uri.join("d/multi"), part)
    parts = [await mpu.put_part(i, os.urandom(part)) for i in range(2)]
    await mpu.complete(parts, {"fastckpt-xxh3": "0" * 32, "fastckpt-chunk": str(part)})
    listed = [m async for m in s.list(uri.join("d"))]
    assert len(listed) == 4
    await s.delete_listed(listed)
    assert [m async for m in s.list(uri.join("d"))] == []
    assert await s.list_orphans(uri.key, before=time.time() + 60) == []


async def test_head_and_get_missing(store) -> None:
    s, uri = store
    with pytest.raises(ObjectNotFoundError):
        await s.head(uri.join("missing"))
    with pytest.raises(ObjectNotFoundError):
        await s.get_range(uri.join("missing"), 0, 10)


async def test_create_if_absent(store) -> None:
    s, uri = store
    await s.put(uri.join("marker"), b"first", if_absent=True)
    with pytest.raises(AlreadyExistsError):
        await s.put(uri.join("marker"), b"second", if_absent=True)
    assert await s.get_range(uri.join("marker"), 0, 100) == b"first"


async def test_create_if_absent_race(store) -> None:
    s, uri = store
    results = await asyncio.gather(*(s.put(uri.join("race"), str(i).encode(), if_absent=True)
                                     for i in range(8)), return_exceptions=True)
    winners = [i for i, r in enumerate(results) if r is None]
    assert len(winners) == 1, results
    assert all(isinstance(r, AlreadyExistsError) for r in results if r is not None)
    assert await s.get_range(uri.join("race"), 0, 10) == str(winners[0]).encode()


async def test_concurrent_uploads_to_different_keys(store, tmp_path) -> None:
    s, uri = store
    part = part_size_of(s)
    datas = {}
    for i in range(6):
        p = tmp_path / f"c{i}"
        datas[i] = os.urandom(part + 100 * i + 1)
        p.write_bytes(datas[i])
    transfer = Transfer(s, small_config())
    await transfer.upload_files([(str(tmp_path / f"c{i}"), uri.join(f"c/{i}")) for i in range(6)])
    for i in range(6):
        meta = await s.head(uri.join(f"c/{i}"))
        assert meta.size == len(datas[i])
        assert await s.get_range(uri.join(f"c/{i}"), 0, meta.size) == datas[i]
    transfer.close()


async def test_aborted_multipart_leaves_nothing(store) -> None:
    s, uri = store
    part = part_size_of(s)
    mpu = await s.create_multipart(uri.join("aborted"), part)
    await mpu.put_part(0, os.urandom(part))
    await mpu.put_part(1, b"tail")
    await mpu.abort()
    with pytest.raises(ObjectNotFoundError):
        await s.head(uri.join("aborted"))
    assert [m async for m in s.list(uri.join("aborted"))] == []
    assert [u for u in await s.list_pending_uploads(uri.key) if u.key == uri.join("aborted")] == []


async def test_multipart_parts_out_of_order(store) -> None:
    s, uri = store
    part = part_size_of(s)
    chunks = [os.urandom(part), os.urandom(part), os.urandom(17)]
    mpu = await s.create_multipart(uri.join("ooo"), part, {"k": "v"})
    infos = await asyncio.gather(*(mpu.put_part(i, chunks[i]) for i in (2, 0, 1)))
    await mpu.complete(sorted(infos, key=lambda p: p.index), {"k": "v"})
    meta = await s.head(uri.join("ooo"))
    assert meta.size == 2 * part + 17
    assert meta.metadata.get("k") == "v"
    assert await s.get_range(uri.join("ooo"), 0, meta.size) == b"".join(chunks)


async def test_metadata_known_at_completion_is_the_objects(store) -> None:
    """The digest is known only when the last part is sent: what ``complete`` is given, ``head`` reports, and a
    delete leaves nothing behind, not even among hidden keys."""
    s, uri = store
    part = part_size_of(s)
    key = uri.join("late", "meta")
    mpu = await s.create_multipart(key, part, {"early": "1"})
    infos = [await mpu.put_part(0, os.urandom(part)), await mpu.put_part(1, b"tail")]
    await mpu.complete(infos, {"early": "1", "fastckpt-xxh3": "00ff", "fastckpt-chunk": str(part)})
    meta = await s.head(key)
    assert {k: meta.metadata.get(k) for k in ("early", "fastckpt-xxh3", "fastckpt-chunk")} == {
        "early": "1", "fastckpt-xxh3": "00ff", "fastckpt-chunk": str(part)}
    assert [m.key async for m in s.list(uri.join("late"))] == [key]
    await s.delete(key)
    if s.paged:
        assert (await s.list_page(uri.join("late") + "/")).objects == []


async def test_pending_upload_listed_and_aborted(store) -> None:
    s, uri = store
    part = part_size_of(s)
    mpu = await s.create_multipart(uri.join("pending/obj"), part)
    await mpu.put_part(0, os.urandom(part))
    pending = [u for u in await s.list_pending_uploads(uri.key) if u.key == uri.join("pending/obj")]
    assert len(pending) == 1
    await s.abort_pending_upload(pending[0])
    assert [u for u in await s.list_pending_uploads(uri.key) if u.key == uri.join("pending/obj")] == []


async def test_ranged_reads(store) -> None:
    s, uri = store
    data = os.urandom(10_000)
    await s.put(uri.join("r"), data)
    assert await s.get_range(uri.join("r"), 0, 10) == data[:10]
    assert await s.get_range(uri.join("r"), 9_990, 10) == data[9_990:]
    assert await s.get_range(uri.join("r"), 5_000, 1) == data[5_000:5_001]
    assert await s.get_range(uri.join("r"), 9_995, 100) == data[9_995:]  # past the end: truncated
    buf = bytearray(300)
    assert await s.read_into(uri.join("r"), 100, memoryview(buf)) == 300
    assert bytes(buf) == data[100:400]


async def test_metadata_roundtrip(store) -> None:
    s, uri = store
    await s.put(uri.join("meta"), b"abc", metadata={"fastckpt-xxh3": "00ff", "fastckpt-chunk": "42"})
    meta = await s.head(uri.join("meta"))
    assert meta.metadata.get("fastckpt-xxh3") == "00ff"
    assert meta.metadata.get("fastckpt-chunk") == "42"


async def test_overwrite_replaces(store) -> None:
    s, uri = store
    await s.put(uri.join("o"), b"old-old")
    await s.put(uri.join("o"), b"new")
    assert await s.get_range(uri.join("o"), 0, 100) == b"new"


async def test_multipart_create_if_absent(store) -> None:
    """A multipart upload created ``if_absent`` completes only while its key is free."""
    s, uri = store
    part = part_size_of(s)
    key = uri.join("mp-once")
    first = await s.create_multipart(key, part, if_absent=True)
    infos = [await first.put_part(0, os.urandom(part)), await first.put_part(1, b"first")]
    await first.complete(infos)
    second = await s.create_multipart(key, part, if_absent=True)
    infos = [await second.put_part(0, os.urandom(part)), await second.put_part(1, b"second-and-longer")]
    with pytest.raises(AlreadyExistsError):
        await second.complete(infos)
    await second.abort()
    assert (await s.head(key)).size == part + len(b"first")
    assert await s.get_range(key, part, 100) == b"first"
    assert [u for u in await s.list_pending_uploads(uri.key) if u.key == key] == []


@pytest.mark.parametrize("size", ["single", "multipart"])
async def test_engine_create_if_absent(store, tmp_path, size: str) -> None:
    """The engine's create-if-absent: an identical object counts as written, a different one is kept."""
    s, uri = store
    n = 1000 if size == "single" else 2 * part_size_of(s) + 5
    src, other = tmp_path / "src", tmp_path / "other"
    src.write_bytes(os.urandom(n))
    other.write_bytes(os.urandom(n))
    transfer = Transfer(s, small_config())
    try:
        first = await transfer.upload_file(str(src), uri.join("once"), if_absent=True)
        again = await transfer.upload_file(str(src), uri.join("once"), if_absent=True)
        assert again.digest == first.digest
        with pytest.raises(AlreadyExistsError):
            await transfer.upload_file(str(other), uri.join("once"), if_absent=True)
        down = await transfer.download_file(uri.join("once"), str(tmp_path / "down"))
    finally:
        transfer.close()
    assert (tmp_path / "down").read_bytes() == src.read_bytes()
    assert down.digest == first.digest
    assert [u for u in await s.list_pending_uploads(uri.key) if u.key == uri.join("once")] == []


async def test_read_with_meta(store) -> None:
    """The object's metadata with its first bytes (one request where the backend can): whole when it fits,
    a prefix and the true size when it does not, nothing for an empty object."""
    s, uri = store
    await s.put(uri.join("rwm/small"), b"0123456789", metadata={"fastckpt-k": "v"})
    await s.put(uri.join("rwm/empty"), b"")
    buf = bytearray(16)
    meta, n = await s.read_with_meta(uri.join("rwm/small"), memoryview(buf))
    assert (meta.size, n, bytes(buf[:n])) == (10, 10, b"0123456789")
    assert meta.metadata.get("fastckpt-k") == "v" and meta.key == uri.join("rwm/small")
    meta, n = await s.read_with_meta(uri.join("rwm/small"), memoryview(buf)[:4])
    assert meta.size == 10 and n in (0, 4) and bytes(buf[:n]) == b"0123"[:n]
    meta, n = await s.read_with_meta(uri.join("rwm/empty"), memoryview(buf))
    assert (meta.size, n) == (0, 0)
    with pytest.raises(ObjectNotFoundError):
        await s.read_with_meta(uri.join("rwm/missing"), memoryview(buf))


async def test_bytes_changed_behind_fastckpt_fail_the_read(store, tmp_path) -> None:
    """An object whose bytes change after fastckpt wrote them, by the backend's own means and keeping the recorded
    digests (a file edited in place; another client's write that copies the metadata), fails every read with
    IntegrityError naming it. Where the store can tell (a file's version), a rerun of the upload sends the file again
    instead of trusting the record."""
    from fastckpt import IntegrityError

    s, uri = store
    key = uri.join("changed.bin")
    data = os.urandom(2 * part_size_of(s) + 100)
    src = tmp_path / "changed.bin"
    src.write_bytes(data)
    transfer = Transfer(s, small_config())
    try:
        await transfer.upload_file(str(src), key)
        tampered = bytearray(data)
        tampered[len(data) // 2] ^= 0xFF
        path = s.local_file(key)
        if path is not None:  # a file on a filesystem: edited in place (its extended attributes stay)
            fd = os.open(path, os.O_WRONLY)
            os.pwrite(fd, bytes(tampered[len(data) // 2:len(data) // 2 + 1]), len(data) // 2)
            os.close(fd)
        else:
            await s.put(key, bytes(tampered), metadata=(await s.head(key)).metadata)
        reads = (lambda: transfer.download_file(key, str(tmp_path / "out.bin")), lambda: transfer.verify_object(key))
        for read in reads:
            with pytest.raises(IntegrityError, match=r"changed\.bin") as caught:
                await read()
            if path is not None:
                assert "changed after it was written" in str(caught.value)
        assert not (tmp_path / "out.bin").exists()
        if path is not None:
            assert await transfer.holds_file(str(src), key) is None
        await transfer.upload_file(str(src), key)
        await transfer.download_file(key, str(tmp_path / "out.bin"))
        assert (tmp_path / "out.bin").read_bytes() == data
    finally:
        transfer.close()
