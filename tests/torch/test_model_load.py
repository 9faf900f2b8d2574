"""``fastckpt.torch.load_safetensors`` against ``safetensors.torch.load_file`` itself: files the real library wrote,
one file and the Hugging Face layout (indexed shards, shards without an index), every dtype, on the local store and
the emulators; hostile headers refused clearly; a byte changed in a file that fastckpt uploaded caught by its
digests."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import fastckpt
import fastckpt.torch as ft
from fastckpt import CheckpointError, IntegrityError
from harness.uris import below

from ..conftest import small_config

DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
          torch.int8, torch.uint8, torch.bool, torch.float8_e4m3fn, torch.float8_e5m2, torch.uint16, torch.uint32,
          torch.uint64, torch.complex64]


def tensors(seed: int, scale: int = 1) -> dict[str, torch.Tensor]:
    """One tensor of every dtype safetensors stores, of mixed sizes, and an empty one."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for i, dtype in enumerate(DTYPES):
        raw = torch.randint(0, 256, (1000 * scale + 37 * i,), dtype=torch.uint8, generator=g)
        n = raw.numel() // dtype.itemsize if dtype != torch.bool else raw.numel()
        out[f"layer.{i}.{str(dtype)[6:]}"] = (raw[:n] & 1).bool() if dtype == torch.bool else \
            raw[:n * dtype.itemsize].view(dtype).reshape(-1, 1)
    out["empty"] = torch.zeros(0, 4)
    return out


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and a[k].shape == b[k].shape
                                        and a[k].view(-1).view(torch.uint8).equal(b[k].view(-1).view(torch.uint8))
                                        for k in a)


@pytest.mark.parametrize("backend", ["local", "s3", "gcs", "azure"])
def test_the_hugging_face_layout_loads_as_the_library_loads_it(backend: str, tmp_path: Path,
                                                               request: pytest.FixtureRequest) -> None:
    base = f"file://{tmp_path}/store" if backend == "local" else request.getfixturevalue(f"{backend}_uri")
    model = tmp_path / "model"
    model.mkdir()
    shards = {"model-00001-of-00002.safetensors": tensors(1, 40), "model-00002-of-00002.safetensors": tensors(2)}
    shards["model-00002-of-00002.safetensors"] = {f"head.{k}": v for k, v in shards[
        "model-00002-of-00002.safetensors"].items()}
    for name, part in shards.items():
        save_file(part, model / name, metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {k: n for n, part in shards.items() for k in part}}
    (model / "model.safetensors.index.json").write_text(json.dumps(index))
    (model / "config.json").write_text("{}")
    fastckpt.upload(model, below(base, "model"))
    want = {k: v for n in shards for k, v in load_file(model / n).items()}
    assert same(ft.load_safetensors(below(base, "model"), config=small_config()), want)
    one = ft.load_safetensors(below(base, "model/model-00002-of-00002.safetensors"), config=small_config())
    assert same(one, load_file(model / "model-00002-of-00002.safetensors"))
    (model / "model.safetensors.index.json").unlink()  # shards without an index: every *.safetensors
    fastckpt.upload(model, below(base, "bare"))
    assert same(ft.load_safetensors(below(base, "bare"), config=small_config()), want)
    cast = ft.load_safetensors(below(base, "model"), dtype=torch.bfloat16, config=small_config())
    assert cast["layer.1.float32"].dtype == torch.bfloat16 and cast["layer.4.int64"].dtype == torch.int64


def test_a_committed_checkpoint_is_checked_against_its_manifests(tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    save_file(tensors(3, 200), model / "model.safetensors")
    uri = f"{tmp_path}/ckpt"
    with fastckpt.SyncCheckpointWriter(uri) as writer:
        writer.put_dir(model)
    assert same(ft.load_safetensors(uri), load_file(model / "model.safetensors"))
    stored = Path(uri) / "model.safetensors"
    data = bytearray(stored.read_bytes())
    data[-100] ^= 1  # a tensor's byte, changed in place
    stored.write_bytes(bytes(data))
    with pytest.raises(IntegrityError, match=r"model\.safetensors"):
        ft.load_safetensors(uri)
    with pytest.raises(IntegrityError):
        ft.load_safetensors(f"{uri}/model.safetensors")


def hostile(header: dict | bytes, data: bytes = b"\0" * 64, length: int | None = None) -> bytes:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(raw) if length is None else length) + raw + data


@pytest.mark.parametrize(("blob", "error"), [
    (hostile({"t": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, length=1 << 40), "larger than"),
    (hostile({"t": {"dtype": "F32", "shape": [4], "data_offsets": [0, 1 << 40]}}), "do not fit"),
    (hostile({"t": {"dtype": "F32", "shape": [1 << 30], "data_offsets": [0, 4 << 30]}}), "describes"),
    (hostile({"a": {"dtype": "U8", "shape": [16], "data_offsets": [0, 16]},
              "b": {"dtype": "U8", "shape": [16], "data_offsets": [8, 24]}}), "overlap"),
    (hostile({"t": {"dtype": "F13", "shape": [4], "data_offsets": [0, 16]}}), "malformed"),
    (hostile(b"{not json"), "malformed"),
    (b"\x01\x02", "too short"),
], ids=["huge-header", "offsets", "beyond-file", "overlap", "dtype", "json", "truncated"])
def test_hostile_headers_are_refused_clearly(blob: bytes, error: str, tmp_path: Path) -> None:
    path = tmp_path / "bad.safetensors"
    path.write_bytes(blob)
    with pytest.raises(CheckpointError, match=error):
        ft.load_safetensors(str(path))


def test_a_bad_index_is_refused(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": "../etc/x.safetensors"}}))
    with pytest.raises(CheckpointError, match="not a file beside the index"):
        ft.load_safetensors(str(tmp_path))
    (tmp_path / "model.safetensors.index.json").unlink()
    with pytest.raises(fastckpt.ObjectNotFoundError, match="no safetensors model"):
        ft.load_safetensors(str(tmp_path))


def test_bench_load_reports_what_it_loaded(s3_uri: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``fastckpt bench-load`` of a two-shard model on moto: both files, every tensor byte, times in order, and the
    shards reported as they completed (``on_shard``)."""
    from fastckpt.cli import main

    model = tmp_path / "model"
    model.mkdir()
    parts = {"a.safetensors": tensors(3, 20), "b.safetensors": {f"b.{k}": v for k, v in tensors(4).items()}}
    for name, part in parts.items():
        save_file(part, model / name)
    uri = below(s3_uri, "bench-load")
    fastckpt.upload(model, uri, config=small_config())
    assert main(["bench-load", uri, "--rounds", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["files"] == 2 and len(out["rounds"]) == 2
    assert out["tensor_bytes"] == sum(t.numel() * t.element_size() for p in parts.values() for t in p.values())
    for r in out["rounds"]:
        assert 0 < r["first_shard_s"] <= r["seconds"] and r["gb_per_s"] > 0
    assert main(["bench-load", below(s3_uri, "missing")]) == 1
    assert "no safetensors model" in capsys.readouterr().err
