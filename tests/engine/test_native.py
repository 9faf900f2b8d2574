"""The native accelerator ``fastckpt._native`` and its pure-Python fallback in ``fastckpt.integrity``.

Both paths must give digests byte-identical to the ``xxhash`` package and raise the same errors. The pure
path is the default; ``FASTCKPT_NATIVE=1`` turns the module on, and then it must be present.
"""

from __future__ import annotations

import importlib
import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from fastckpt import fileio, integrity
from fastckpt import native as accelerator

CHUNK = 64 << 10  # also the native GIL threshold, so both sides of it are covered
SIZES = [0, 1, 3, 15, 16, 17, 128, 129, 240, 241, 1001, CHUNK - 1, CHUNK, CHUNK + 1, 3 * CHUNK + 7, (8 << 20) + 13]
ROOT = Path(__file__).resolve().parents[2]


def _load_native() -> ModuleType | None:
    try:
        return importlib.import_module("fastckpt._native")
    except ModuleNotFoundError:
        return None


NATIVE_MODULE = _load_native()
NATIVE_OFF = os.environ.get("FASTCKPT_NATIVE", "0").lower() not in ("1", "true", "yes", "on")


@pytest.fixture(scope="module")
def native() -> ModuleType:
    """The native module; a failure when it is missing and FASTCKPT_NATIVE=1 or FASTCKPT_REQUIRE_NATIVE=1 (else a
    skip)."""
    if NATIVE_MODULE is None:
        if NATIVE_OFF and os.environ.get("FASTCKPT_REQUIRE_NATIVE") != "1":
            pytest.skip("fastckpt._native is not built and FASTCKPT_NATIVE is not 1")
        pytest.fail("fastckpt._native is not built: install a C compiler and libxxhash-dev, then "
                    "`pip install -e .`; or leave FASTCKPT_NATIVE unset to test the pure-Python path only")
    return NATIVE_MODULE


