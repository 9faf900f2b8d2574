"""The pyarrow facade (fastckpt.fs) over every backend: pyarrow filesystem semantics, streams, copy_files,
threading, pickling, delegation, and that no upload failure is ever lost."""

from __future__ import annotations

import asyncio
import functools
import gc
import multiprocessing
import os
import pickle
import threading
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.fs as pafs
import pytest
from pyarrow.lib import ArrowNotImplementedError

import fastckpt.fs as ffs
from fastckpt import IntegrityError, StoreError, TransferConfig
from fastckpt.engine.plan import plan_upload
from fastckpt.integrity import FileDigest
from fastckpt.stores.base import Store
from harness.faults import FaultInjectingStore

from ..conftest import small_config

MiB = 1 << 20
OBJECT_STORES = ("memory", "s3", "gcs", "azure")


# ----------------------------------------------------------------------------- helpers


def facade(uri: str, config: TransferConfig | None = None, wrapper=None) -> tuple[pafs.FileSystem, str]:
    """(filesystem, base path) for a fresh store URI; the base directory exists."""
    plain, base = ffs.from_uri(uri, config=config or small_config())
    plain.create_dir(base, recursive=True)
    return (ffs.from_uri(uri, config=config or small_config(), store_wrapper=wrapper)[0] if wrapper else plain), base


def store_of(fs: pafs.FileSystem, path: str) -> tuple[Store, str]:
    handler = fs.handler
    bucket, key = handler.split(path)
    return handler.run(handler.store(bucket)), key


def head(fs: pafs.FileSystem, path: str):
    store, key = store_of(fs, path)
    return fs.handler.run(store.head(key))


def pending(fs: pafs.FileSystem, path: str) -> list:
    store, key = store_of(fs, path)
    return fs.handler.run(store.list_pending_uploads(key))


def part_size(fs: pafs.FileSystem, path: str) -> int:
    return plan_upload(1, fs.handler.config, store_of(fs, path)[0]).part_size


def write(fs: pafs.FileSystem, path: str, data: bytes, step: int | None = None) -> None:
    with fs.open_output_stream(path) as out:
        step = step or max(1, len(data))
        for i in range(0, len(data), step):
            out.write(data[i : i + step])


def read(fs: pafs.FileSystem, path: str, step: int = -1) -> bytes:
    with fs.open_input_stream(path) as f:
        if step < 0:
            return f.read()
        chunks = []
        while chunk := f.read(step):
            chunks.append(chunk)
        return b"".join(chunks)


def permanent(ops: set[str]):
    """A store wrapper (picklable) whose ``ops`` fail for good."""
    return functools.partial(FaultInjectingStore, fail_after=0, ops=ops)


# ----------------------------------------------------------------------------- semantics vs pyarrow


