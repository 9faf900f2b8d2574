"""Which writes are fsynced: a local or NFS store's by default (the checkpoint's home), a download's only when asked
(the object store keeps the data, as with s5cmd, the AWS CLI, gsutil and pyarrow)."""

from __future__ import annotations

import os

import pytest

import fastckpt
from fastckpt import TransferConfig


@pytest.fixture
def fsyncs(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The file descriptors passed to ``os.fsync`` (which still runs)."""
    calls: list[int] = []
    real = os.fsync

    def counted(fd: int) -> None:
        calls.append(fd)
        real(fd)

    monkeypatch.setattr(os, "fsync", counted)
    return calls


@pytest.mark.parametrize(("fsync", "synced"), [(None, False), (True, True), (False, False)])
async def test_downloads_fsync_only_when_asked(tmp_path, fsyncs: list[int], fsync: bool | None, synced: bool) -> None:
    src = tmp_path / "src.bin"
    src.write_bytes(os.urandom(3 << 20))
    uri = f"memory://dur-{os.urandom(3).hex()}/f.bin"
    config = TransferConfig(part_size=1 << 20, multipart_threshold=1 << 20, fsync=fsync)
    await fastckpt.upload_async(str(src), uri, config=config)
    fsyncs.clear()
    await fastckpt.download_async(uri, str(tmp_path / "out.bin"), config=config)
    assert (tmp_path / "out.bin").read_bytes() == src.read_bytes()
    assert bool(fsyncs) is synced


@pytest.mark.parametrize(("fsync", "synced"), [(None, True), (True, True), (False, False)])
async def test_local_store_writes_are_durable_by_default(tmp_path, fsyncs: list[int], fsync: bool | None,
                                                         synced: bool) -> None:
    src = tmp_path / "src.bin"
    src.write_bytes(os.urandom(1 << 20))
    await fastckpt.upload_async(str(src), f"file://{tmp_path}/store/f.bin", config=TransferConfig(fsync=fsync))
    assert (tmp_path / "store" / "f.bin").read_bytes() == src.read_bytes()
    assert bool(fsyncs) is synced


def test_fsync_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    assert TransferConfig.from_env().fsync is None
    monkeypatch.setenv("FASTCKPT_FSYNC", "1")
    assert TransferConfig.from_env().download_fsync and TransferConfig.from_env().store_fsync
    monkeypatch.setenv("FASTCKPT_FSYNC", "0")
    assert not TransferConfig.from_env().store_fsync


def test_cp_durable_asks_for_fsync() -> None:
    from fastckpt.cli import build_parser, config_of

    assert config_of(build_parser().parse_args(["cp", "--durable", "s3://b/k", "/tmp/x"])).download_fsync
    assert config_of(build_parser().parse_args(["cp", "s3://b/k", "/tmp/x"])).fsync is None
