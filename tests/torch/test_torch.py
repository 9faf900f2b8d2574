"""fastckpt.torch: tensor state saved from memory and loaded into tensors, on every backend."""

from __future__ import annotations

import json
import math
import os
import struct
import threading
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
safetensors = pytest.importorskip("safetensors")

import fastckpt  # noqa: E402
import fastckpt.torch as ft  # noqa: E402
from fastckpt import CheckpointError, InProcessBarrier, IntegrityError, open_store  # noqa: E402
from fastckpt.errors import StoreError  # noqa: E402
from fastckpt.torch.format import flatten  # noqa: E402
from harness.faults import FaultInjectingStore  # noqa: E402
from harness.uris import below  # noqa: E402

from ..conftest import small_config  # noqa: E402


def llm_like_state(seed: int = 0) -> dict[str, Any]:
    """Every kind of value a training state holds, with awkward tensors (bf16, fp8, views, empty, 0-dim)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(300, 257, generator=g).to(torch.bfloat16)
    return {
        "model": {"embed.weight": w, "proj.weight": torch.randn(64, 96, generator=g).t(),
                  "norm.bias": torch.randn(257, generator=g)[::2], "mask": torch.rand(33, generator=g) > 0.5,
                  "fp8": torch.randn(17, generator=g).to(torch.float8_e4m3fn), "empty": torch.empty(0, 4),
                  "scalar": torch.tensor(2.5, dtype=torch.float64), "ids": torch.arange(-5, 6, dtype=torch.int16)},
        "optim": {"state": {0: {"step": torch.tensor(11.0), "exp_avg": torch.randn(300, 257, generator=g)},
                            1: {"step": torch.tensor(11.0), "exp_avg_sq": torch.rand(64, 96, generator=g)}},
                  "param_groups": [{"lr": 3e-4, "betas": (0.9, 0.95), "params": [0, 1], "fused": None}]},
        "step": 1234, "loss": float("nan"), "best": -math.inf, "run": "llm-1b", "tags": ["a", "b"],
        "rng": b"\x00\xffstate", "dtype": torch.bfloat16, (1, 2): "tuple key",
    }


def same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
                and torch.equal(a.view(torch.uint8) if a.dtype.is_floating_point and a.element_size() == 1 else a,
                                b.view(torch.uint8) if b.dtype.is_floating_point and b.element_size() == 1 else b))
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, float) and math.isnan(a):
        return isinstance(b, float) and math.isnan(b)
    return type(a) is type(b) and a == b


# ----------------------------------------------------------------------------- every backend


def test_round_trip_every_backend(store_uri: str) -> None:
    """save, async_save and both load paths give back exactly what was saved; the checkpoint is committed."""
    state = llm_like_state()
    cfg = small_config()
    done = ft.save(state, below(store_uri, "step-1"), config=cfg)
    assert done.files == 1 and done.world_size == 1
    assert same(state, ft.load(below(store_uri, "step-1"), config=cfg))
    handle = ft.async_save(state, below(store_uri, "step-2"), config=cfg, staging=ft.Staging())
    assert handle.wait().files == 1 and handle.done()
    window = max(256 << 10, open_store(store_uri, config=cfg).min_part_size)  # two windows
    assert same(state, ft.load(below(store_uri, "step-2"), config=cfg, staging=ft.Staging(window)))
    assert fastckpt.latest(store_uri, config=cfg).partition("?")[0].endswith("step-2")
    assert fastckpt.verify(below(store_uri, "step-1"), config=cfg).ok


# ----------------------------------------------------------------------------- format and load targets


def test_rank_file_opens_with_safetensors(tmp_path: Path) -> None:
    state = llm_like_state()
    ft.save(state, str(tmp_path / "c"))
    with safetensors.safe_open(str(tmp_path / "c" / ft.rank_file(0)), "pt") as f:
        assert torch.equal(f.get_tensor("model.embed.weight"), state["model"]["embed.weight"])
        assert torch.equal(f.get_tensor("optim.state.0.exp_avg"), state["optim"]["state"][0]["exp_avg"])
        assert torch.equal(f.get_tensor("model.proj.weight"), state["model"]["proj.weight"])
        assert f.metadata()["fastckpt.state_tensor"] == "__fastckpt_state__"  # the skeleton: JSON in a U8 tensor
        assert "d" in json.loads(f.get_tensor("__fastckpt_state__").numpy().tobytes())


def test_plain_safetensors_file_loads_as_flat_dict(tmp_path: Path) -> None:
    """A checkpoint whose rank file was written by safetensors itself loads as its flat tensor dict."""
    from safetensors.torch import save_file

    tensors = {"a": torch.randn(5, 7), "b": torch.arange(9, dtype=torch.int32)}
    src = tmp_path / "src"
    src.mkdir()
    save_file(tensors, str(src / ft.rank_file(0)))
    with fastckpt.SyncCheckpointWriter(str(tmp_path / "c")) as w:
        w.put_dir(src)
    assert same(tensors, ft.load(str(tmp_path / "c")))


def test_load_into_state_dict_in_place(tmp_path: Path) -> None:
    state = llm_like_state()
    ft.save(state, str(tmp_path / "c"))
    target = llm_like_state(seed=1)
    target["model"]["proj.weight"] = torch.zeros(64, 96).t()  # a non-contiguous destination
    embed = target["model"]["embed.weight"]
    out = ft.load(str(tmp_path / "c"), state_dict=target)
    assert out["model"]["embed.weight"] is embed and torch.equal(embed, state["model"]["embed.weight"])
    assert torch.equal(target["model"]["proj.weight"], state["model"]["proj.weight"])
    assert same(state, out)


def test_load_refuses_mismatched_or_missing_tensors(tmp_path: Path) -> None:
    ft.save({"w": torch.zeros(4, 4)}, str(tmp_path / "c"))
    with pytest.raises(CheckpointError, match=r"'w' is stored as torch.float32\[4, 4\]"):
        ft.load(str(tmp_path / "c"), state_dict={"w": torch.zeros(4, 5)})
    with pytest.raises(CheckpointError, match="no stored tensor for \\['v'\\]"):
        ft.load(str(tmp_path / "c"), state_dict={"w": torch.zeros(4, 4), "v": torch.zeros(1)})


def test_unstorable_values_are_named() -> None:
    with pytest.raises(TypeError, match=r"'opt\.sched': set cannot be stored without pickle"):
        flatten({"opt": {"sched": {1, 2}}})
    with pytest.raises(TypeError, match=r"'x': tensor dtype torch\.complex128"):
        flatten({"x": torch.zeros(2, dtype=torch.complex128)})


def test_corrupted_byte_is_detected_on_load(tmp_path: Path) -> None:
    ft.save({"w": torch.randn(1000, 100)}, str(tmp_path / "c"), config=small_config())
    path = tmp_path / "c" / ft.rank_file(0)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(IntegrityError, match="digest mismatch"):
        ft.load(str(tmp_path / "c"), config=small_config())
    with pytest.raises(IntegrityError, match="digest mismatch"):
        ft.load(str(tmp_path / "c"), config=small_config(), staging=ft.Staging(256 << 10))


def test_hostile_headers_are_refused(tmp_path: Path) -> None:
    """A rank file is untrusted: a huge header length or tensors overlapping or outside the file fail clearly."""
    def commit(raw: bytes, name: str) -> str:
        src = tmp_path / f"{name}-src"
        src.mkdir()
        (src / ft.rank_file(0)).write_bytes(raw)
        with fastckpt.SyncCheckpointWriter(str(tmp_path / name)) as w:
            w.put_dir(src)
        return str(tmp_path / name)

    huge = struct.pack("<Q", 1 << 40) + b"{}"
    with pytest.raises(CheckpointError, match="header of 1099511627776 bytes"):
        ft.load(commit(huge, "huge"))
    body = (b'{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},'
            b'"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}}')
    with pytest.raises(CheckpointError, match="overlap"):
        ft.load(commit(struct.pack("<Q", len(body)) + body + bytes(12), "overlap"))
    body = b'{"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}}'
    with pytest.raises(CheckpointError, match="describes"):
        ft.load(commit(struct.pack("<Q", len(body)) + body + bytes(8), "short"))
    body = b'{"a":{"dtype":"F32","shape":[3],"data_offsets":[0,16]}}'
    with pytest.raises(CheckpointError, match="do not fit"):
        ft.load(commit(struct.pack("<Q", len(body)) + body + bytes(16), "size"))


def test_load_of_uncommitted_checkpoint_is_refused(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="not committed"):
        ft.load(str(tmp_path / "nothing-here"))


# ----------------------------------------------------------------------------- async_save


def test_async_save_snapshot_survives_training_changes(tmp_path: Path) -> None:
    """Tensors changed right after async_save returns do not reach the checkpoint."""
    state = {"w": torch.zeros(512, 512), "step": 1}
    handle = ft.async_save(state, str(tmp_path / "c"), staging=ft.Staging(), config=small_config())
    state["w"].add_(1.0)
    handle.wait()
    assert torch.count_nonzero(ft.load(str(tmp_path / "c"))["w"]) == 0
    assert handle.blocked_s >= 0


def test_second_async_save_waits_or_fails_clearly(tmp_path: Path) -> None:
    base = f"file://{tmp_path}/store"
    slow = FaultInjectingStore(open_store(base, config=small_config()), latency=0.05, ops={"put_part", "put"})
    staging = ft.Staging()
    first_state = {"w": torch.full((256, 1024), 1.0)}
    first = ft.async_save(first_state, f"{base}/a", staging=staging, store=slow, config=small_config())
    with pytest.raises(RuntimeError, match="still uploading"):
        ft.async_save({"w": torch.full((256, 1024), 2.0)}, f"{base}/b", staging=staging, if_busy="error")
    second = ft.async_save({"w": torch.full((256, 1024), 2.0)}, f"{base}/b", staging=staging, config=small_config())
    assert first.done()  # "wait" waited for the first upload before reusing the staging memory
    second.wait()
    assert torch.all(ft.load(f"{base}/a")["w"] == 1.0) and torch.all(ft.load(f"{base}/b")["w"] == 2.0)


def test_failed_async_save_raises_on_wait_and_commits_nothing(tmp_path: Path) -> None:
    base = f"file://{tmp_path}/store"
    broken = FaultInjectingStore(open_store(base, config=small_config()), fail_after=2, ops={"put_part"},
                                 permanent=StoreError("injected: disk quota exceeded"))
    handle = ft.async_save({"w": torch.randn(1024, 1024)}, f"{base}/c", staging=ft.Staging(), store=broken,
                           config=small_config())
    with pytest.raises(StoreError, match="disk quota exceeded"):
        handle.wait()
    assert isinstance(handle.exception(), StoreError)
    assert fastckpt.latest(base) is None
    with pytest.raises(CheckpointError, match="not committed"):
        ft.load(f"{base}/c")


def test_staging_capacity_is_enforced() -> None:
    with pytest.raises(ValueError, match="does not fit the staging area of 1024 bytes"):
        ft.async_save({"w": torch.zeros(1024)}, "memory://cap/c", staging=ft.Staging(1024))


# ----------------------------------------------------------------------------- many ranks


def test_ranks_commit_together_and_load_their_own_state(tmp_path: Path) -> None:
    base, world = f"file://{tmp_path}/store", 3
    barrier, results = InProcessBarrier(timeout=60), {}

    def rank(r: int) -> None:
        state = {"shard": torch.full((100, 10), float(r)), "rank": r} if r != 1 else {}
        results[r] = ft.async_save(state, f"{base}/step-5", rank=r, world_size=world, barrier=barrier,
                                   attempt="job-1", config=small_config()).wait()

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert {r.world_size for r in results.values()} == {3}
    assert fastckpt.latest(base).endswith("step-5")
    assert fastckpt.verify(f"{base}/step-5").ok
    assert ft.load(f"{base}/step-5", rank=2, world_size=3)["rank"] == 2
    assert ft.load(f"{base}/step-5", rank=1) == {}
    with pytest.raises(CheckpointError, match="saved by 3 ranks: pass rank="):
        ft.load(f"{base}/step-5")
    with pytest.raises(CheckpointError, match="saved by 3 rank\\(s\\), not 2"):
        ft.load(f"{base}/step-5", rank=0, world_size=2)


def test_a_failed_rank_commits_nothing(tmp_path: Path) -> None:
    base = f"file://{tmp_path}/store"
    barrier, errors = InProcessBarrier(timeout=60), {}
    broken = FaultInjectingStore(open_store(base, config=small_config()), fail_after=0, ops={"put", "put_part"},
                                 permanent=StoreError("injected: rank 1 lost its network"))

    def rank(r: int) -> None:
        try:
            ft.save({"w": torch.randn(300, 300)}, f"{base}/c", rank=r, world_size=2, barrier=barrier,
                    attempt="job-2", config=small_config(), store=broken if r == 1 else None)
        except Exception as exc:
            errors[r] = exc

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert "rank 1 lost its network" in str(errors[1]) and "rank 1 failed" in str(errors[0])
    assert fastckpt.latest(base) is None
    report = fastckpt.gc(base, older_than=0)
    assert any(k.endswith(ft.rank_file(0)) for k in report.removed)
    assert not os.path.exists(tmp_path / "store" / "c" / ft.rank_file(0))


# ----------------------------------------------------------------------------- DCP plugin in one process


def test_dcp_plugin_round_trip_and_corruption(tmp_path: Path) -> None:
    """dcp.save / dcp.load through fastckpt in one process (no process group): tensors straight into the
    destination, byte items through DCP's planner; a flipped byte in the stored data is detected."""
    import warnings

    import torch.distributed.checkpoint as dcp

    from fastckpt.torch.dcp import Reader, Writer

    state = {"w": torch.randn(300, 200), "b": torch.arange(7.0), "step": 12, "name": "run"}
    uri = str(tmp_path / "c")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "assuming the intent is to save in a single process"
        dcp.save(state, storage_writer=Writer(uri, config=small_config()))
        assert fastckpt.verify(uri).ok
        target = {"w": torch.zeros(300, 200), "b": torch.zeros(7), "step": 0, "name": ""}
        w = target["w"]
        dcp.load(target, storage_reader=Reader(uri, config=small_config()))
        assert target["w"] is w and torch.equal(w, state["w"]) and torch.equal(target["b"], state["b"])
        assert (target["step"], target["name"]) == (12, "run")
        path = tmp_path / "c" / "rank-00000.distcp"
        data = bytearray(path.read_bytes())
        data[1000] ^= 0x40
        path.write_bytes(bytes(data))
        with pytest.raises(dcp.api.CheckpointException) as failed:  # DCP wraps each rank's error
            dcp.load({"w": torch.zeros(300, 200), "b": torch.zeros(7), "step": 0, "name": ""},
                     storage_reader=Reader(uri, config=small_config()))
        [(error, _)] = failed.value.failures.values()
        assert isinstance(error, IntegrityError) and "does not match its recorded digest" in str(error)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_dcp_reader_refuses_an_uncommitted_save(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    from fastckpt.torch.dcp import Reader

    (tmp_path / "c").mkdir()
    with pytest.raises(dcp.api.CheckpointException) as failed:
        dcp.load({"w": torch.zeros(2)}, storage_reader=Reader(str(tmp_path / "c")))
    [(error, _)] = failed.value.failures.values()
    assert "is not committed" in str(error)  # DCP re-raises it inside its own AssertionError


def test_saves_and_loads_in_one_process_share_one_store() -> None:
    """A loop that saves every N steps opens its store once (clients and connections are kept)."""
    from fastckpt.engine import open_stores as cache

    base, before = "memory://kept-store/run", len(cache._open)
    staging = ft.Staging()
    for step in range(3):
        ft.async_save({"w": torch.full((64,), float(step))}, f"{base}/step-{step}", staging=staging).wait()
    ft.save({"w": torch.zeros(3)}, f"{base}/step-3")
    assert torch.all(ft.load(f"{base}/step-2")["w"] == 2.0)
    assert len(cache._open) == before + 1
