"""The torch.distributed.checkpoint plugin in real multi-process gloo jobs (tests/ranks/dcp_job.py):
FSDP-style sharded state saved by 4 ranks, loaded back by 4 and by 2 (DCP's resharding), a rank killed
mid-save leaving no checkpoint, and the next save over its leftovers."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch.distributed.checkpoint")

import fastckpt
from fastckpt import CheckpointError
from harness.uris import below

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]


def job(mode: str, uri: str, world: int) -> subprocess.CompletedProcess[str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return subprocess.run([sys.executable, "-m", "tests.ranks.dcp_job", mode, uri, str(world), str(port)], cwd=REPO,
                          capture_output=True, text=True, timeout=280)


def ok(run: subprocess.CompletedProcess[str]) -> None:
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]


@pytest.mark.parametrize("backend", ["local", "s3"])
def test_sharded_save_and_resharded_load(backend: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    base = f"file://{tmp_path}/store" if backend == "local" else request.getfixturevalue("s3_uri")
    ok(job("save", base, 4))  # dcp.save and dcp.async_save by 4 ranks, loaded back by the same 4
    infos = {c.name: c for c in fastckpt.list_checkpoints(base)}
    want = {n: ("committed", 4) for n in ("a", "b", "b21", "b22")}
    assert {n: (c.state, c.world_size) for n, c in infos.items()} == want
    assert fastckpt.verify(below(base, "a")).ok
    ok(job("load", base, 2))  # resharded onto 2 ranks


def test_writer_stages_into_memory_it_keeps(tmp_path: Path) -> None:
    """``Writer(cache_staged_state_dict=True)`` stages each save into the memory of the last, once that save wrote its
    data; a save staged before then, and a writer without the cache, get fresh memory. Every save loads bit-exact."""
    import pickle

    import torch
    import torch.distributed.checkpoint as dcp

    from fastckpt.torch.dcp import Reader, Writer

    state = {"w": torch.randn(4096), "step": 1}
    writer, ptrs = Writer(cache_staged_state_dict=True), []
    for step in (1, 2):
        state["w"].add_(1)
        staged = writer.stage(state)
        ptrs.append(staged["w"].data_ptr())
        if step == 1:
            assert writer.stage(state)["w"].data_ptr() != ptrs[0]  # the first save has not written its data yet
        dcp.save(staged, storage_writer=writer, checkpoint_id=str(tmp_path / f"s{step}"), no_dist=True)
        back = {"w": torch.zeros(4096), "step": 0}
        dcp.load(back, storage_reader=Reader(str(tmp_path / f"s{step}")), no_dist=True)
        assert torch.equal(back["w"], state["w"])
    assert ptrs[0] == ptrs[1]
    sent = pickle.loads(pickle.dumps(writer))  # as to DCP's writing process: without the kept memory
    assert sent._stager is None and sent.cache_staged_state_dict and writer._stager is not None
    writer.close()
    fresh = Writer()
    assert fresh.stage(state)["w"].data_ptr() != fresh.stage(state)["w"].data_ptr()


def test_incremental_saves_with_latest(tmp_path: Path) -> None:
    """Two ranks save twice with ``base="latest"`` (DCP and fastckpt.torch): the frozen weights are copied by the
    store on the second save, and it loads bit-exact once the first is deleted (checked in the job)."""
    ok(job("incr", f"file://{tmp_path}/store", 2))
    assert fastckpt.verify(f"file://{tmp_path}/store/dcp-2").ok


def test_rank_killed_mid_save_leaves_no_checkpoint(tmp_path: Path) -> None:
    base = f"file://{tmp_path}/store"
    crashed = job("crash", base, 4)
    assert crashed.returncode != 0 and "exit codes: [1, 1, 9, 1]" in crashed.stdout, crashed.stdout[-2000:]
    assert fastckpt.latest(base) is None
    with pytest.raises(CheckpointError, match="not committed"):
        fastckpt.open_checkpoint(below(base, "c"))
    report = fastckpt.gc(base, older_than=0)
    assert report.aborted_uploads and report.removed
    ok(job("resave", base, 2))  # a new run saves the same checkpoint and loads it back
    assert fastckpt.latest(base).endswith("/c")


def test_fastckpt_torch_ranks_through_torch_distributed(tmp_path: Path) -> None:
    """fastckpt.torch under a real gloo job: rank, world size and barrier from torch.distributed; a rank
    killed mid-upload commits nothing."""
    base = f"file://{tmp_path}/store"
    ok(job("ft", base, 4))
    assert [(c.name, c.world_size) for c in fastckpt.list_checkpoints(base)] == [("t", 4)]
    crashed = job("ft-crash", base, 4)
    assert crashed.returncode != 0 and "exit codes: [1, 1, 9, 1]" in crashed.stdout, crashed.stdout[-2000:]
    assert fastckpt.latest(base).endswith("/t")
    with pytest.raises(CheckpointError, match="not committed"):
        fastckpt.open_checkpoint(below(base, "u"))


def drop_in(mode: str, uri: str) -> subprocess.CompletedProcess[str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return subprocess.run([sys.executable, "-m", "tests.ranks.dcp_drop_in", mode, uri, "2", str(port)], cwd=REPO,
                          capture_output=True, text=True, timeout=280)


@pytest.mark.parametrize("backend", ["local", "s3", "gcs", "azure"])
def test_repeated_saves_to_one_path_with_resharding(backend: str, tmp_path: Path,
                                                    request: pytest.FixtureRequest) -> None:
    """Code written for ``FileSystemWriter`` saves to one path again and again (DCP's ``overwrite=True``), with another
    shard plan each time: each save replaces the last, ``overwrite=False`` is refused (checked in the job)."""
    base = f"file://{tmp_path}/store" if backend == "local" else request.getfixturevalue(f"{backend}_uri")
    ok(drop_in("resave", base))
    assert fastckpt.verify(below(base, "o")).ok


@pytest.mark.parametrize("backend", ["local", "s3"])
def test_stock_options_and_zstandard(backend: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    base = f"file://{tmp_path}/store" if backend == "local" else request.getfixturevalue("s3_uri")
    ok(drop_in("options", base))


@pytest.mark.parametrize("backend", ["local", "s3"])
def test_checkpoints_move_between_fastckpt_and_the_stock_classes(backend: str, tmp_path: Path,
                                                                 request: pytest.FixtureRequest) -> None:
    base = f"file://{tmp_path}/store" if backend == "local" else request.getfixturevalue("s3_uri")
    ok(drop_in("interop", base))


def test_a_rank_killed_mid_overwrite_leaves_the_old_checkpoint(tmp_path: Path) -> None:
    base = f"file://{tmp_path}/store"
    assert drop_in("crash", base).returncode != 0
    ok(drop_in("survivor", base))


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_dcp_tools_read_what_fastckpt_wrote(tmp_path: Path) -> None:
    """``dcp_to_torch_save`` (and so DCP's other offline tools) converts a fastckpt checkpoint, saved over once."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from fastckpt.torch.dcp import Writer

    path = str(tmp_path / "ckpt")
    for step in (1, 2):
        state = {"w": torch.full((64, 32), float(step)), "b": torch.arange(5, dtype=torch.bfloat16), "step": step,
                 "opt": {"lr": 0.1 * step, "name": "adam"}}
        dcp.save(state, storage_writer=Writer(path), no_dist=True)
    dcp_to_torch_save(path, tmp_path / "out.pt")
    back = torch.load(tmp_path / "out.pt", weights_only=False)
    assert torch.equal(back["w"], state["w"]) and torch.equal(back["b"], state["b"])
    assert (back["step"], back["opt"]) == (2, {"lr": 0.2, "name": "adam"})


def test_every_stock_argument_is_taken() -> None:
    """Each parameter of ``FileSystemWriter`` / ``FileSystemReader`` (with its stock default) and the common fsspec
    storage options are accepted by name; an option fastckpt cannot honour is named in a ValueError, never a
    TypeError."""
    import inspect

    from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

    from fastckpt.torch.dcp import Reader, Writer

    for stock, ours in ((FileSystemWriter, Writer), (FileSystemReader, Reader)):
        params = list(inspect.signature(stock.__init__).parameters.values())[1:]
        given = {p.name: p.default for p in params if p.default is not inspect.Parameter.empty}
        ours("/tmp/x", **given)  # by name
        ours("/tmp/x", *given.values())  # in the stock order
    writer = Writer("s3://bucket/ckpt", endpoint_url="http://127.0.0.1:1", client_kwargs={"region_name": "eu-1"})
    assert writer._target().options == {"endpoint_override": "http://127.0.0.1:1", "region": "eu-1"}
    with pytest.raises(ValueError, match=r"\['key', 'secret'\]"):
        Reader("s3://bucket/ckpt", key="id", secret="s")
    with pytest.raises(ValueError, match="TORCH_SAVE"):
        from torch.distributed.checkpoint.filesystem import SerializationFormat
        Writer("/tmp/x", serialization_format=SerializationFormat.SAFETENSORS)
