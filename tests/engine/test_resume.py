"""Killed transfers resume: a process is SIGKILLed with some parts stored, and the same transfer run
again sends only what is missing (parts in flight at the kill at most), on every backend that outlives a
process. A changed source or a damaged partial file restarts what must be restarted; ``gc`` of the prefix
removes what a killed run left behind."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fastckpt import open_store, parse_uri
from fastckpt.cli import main as cli_main
from fastckpt.config import TransferConfig
from fastckpt.engine.journal import Journal
from fastckpt.engine.plan import plan_upload
from fastckpt.engine.transfer import Transfer
from fastckpt.stores.local import TMP_SUFFIX
from harness.faults import FaultInjectingStore

from ..conftest import small_config

pytestmark = pytest.mark.timeout(180)
BACKENDS = ["local", "s3", "gcs", "azure"]
PARTS, DONE, IN_FLIGHT = 6, 3, 2

# Run in a child process: transfer through a store that hangs once DONE parts went through (with IN_FLIGHT
# parts in flight), say so, and wait to be killed.
CHILD = f"""
import asyncio, sys
from fastckpt import open_store
from fastckpt.engine.transfer import Transfer
from fastckpt.stores.local import TMP_SUFFIX
from harness.faults import FaultInjectingStore
from tests.conftest import small_config

class HangAfter(FaultInjectingStore):
    async def fault(self, op, key):
        if op in ("put_part", "get_range"):
            self.calls += 1
            if self.calls > {DONE}:
                if self.calls == {DONE} + {IN_FLIGHT}:
                    print("HANGING", flush=True)
                await asyncio.sleep(3600)

async def main(direction, uri, key, path):
    store, config = HangAfter(open_store(uri, retry=False)), small_config(max_in_flight={IN_FLIGHT}, range_size=1)
    if direction == "checkpoint":  # one small file, then the big one (which hangs)
        from fastckpt import CheckpointWriter
        async with CheckpointWriter(uri, attempt="a1", store=store, config=config) as writer:
            await writer.put_file(path + ".small", "small.json")
            await writer.put_file(path, "model.bin")
    elif direction == "up":
        await Transfer(store, config).upload_file(path, key)
    else:
        await Transfer(store, config).download_file(key, path)

