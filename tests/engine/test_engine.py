"""Engine behaviour under faults, corruption and bad input, on the memory and local stores."""

from __future__ import annotations

import asyncio
import errno
import itertools
import os

import pytest

import fastckpt
from fastckpt import IntegrityError, ObjectNotFoundError, StoreError, TransferConfig, TransientStoreError
from fastckpt.engine.pool import BufferPool
from fastckpt.engine.transfer import Transfer
from fastckpt.stores.local import LocalStore
from fastckpt.stores.memory import MemoryStore
from harness.faults import FaultInjectingStore

from ..conftest import small_config

MiB = 1 << 20


@pytest.fixture
def data_file(tmp_path):
    path = tmp_path / "big.bin"
    path.write_bytes(os.urandom(3 * MiB + 777))
    return path


def leftovers(root) -> list[str]:
    return [n for _, _, files in os.walk(root) for n in files if n.endswith(".fastckpt-part")]


@pytest.mark.parametrize("inner", ["memory", "local"])
async def test_transient_errors_are_retried(inner: str, data_file, tmp_path) -> None:
    base = MemoryStore("retry") if inner == "memory" else LocalStore(str(tmp_path / "store"))
    store = FaultInjectingStore(base, error_rate=0.10, seed=7)
    transfer = Transfer(store, small_config(retries=8))
    up = await transfer.upload_file(str(data_file), "ckpt/big.bin")
    down = await transfer.download_file("ckpt/big.bin", str(tmp_path / "back.bin"))
    assert store.injected > 0, "the fault injector never fired; the test proves nothing"
    assert (tmp_path / "back.bin").read_bytes() == data_file.read_bytes()
    assert up.digest == down.digest


async def test_permanent_error_aborts_and_leaves_nothing(data_file, tmp_path) -> None:
    root = tmp_path / "store"
    base = LocalStore(str(root))
    store = FaultInjectingStore(base, fail_after=3, ops={"put_part", "complete"})
    transfer = Transfer(store, small_config())
    with pytest.raises(StoreError, match="injected permanent failure"):
        await transfer.upload_file(str(data_file), "ckpt/big.bin")
    with pytest.raises(ObjectNotFoundError):
        await base.head("ckpt/big.bin")
    assert leftovers(root) == []
    assert await base.list_pending_uploads("") == []


class SlowToAnswerCreate(MemoryStore):
    """Starts a multipart upload at once but answers late, as a server does whose answer is still on the wire."""

    async def create_multipart(self, key, part_size, metadata=None, *, if_absent=False):
        mpu = await super().create_multipart(key, part_size, metadata, if_absent=if_absent)
        await asyncio.sleep(0.2)
        return mpu


async def test_an_upload_started_while_a_sibling_fails_is_aborted(data_file, tmp_path) -> None:
    """A failing small file cancels the big one while its upload is being created: the upload the store
    started is aborted, not left for gc."""
    base = SlowToAnswerCreate("sibling")
    store = FaultInjectingStore(base, fail_after=0, ops={"put"})
    (tmp_path / "small.bin").write_bytes(b"s" * 100)
    transfer = Transfer(store, small_config())
    with pytest.raises(StoreError, match="injected permanent failure"):
        await transfer.upload_files([(str(data_file), "x/big.bin"), (str(tmp_path / "small.bin"), "x/small.bin")])
    assert await base.list_pending_uploads("") == []


async def test_retries_exhausted_names_the_file(data_file) -> None:
    store = FaultInjectingStore(MemoryStore("exhaust"), error_rate=1.0, ops={"put_part"})
    transfer = Transfer(store, small_config(retries=2))
    with pytest.raises(TransientStoreError, match=r"big\.bin.*failed after 3 attempts"):
        await transfer.upload_file(str(data_file), "x/big.bin")
    assert [m async for m in store.inner.list("x")] == []
    assert await store.inner.list_pending_uploads("") == []


