"""Two writers of one checkpoint, on every backend: a committed checkpoint's bytes never change.

Each scenario runs with two attempt ids and with one shared attempt id (a zombie of the same run), with
a small file (one PUT) and a multipart file, against every backend's real server.
"""

from __future__ import annotations

import os

import pytest

import fastckpt
from fastckpt import CheckpointError, open_store, parse_uri
from fastckpt.checkpoint.documents import read_object
from fastckpt.checkpoint.manifest import meta_prefix, rank_key
from harness.uris import below

from ..conftest import small_config

ATTEMPTS = {"two-attempts": ("a", "b"), "same-attempt": ("x", "x")}
BIG = 6 << 20  # multipart on every backend (S3's smallest part is 5 MiB)


def writer(uri: str, attempt: str) -> fastckpt.CheckpointWriter:
    return fastckpt.CheckpointWriter(uri, attempt=attempt, config=small_config())


def sources(tmp_path, tag: str) -> tuple[str, str, bytes, bytes]:
    """Two local files (small, multipart) with bytes unique to ``tag``."""
    small, big = os.urandom(1000), os.urandom(BIG)
    (tmp_path / f"{tag}-small").write_bytes(small)
    (tmp_path / f"{tag}-big").write_bytes(big)
    return str(tmp_path / f"{tag}-small"), str(tmp_path / f"{tag}-big"), small, big


async def put_both(w: fastckpt.CheckpointWriter, small: str, big: str) -> None:
    await w.put_file(small, "model.bin")
    await w.put_file(big, "optim/big.bin")


async def assert_holds(uri: str, tmp_path, small: bytes, big: bytes) -> None:
    """``uri`` is committed, verifies, and downloads to exactly ``small`` / ``big``."""
    assert (await fastckpt.verify_async(uri, config=small_config())).ok
    out = tmp_path / f"out-{os.urandom(3).hex()}"
    await fastckpt.download_checkpoint_async(uri, out, config=small_config())
    assert (out / "model.bin").read_bytes() == small
    assert (out / "optim" / "big.bin").read_bytes() == big


@pytest.mark.parametrize("attempts", list(ATTEMPTS), ids=list(ATTEMPTS))
async def test_loser_after_the_commit_writes_nothing(store_uri: str, tmp_path, attempts: str) -> None:
    """Both writers enter; A writes and commits; B's writes then fail before touching A's files."""
    uri, (first, second) = below(store_uri, "step-1"), ATTEMPTS[attempts]
    (a_small, a_big, small, big), (b_small, b_big, _, _) = sources(tmp_path, "a"), sources(tmp_path, "b")
    manifest = rank_key(meta_prefix(parse_uri(uri).key), first, 0)

    b = writer(uri, second)
    await b.__aenter__()
    async with writer(uri, first) as a:
        await put_both(a, a_small, a_big)
    async with open_store(uri, config=small_config()) as store:
        committed_manifest = await read_object(store, manifest)

    with pytest.raises(CheckpointError, match=r"already committed.*not written") as failed:
        await put_both(b, b_small, b_big)
    await b.__aexit__(CheckpointError, failed.value, None)  # B hands its failure record to the barrier
    assert b.result is None
    await assert_holds(uri, tmp_path, small, big)
    async with open_store(uri, config=small_config()) as store:
        assert await read_object(store, manifest) == committed_manifest


@pytest.mark.parametrize("attempts", list(ATTEMPTS), ids=list(ATTEMPTS))
async def test_replaced_files_fail_the_first_commit(store_uri: str, tmp_path, attempts: str) -> None:
    """A writes but has not committed; B takes the names over (A looks dead). A's commit then fails, B's wins."""
    uri, (first, second) = below(store_uri, "step-2"), ATTEMPTS[attempts]
    (a_small, a_big, _, _), (b_small, b_big, small, big) = sources(tmp_path, "a"), sources(tmp_path, "b")

    a, b = writer(uri, first), writer(uri, second)
    await a.__aenter__()
    await b.__aenter__()
    await put_both(a, a_small, a_big)
    await put_both(b, b_small, b_big)
    with pytest.raises(CheckpointError, match="no longer holds what rank 0 wrote"):
        await a.__aexit__(None, None, None)
    await b.__aexit__(None, None, None)
    assert b.result is not None and b.result.attempt == second
    await assert_holds(uri, tmp_path, small, big)


async def test_a_file_created_meanwhile_is_not_replaced(store_uri: str, tmp_path) -> None:
    """A name created by another writer after this writer listed the checkpoint fails the write."""
    uri = below(store_uri, "step-3")
    a_small, a_big, small, big = sources(tmp_path, "a")
    b_small, b_big, _, _ = sources(tmp_path, "b")

    b = writer(uri, "b")
    await b.__aenter__()
    await b.put_file(b_small, "other.bin")  # B has listed the (then empty) checkpoint
    async with writer(uri, "a") as a:
        await put_both(a, a_small, a_big)
    for src, name in ((b_small, "model.bin"), (b_big, "optim/big.bin")):
        with pytest.raises(CheckpointError, match=r"already committed|created meanwhile"):
            await b.put_file(src, name)
    with pytest.raises(CheckpointError, match="committed by another writer"):
        await b.__aexit__(None, None, None)
    await assert_holds(uri, tmp_path, small, big)
