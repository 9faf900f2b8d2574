"""The facade and the fsspec face close every client session they open: on ``close()`` or a ``with`` block, when a
copy is garbage-collected (Ray copies the filesystem into every task and actor), and at interpreter exit (with
``fastckpt.torch``'s too), without aiohttp's "Unclosed client session" error."""

from __future__ import annotations

import gc
import logging
import pickle
import subprocess
import sys
import time

import aiohttp
import pyarrow.fs as pafs
import pytest

import fastckpt.fs as ffs

from ..conftest import small_config

OBJECT_STORES = ("s3", "gcs", "azure")


def open_sessions() -> int:
    gc.collect()
    return sum(1 for o in gc.get_objects() if isinstance(o, aiohttp.ClientSession) and not o.closed)


def settles_at(count: int) -> int:
    """The open sessions once closes started in the background have run (at most a few seconds)."""
    deadline = time.monotonic() + 10
    while (now := open_sessions()) != count and time.monotonic() < deadline:
        time.sleep(0.05)
    return now


def use(fs: pafs.FileSystem, base: str) -> None:
    """Requests of every kind (on S3 the SDK's, which hold the aiohttp session: metadata that fastckpt does not send
    as plain headers, here a tab, goes through botocore; as well as fastckpt's own)."""
    assert fs.get_file_info(f"{base}/a").size == 1
    with fs.open_output_stream(f"{base}/b", metadata={"note": "a\tb"}) as f:
        f.write(b"y")
    fs.delete_file(f"{base}/b")


def seeded(uri: str) -> tuple[pafs.FileSystem, str]:
    fs, base = ffs.from_uri(uri, config=small_config())
    with fs.open_output_stream(f"{base}/a") as f:
        f.write(b"x")
    return fs, base


@pytest.mark.parametrize("backend", OBJECT_STORES)
def test_dropped_copies_close_their_sessions(store_uri: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.ERROR, logger="asyncio")
    fs, base = seeded(store_uri)
    before = open_sessions()
    blob = pickle.dumps(fs)
    for _ in range(20):
        copy = pickle.loads(blob)
        use(copy, base)
        del copy
    assert settles_at(before) == before
    gc.collect()
    time.sleep(0.2)  # aiohttp reports a session collected unclosed through the loop, as the loop gets to it
    assert not [r.getMessage() for r in caplog.records if "nclosed" in r.getMessage()]
    fs.close()


@pytest.mark.parametrize("backend", OBJECT_STORES)
def test_close_and_with_block_close_the_sessions(store_uri: str) -> None:
    fs, base = seeded(store_uri)
    fs.close()
    before = open_sessions()
    with pickle.loads(pickle.dumps(fs)) as copy:
        use(copy, base)
        assert open_sessions() > before
    assert open_sessions() == before
    use(fs, base)  # a closed facade opens its clients again
    fs.close()
    assert open_sessions() == before


@pytest.mark.parametrize("backend", ["s3"])
def test_fsspec_copies_do_not_pile_up_sessions(store_uri: str) -> None:
    fsspec = pytest.importorskip("fsspec")
    uri, _, query = store_uri.partition("?")
    options = dict(pair.split("=", 1) for pair in query.split("&") if pair)
    fs = fsspec.filesystem("fastckpt", skip_instance_cache=True, **options)
    fs.pipe_file(f"{uri}/b", b"y")
    blob = pickle.dumps(fs)

    def cycle() -> None:
        copy = pickle.loads(blob)  # fsspec's instance cache may hand back one kept instance: its clients stay open
        assert copy.cat_file(f"{uri}/b") == b"y"
        copy.pipe_file(f"{uri}/c", b"z")
        copy.rm_file(f"{uri}/c")

    cycle()
    after_one = settles_at(open_sessions())
    for _ in range(20):
        cycle()
    assert settles_at(after_one) == after_one


EXIT = """
import pickle, sys
import fastckpt.fs, fsspec
uri = sys.argv[1]
fs, base = fastckpt.fs.from_uri(uri)
with fs.open_output_stream(base + "/c") as f:
    f.write(b"z")
kept = [pickle.loads(pickle.dumps(fs)) for _ in range(3)]
print([k.get_file_info(base + "/c").size for k in kept])
plain, _, query = uri.partition("?")
other = fsspec.filesystem("fastckpt", skip_instance_cache=True, **dict(p.split("=", 1) for p in query.split("&") if p))
print(other.cat_file(plain + "/c"))
import torch, fastckpt.torch as ft
ft.save({"w": torch.arange(10)}, f"{plain}/step-1?{query}")
print(int(ft.load(f"{plain}/step-1?{query}")["w"].sum()))
"""


@pytest.mark.parametrize("backend", OBJECT_STORES)
def test_nothing_unclosed_at_interpreter_exit(store_uri: str) -> None:
    done = subprocess.run([sys.executable, "-c", EXIT, store_uri], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "Unclosed" not in done.stderr and "nclosed" not in done.stdout, done.stderr