@pytest.mark.parametrize("inner", ["memory", "local"])
async def test_flipped_byte_raises_integrity_error(inner: str, data_file, tmp_path) -> None:
    store = MemoryStore("flip") if inner == "memory" else LocalStore(str(tmp_path / "store"))
    transfer = Transfer(store, small_config())
    await transfer.upload_file(str(data_file), "ckpt/model.bin")
    meta = await store.head("ckpt/model.bin")
    data = bytearray(await store.get_range("ckpt/model.bin", 0, meta.size))
    data[2 * MiB + 5] ^= 0x01
    await store.put("ckpt/model.bin", bytes(data), metadata=meta.metadata)
    out = tmp_path / "out" / "model.bin"
    with pytest.raises(IntegrityError, match=r"ckpt/model\.bin"):
        await transfer.download_file("ckpt/model.bin", str(out))
    assert not out.exists()
    assert leftovers(tmp_path / "out") == []
    with pytest.raises(IntegrityError, match=r"ckpt/model\.bin"):
        await transfer.verify_object("ckpt/model.bin")


async def test_memory_stays_bounded_by_pool(tmp_path) -> None:
    path = tmp_path / "f"
    path.write_bytes(os.urandom(20 * MiB))
    config = small_config(part_size=MiB, multipart_threshold=MiB, max_in_flight=64, memory_limit=3 * MiB)
    transfer = Transfer(MemoryStore("bounded"), config)
    await transfer.upload_file(str(path), "f")
    await transfer.download_file("f", str(tmp_path / "g"))
    assert transfer.ring == MiB and transfer.pool.peak <= 3 * MiB  # 40 parts and ranges moved through 3 MiB


async def test_pool_reuses_and_replaces_buffers_within_its_limit() -> None:
    pool = BufferPool(MiB, limit=2 * MiB)
    async with pool.buffer(100) as a:  # small: a 64 KiB buffer, reused for what fits it
        assert len(a) == 100
    async with pool.buffer(4096) as b:
        assert len(b) == 4096
    assert pool.allocated == 1
    async with pool.buffer(MiB), pool.buffer(MiB):  # the free 64 KiB buffer is unmapped to make room
        assert pool.allocated == 2 and pool.peak <= 2 * MiB
    async with pool.buffer(3 * MiB) as big:  # larger than the limit: served while nothing else is lent
        assert len(big) == 3 * MiB
    pool.close()
    assert pool.allocated == 0


async def test_pool_lends_in_turn_within_its_limit_and_count() -> None:
    pool, order, lent = BufferPool(MiB, limit=2 * MiB, count=3), [], []

    async def hold(name: str, nbytes: int) -> None:
        async with pool.buffer(nbytes):
            order.append(name)
            lent.append(pool.peak)
            await asyncio.sleep(0.01)

    await asyncio.gather(hold("a", MiB), hold("b", MiB), hold("big", 2 * MiB), hold("small", 64 << 10))
    assert order == ["a", "b", "big", "small"]  # the small one waited its turn behind the big one
    assert max(lent) <= 2 * MiB
    small = BufferPool(MiB, limit=1 << 30, count=3)
    held = 0

    async def count() -> None:
        nonlocal held
        async with small.buffer(4096):
            held += 1
            assert held <= 3
            await asyncio.sleep(0.01)
            held -= 1

    await asyncio.gather(*(count() for _ in range(10)))


async def test_progress_reaches_total(data_file, tmp_path) -> None:
    seen: list[tuple[int, int]] = []
    transfer = Transfer(MemoryStore("progress"), small_config(), progress=lambda d, t: seen.append((d, t)))
    await transfer.upload_file(str(data_file), "p")
    assert seen[-1] == (data_file.stat().st_size, data_file.stat().st_size)
    assert all(d1 <= d2 for (d1, _), (d2, _) in itertools.pairwise(seen))


