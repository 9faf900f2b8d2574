"""``download_checkpoint(..., group=)`` and ``fastckpt.torch.load(..., group=)`` in real gloo jobs
(``tests/ranks/group_job.py``): every rank ends with the whole checkpoint (or its state), each byte read from storage
once for the group, and a failure on any rank fails every rank."""

from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit

import pytest

import fastckpt
from harness.proxy import FaultProxy
from harness.uris import below

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]
REPO = Path(__file__).resolve().parents[2]
WORLD = 3
SIZES = {"model-00001.safetensors": 3 << 20, "model-00002.safetensors": (2 << 20) + 17, "optim/rank_00.pt": 3 << 19,
         "config.json": 300}


def job(tmp_path: Path, uri: str, *, group: bool = True, die: int | None = None, unreadable: int | None = None,
        mode: str = "download", keys: list[list[str]] | None = None) -> list[dict]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / f"out-{os.urandom(3).hex()}"
    out.mkdir()
    spec = {"uri": uri, "world": WORLD, "port": port, "out": str(out), "group": group, "die": die,
            "unreadable": unreadable, "mode": mode, "keys": keys}
    run = subprocess.run([sys.executable, "-m", "tests.ranks.group_job", json.dumps(spec)], cwd=REPO,
                         capture_output=True, text=True, timeout=200)
    records = [json.loads(p.read_text()) for p in sorted(out.glob("rank-*.json"))]
    assert records, run.stdout[-2000:] + run.stderr[-2000:]
    return records


def served(endpoint: str, uri: str, tmp_path: Path, mode: str, keys: list[list[str]] | None = None
           ) -> tuple[list[dict], list[dict], int, int]:
    """The job run on ``uri`` through a byte-counting proxy in front of ``endpoint``, with ``group=`` and without:
    (records with, records without, bytes the store served with, bytes without)."""
    with FaultProxy(urlsplit(endpoint).port) as proxy:
        through = uri.replace(endpoint, proxy.url)
        shared = job(tmp_path, through, mode=mode, keys=keys)
        once = proxy.moved["down"]
        alone = job(tmp_path, through, group=False, mode=mode, keys=keys)
        return shared, alone, once, proxy.moved["down"] - once


def flip_byte(path: Path, at: int) -> None:
    """The byte at offset ``at`` (negative: from the end) of the file ``path`` changed in place."""
    data = bytearray(path.read_bytes())
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))


def one_error(records: list[dict]) -> str:
    """The error every rank failed with: one, the same on all of them."""
    errors = {r["error"] for r in records}
    assert len(errors) == 1 and not any(r["ok"] for r in records), errors
    return errors.pop()


def committed(uri: str, tmp_path: Path) -> dict[str, str]:
    """A committed checkpoint of ``SIZES`` at ``uri``; the sha256 of each file."""
    src = tmp_path / "src"
    for name, size in SIZES.items():
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        (src / name).write_bytes(os.urandom(size))
    with fastckpt.SyncCheckpointWriter(uri) as w:
        w.put_dir(src)
    return {n: hashlib.sha256((src / n).read_bytes()).hexdigest() for n in SIZES}


@pytest.mark.parametrize("mode", ["download", "load"])
def test_each_byte_read_once_for_the_group(mode: str, s3_uri: str, moto_server, tmp_path: Path) -> None:
    """3 ranks each restore through a byte-counting proxy (``download``: the whole checkpoint; ``load``: stored rank
    0's state): with ``group=`` the store serves its bytes about once (each rank fetches a part and sends it to the
    others), without it three times; every rank ends bit-exact either way."""
    uri = below(s3_uri, mode)
    want = committed(uri, tmp_path) if mode == "download" else saved_state(uri)
    size = sum(f.size for f in fastckpt.open_checkpoint(uri).files.values() if f is not None)
    shared, alone, once, thrice = served(moto_server.endpoint, uri, tmp_path, mode)
    for record in shared + alone:
        assert record["ok"] and record["files"] == want, record["error"]
    assert once <= 1.05 * size, f"{once} bytes came from the store for {size} bytes of checkpoint"
    assert thrice >= WORLD * size