def scenario(fs: pafs.FileSystem, base: str) -> list[tuple[str, object]]:
    """Operations with their outcome: a normalised result, or the exception raised."""
    p = lambda rel: f"{base}/{rel}" if rel else base  # noqa: E731
    out: list[tuple[str, object]] = []

    def rel(path: str) -> str:
        return path[len(base) + 1 :]

    def infos(result: list[pafs.FileInfo]) -> list[tuple[str, str, int | None]]:
        return sorted((rel(i.path), i.type.name, i.size if i.is_file else None) for i in result)

    def do(name: str, fn, *args, **kwargs) -> None:
        try:
            out.append((name, fn(*args, **kwargs)))
        except Exception as exc:
            out.append((name, exc))

    def put(rel_path: str, data: bytes) -> None:
        with fs.open_output_stream(p(rel_path)) as f:
            f.write(data)

    def stat(*rels: str) -> list[tuple[str, str, int | None]]:
        return infos(fs.get_file_info([p(r) for r in rels]))

    all_paths = ("a", "a/1", "a/2", "a/b", "a/b/c", "a/b/3", "ab", "ab/4", "nope", "a/1/x", "m1", "c3")
    do("mkdir recursive", fs.create_dir, p("a/b/c"))
    do("mkdir again", fs.create_dir, p("a/b/c"), recursive=False)
    do("mkdir missing parent", fs.create_dir, p("x/y"), recursive=False)
    do("write a/1", put, "a/1", b"0123456789")
    do("write a/2 empty", put, "a/2", b"")
    do("write a/b/3", put, "a/b/3", os.urandom(1000))
    do("mkdir ab", fs.create_dir, p("ab"))
    do("write ab/4", put, "ab/4", b"4")
    do("stat", stat, *all_paths)
    do("select recursive", lambda: infos(fs.get_file_info(pafs.FileSelector(base, recursive=True))))
    do("select a", lambda: infos(fs.get_file_info(pafs.FileSelector(p("a")))))
    do("select a/ trailing slash", lambda: infos(fs.get_file_info(pafs.FileSelector(p("a") + "/"))))
    do("select missing", fs.get_file_info, pafs.FileSelector(p("nope")))
    do("select missing ok", lambda: infos(fs.get_file_info(pafs.FileSelector(p("nope"), allow_not_found=True))))
    do("select file", fs.get_file_info, pafs.FileSelector(p("a/1")))
    do("mkdir over file", fs.create_dir, p("a/1"))
    do("mkdir below file", fs.create_dir, p("a/1/z"))
    do("open dir", fs.open_input_stream, p("a"))
    do("open missing", fs.open_input_file, p("nope"))
    do("write over dir", fs.open_output_stream, p("a"))
    do("delete_file dir", fs.delete_file, p("a"))
    do("delete_file missing", fs.delete_file, p("nope"))
    do("delete_dir file", fs.delete_dir, p("a/1"))
    do("delete_dir missing", fs.delete_dir, p("nope"))
    do("delete_dir_contents missing", fs.delete_dir_contents, p("nope"))
    do("delete_dir_contents missing ok", fs.delete_dir_contents, p("nope"), missing_dir_ok=True)
    do("delete_dir_contents file", fs.delete_dir_contents, p("a/1"))
    do("move a/1 -> m1", fs.move, p("a/1"), p("m1"))
    do("move missing", fs.move, p("nope"), p("m2"))
    do("copy a/b/3 -> c3", fs.copy_file, p("a/b/3"), p("c3"))
    do("copy dir", fs.copy_file, p("a"), p("c4"))
    do("copy missing", fs.copy_file, p("nope"), p("c5"))
    do("same bytes after copy", lambda: read(fs, p("c3")) == read(fs, p("a/b/3")))
    do("stat after moves", stat, *all_paths)
    do("delete_dir_contents a/b", fs.delete_dir_contents, p("a/b"))
    do("stat after delete_dir_contents", stat, "a/b", "a/b/c", "a/b/3")
    do("delete_file m1", fs.delete_file, p("m1"))
    do("delete_file ab/4 keeps ab", fs.delete_file, p("ab/4"))
    do("delete_dir a", fs.delete_dir, p("a"))
    do("stat after deletes", stat, "", "a", "a/2", "ab", "m1")
    do("select after deletes", lambda: infos(fs.get_file_info(pafs.FileSelector(base, recursive=True))))
    return out


def same_outcome(ours: object, ref: object) -> bool:
    """Equal results, or an exception of the reference's type (ours may be more specific)."""
    if isinstance(ref, BaseException):
        return isinstance(ours, type(ref))
    return ours == ref


def test_semantics_match_pyarrow(store_uri: str, tmp_path: Path) -> None:
    ref_base = str(tmp_path / "reference")
    os.makedirs(ref_base)
    reference = scenario(pafs.LocalFileSystem(), ref_base)
    fs, base = facade(store_uri)
    ours = scenario(fs, base)
    assert [name for name, _ in ours] == [name for name, _ in reference]
    mismatches = [f"{name}: ours {o!r}, pyarrow {r!r}" for (name, o), (_, r) in zip(ours, reference, strict=True)
                  if not same_outcome(o, r)]
    assert not mismatches, "\n".join(mismatches)
    assert ours[0][1] is None and isinstance(dict(reference)["open dir"], OSError)  # the scenario ran


