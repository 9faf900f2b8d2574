"""Saving over a committed checkpoint (``overwrite=True``), on every backend: the new files go into a folder of their
own, one marker write switches readers from the old checkpoint to the new, the old files go after it; a writer that
fails leaves the old checkpoint whole, and ``gc`` takes what it left; without ``overwrite`` a committed checkpoint is
refused."""

from __future__ import annotations

from pathlib import Path

import pytest

import fastckpt
from fastckpt import CheckpointError, CheckpointWriter
from fastckpt.checkpoint.manifest import GENERATION
from fastckpt.stores.base import Store
from fastckpt.uri import StorageURI

from ..conftest import small_config


async def keys(store: Store, uri: StorageURI) -> list[str]:
    return sorted([m.key[len(uri.key) + 1:] async for m in store.list(uri.key)])


async def save(uri: str, files: dict[str, bytes], tmp_path: Path, **options: object) -> fastckpt.CheckpointWriter:
    src = tmp_path / f"src-{abs(hash(tuple(files.items())))}"
    src.mkdir()
    for name, data in files.items():
        (src / name).write_bytes(data)
    async with CheckpointWriter(uri, config=small_config(), **options) as writer:
        await writer.put_dir(src)
    return writer


async def read(uri: str, tmp_path: Path) -> dict[str, bytes]:
    out = tmp_path / f"out-{len(list(tmp_path.iterdir()))}"
    await fastckpt.download_checkpoint_async(uri, out, config=small_config())
    return {p.name: p.read_bytes() for p in out.iterdir()}


async def test_a_save_over_a_committed_checkpoint_replaces_it(store, tmp_path: Path) -> None:
    s, base = store
    target = base.with_key(base.join("ckpt"))
    await save(target.uri(), {"a.bin": b"old" * 1000, "gone.bin": b"x"}, tmp_path)
    with pytest.raises(CheckpointError, match="overwrite=True"):
        await save(target.uri(), {"a.bin": b"refused"}, tmp_path)

    writer = await save(target.uri(), {"a.bin": b"new" * 1000}, tmp_path, overwrite=True)
    assert writer.root == GENERATION + writer.attempt
    assert await read(target.uri(), tmp_path) == {"a.bin": b"new" * 1000}
    assert (await fastckpt.verify_async(target.uri(), config=small_config())).ok
    # the old files and manifests are gone: the new files in their folder, the marker and the new attempt's manifest
    left = await keys(s, target)
    assert [k for k in left if not k.startswith(".fastckpt/")] == [f"{writer.root}/a.bin"]
    assert {k.split("/")[1] for k in left if k.startswith(".fastckpt/")} == {"COMMITTED", writer.attempt}

    again = await save(target.uri(), {"a.bin": b"newer"}, tmp_path, overwrite=True)
    assert await read(target.uri(), tmp_path) == {"a.bin": b"newer"}
    assert not [k for k in await keys(s, target) if k.startswith(writer.root)]
    assert [c.attempt for c in await fastckpt.list_checkpoints_async(base.raw, config=small_config())] == \
        [again.attempt]


async def test_a_failed_save_over_a_checkpoint_leaves_it_whole(store, tmp_path: Path) -> None:
    s, base = store
    target = base.with_key(base.join("ckpt"))
    await save(target.uri(), {"a.bin": b"old" * 1000}, tmp_path)
    before = await keys(s, target)
    src = tmp_path / "half"
    src.mkdir()
    (src / "a.bin").write_bytes(b"half" * 1000)
    with pytest.raises(RuntimeError, match="dies"):
        async with CheckpointWriter(target.uri(), config=small_config(), overwrite=True) as writer:
            await writer.put_dir(src)
            raise RuntimeError("the job dies before the commit")
    assert await read(target.uri(), tmp_path) == {"a.bin": b"old" * 1000}
    report = await fastckpt.gc_async(base.raw, older_than=0, config=small_config())
    assert any(k.endswith(f"{writer.root}/a.bin") for k in report.removed)
    assert await keys(s, target) == before


async def test_the_replaced_checkpoint_is_the_base_of_its_replacement(store, tmp_path: Path) -> None:
    _, base = store
    target = base.with_key(base.join("ckpt"))
    big = bytes(range(256)) * 4096  # 1 MiB: parts the store can copy
    await save(target.uri(), {"w.bin": big, "s.bin": b"1"}, tmp_path)
    writer = await save(target.uri(), {"w.bin": big, "s.bin": b"2"}, tmp_path, overwrite=True, base=target.uri())
    assert writer.result is not None and writer.result.copied == len(big)
    assert await read(target.uri(), tmp_path) == {"w.bin": big, "s.bin": b"2"}


async def test_gc_keeps_what_a_replacing_commit_published(store, tmp_path: Path) -> None:
    """An index written at the checkpoint itself for other tools (DCP's ``.metadata`` after a save over a
    committed checkpoint) is named in the marker, and ``gc`` leaves it."""
    s, base = store
    target = base.with_key(base.join("ckpt"))
    await save(target.uri(), {"a.bin": b"one"}, tmp_path)
    src = tmp_path / "two"
    src.mkdir()
    (src / "a.bin").write_bytes(b"two")
    async with CheckpointWriter(target.uri(), config=small_config(), overwrite=True) as writer:
        await writer.put_dir(src)
        writer.publish("index.json", b'{"at": "v"}')
    await fastckpt.gc_async(base.uri(), older_than=0, config=small_config())
    assert await s.get_range(target.join("index.json"), 0, 100) == b'{"at": "v"}'
    assert await read(target.uri(), tmp_path) == {"a.bin": b"two"}


async def test_a_download_brings_a_checkpoint_as_committed(store, tmp_path: Path) -> None:
    """``fastckpt.download`` of a prefix: a committed checkpoint in it comes down as ``download_checkpoint`` brings
    it (its committed files, verified; no ``.fastckpt/`` records, no replaced or uncommitted files), other objects
    as they are; ``raw=True`` copies everything."""
    s, base = store
    run = base.with_key(base.join("run"))
    await save(base.with_key(run.join("step-1")).uri(), {"a.bin": b"old"}, tmp_path)
    await save(base.with_key(run.join("step-1")).uri(), {"a.bin": b"new"}, tmp_path, overwrite=True)
    await s.put(run.join("step-1", "stray.bin"), b"left by a dead attempt")
    await s.put(run.join("notes.txt"), b"plain")
    out = tmp_path / "out"
    results = await fastckpt.download_async(run.uri(), out, config=small_config())
    got = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())
    assert got == ["notes.txt", "step-1/a.bin"] and len(results) == 2
    assert (out / "step-1" / "a.bin").read_bytes() == b"new"
    raw = tmp_path / "raw"
    await fastckpt.download_async(run.uri(), raw, config=small_config(), raw=True)
    assert (raw / "step-1" / ".fastckpt" / "COMMITTED").exists() and (raw / "step-1" / "stray.bin").exists()