def test_a_failure_on_one_rank_fails_every_rank(tmp_path: Path) -> None:
    """A data object changed behind the checkpoint's back fails the rank that fetches it, and so every rank, with
    the same error; no rank has the bad file under its name."""
    uri = f"file://{tmp_path}/store/step-1"
    committed(uri, tmp_path)
    victim = tmp_path / "store/step-1/model-00002.safetensors"
    victim.write_bytes(os.urandom(victim.stat().st_size))
    records = job(tmp_path, uri)
    assert "digest mismatch" in one_error(records)
    assert not any("model-00002.safetensors" in r["files"] for r in records)


def test_a_file_unreadable_mid_exchange_fails_every_rank_in_step(tmp_path: Path) -> None:
    """The owner of a file cannot read it back while sending it: it keeps taking part in every broadcast, so the
    ranks stay in step and all of them fail, soon, with one error naming that rank (its own, or a receiver's
    mismatch on what came from it)."""
    uri = f"file://{tmp_path}/store/step-1"
    committed(uri, tmp_path)
    records = job(tmp_path, uri, unreadable=1)
    assert len(records) == WORLD
    error = one_error(records)
    assert "rank 1" in error and "model-00002.safetensors" in error, error
    assert all(r["seconds"] < 60 for r in records)


def test_a_rank_that_dies_fails_the_others_in_bounded_time(tmp_path: Path) -> None:
    uri = f"file://{tmp_path}/store/step-1"
    committed(uri, tmp_path)
    records = job(tmp_path, uri, die=1)
    assert len(records) == WORLD - 1  # the dead rank recorded nothing
    for record in records:
        assert not record["ok"] and "process group" in record["error"], record
        assert record["seconds"] < 60


