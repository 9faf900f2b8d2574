"""Copies of a directory whose files are still being written (Ray Tune's experiment directory, synced while the
trials append to their event files): a file is taken as it is when it is opened. Through the pyarrow facade
(``pyarrow.fs.copy_files``, what Ray and Tune call) and ``fastckpt cp`` a file that grows meanwhile is no error
and arrives as a prefix of its source, on every backend; one rewritten throughout fails after a bounded number of
reads, naming it; one renamed away before it is opened (a temporary file) is left out; checkpoint saves stay
strict, for one part and many alike."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pyarrow.fs as pafs
import pytest

import fastckpt
from fastckpt import IntegrityError
from fastckpt.engine.transfer import Transfer
from fastckpt.engine.upload import SNAPSHOT_READS, SourceChanged
from harness.faults import FaultInjectingStore

from ..conftest import small_config
from ..faces.test_fs import facade, part_size, read

MiB = 1 << 20


@contextmanager
def repeating(step: Callable[[], None]) -> Iterator[None]:
    """``step()`` run again and again on a thread of its own while the block runs."""
    stop = threading.Event()

    def run() -> None:
        while not stop.is_set():
            step()

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    try:
        yield
    finally:
        stop.set()
        worker.join()


@contextmanager
def growing(path: Path, start: int, every: float = 0.0002) -> Iterator[None]:
    """``path`` holds a counted byte pattern of ``start`` bytes and keeps being appended to, as an event log is."""
    pattern = bytes(range(256)) * 4096
    path.write_bytes(pattern[:start])
    with open(path, "ab", buffering=0) as f:
        def append() -> None:
            at = f.tell() % 256
            f.write(pattern[at:at + 97])
            time.sleep(every)

        with repeating(append):
            yield


@contextmanager
def renamed_into_place(path: Path) -> Iterator[None]:
    """``path`` keeps being replaced the way Tune writes its state: a hidden temporary file, then a rename."""
    path.write_bytes(b"{}")
    count = itertools.count(1)

    def replace() -> None:
        n = next(count)
        tmp = path.with_name(f".{n}-tmp-{path.name}")
        tmp.write_bytes(b"{\"n\": %d}" % n)
        os.replace(tmp, path)

    with repeating(replace):
        yield


def live_tree(root: Path, part: int) -> dict[str, bytes]:
    """40 small files that do not change; the growing ones are added by ``growing``."""
    files = {f"trial_{i % 4}/result-{i}.json": os.urandom(500 + i) for i in range(40)}
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    return files


def test_live_directory_copies_through_the_facade(store_uri: str, tmp_path: Path) -> None:
    """Five copies of a directory while one small and one multipart file grow: none fails, every file is there,
    the still files whole and each growing one a prefix of its source at least as long as when it was listed."""
    fs, base = facade(store_uri)
    part = part_size(fs, base)
    src = tmp_path / "exp"
    still = live_tree(src, part)
    small, large = src / "trial_0" / "events.out.tfevents", src / "experiment_state.json"
    with growing(small, 100), growing(large, 2 * part + 5), renamed_into_place(src / "basic-variant-state.json"):
        listed = []
        for i in range(5):
            listed.append((small.stat().st_size, large.stat().st_size))
            pafs.copy_files(str(src), f"{base}/run{i}", destination_filesystem=fs)
    final = {"trial_0/events.out.tfevents": small.read_bytes(), "experiment_state.json": large.read_bytes()}
    for i, sizes in enumerate(listed):
        for rel, data in still.items():
            assert read(fs, f"{base}/run{i}/{rel}") == data
        for (rel, source), size in zip(final.items(), sizes, strict=True):
            copied = read(fs, f"{base}/run{i}/{rel}")
            assert len(copied) >= size and copied == source[:len(copied)], f"run{i}/{rel}"


@pytest.mark.parametrize("backend", ["local", "s3"])
def test_cp_of_a_live_directory(store_uri: str, tmp_path: Path) -> None:
    src = tmp_path / "exp"
    live_tree(src, 0)
    log = src / "trial_1" / "events.out.tfevents"
    dst = store_uri.split("?")[0] + "/exp"
    query = "?" + store_uri.split("?")[1] if "?" in store_uri else ""
    env = {**os.environ, "FASTCKPT_MULTIPART_THRESHOLD": "256KiB", "FASTCKPT_PART_SIZE": "256KiB"}
    with growing(log, 300 << 10):
        runs = [subprocess.run([sys.executable, "-m", "fastckpt.cli", "cp", str(src), dst + query],
                               capture_output=True, text=True, env=env, timeout=120) for _ in range(3)]
    assert [r.returncode for r in runs] == [0, 0, 0], [r.stderr for r in runs]
    out = tmp_path / "out"
    fastckpt.download(dst + query, out)
    copied = (out / "trial_1" / "events.out.tfevents").read_bytes()
    assert len(copied) >= 300 << 10 and copied == log.read_bytes()[:len(copied)]


async def test_a_file_gone_before_it_is_opened_is_left_out_of_a_snapshot(tmp_path: Path) -> None:
    """A listed file removed (or renamed away) before its upload opens it is no part of a snapshot copy; a checkpoint
    save still fails naming it."""
    present, gone = tmp_path / "state.json", tmp_path / ".1-tmp-state.json"
    present.write_bytes(b"{}")
    uri = f"memory://gone-{os.urandom(4).hex()}/x"
    transfer = Transfer(fastckpt.open_store(uri, config=small_config()), small_config())
    try:
        results = await transfer.upload_files([(str(gone), "x/tmp"), (str(present), "x/state.json")], snapshot=True)
        assert [r.key for r in results] == ["x/state.json"]
        with pytest.raises(FileNotFoundError, match=f"source file {gone} does not exist"):
            await transfer.upload_files([(str(gone), "x/tmp"), (str(present), "x/again.json")])
    finally:
        transfer.close()


async def test_a_file_rewritten_throughout_fails_naming_it(tmp_path: Path) -> None:
    """A snapshot upload reads a file rewritten in place again, ``SNAPSHOT_READS`` times, then fails naming it;
    nothing is left under its key."""
    path = tmp_path / "state.json"
    path.write_bytes(os.urandom(8 * MiB))
    stop = threading.Event()

    def rewrite() -> None:
        fd = os.open(path, os.O_WRONLY)
        n = 0
        while not stop.is_set():
            n += 1
            os.pwrite(fd, n.to_bytes(8, "little") * 8192, (n * 65536) % (8 * MiB))
        os.close(fd)

    writer = threading.Thread(target=rewrite, daemon=True)
    writer.start()
    store = FaultInjectingStore(fastckpt.open_store(f"memory://live-{os.urandom(4).hex()}/x"), latency=0.01)
    transfer = Transfer(store, small_config())
    try:
        with pytest.raises(SourceChanged, match=f"{path} was rewritten .* at each of {SNAPSHOT_READS} reads"):
            await transfer.upload_files([(str(path), "x/state.json")], snapshot=True)
    finally:
        stop.set()
        writer.join()
        transfer.close()
    assert [m.key async for m in store.list("x/")] == []


async def test_checkpoint_saves_stay_strict(tmp_path: Path) -> None:
    """A file that grows while a checkpoint writer sends it fails the save with an IntegrityError naming it."""
    path = tmp_path / "model.bin"
    uri = f"memory://strict-{os.urandom(4).hex()}/ck"
    with growing(path, 3 * MiB, every=0.001):
        with pytest.raises(IntegrityError, match=f"{path} changed while it was being uploaded"):
            slow = FaultInjectingStore(fastckpt.open_store(uri, config=small_config()), latency=0.01)
            async with fastckpt.CheckpointWriter(uri, config=small_config(), store=slow) as w:
                await w.put_file(path, "model.bin")
