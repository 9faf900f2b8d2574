"""fastckpt.torch saves with ``base=``: a fine-tuning state whose frozen weights keep their parts save after save."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")

import fastckpt  # noqa: E402
import fastckpt.torch as ft  # noqa: E402
from fastckpt import CheckpointWriter  # noqa: E402
from fastckpt.config import TransferConfig  # noqa: E402
from fastckpt.torch.format import flatten, with_state  # noqa: E402
from fastckpt.torch.save import rank_files  # noqa: E402
from harness.uris import below  # noqa: E402

PART = 1 << 20
CFG = TransferConfig(part_size=PART, multipart_threshold=PART)


def lora_state(step: int, frozen: dict[str, torch.Tensor]) -> dict:
    """Frozen bf16 weights, fp32 adapters and their Adam moments that change every step, and scalars."""
    g = torch.Generator().manual_seed(step)
    adapters = {f"{k}.lora_{ab}": torch.randn(4, 256, generator=g) for k in frozen for ab in "AB"}
    moments = {k: {"exp_avg": torch.randn_like(v), "exp_avg_sq": torch.rand_like(v), "step": torch.tensor(float(step))}
               for k, v in adapters.items()}
    return {"model": {**frozen, **adapters}, "optim": {"state": moments, "param_groups": [{"lr": 1e-4 / step}]},
            "step": step, "note": "x" * step}


def frozen_weights() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {f"layers.{i}.proj": torch.randn(1024, 768, generator=g).to(torch.bfloat16) for i in range(6)}


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def test_same_tensors_same_files_whatever_the_values() -> None:
    """Keys, shapes and dtypes fix the files, their headers and every offset; the skeleton's values live in the
    state tensor of the small file, and the large tensors have a file of their own."""
    frozen = frozen_weights()
    layouts = []
    for step in (1, 2, 99):
        skeleton, tensors = flatten(lora_state(step, frozen))
        layouts.append([(name, h.raw) for name, h in rank_files(0, skeleton, tensors, True)])
    assert layouts[0] == layouts[1] == layouts[2]
    (large, large_raw), (small, _) = layouts[0]
    assert (large, small) == ("rank-00000-large.safetensors", "rank-00000.safetensors")
    assert all(f"model.{k}".encode() in large_raw for k in frozen) and b"lora" not in large_raw


@pytest.mark.parametrize("how", ["save", "async_save"])
def test_lora_saves_send_only_what_changed(fast_uri: str, tmp_path, how: str) -> None:
    frozen = frozen_weights()
    states = [lora_state(step, frozen) for step in (1, 2, 3)]
    results = []
    for step, state in enumerate(states, 1):
        uri = below(fast_uri, f"step-{step}")
        if how == "save":
            results.append(ft.save(state, uri, config=CFG, base="latest"))
        else:
            results.append(ft.async_save(state, uri, config=CFG, base="latest", staging=ft.Staging()).wait())
    frozen_bytes = sum(t.numel() * t.element_size() for t in frozen.values())
    skeleton, tensors = flatten(states[1])
    changed = sum(t.numel() * t.element_size() for n, t in with_state(skeleton, tensors).items()
                  if not n.endswith(".proj"))  # adapters, their moments, the skeleton
    assert results[0].copied == 0
    for r in results[1:]:
        assert r.copied >= frozen_bytes and r.sent <= 1.1 * changed, (r, changed)
    _delete_all_but(fast_uri, "step-3")
    assert fastckpt.verify(below(fast_uri, "step-3")).ok
    assert same(ft.load(below(fast_uri, "step-3"), config=CFG), states[2])


def _delete_all_but(uri: str, keep: str) -> None:
    async def run() -> None:
        target = fastckpt.parse_uri(uri)
        async with fastckpt.open_store(target) as store:
            await store.delete_many([m.key async for m in store.list(target.key)
                                     if not m.key.startswith(target.join(keep) + "/")])

    fastckpt._loop.BackgroundLoop.get().run(run())


def test_rank_files_of_earlier_versions_load(tmp_path) -> None:
    """A rank file holding its skeleton in the header (written before the state tensor) loads as it did."""
    from safetensors.torch import save_file

    state = {"w": torch.arange(6.0).reshape(2, 3), "step": 7}
    skeleton, tensors = flatten(state)
    save_file(tensors, str(tmp_path / "rank.safetensors"),
              metadata={"fastckpt.state": json.dumps(skeleton), "format": "pt"})

    async def commit() -> None:
        async with CheckpointWriter(str(tmp_path / "old")) as w:
            await w.put_file(tmp_path / "rank.safetensors", ft.rank_file(0))

    fastckpt._loop.BackgroundLoop.get().run(commit())
    assert same(ft.load(str(tmp_path / "old")), state)