def saved_state(uri: str, base: str | None = None) -> dict[str, str]:
    """Rank 0's tensor state (7 MiB: several chunks on every backend) saved to ``uri`` (``base``: incrementally, its
    large tensors in a file of their own); the sha256 of each tensor's bytes."""
    torch = pytest.importorskip("torch")
    import fastckpt.torch as ft

    gen = torch.Generator().manual_seed(7)
    state = {"embed": torch.randn(1024, 1024, generator=gen), "head": torch.randn(512, 1536, generator=gen),
             "step": torch.tensor([3])}
    ft.save(state, uri, config=fastckpt.TransferConfig(part_size=1 << 20), base=base)
    return {k: hashlib.sha256(v.contiguous().view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()
            for k, v in state.items()}


def test_an_incremental_state_loads_in_a_group(tmp_path: Path) -> None:
    """A state saved with ``base=`` is in two files (its large tensors, and the rest with the skeleton): every rank
    of the group loads both, each byte read once, bit-exact."""
    uri = f"file://{tmp_path}/store/incremental"
    want = saved_state(uri, base="latest")
    assert sorted(fastckpt.open_checkpoint(uri).files) == ["rank-00000-large.safetensors", "rank-00000.safetensors"]
    records = job(tmp_path, uri, mode="load")
    assert all(r["ok"] and r["files"] == want for r in records), [r["error"] for r in records]


def test_a_corrupt_state_fails_every_loading_rank(tmp_path: Path) -> None:
    uri = f"file://{tmp_path}/store/state"
    saved_state(uri)
    flip_byte(tmp_path / "store/state/rank-00000.safetensors", -5)  # the last chunk: fetched by the last rank
    records = job(tmp_path, uri, mode="load")
    assert "differ from the manifest" in one_error(records)


def test_each_rank_loading_a_shard_of_its_own(tmp_path: Path) -> None:
    """Each rank of the group loads its own stored rank's state (nothing shared: each reads its file alone) and gets
    it bit-exact; one rank's damaged file fails every rank with the same error."""
    import threading

    torch = pytest.importorskip("torch")
    import fastckpt.torch as ft

    uri, barrier, want = f"file://{tmp_path}/store/shards", fastckpt.InProcessBarrier(timeout=60), {}

    def save(r: int) -> None:
        state = {"shard": torch.randn(512, 1024, generator=torch.Generator().manual_seed(r)), "rank": torch.tensor(r)}
        want[r] = {k: hashlib.sha256(v.contiguous().view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()
                   for k, v in state.items()}
        ft.save(state, uri, rank=r, world_size=WORLD, barrier=barrier,
                config=fastckpt.TransferConfig(part_size=1 << 20))

    threads = [threading.Thread(target=save, args=(r,)) for r in range(WORLD)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    records = job(tmp_path, uri, mode="own")
    assert [r["files"] for r in records] == [want[r] for r in range(WORLD)], [r["error"] for r in records]
    flip_byte(tmp_path / "store/shards/rank-00001.safetensors", -5)
    records = job(tmp_path, uri, mode="own")
    assert "on rank 1" in (error := one_error(records)) and "rank-00001.safetensors" in error, error


DCP_SHAPES = {"embed": (1024, 768), "head": (768, 512), "norm": (4096,)}


def dcp_saved(uri: str) -> dict[str, str]:
    """A DCP checkpoint of a 5 MiB state saved by one process to ``uri`` with small chunks (several per tensor); the
    sha256 of each tensor's bytes and the ``step`` item."""
    torch = pytest.importorskip("torch")
    import torch.distributed.checkpoint as dcp

    from fastckpt.torch.dcp import Writer

    gen = torch.Generator().manual_seed(11)
    state = {k: torch.randn(shape, generator=gen) for k, shape in DCP_SHAPES.items()}
    state["head"] = state["head"].to(torch.bfloat16)
    dcp.save({**state, "step": 42}, storage_writer=Writer(uri, config=fastckpt.TransferConfig(part_size=1 << 20)),
             no_dist=True)
    return {**{k: hashlib.sha256(v.view(-1).view(torch.uint8).numpy().tobytes()).hexdigest() for k, v in state.items()},
            "step": "42"}


@pytest.mark.parametrize("layout", ["replicas", "overlapping"])
def test_dcp_reader_reads_each_byte_once_for_the_group(layout: str, s3_uri: str, moto_server, tmp_path: Path) -> None:
    """3 ranks load a DCP checkpoint through ``Reader(group=)``: all of it on every rank (data-parallel replicas), or
    overlapping subsets of its tensors; the store serves each byte any rank needs about once with the group, and
    once per rank that needs it without; every rank loads its tensors bit-exact either way."""
    uri = below(s3_uri, f"dcp-{layout}")
    want = dcp_saved(uri)
    names = sorted(DCP_SHAPES)
    keys = [names] * WORLD if layout == "replicas" else [names, ["embed"], ["embed", "norm"]]
    files = fastckpt.open_checkpoint(uri).files
    tensors = sum(f.size for n, f in files.items() if f is not None and n != ".metadata")
    shared, alone, once, without = served(moto_server.endpoint, uri, tmp_path, "dcp", keys)
    for rank, record in enumerate(shared + alone):
        assert record["ok"], record["error"]
        assert record["files"] == {k: want[k] for k in [*keys[rank % WORLD], "step"]}
    assert once <= 1.05 * tensors + files[".metadata"].size * 2 * WORLD, (once, tensors)
    assert without >= (WORLD if layout == "replicas" else 1.3) * tensors, (without, tensors)


def test_dcp_reader_in_a_group_fails_every_rank_on_a_corrupt_chunk(tmp_path: Path) -> None:
    uri = f"file://{tmp_path}/store/dcp"
    dcp_saved(uri)
    victim = tmp_path / "store/dcp/rank-00000.distcp"
    flip_byte(victim, victim.stat().st_size // 2)
    records = job(tmp_path, uri, mode="dcp", keys=[sorted(DCP_SHAPES)] * WORLD)
    assert len(records) == WORLD and not any(r["ok"] for r in records), records
    assert all("do not match their recorded chunk digests" in r["error"] for r in records), records


def test_dcp_reader_in_a_group_fails_in_bounded_time_when_a_rank_dies(tmp_path: Path) -> None:
    uri = f"file://{tmp_path}/store/dcp"
    dcp_saved(uri)
    """Our exchange fails as the others do above; DCP then runs a collective of its own to share that failure, and
    gloo's error from that one (the peer closed the connection, a read error) is what dcp.load raises: either way,
    soon."""
    records = job(tmp_path, uri, mode="dcp", keys=[sorted(DCP_SHAPES)] * WORLD, die=1)
    assert len(records) == WORLD - 1  # the dead rank recorded nothing
    for record in records:
        assert not record["ok"], record
        assert "process group" in record["error"] or "gloo/transport" in record["error"], record
        assert record["seconds"] < 60


def hf_model(folder: Path) -> dict[str, str]:
    """A Hugging Face layout in ``folder``: two bf16/f32 shards (several 1 MiB chunks each) and their index; the
    sha256 of each tensor as ``safetensors.torch.load_file`` returns it."""
    torch = pytest.importorskip("torch")
    st = pytest.importorskip("safetensors.torch")
    gen = torch.Generator().manual_seed(11)
    shards = {"model-00001-of-00002.safetensors": {"embed": torch.randn(1024, 1280, generator=gen).bfloat16(),
                                                   "norm": torch.ones(1280)},
              "model-00002-of-00002.safetensors": {"layers.0.mlp": torch.randn(768, 1024, generator=gen),
                                                   "step": torch.tensor([5])}}
    folder.mkdir(parents=True)
    want = {}
    for name, tensors in shards.items():
        st.save_file(tensors, str(folder / name))
        want.update({k: hashlib.sha256(v.contiguous().view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()
                     for k, v in st.load_file(str(folder / name)).items()})
    index = {"metadata": {}, "weight_map": {k: n for n, t in shards.items() for k in t}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return want


def test_a_safetensors_model_is_read_once_for_the_group(s3_uri: str, moto_server, tmp_path: Path) -> None:
    """``load_safetensors(uri, group=)`` of an indexed model uploaded by ``fastckpt cp``: every rank ends with what
    ``safetensors.torch.load_file`` returns, the store serving the weights about once with ``group=`` and three times
    without."""
    uri = below(s3_uri, "model")
    want = hf_model(tmp_path / "model")
    fastckpt.upload(tmp_path / "model", uri, config=fastckpt.TransferConfig(part_size=1 << 20))
    size = sum(p.stat().st_size for p in (tmp_path / "model").glob("*.safetensors"))
    shared, alone, once, thrice = served(moto_server.endpoint, uri, tmp_path, "safetensors")
    for record in shared + alone:
        assert record["ok"] and record["files"] == want, record["error"]
    assert once <= 1.05 * size, f"{once} bytes came from the store for {size} bytes of weights"
    assert thrice >= WORLD * size


def test_a_changed_model_shard_fails_every_rank(tmp_path: Path) -> None:
    """A shard of a committed model changed behind its manifest fails the rank that fetches the changed range, and so
    every rank, with one error naming the shard."""
    uri = f"file://{tmp_path}/store/model"
    hf_model(tmp_path / "model")
    with fastckpt.SyncCheckpointWriter(uri) as w:
        w.put_dir(tmp_path / "model")
    flip_byte(tmp_path / "store/model/model-00002-of-00002.safetensors", -100)
    records = job(tmp_path, uri, mode="safetensors")
    assert len(records) == WORLD
    error = one_error(records)
    assert "model-00002-of-00002.safetensors" in error and "differ" in error, error