def test_bad_input_errors(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="does-not-exist"):
        fastckpt.upload(tmp_path / "does-not-exist", f"file://{tmp_path}/dst")
    with pytest.raises(ValueError, match="invalid storage URI"):
        fastckpt.upload(__file__, "s3://")
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a").write_bytes(b"a")
    (tmp_path / "src" / "b").write_bytes(b"b")
    fastckpt.upload(tmp_path / "src", f"file://{tmp_path}/store/dir")
    (tmp_path / "plain-file").write_bytes(b"x")
    with pytest.raises(NotADirectoryError, match=r"plain-file.*is a file"):
        fastckpt.download(f"file://{tmp_path}/store/dir", tmp_path / "plain-file")
    with pytest.raises(ObjectNotFoundError, match="nothing found"):
        fastckpt.download(f"file://{tmp_path}/store/none", tmp_path / "out")


def test_sync_api_inside_running_loop(tmp_path) -> None:
    import asyncio

    (tmp_path / "f").write_bytes(b"hello")

    async def caller() -> list[fastckpt.FileResult]:
        return fastckpt.upload(tmp_path / "f", "memory://loop/f")  # sync call from a loop thread

    results = asyncio.run(caller())
    assert results[0].digest.size == 5


def test_download_into_directory_and_file_target(tmp_path) -> None:
    (tmp_path / "f.bin").write_bytes(b"payload")
    fastckpt.upload(tmp_path / "f.bin", "memory://targets/dir/")
    (tmp_path / "d").mkdir()
    fastckpt.download("memory://targets/dir/f.bin", tmp_path / "d")
    assert (tmp_path / "d" / "f.bin").read_bytes() == b"payload"
    fastckpt.download("memory://targets/dir/f.bin", tmp_path / "renamed.bin")
    assert (tmp_path / "renamed.bin").read_bytes() == b"payload"


async def test_pool_never_reuses_a_buffer_after_a_failure() -> None:
    pool = BufferPool(1024, 1)
    held = []
    with pytest.raises(RuntimeError):
        async with pool.buffer(10) as view:
            held.append(memoryview(view))  # e.g. a connection still flushing it
            raise RuntimeError("request failed")
    async with pool.buffer(10) as again:
        again[:3] = b"new"
    assert bytes(held[0][:3]) == b"\0\0\0"  # the failed request's buffer was not lent again
    assert pool.allocated == 1
    pool.close()


@pytest.mark.parametrize("pieces", [[1], [7, 1, 30], [64], [13] * 9, [100, 1, 1]])
def test_chunk_hasher_matches_one_shot_hashing(pieces: list[int]) -> None:
    """Streaming digests (downloads hash each slice as it lands) equal the one-shot chunk digests, wherever
    the slices fall relative to the chunk boundaries."""
    from fastckpt.integrity import ChunkHasher, hash_chunks

    data = os.urandom(sum(pieces))
    hasher = ChunkHasher(16)
    pos = 0
    for size in pieces:
        hasher.update(memoryview(data)[pos:pos + size])
        pos += size
    assert hasher.finish() == hash_chunks(data, 16)


async def _arrive(sink, data: bytes, step: int, full: list[tuple[int, int]] | None = None) -> int:
    """A request landing ``data`` in ``sink``, ``step`` bytes per socket read, waiting whenever it has no room
    (``full`` records, each time, how much of the file was written and how many bytes had landed)."""
    pos = 0
    while pos < len(data):
        room = sink.free()
        if not len(room):
            if full is not None:
                full.append((os.fstat(sink.fd).st_size, sink.count))
            await sink.room()
            continue
        n = min(len(room), step, len(data) - pos)
        room[:n] = data[pos:pos + n]
        sink.landed(n)
        pos += n
        await asyncio.sleep(0)
    return pos


async def test_a_long_range_is_hashed_and_written_through_a_small_ring(tmp_path) -> None:
    """A range five times the ring arrives in uneven reads: each whole slice is hashed and written as it lands,
    arrival waits while the ring is full, and the file and chunk digests come out whole."""
    import threading

    from fastckpt.engine.sink import SLICE, RingSink
    from fastckpt.integrity import hash_chunks

    data = os.urandom(5 * SLICE + 5)
    path = tmp_path / "out"
    fd = os.open(path, os.O_RDWR | os.O_CREAT)
    try:
        sink = RingSink("obj", fd, threading.Lock(), 7, len(data), memoryview(bytearray(2 * SLICE)), 3 * SLICE)
        full: list[tuple[int, int]] = []
        digests = await sink.receive(_arrive(sink, data, 300_001, full))
    finally:
        os.close(fd)
    assert digests == hash_chunks(data, 3 * SLICE) and path.read_bytes() == bytes(7) + data
    # it waited with the ring full: the slices before the ring on disk, the ring's own still being written
    assert full and all(landed - 2 * SLICE <= max(size - 7, 0) <= landed for size, landed in full)