asyncio.run(main(*sys.argv[1:]))
"""


def kill_midway(direction: str, uri: str, key: str, path: Path) -> None:
    """Run the child until DONE parts are through and IN_FLIGHT hang, then SIGKILL it."""
    child = subprocess.Popen([sys.executable, "-c", CHILD, direction, uri, key, str(path)],
                             cwd=Path(__file__).resolve().parents[2], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "HANGING"
        time.sleep(0.2)
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(30)


async def counted(uri: str, direction: str, key: str, path: Path) -> int:
    """Run the transfer to the end in this process; how many parts it sent or fetched."""
    counter = FaultInjectingStore(open_store(uri, retry=False), ops={"put_part", "get_range"})
    transfer = Transfer(counter, small_config(max_in_flight=IN_FLIGHT, range_size=1))
    try:
        if direction == "up":
            await transfer.upload_file(str(path), key)
        else:
            await transfer.download_file(key, str(path))
    finally:
        transfer.close()
        await counter.close()
    return counter.calls


class DataWrites(FaultInjectingStore):
    """Counts the writes of data files (not of the checkpoint's own metadata)."""

    async def fault(self, op: str, key: str) -> None:
        if op in ("put", "put_part") and "/.fastckpt/" not in f"/{key}":
            self.calls += 1


def flip_first_byte(path: Path) -> None:
    with open(path, "r+b") as f:
        first = f.read(1)
        f.seek(0)
        f.write(bytes([first[0] ^ 0xFF]))


def sample(uri: str, tmp_path: Path) -> tuple[Path, bytes]:
    part = plan_upload(1, small_config(), open_store(uri, retry=False)).part_size
    data = os.urandom(PARTS * part - 1000)
    src = tmp_path / "model.bin"
    src.write_bytes(data)
    return src, data


async def pending(uri: str, key: str) -> list:
    async with open_store(uri, config=small_config()) as store:
        return await store.list_pending_uploads(key)


@pytest.mark.parametrize("backend", BACKENDS)
async def test_killed_upload_resumes(store_uri: str, tmp_path: Path, backend: str) -> None:
    key = parse_uri(store_uri).join("model.bin")
    src, data = sample(store_uri, tmp_path)
    kill_midway("up", store_uri, key, src)
    assert len(await pending(store_uri, key)) == 1 and os.listdir(TransferConfig().journal_dir)
    sent = await counted(store_uri, "up", key, src)
    print(f"{backend}: resumed upload sent {sent} of {PARTS} parts ({DONE} were stored before the kill)")
    assert sent == PARTS - DONE
    async with open_store(store_uri, config=small_config()) as store:
        assert await store.get_range(key, 0, len(data) + 1) == data
    assert await pending(store_uri, key) == []


@pytest.mark.parametrize("backend", BACKENDS)
async def test_changed_source_restarts_the_upload(store_uri: str, tmp_path: Path, backend: str) -> None:
    key = parse_uri(store_uri).join("model.bin")
    src, data = sample(store_uri, tmp_path)
    kill_midway("up", store_uri, key, src)
    changed = bytes(reversed(data))
    src.write_bytes(changed)
    os.utime(src, ns=(time.time_ns(), time.time_ns() + 10**9))
    assert await counted(store_uri, "up", key, src) == PARTS
    async with open_store(store_uri, config=small_config()) as store:
        assert await store.get_range(key, 0, len(data) + 1) == changed
    assert await pending(store_uri, key) == []  # the killed run's upload was aborted


@pytest.mark.parametrize("backend", BACKENDS)
async def test_killed_download_resumes_and_rechecks_the_partial_file(store_uri: str, tmp_path: Path,
                                                                     backend: str) -> None:
    key = parse_uri(store_uri).join("model.bin")
    src, data = sample(store_uri, tmp_path)
    await counted(store_uri, "up", key, src)
    out = tmp_path / "out" / "model.bin"
    kill_midway("down", store_uri, key, out)
    partials = sorted(p.name for p in out.parent.iterdir())
    assert partials == [f".model.bin.dl{TMP_SUFFIX}", f".model.bin.journal{TMP_SUFFIX}"] and not out.exists()
    flip_first_byte(out.parent / partials[0])  # damage the first stored part: it must be fetched again
    fetched = await counted(store_uri, "down", key, out)
    print(f"{backend}: resumed download fetched {fetched} of {PARTS} parts")
    assert fetched == PARTS - DONE + 1
    assert out.read_bytes() == data and sorted(os.listdir(out.parent)) == ["model.bin"]


@pytest.mark.parametrize("backend", BACKENDS)
async def test_gc_of_the_prefix_removes_what_a_killed_upload_left(store_uri: str, tmp_path: Path,
                                                                  backend: str) -> None:
    key = parse_uri(store_uri).join("model.bin")
    src, _ = sample(store_uri, tmp_path)
    kill_midway("up", store_uri, key, src)
    assert len(await pending(store_uri, key)) == 1
    base, _, query = store_uri.partition("?")
    prefix = f"{base}/" + (f"?{query}" if query else "")
    assert await asyncio.to_thread(cli_main, ["gc", prefix, "--older-than", "0", "--json"]) == 0
    assert await pending(store_uri, key) == []


@pytest.mark.parametrize("backend", BACKENDS)
async def test_killed_checkpoint_attempt_reuses_what_it_wrote(store_uri: str, tmp_path: Path, backend: str) -> None:
    """The same rank and attempt, run again after a SIGKILL: the finished file is not sent again, the
    interrupted one continues, and the checkpoint commits and verifies."""
    import fastckpt

    src, _ = sample(store_uri, tmp_path)
    (tmp_path / "model.bin.small").write_bytes(b'{"step": 100}')
    base, _, query = store_uri.partition("?")
    uri = f"{base}/step-100" + (f"?{query}" if query else "")
    kill_midway("checkpoint", uri, "", src)
    counter = DataWrites(open_store(uri, retry=False))
    async with fastckpt.CheckpointWriter(uri, attempt="a1", store=counter,
                                         config=small_config(max_in_flight=IN_FLIGHT)) as writer:
        await writer.put_file(tmp_path / "model.bin.small", "small.json")
        await writer.put_file(src, "model.bin")
    print(f"{backend}: the rerun sent {counter.calls} data requests for {PARTS} parts + 1 small file")
    assert counter.calls == PARTS - DONE  # the small file is re-used, the big one continues
    report = await fastckpt.verify_async(uri, config=small_config())
    assert report.ok and report.files == 2


@pytest.mark.parametrize("backend", ["local", "memory"])
async def test_a_journal_that_cannot_be_written_aborts_its_upload(store_uri: str, tmp_path: Path, backend: str,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(self: Journal, **fields: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Journal, "start", refuse)
    key = parse_uri(store_uri).join("model.bin")
    src, _ = sample(store_uri, tmp_path)
    async with open_store(store_uri, config=small_config()) as store:
        transfer = Transfer(store, small_config())
        try:
            with pytest.raises(OSError, match="No space left"):
                await transfer.upload_file(str(src), key)
        finally:
            transfer.close()
        assert await store.list_pending_uploads(key) == []
        assert [m async for m in store.list(key)] == []