@pytest.fixture(params=["native", "fallback"])
def impl(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> SimpleNamespace:
    """The four accelerated functions, from the native module or from integrity's fallback."""
    if request.param == "native":
        mod = request.getfixturevalue("native")
        return SimpleNamespace(xxh3_128=mod.xxh3_128, chunks=mod.xxh3_128_chunks,
                               read_and_hash=mod.read_and_hash, write_at=mod.write_at)
    monkeypatch.setattr(integrity, "_native", None)
    monkeypatch.setattr(fileio, "_native", None)
    return SimpleNamespace(xxh3_128=integrity.hash_chunk, chunks=integrity.hash_chunks,
                           read_and_hash=integrity.read_and_hash, write_at=fileio.write_at)


def ref_chunks(data: bytes, chunk: int) -> list[bytes]:
    return [xxhash.xxh3_128_digest(data[i : i + chunk]) for i in range(0, len(data), chunk)]


def data_file(directory: Path, data: bytes) -> Path:
    path = directory / "data.bin"
    path.write_bytes(data)
    return path


# ----------------------------------------------------------------------------- presence


def test_native_required_when_asked() -> None:
    """CI sets FASTCKPT_REQUIRE_NATIVE=1: the build must have produced the module, and it must load."""
    if os.environ.get("FASTCKPT_REQUIRE_NATIVE") != "1":
        pytest.skip("FASTCKPT_REQUIRE_NATIVE is not set")
    assert NATIVE_MODULE is not None, "FASTCKPT_REQUIRE_NATIVE=1 but fastckpt._native is not built"
    if not NATIVE_OFF:
        assert accelerator.NATIVE and accelerator.native_info()["status"] == "loaded"


def test_native_info_matches_module() -> None:
    info = accelerator.native_info()
    assert info["native"] is accelerator.NATIVE
    assert accelerator.NATIVE == (NATIVE_MODULE is not None and not NATIVE_OFF)
    if accelerator.NATIVE:
        assert info["xxhash"] == NATIVE_MODULE.XXHASH_VERSION
        assert Path(str(info["path"])).name.startswith("_native")


# ----------------------------------------------------------------------------- digests


@pytest.mark.parametrize("size", SIZES)
def test_digest_matches_xxhash(impl: SimpleNamespace, size: int) -> None:
    data = random.Random(size).randbytes(size)
    expected = xxhash.xxh3_128_digest(data)
    for form in (data, bytearray(data), memoryview(data)):
        assert impl.xxh3_128(form) == expected


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("chunk", [1, 7, 256, CHUNK - 1, CHUNK, CHUNK + 1])
def test_chunks_match_xxhash(impl: SimpleNamespace, size: int, chunk: int) -> None:
    if chunk < 256 and size > 4 * CHUNK:
        pytest.skip("tiny chunks over large buffers only repeat the small cases")
    data = random.Random(size * 31 + chunk).randbytes(size)
    assert impl.chunks(memoryview(data), chunk) == ref_chunks(data, chunk)


@pytest.mark.parametrize("size", SIZES)
def test_read_and_hash_matches_xxhash(impl: SimpleNamespace, tmp_path: Path, size: int) -> None:
    data = random.Random(size).randbytes(size + 100)
    fd = os.open(data_file(tmp_path, data), os.O_RDONLY)
    try:
        for offset in (0, 1, 100):
            buf = bytearray(size)
            assert impl.read_and_hash(fd, offset, memoryview(buf)) == xxhash.xxh3_128_digest(data[offset:offset + size])
            assert buf == data[offset : offset + size]
    finally:
        os.close(fd)


@pytest.mark.parametrize("size", [0, 1, CHUNK + 1, (8 << 20) + 13])
def test_write_at_writes_everything(impl: SimpleNamespace, tmp_path: Path, size: int) -> None:
    data = random.Random(size).randbytes(size)
    path = tmp_path / "out.bin"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        impl.write_at(fd, 10, memoryview(data))
        impl.write_at(fd, 0, b"0123456789")
    finally:
        os.close(fd)
    assert path.read_bytes() == b"0123456789" + data


@settings(max_examples=60, deadline=None)
@given(size=st.integers(0, 300_000), chunk=st.integers(1, 100_000), seed=st.integers(0, 2**32))
def test_property_native_and_fallback_agree(size: int, chunk: int, seed: int) -> None:
    data = random.Random(seed).randbytes(size)
    want = ref_chunks(data, chunk)
    assert integrity.hash_chunks(data, chunk) == want
    assert integrity.hash_chunk(data) == xxhash.xxh3_128_digest(data)
    if NATIVE_MODULE is not None:
        assert NATIVE_MODULE.xxh3_128_chunks(data, chunk) == want
        assert NATIVE_MODULE.xxh3_128(data) == xxhash.xxh3_128_digest(data)


@settings(max_examples=40, deadline=None)
@given(size=st.integers(0, 2_000_000), seed=st.integers(0, 2**32), data=st.data())
def test_property_read_and_hash(size: int, seed: int, data: st.DataObject) -> None:
    content = random.Random(seed).randbytes(size)
    offset = data.draw(st.integers(0, size))
    length = data.draw(st.integers(0, size - offset))
    with tempfile.TemporaryFile() as f:
        f.write(content)
        f.flush()
        want = xxhash.xxh3_128_digest(content[offset : offset + length])
        fns = [integrity.read_and_hash] + ([NATIVE_MODULE.read_and_hash] if NATIVE_MODULE is not None else [])
        for fn in fns:
            buf = bytearray(length)
            assert fn(f.fileno(), offset, memoryview(buf)) == want
            assert buf == content[offset : offset + length]


# ----------------------------------------------------------------------------- errors


def test_bad_fd_raises_oserror(impl: SimpleNamespace, tmp_path: Path) -> None:
    fd = os.open(data_file(tmp_path, b"x" * 10), os.O_RDONLY)
    os.close(fd)  # now a closed descriptor
    for bad in (-1, fd):
        with pytest.raises(OSError) as err:
            impl.read_and_hash(bad, 0, bytearray(4))
        assert err.value.errno == 9  # EBADF
        with pytest.raises(OSError):
            impl.write_at(bad, 0, b"abcd")


def test_write_to_read_only_fd_raises(impl: SimpleNamespace, tmp_path: Path) -> None:
    fd = os.open(data_file(tmp_path, b"x" * 10), os.O_RDONLY)
    try:
        with pytest.raises(OSError):
            impl.write_at(fd, 0, b"abcd")
    finally:
        os.close(fd)


def test_range_past_eof_raises_eoferror(impl: SimpleNamespace, tmp_path: Path) -> None:
    fd = os.open(data_file(tmp_path, bytes(range(100))), os.O_RDONLY)
    try:
        with pytest.raises(EOFError, match="end of file at byte 100: wanted 50 bytes from offset 60, got 40"):
            impl.read_and_hash(fd, 60, bytearray(50))
        with pytest.raises(EOFError, match="end of file at byte 200: wanted 5 bytes from offset 200, got 0"):
            impl.read_and_hash(fd, 200, bytearray(5))
    finally:
        os.close(fd)


def test_bad_buffers_and_arguments(impl: SimpleNamespace, tmp_path: Path) -> None:
    fd = os.open(data_file(tmp_path, b"y" * 100), os.O_RDWR)
    try:
        for read_only in (b"abcd", memoryview(b"abcd")):
            with pytest.raises(BufferError):
                impl.read_and_hash(fd, 0, read_only)
        strided = memoryview(bytearray(8))[::2]
        with pytest.raises(BufferError):
            impl.read_and_hash(fd, 0, strided)
        with pytest.raises(ValueError, match="offset"):
            impl.read_and_hash(fd, -1, bytearray(4))
        with pytest.raises(ValueError, match="offset"):
            impl.write_at(fd, -1, b"abcd")
        for chunk in (0, -5):
            with pytest.raises(ValueError):
                impl.chunks(b"abc", chunk)
        assert impl.read_and_hash(fd, 0, bytearray(0)) == xxhash.xxh3_128_digest(b"")
    finally:
        os.close(fd)


def test_native_rejects_non_buffers(native: ModuleType) -> None:
    for fn, args in [(native.xxh3_128, ("text",)), (native.xxh3_128_chunks, ("text", 4)),
                     (native.read_and_hash, (0, 0, "text")), (native.write_at, (0, 0, 42)),
                     (native.read_and_hash, ("fd", 0, bytearray(1))), (native.read_and_hash, (0, 2**70, bytearray(1)))]:
        with pytest.raises((TypeError, OverflowError)):
            fn(*args)


# ----------------------------------------------------------------------------- the GIL


def _two_threads_overlap(call: Callable[[int], object], rounds: int = 40) -> bool:
    """Whether two threads looping over ``call`` were ever inside it at the same time.

    With a huge switch interval, a thread gives up the GIL only when something it calls releases it.
    A call that holds the GIL therefore runs its whole loop alone and no call can start inside another's
    (start, end) interval; a call that releases it lets the other thread start while it runs.
    """
    spans: list[list[tuple[float, float]]] = [[], []]
    barrier = threading.Barrier(2)

    def worker(who: int) -> None:
        barrier.wait()
        for _ in range(rounds):
            start = time.perf_counter()
            call(who)
            spans[who].append((start, time.perf_counter()))

    old = sys.getswitchinterval()
    sys.setswitchinterval(100.0)
    try:
        threads = [threading.Thread(target=worker, args=(i,)) for i in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(old)
    return any(s0 < e1 and s1 < e0 for s0, e0 in spans[0] for s1, e1 in spans[1])


def test_overlap_probe_detects_gil_holders() -> None:
    """Control: a C call that holds the GIL (``sum`` over a range) never overlaps."""
    assert not _two_threads_overlap(lambda _: sum(range(200_000)), rounds=10)


def test_native_hashing_releases_gil(native: ModuleType) -> None:
    bufs = [random.Random(i).randbytes(16 << 20) for i in (0, 1)]
    assert _two_threads_overlap(lambda who: native.xxh3_128(bufs[who]))
    assert _two_threads_overlap(lambda who: native.xxh3_128_chunks(bufs[who], 1 << 20))


def test_native_file_io_releases_gil(native: ModuleType, tmp_path: Path) -> None:
    data = random.Random(7).randbytes(16 << 20)
    fds = [os.open(data_file(tmp_path, data), os.O_RDWR) for _ in (0, 1)]
    bufs = [bytearray(len(data)) for _ in (0, 1)]
    try:
        assert _two_threads_overlap(lambda who: native.read_and_hash(fds[who], 0, bufs[who]))
        assert _two_threads_overlap(lambda who: native.write_at(fds[who], 0, bufs[who]))
    finally:
        for fd in fds:
            os.close(fd)


# ----------------------------------------------------------------------------- engine round trip

ROUND_TRIP = """
import json, os, sys
from fastckpt import TransferConfig, native
from fastckpt.api import download, upload
src, store, out = sys.argv[1:4]
config = TransferConfig(part_size=256 << 10, multipart_threshold=256 << 10, max_in_flight=4)
up = upload(src, f"file://{store}/ckpt", config=config)
down = download(f"file://{store}/ckpt", out, config=config)
def digests(results):
    return sorted((os.path.basename(r.path), r.digest.size, r.digest.chunk_size, r.digest.digest) for r in results)
print(json.dumps({"native": native.NATIVE, "up": digests(up), "down": digests(down)}))
"""


def test_engine_round_trip_native_on_and_off(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    rng = random.Random(5)
    for name, size in [("empty", 0), ("small", 1001), ("one_part", 256 << 10), ("multi", (3 << 20) + 777)]:
        (src / name).write_bytes(rng.randbytes(size))
    results = {}
    for flag in ("0", "1"):
        env = {**os.environ, "FASTCKPT_NATIVE": flag, "PYTHONPATH": str(ROOT)}
        proc = subprocess.run([sys.executable, "-c", ROUND_TRIP, str(src), str(tmp_path / f"store{flag}"),
                               str(tmp_path / f"out{flag}")], env=env, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        results[flag] = json.loads(proc.stdout.strip().splitlines()[-1])
        for name in os.listdir(src):
            assert (tmp_path / f"out{flag}" / name).read_bytes() == (src / name).read_bytes()
    assert results["0"]["native"] is False
    assert results["1"]["native"] is (NATIVE_MODULE is not None)
    if NATIVE_MODULE is None and not NATIVE_OFF:
        pytest.fail("fastckpt._native is not built (leave FASTCKPT_NATIVE unset to test pure Python only)")
    assert results["0"]["up"] == results["1"]["up"] == results["0"]["down"] == results["1"]["down"]
    assert len(results["0"]["up"]) == 4