async def test_a_ring_sink_that_cannot_write_stops_its_request(tmp_path) -> None:
    """A failed write (here a read-only file) cancels the request receiving into the ring and is raised; an
    object that ends early is a StoreError."""
    import threading

    from fastckpt.engine.sink import SLICE, RingSink

    data = os.urandom(4 * SLICE)
    (tmp_path / "ro").write_bytes(b"")
    fd = os.open(tmp_path / "ro", os.O_RDONLY)
    request = asyncio.ensure_future(asyncio.sleep(0))
    try:
        sink = RingSink("obj", fd, threading.Lock(), 0, len(data), memoryview(bytearray(SLICE)), SLICE)
        request = asyncio.ensure_future(_arrive(sink, data, SLICE))
        with pytest.raises(OSError) as info:
            await sink.receive(request)
        assert info.value.errno == errno.EBADF and request.cancelled()
    finally:
        os.close(fd)
    sink = RingSink("obj", None, threading.Lock(), 0, len(data), memoryview(bytearray(SLICE)), SLICE)
    with pytest.raises(StoreError, match="obj: object shrank during download"):
        await sink.receive(_arrive(sink, data[:SLICE + 3], 4096))


async def test_a_retried_receive_asks_only_for_what_did_not_land() -> None:
    """A request that fails mid-body is retried from the first byte that had not landed, into the same
    receiver."""
    from fastckpt.stores.retry import RetryingStore
    from fastckpt.transport import BufferReceiver

    class CutOff(MemoryStore):
        calls: list[tuple[int, int]] = []

        async def receive(self, key, start, length, into):
            self.calls.append((start, length))
            if len(self.calls) == 1:  # half of it lands, then the connection breaks
                half = length // 2
                into.free()[:half] = (await self.get_range(key, start, half))
                into.landed(half)
                raise ConnectionResetError("reset mid-body")
            return await super().receive(key, start, length, into)

    data = os.urandom(1000)
    store = CutOff()
    await store.put("k", data)
    buf = bytearray(900)
    into = BufferReceiver(memoryview(buf))
    retried = RetryingStore(store, TransferConfig(backoff_base=0.001))
    assert await retried.receive("k", 100, 900, into) == 900
    assert bytes(buf) == data[100:] and store.calls == [(100, 900), (550, 450)]


@pytest.mark.parametrize("in_kernel", [True, False])
def test_copy_and_hash_copies_and_hashes_what_it_wrote(tmp_path, monkeypatch, in_kernel: bool) -> None:
    """Local copies go through ``copy_file_range`` and a mapping of the target, or, where the kernel cannot
    copy, through a small buffer: the same bytes and the same chunk digests either way, at any offset."""
    import threading

    from fastckpt.engine.sink import COPY_SLICE as SLICE
    from fastckpt.engine.sink import copy_and_hash
    from fastckpt.integrity import hash_chunks

    if not in_kernel:
        monkeypatch.delattr(os, "copy_file_range", raising=False)
    data = os.urandom(3 * SLICE + 4099)
    (tmp_path / "src").write_bytes(data)
    fd = os.open(tmp_path / "dst", os.O_RDWR | os.O_CREAT)
    try:
        offset, length = 5000, len(data) - 5000  # not page-aligned
        digests = copy_and_hash(str(tmp_path / "src"), offset, length, fd, threading.Lock(), SLICE + 7)
        with pytest.raises(EOFError):
            copy_and_hash(str(tmp_path / "src"), len(data) - 10, 20, fd, threading.Lock(), 20)
    finally:
        os.close(fd)
    assert (tmp_path / "dst").read_bytes()[offset:offset + length] == data[offset:]
    assert digests == hash_chunks(data[offset:], SLICE + 7)