# ----------------------------------------------------------------------------- streams


@pytest.mark.parametrize("shape", ["empty", "small", "one_part", "part_plus_one", "multi_part"])
def test_stream_roundtrip(store_uri: str, shape: str) -> None:
    fs, base = facade(store_uri)
    part = part_size(fs, base)
    size = {"empty": 0, "small": 1000, "one_part": part, "part_plus_one": part + 1,
            "multi_part": 3 * part + 12345}[shape]
    data = os.urandom(size)
    path = f"{base}/obj.bin"
    write(fs, path, data, step=part // 3 + 7 if size > part else None)
    assert fs.get_file_info(path).size == size
    assert read(fs, path) == data
    assert read(fs, path, step=part // 5 + 3) == data
    with fs.open_input_file(path) as f:
        assert f.size() == size
        for offset, n in [(0, 10), (size // 2, part + 3), (max(0, size - 5), 100), (size, 10)]:
            assert f.read_at(n, offset) == data[offset : offset + n]
        f.seek(size // 3)
        assert f.read(17) == data[size // 3 : size // 3 + 17]
    meta = head(fs, path)
    recorded = FileDigest.from_metadata(size, meta.metadata)
    assert recorded is not None and recorded.chunk_size == part


def test_output_stream_metadata_and_visibility(store_uri: str) -> None:
    fs, base = facade(store_uri)
    path = f"{base}/with-meta.txt"
    out = fs.open_output_stream(path, metadata={"fastckpt-test": "yes"})
    out.write(b"x" * (part_size(fs, base) + 1))
    assert fs.get_file_info(path).type == pafs.FileType.NotFound  # appears only on close
    out.close()
    assert fs.get_file_info(path).type == pafs.FileType.File
    assert head(fs, path).metadata.get("fastckpt-test") == "yes"


def test_exception_in_with_block_aborts(store_uri: str) -> None:
    fs, base = facade(store_uri)
    path = f"{base}/aborted.bin"
    part = part_size(fs, base)
    with pytest.raises(RuntimeError, match="boom"), fs.open_output_stream(path) as out:
        out.write(os.urandom(2 * part + 5))
        raise RuntimeError("boom")
    out2 = fs.open_output_stream(f"{base}/aborted2.bin")
    out2.write(os.urandom(part + 1))
    out2.abort()
    out2.close()  # after abort: nothing to do
    for name in ("aborted.bin", "aborted2.bin"):
        assert fs.get_file_info(f"{base}/{name}").type == pafs.FileType.NotFound
    if not store_uri.startswith("file:"):
        assert pending(fs, base) == []


def test_write_blocks_with_bounded_buffers(store_uri: str) -> None:
    config = small_config(max_in_flight=2)
    fs, base = facade(store_uri, config, wrapper=functools.partial(FaultInjectingStore, latency=0.02))
    part = part_size(fs, base)
    data = os.urandom(6 * part + 1)
    out = fs.open_output_stream(f"{base}/bounded.bin")
    for i in range(0, len(data), part // 2):
        out.write(data[i : i + part // 2])
        assert out.handle._writer.pool.allocated <= 2
    out.close()
    assert read(fs, f"{base}/bounded.bin") == data


class ConcurrencyProbe(FaultInjectingStore):
    """A store wrapper that records how many ranged reads were in flight at once."""

    def __init__(self, inner: Store) -> None:
        super().__init__(inner, latency=0.02, ops={"get_range"})
        self.active = self.peak = 0

    async def read_into(self, key: str, start: int, buf: memoryview) -> int:
        self.active += 1
        self.peak = max(self.peak, self.active)
        try:
            return await super().read_into(key, start, buf)
        finally:
            self.active -= 1


def test_sequential_reader_prefetches_in_parallel(tmp_path: Path) -> None:
    fs, base = facade(f"memory://prefetch-{os.getpid()}/t", small_config(max_in_flight=4), wrapper=ConcurrencyProbe)
    data = os.urandom(8 * (256 << 10) + 3)
    write(fs, f"{base}/big", data)
    probe = store_of(fs, base)[0]
    with fs.open_input_stream(f"{base}/big") as f:
        assert f.read(8) == data[:8]
        assert probe.calls == 1  # a small first read fetches one part, no more
        chunks = [data[:8]]
        while chunk := f.read(64 << 10):
            chunks.append(chunk)
    assert b"".join(chunks) == data
    assert probe.peak >= 3, probe.peak  # the read-ahead window grew


def test_integrity_checked_on_full_sequential_read(store_uri: str) -> None:
    fs, base = facade(store_uri)
    part = part_size(fs, base)
    store = store_of(fs, base)[0]
    for size in [part // 2 + 1, 2 * part + 7]:  # one put; a streamed multipart upload
        path = f"{base}/victim-{size}"
        data = os.urandom(size)
        write(fs, path, data)
        meta = head(fs, path)
        assert FileDigest.from_metadata(size, meta.metadata) is not None
        corrupt = bytearray(data)
        corrupt[size // 2] ^= 0xFF
        key = store_of(fs, path)[1]
        local = store.local_file(key)
        if local is not None:  # a file edited in place: its recorded digests stay, for another version
            with open(local, "r+b") as f:
                f.seek(size // 2)
                f.write(bytes([corrupt[size // 2]]))
        else:
            fs.handler.run(store.put(key, bytes(corrupt), metadata=meta.metadata))
        with pytest.raises(IntegrityError, match=f"victim-{size}") as info:
            read(fs, path, step=part // 3 + 1)
        assert isinstance(info.value, OSError)
        assert local is None or "changed after it was written" in str(info.value)
        with fs.open_input_file(path) as f:  # a random read fetches only its range: nothing to check
            assert f.read_at(10, 5) == bytes(corrupt[5:15])


# ----------------------------------------------------------------------------- copy_files


def make_tree(root: Path, part: int) -> dict[str, bytes]:
    files = {"model.bin": os.urandom(3 * part + 99), "optim/rank_0.pt": os.urandom(5000),
             "optim/rank_1.pt": os.urandom(part), "empty.txt": b"", "deep/a/b/c.json": b"{}"}
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    (root / "empty_dir" / "inner").mkdir(parents=True)
    return files


def tree(root: Path) -> tuple[dict[str, bytes], list[str]]:
    files = {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()}
    dirs = sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_dir())
    return files, dirs


@pytest.mark.parametrize("copier", ["guarded", "pyarrow"])
def test_copy_files_both_directions(store_uri: str, tmp_path: Path, copier: str) -> None:
    fs, base = facade(store_uri)
    part = part_size(fs, base)
    src = tmp_path / "src"
    files = make_tree(src, part)
    copy = pafs.copy_files if copier == "guarded" else ffs.pyarrow_copy_files()
    if copier == "guarded":
        assert pafs.copy_files is ffs.copy_files  # creating a facade installed the guard
    copy(str(src), f"{base}/ckpt", destination_filesystem=fs, chunk_size=64 * MiB, use_threads=True)
    for rel, data in files.items():
        assert read(fs, f"{base}/ckpt/{rel}") == data
    assert fs.get_file_info(f"{base}/ckpt/empty_dir/inner").type == pafs.FileType.Directory
    out = tmp_path / "out"
    out.mkdir()
    copy(f"{base}/ckpt", str(out), source_filesystem=fs, chunk_size=64 * MiB, use_threads=True)
    assert tree(out) == tree(src)
    single = tmp_path / "single.bin"
    copy(f"{base}/ckpt/model.bin", str(single), source_filesystem=fs, chunk_size=64 * MiB)
    assert single.read_bytes() == files["model.bin"]
    if copier == "guarded":  # uploads through the engine record digests everywhere
        assert FileDigest.from_metadata(len(files["model.bin"]), head(fs, f"{base}/ckpt/model.bin").metadata)


def test_copy_files_between_facade_and_other_pyarrow_filesystems(store_uri: str, tmp_path: Path) -> None:
    fsspec = pytest.importorskip("fsspec")
    fs, base = facade(store_uri)
    src = tmp_path / "src"
    files = make_tree(src, part_size(fs, base))
    via_fsspec = pafs.PyFileSystem(pafs.FSSpecHandler(fsspec.filesystem("file")))  # like Ray's exclude path
    pafs.copy_files(str(src), f"{base}/c", source_filesystem=via_fsspec, destination_filesystem=fs,
                    chunk_size=64 * MiB, use_threads=True)
    mem, mem_base = facade(f"memory://other-{os.getpid()}/x")
    pafs.copy_files(f"{base}/c", f"{mem_base}/c", source_filesystem=fs, destination_filesystem=mem,
                    use_threads=True)
    for rel, data in files.items():
        assert read(mem, f"{mem_base}/c/{rel}") == data


@pytest.mark.parametrize("failing", [{"put_part"}, {"complete"}, {"put"}, {"create_multipart"}])
def test_upload_failure_raises_from_copy_files(store_uri: str, tmp_path: Path, failing: set[str]) -> None:
    fs, base = facade(store_uri, wrapper=permanent(failing))
    part = part_size(fs, base)
    src = tmp_path / "src"
    src.mkdir()
    (src / "big.bin").write_bytes(os.urandom(3 * part + 1))
    (src / "small.bin").write_bytes(b"s" * 100)
    (src / "big2.bin").write_bytes(os.urandom(2 * part + 1))
    with pytest.raises(OSError, match="injected permanent failure") as info:
        pafs.copy_files(str(src), f"{base}/ckpt", destination_filesystem=fs, chunk_size=64 * MiB)
    assert isinstance(info.value, StoreError)
    doomed = "small.bin" if failing == {"put"} else "big.bin"
    assert fs.get_file_info(f"{base}/ckpt/{doomed}").type == pafs.FileType.NotFound
    if not store_uri.startswith("file:"):
        assert pending(fs, base) == []


@pytest.mark.parametrize("failing", [{"put_part"}, {"complete"}])
def test_stream_upload_failure_raises_from_write_or_close(store_uri: str, failing: set[str]) -> None:
    fs, base = facade(store_uri, wrapper=permanent(failing))
    part = part_size(fs, base)
    path = f"{base}/stream.bin"
    out = fs.open_output_stream(path)
    with pytest.raises(OSError, match="injected permanent failure"):
        for _ in range(4):
            out.write(os.urandom(part))
        out.close()
    assert fs.get_file_info(path).type == pafs.FileType.NotFound
    if not store_uri.startswith("file:"):
        assert pending(fs, base) == []


def test_pyarrow_copy_files_loses_close_errors_hence_the_guard(tmp_path: Path) -> None:
    """Arrow's CopyFiles ignores the status of CloseAsync(); through it a failed upload returns normally.
    If this starts failing, Arrow fixed it upstream and the guard is no longer needed for this."""
    fs, base = facade(f"memory://lost-{os.getpid()}/x", wrapper=permanent({"put"}))
    (tmp_path / "f.bin").write_bytes(b"lost")
    ffs.pyarrow_copy_files()(str(tmp_path / "f.bin"), f"{base}/f.bin", destination_filesystem=fs)
    assert fs.get_file_info(f"{base}/f.bin").type == pafs.FileType.NotFound
    with pytest.raises(OSError, match="injected permanent failure"):
        pafs.copy_files(str(tmp_path / "f.bin"), f"{base}/f.bin", destination_filesystem=fs)


def test_output_stream_dropped_by_pyarrow_is_aborted() -> None:
    """When Arrow's CopyFiles fails on the source it drops the destination stream without closing it:
    the upload is aborted (parts already sent are discarded), nothing is written."""
    pid = os.getpid()
    src, src_base = facade(f"memory://dropped-src-{pid}/x", wrapper=functools.partial(
        FaultInjectingStore, fail_after=4, ops={"get_range"}))
    dst, dst_base = facade(f"memory://dropped-dst-{pid}/x", small_config(max_in_flight=8))
    write(src, f"{src_base}/f", os.urandom(12 * (256 << 10)))
    with pytest.raises(OSError, match="injected permanent failure"):
        ffs.pyarrow_copy_files()(f"{src_base}/f", f"{dst_base}/f", source_filesystem=src, destination_filesystem=dst,
                                 chunk_size=MiB, use_threads=False)
    gc.collect()
    deadline = time.monotonic() + 60
    while pending(dst, dst_base) and time.monotonic() < deadline:  # the abort runs on the loop
        time.sleep(0.05)
    assert pending(dst, dst_base) == []
    assert dst.get_file_info(f"{dst_base}/f").type == pafs.FileType.NotFound


def test_missing_bucket_on_real_server_raises(store_uri: str, tmp_path: Path) -> None:
    if not store_uri.startswith(("s3:", "gs:", "gcs:", "az:", "azure:", "abfs")):
        pytest.skip("only object-store servers have buckets that can be missing")
    fs, _ = facade(store_uri)
    missing = "no-such-bucket-" + os.urandom(4).hex()
    (tmp_path / "f.bin").write_bytes(os.urandom(1000))
    with pytest.raises(FileNotFoundError, match=missing):
        pafs.copy_files(str(tmp_path / "f.bin"), f"{missing}/x/f.bin", destination_filesystem=fs)
    with pytest.raises(FileNotFoundError, match=missing):
        with fs.open_output_stream(f"{missing}/y") as out:
            out.write(b"data")


# ----------------------------------------------------------------------------- threads and loops


def test_concurrent_output_streams_from_foreign_threads(store_uri: str) -> None:
    fs, base = facade(store_uri)
    part = part_size(fs, base)
    datas = {i: os.urandom(part * (i % 3) + 1000 * i + 1) for i in range(8)}
    fs.create_dir(f"{base}/t")
    errors: list[BaseException] = []
    barrier = threading.Barrier(len(datas))

    def worker(i: int) -> None:
        try:
            barrier.wait()
            write(fs, f"{base}/t/{i}", datas[i], step=part // 4 + i + 1)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in datas]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for i, data in datas.items():
        assert read(fs, f"{base}/t/{i}") == data


async def test_calls_from_inside_a_running_event_loop(store_uri: str) -> None:
    asyncio.get_running_loop()  # this thread runs a loop, as Ray's controller does
    fs, base = facade(store_uri)
    write(fs, f"{base}/in-loop", b"from a loop thread")
    assert read(fs, f"{base}/in-loop") == b"from a loop thread"
    assert [i.path for i in fs.get_file_info(pafs.FileSelector(base))] == [f"{base}/in-loop"]


# ----------------------------------------------------------------------------- identity, pickling, processes


def test_pickle_and_equality(tmp_path: Path) -> None:
    cfg = small_config()
    a = ffs.filesystem("s3://bucket?endpoint_override=http://127.0.0.1:9", config=cfg)
    b = ffs.filesystem("s3://other-bucket?endpoint_override=http://127.0.0.1:9", config=cfg)
    c = ffs.filesystem("s3://bucket?endpoint_override=http://127.0.0.1:10", config=cfg)
    d = ffs.filesystem("s3://bucket?endpoint_override=http://127.0.0.1:9", config=small_config(part_size=MiB))
    assert a.handler is not b.handler
    assert a == b and not (a != b)  # PyFileSystem equality goes through the handlers' __eq__
    assert a != c and a != d and a != pafs.LocalFileSystem()
    clone = pickle.loads(pickle.dumps(a))
    assert clone == a and clone.handler is not a.handler and clone.type_name == "py::fastckpt+s3"
    assert type(clone) is ffs.FacadeFileSystem
    wrapped = ffs.filesystem("memory://b", config=cfg, store_wrapper=permanent({"put"}))
    assert pickle.loads(pickle.dumps(wrapped)) == wrapped  # wrappers compare by value
    assert wrapped != ffs.filesystem("memory://b", config=cfg, store_wrapper=permanent({"get_range"}))
    assert wrapped != ffs.filesystem("memory://b", config=cfg)
    local = ffs.filesystem(str(tmp_path))
    local.create_dir(str(tmp_path / "p"))
    write(local, str(tmp_path / "p" / "f"), b"abc")
    again = pickle.loads(pickle.dumps(local))
    assert again == local and read(again, str(tmp_path / "p" / "f")) == b"abc"


def _child_roundtrip(fs: pafs.FileSystem, path: str) -> None:
    data = read(fs, path)
    write(fs, path + ".child", data[::-1])


def test_usable_after_fork_and_in_spawned_process(store_uri: str) -> None:
    if store_uri.startswith("memory:"):
        pytest.skip("memory buckets belong to one process")
    fs, base = facade(store_uri)
    write(fs, f"{base}/parent", b"from the parent")  # the parent's stores and loop exist now
    for method in ("fork", "spawn"):
        proc = multiprocessing.get_context(method).Process(target=_child_roundtrip, args=(fs, f"{base}/parent"))
        proc.start()
        proc.join(120)
        assert proc.exitcode == 0, method
        assert read(fs, f"{base}/parent.child") == b"from the parent"[::-1]
        fs.delete_file(f"{base}/parent.child")


# ----------------------------------------------------------------------------- paths, appends, delegation


def test_paths_and_appends(store_uri: str) -> None:
    fs, base = facade(store_uri)
    write(fs, f"{base}/f", b"abc")
    if store_uri.startswith("file:"):
        with fs.open_append_stream(f"{base}/f") as out:
            out.write(b"def")
        assert read(fs, f"{base}/f") == b"abcdef"
        with pytest.raises(ValueError, match="URI"):
            fs.normalize_path("file:///tmp/x")
        return
    with pytest.raises(ArrowNotImplementedError, match="append"):  # what pyarrow's S3FileSystem raises
        fs.open_append_stream(f"{base}/f")
    for bad in ("/" + base, base + "//f", "s3://" + base):
        with pytest.raises(ValueError):
            fs.get_file_info(bad)
    assert fs.normalize_path(f"{base}/f") == f"{base}/f"
    assert fs.get_file_info(f"{base}/").type == pafs.FileType.Directory
    with pytest.raises(IsADirectoryError):
        fs.move(base, base + "-moved")
    with pytest.raises(PermissionError):
        fs.delete_dir_contents("", accept_root_dir=True)


def test_unknown_schemes_delegate_to_pyarrow() -> None:
    mock = ffs.filesystem("mock://")
    assert isinstance(mock, pafs.FileSystem) and not isinstance(mock, pafs.PyFileSystem)
    assert mock.type_name == "mock"
    mock.create_dir("b")
    with mock.open_output_stream("b/x") as out:
        out.write(b"delegated")
    assert mock.open_input_stream("b/x").read() == b"delegated"
    fs, path = ffs.from_uri("mock:///b/x")
    assert fs.type_name == "mock" and path == "b/x"
    with pytest.raises((OSError, pa.ArrowException), match=r"(?i)hdfs|hadoop|jvm|java"):
        ffs.filesystem("hdfs://namenode:8020/ckpt")
    with pytest.raises((OSError, pa.ArrowException), match=r"(?i)hdfs|hadoop|jvm|java"):
        ffs.filesystem("viewfs://cluster/ckpt")
