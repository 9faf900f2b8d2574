"""A checkpoint read from a bucket is input from anyone who can write there: crafted manifests, names and
local trees must never make fastckpt write outside the destination, load unbounded data or crash."""

from __future__ import annotations

import errno
import os
import subprocess
from pathlib import Path

import pytest

import fastckpt
from fastckpt import CheckpointError, open_store, parse_uri
from fastckpt.checkpoint import documents
from fastckpt.checkpoint.manifest import (
    CommitMarker,
    FileEntry,
    RankManifest,
    digest_of,
    marker_key,
    meta_prefix,
    rank_key,
)
from fastckpt.integrity import FileDigest, combine, hash_chunks

from ..conftest import small_config

DATA = b"checkpoint bytes"


async def forge(uri: str, names: list[str], raw_manifest: bytes | None = None) -> None:
    """Write a committed checkpoint whose one rank manifest lists ``names`` (each object holding DATA), or
    whose manifest is ``raw_manifest``, with a marker that matches it, as an attacker with write access could."""
    base = parse_uri(uri)
    digest = FileDigest(len(DATA), 1 << 20, combine(hash_chunks(memoryview(DATA), 1 << 20)))
    async with open_store(base, config=small_config()) as store:
        for name in names:
            await store.put(base.join(name.replace("\\", "/").lstrip("/")), DATA)
        manifest = raw_manifest or RankManifest.encode(RankManifest("a1", 0, 1, tuple(
            FileEntry(name, digest) for name in names)))
        await store.put(rank_key(meta_prefix(base.key), "a1", 0), manifest)
        marker = CommitMarker("a1", 1, (digest_of(manifest),), len(names), len(DATA) * len(names))
        await store.put(marker_key(base.key), marker.encode())


def raw_manifest(names: list[str]) -> bytes:
    """A manifest listing ``names`` as written (bypassing the writer's own name checks)."""
    doc = RankManifest("a1", 0, 1).encode().decode()
    files = ",".join(f'{{"chunk_size":1048576,"digest":"00","name":"{n}","size":16}}' for n in names)
    return doc.replace('"files":[]', f'"files":[{files}]').encode()


async def test_absolute_and_drive_names_land_inside_the_destination(store_uri: str, tmp_path: Path) -> None:
    uri = f"{store_uri.split('?')[0]}/ckpt" + ("?" + store_uri.split("?", 1)[1] if "?" in store_uri else "")
    await forge(uri, ["/abs/x.bin", "C:\\win\\y.bin", "ok.bin"])
    out = tmp_path / "out"
    await fastckpt.download_checkpoint_async(uri, out, config=small_config())
    assert sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file()) == [
        "C:/win/y.bin", "abs/x.bin", "ok.bin"]
    assert not Path("/abs").exists()


@pytest.mark.parametrize("names", [["../escape.bin"], ["a\\\\..\\\\..\\\\escape.bin"], ["x", "x"], ["./x", "x"]])
async def test_crafted_manifest_is_refused(tmp_path: Path, names: list[str]) -> None:
    uri = f"file://{tmp_path}/store/ckpt"
    await forge(uri, [], raw_manifest=raw_manifest(names))
    with pytest.raises(CheckpointError, match=r"malformed manifest|corrupt"):
        await fastckpt.download_checkpoint_async(uri, tmp_path / "out", config=small_config())
    assert not (tmp_path / "escape.bin").exists() and not (tmp_path / "out").exists()