def test_download_and_copy_ranges() -> None:
    """Download ranges stay chunk-aligned and share the batch among the requests in flight (at most 128 MiB
    each; a file of one range has no journal to resume from, so even one that would fit is cut in two). Local
    copies share it among the copy slots: a file that fits in a share is one range, a larger one equal shares."""
    from fastckpt.engine.plan import plan_copy, plan_download

    mib = 1 << 20
    config = TransferConfig(part_size=8 * mib, max_in_flight=8)
    shape = lambda plan: (plan.count, plan.part_size)  # noqa: E731
    assert shape(plan_download(1024 * mib, 32 * mib, config)) == (8, 128 * mib)
    assert shape(plan_download(100 * mib, 32 * mib, config, batch=900 * mib)) == (2, 96 * mib)
    assert shape(plan_download(5 * mib, None, config)) == (1, 8 * mib)
    assert shape(plan_download(0, None, config)) == (0, 8 * mib)
    assert shape(plan_copy(207 * mib, 32 * mib, config, batch=1024 * mib, slots=2)) == (1, 224 * mib)
    assert shape(plan_copy(1024 * mib, 32 * mib, config, batch=1024 * mib, slots=2)) == (2, 512 * mib)
    assert shape(plan_copy(1000 * mib, 32 * mib, config, batch=0, slots=3)) == (3, 352 * mib)
    assert shape(plan_copy(24 * mib, 5 * mib, TransferConfig(range_size=1), batch=0, slots=2)) == (5, 5 * mib)


async def test_local_store_round_trip_uses_no_pooled_buffer(tmp_path) -> None:
    """Files into and out of a local store are copied file to file: no part goes through the buffer pool (a
    small file's upload does: it is read whole, then put)."""
    data = os.urandom(5 * (256 << 10) + 3)
    (tmp_path / "f").write_bytes(data)
    (tmp_path / "small").write_bytes(b"tiny")
    store = LocalStore(str(tmp_path / "store"))
    transfer = Transfer(store, small_config())
    up = await transfer.upload_file(str(tmp_path / "f"), "k")
    assert transfer.pool.allocated == 0
    await transfer.upload_file(str(tmp_path / "small"), "s")
    transfer.close()
    transfer = Transfer(store, small_config())
    down = await transfer.download_file("k", str(tmp_path / "back"))
    await transfer.download_files([("s", str(tmp_path / "small.back"))], sizes={"s": 4})  # a listed small file
    assert transfer.pool.allocated == 0
    transfer.close()
    assert (tmp_path / "back").read_bytes() == data and up.digest == down.digest
    assert (tmp_path / "small.back").read_bytes() == b"tiny"


async def test_a_read_across_views_receives_large_ones_straight_and_hashes_the_whole() -> None:
    """``read_layout`` into views of mixed sizes (large tensors with small ones between): every byte lands in its
    view, the chunk digests are those of the object, and large views are received without a buffer (none is taken
    from the pool for a part whose views are all large)."""
    from fastckpt.engine.layout import DIRECT_PIECE, Layout, read_layout
    from fastckpt.integrity import hash_chunks

    sizes = [2 * DIRECT_PIECE + 3, 10, 20, 3 * DIRECT_PIECE, 5, 7, DIRECT_PIECE + 1]
    data = os.urandom(sum(sizes))
    store = MemoryStore("across")
    await store.put("obj", data)
    transfer = Transfer(store, small_config(part_size=4 * DIRECT_PIECE))
    views = [memoryview(bytearray(n)) for n in sizes]
    taken = []
    buffer = transfer.pool.buffer
    transfer.pool.buffer = lambda n: (taken.append(n), buffer(n))[1]  # type: ignore[method-assign]
    try:
        chunks = await read_layout(transfer, "obj", 0, Layout(views), DIRECT_PIECE)
    finally:
        transfer.close()
    assert b"".join(bytes(v) for v in views) == data
    assert chunks == hash_chunks(memoryview(data), DIRECT_PIECE)
    assert taken == []