async def test_malformed_and_oversized_manifests_fail_clearly(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    uri = f"file://{tmp_path}/store/ckpt"
    await forge(uri, [], raw_manifest=b'{"kind": "rank-manifest", "format": 1, "files": "not a list"')
    with pytest.raises(CheckpointError, match=r"not valid JSON|corrupt"):
        await fastckpt.download_checkpoint_async(uri, tmp_path / "out", config=small_config())
    await forge(uri, ["a.bin", "b.bin"])
    monkeypatch.setattr(documents, "MAX_DOCUMENT", 100)  # the real limit is 256 MiB
    with pytest.raises(CheckpointError, match="over the limit of 100 bytes for a fastckpt manifest"):
        await fastckpt.download_checkpoint_async(uri, tmp_path / "out", config=small_config())


async def test_symlinked_directory_in_the_destination_is_not_followed(tmp_path: Path) -> None:
    uri = f"file://{tmp_path}/store/ckpt"
    await forge(uri, ["sub/model.bin"])
    outside, out = tmp_path / "outside", tmp_path / "out"
    outside.mkdir()
    out.mkdir()
    (out / "sub").symlink_to(outside)
    with pytest.raises(ValueError, match="leads outside"):
        await fastckpt.download_checkpoint_async(uri, out, config=small_config())
    with pytest.raises(ValueError, match="leads outside"):
        await fastckpt.download_async(uri, out, config=small_config())
    assert list(outside.iterdir()) == []


def test_upload_of_a_tree_follows_inner_symlinks_and_refuses_the_rest(tmp_path: Path) -> None:
    tree = tmp_path / "tree"
    (tree / "d").mkdir(parents=True)
    (tree / "d" / "real.bin").write_bytes(b"real")
    (tree / "alias.bin").symlink_to(tree / "d" / "real.bin")
    results = fastckpt.upload(tree, f"file://{tmp_path}/store/t", config=small_config())
    assert sorted(Path(r.key).name for r in results) == ["alias.bin", "real.bin"]
    assert (tmp_path / "store" / "t" / "alias.bin").read_bytes() == b"real"
    (tmp_path / "secret").write_bytes(b"not yours")
    for link, target in (("leak.bin", tmp_path / "secret"), ("dir", tmp_path), ("dangling", tmp_path / "nope")):
        (tree / link).symlink_to(target)
        with pytest.raises(ValueError, match=f"refusing to upload symlink .*{link}"):
            fastckpt.upload(tree, f"file://{tmp_path}/store/u", config=small_config())
        (tree / link).unlink()
    assert not (tmp_path / "store" / "u").exists()


@pytest.mark.parametrize("uri", ["s3://bkt/a/../b", "gs://bkt/./x", "az://c0ntainer/a/%00b?account=a", "memory://m/../x"])
def test_dot_segments_and_nul_in_keys_are_refused_on_the_way_in(uri: str) -> None:
    with pytest.raises(ValueError, match=r"cannot hold a '\.' or '\.\.' part or a NUL byte"):
        parse_uri(uri)


@pytest.mark.parametrize("store", ["local", "memory"])
def test_no_space_left_names_the_file(tmp_path: Path, store: str) -> None:
    """A download into a full filesystem (a 1 MiB tmpfs) fails naming the file, and leaves nothing: copied from
    a local store, or written whole from memory (an object of one part comes down in one read)."""
    tiny = tmp_path / "tiny"
    tiny.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(tiny)], capture_output=True).returncode:
        pytest.skip("cannot mount a small tmpfs here (needs root)")
    try:
        src = tmp_path / "big.bin"
        src.write_bytes(os.urandom(4 << 20))
        config = small_config(part_size=8 << 20)
        if store == "local":
            fastckpt.upload(src, f"file://{tmp_path}/store/big.bin", config=config)
            with pytest.raises(OSError) as info:
                fastckpt.download(f"file://{tmp_path}/store/big.bin", tiny / "big.bin", config=config)
        else:  # listed, so its size is known: one read, then written whole
            fastckpt.upload(src, f"memory://nospace-{tmp_path.name}/d/big.bin", config=config)
            with pytest.raises(OSError) as info:
                fastckpt.download(f"memory://nospace-{tmp_path.name}/d", tiny, config=config)
        assert info.value.errno == errno.ENOSPC and str(tiny / "big.bin") in str(info.value)
        assert list(tiny.iterdir()) == []
    finally:
        subprocess.run(["umount", str(tiny)], check=True)
