"""Synthetic LLM checkpoints: safetensors shards with a Llama-style layout, scaled to a target size.

The mix is what a Ray Train job uploads: a few large model shards (BF16 weights with Llama-3-8B's layer
structure, widths scaled so the whole checkpoint lands near ``size``), one Adam optimizer-state shard per
rank (FP32 ``exp_avg`` / ``exp_avg_sq`` of the rank's ZeRO partition, so 4x the weight bytes), and many
small files (configs, index, trainer state, per-rank RNG states). Tensor bytes are pseudo-random
(PCG64), so nothing can dedupe or compress them.

    python -m bench.generate DIR --size 1GiB [--ranks 4] [--model-shards 4] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import math
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import BinaryIO

import numpy as np

from fastckpt.config import parse_size

DTYPE_SIZE = {"BF16": 2, "F16": 2, "F32": 4, "I64": 8, "U8": 1}
_CHUNK = 16 << 20


@dataclass(frozen=True)
class ModelShape:
    """The dimensions of a Llama-style decoder."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.hidden // self.heads


LLAMA3_8B = ModelShape(hidden=4096, intermediate=14336, layers=32, heads=32, kv_heads=8, vocab=128256)


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of a safetensors file."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        """Bytes of the tensor's data."""
        return math.prod(self.shape) * DTYPE_SIZE[self.dtype]


@dataclass(frozen=True)
class FilePlan:
    """One file of the checkpoint: a safetensors file (``tensors``) or a small file (``content``)."""

    rel: str
    tensors: tuple[TensorSpec, ...] = ()
    content: bytes | None = None
    random_size: int = 0

    @property
    def size(self) -> int:
        """Size of the file once written."""
        if self.tensors:
            return len(safetensors_header(self.tensors)) + sum(t.nbytes for t in self.tensors)
        return len(self.content) if self.content is not None else self.random_size


@dataclass(frozen=True)
class CheckpointPlan:
    """The files of a synthetic checkpoint and the model shape they follow."""

    shape: ModelShape
    ranks: int
    files: tuple[FilePlan, ...]

    @property
    def total_bytes(self) -> int:
        """Bytes over all files."""
        return sum(f.size for f in self.files)


def weight_specs(shape: ModelShape) -> list[TensorSpec]:
    """The BF16 weights of a Llama-style model, in Hugging Face naming and order."""
    h, kv = shape.hidden, shape.kv_heads * shape.head_dim
    specs = [TensorSpec("model.embed_tokens.weight", "BF16", (shape.vocab, h))]
    for i in range(shape.layers):
        p = f"model.layers.{i}."
        specs += [
            TensorSpec(p + "input_layernorm.weight", "BF16", (h,)),
            TensorSpec(p + "self_attn.q_proj.weight", "BF16", (h, h)),
            TensorSpec(p + "self_attn.k_proj.weight", "BF16", (kv, h)),
            TensorSpec(p + "self_attn.v_proj.weight", "BF16", (kv, h)),
            TensorSpec(p + "self_attn.o_proj.weight", "BF16", (h, h)),
            TensorSpec(p + "post_attention_layernorm.weight", "BF16", (h,)),
            TensorSpec(p + "mlp.gate_proj.weight", "BF16", (shape.intermediate, h)),
            TensorSpec(p + "mlp.up_proj.weight", "BF16", (shape.intermediate, h)),
            TensorSpec(p + "mlp.down_proj.weight", "BF16", (h, shape.intermediate)),
        ]
    specs += [TensorSpec("model.norm.weight", "BF16", (h,)), TensorSpec("lm_head.weight", "BF16", (shape.vocab, h))]
    return specs


def _round(x: float, multiple: int) -> int:
    return max(multiple, round(x / multiple) * multiple)


def scaled_shape(weight_bytes: int, base: ModelShape = LLAMA3_8B) -> ModelShape:
    """``base`` with hidden, intermediate and vocab widths scaled so its weights take about ``weight_bytes``."""
    full = sum(t.nbytes for t in weight_specs(base))
    f = math.sqrt(weight_bytes / full)
    heads = max(1, round(base.heads * f))
    hidden = _round(base.hidden * f, 8 * heads) if heads > 1 else _round(base.hidden * f, 8)
    kv_heads = max(1, heads * base.kv_heads // base.heads)
    return ModelShape(hidden=hidden, intermediate=_round(base.intermediate * f, 8), layers=base.layers,
                      heads=heads, kv_heads=kv_heads, vocab=_round(base.vocab * f, 64))


def safetensors_header(specs: tuple[TensorSpec, ...] | list[TensorSpec]) -> bytes:
    """The 8-byte length prefix and JSON header of a safetensors file holding ``specs`` in order."""
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for t in specs:
        header[t.name] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    body = json.dumps(header, separators=(",", ":")).encode()
    body += b" " * (-len(body) % 8)
    return len(body).to_bytes(8, "little") + body


def write_safetensors(path: str, specs: tuple[TensorSpec, ...] | list[TensorSpec],
                      write_tensor: Callable[[BinaryIO, TensorSpec], None]) -> int:
    """Write a safetensors file; ``write_tensor(f, spec)`` writes each tensor's bytes in order. Returns its size."""
    with open(path, "wb") as f:
        f.write(safetensors_header(specs))
        for spec in specs:
            start = f.tell()
            write_tensor(f, spec)
            if f.tell() - start != spec.nbytes:
                raise ValueError(f"{path}: tensor {spec.name} wrote {f.tell() - start} bytes, expected {spec.nbytes}")
        return f.tell()


class RandomWriter:
    """Writes pseudo-random bytes (PCG64, ~3 GB/s) to files."""

    def __init__(self, seed: int) -> None:
        self._gen = np.random.PCG64(seed)

    def bytes(self, n: int) -> np.ndarray:
        """``n`` random bytes as a uint8 array."""
        return self._gen.random_raw((n + 7) // 8).view(np.uint8)[:n]

    def write(self, f: BinaryIO, n: int) -> None:
        """Append ``n`` random bytes to ``f``."""
        while n > 0:
            step = min(n, _CHUNK)
            f.write(self.bytes(step))
            n -= step

    def tensor(self, f: BinaryIO, spec: TensorSpec) -> None:
        """``write_tensor`` callback of ``write_safetensors``."""
        self.write(f, spec.nbytes)


def _shard(specs: list[TensorSpec], count: int) -> list[list[TensorSpec]]:
    total = sum(t.nbytes for t in specs)
    shards: list[list[TensorSpec]] = [[]]
    done = 0
    for t in specs:
        if shards[-1] and done >= total * len(shards) / count and len(shards) < count:
            shards.append([])
        shards[-1].append(t)
        done += t.nbytes
    return shards


def _json(obj: object) -> bytes:
    return json.dumps(obj, indent=2, sort_keys=True).encode() + b"\n"


def plan_checkpoint(size: int, *, ranks: int = 4, model_shards: int = 4) -> CheckpointPlan:
    """The files of a checkpoint of about ``size`` bytes (weights take 1/5, Adam state 4/5)."""
    if ranks < 1 or model_shards < 1:
        raise ValueError("ranks and model_shards must be >= 1")
    shape = scaled_shape(max(size // 5, 1))
    weights = weight_specs(shape)
    shards = _shard(weights, model_shards)
    n = len(shards)
    names = [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    files = [FilePlan(name, tuple(specs)) for name, specs in zip(names, shards, strict=True)]
    weight_map = {t.name: name for name, specs in zip(names, shards, strict=True) for t in specs}
    params = sum(math.prod(t.shape) for t in weights)
    part = -(-params // ranks)
    for r in range(ranks):
        count = min(part, params - r * part)
        files.append(FilePlan(f"optim/rank_{r:02d}.safetensors", (
            TensorSpec("state.exp_avg", "F32", (count,)),
            TensorSpec("state.exp_avg_sq", "F32", (count,)),
            TensorSpec("state.step", "I64", ()),
        )))
        files.append(FilePlan(f"rng_state_{r}.pth", random_size=14583))
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "torch_dtype": "bfloat16",
              "hidden_size": shape.hidden, "intermediate_size": shape.intermediate,
              "num_hidden_layers": shape.layers, "num_attention_heads": shape.heads,
              "num_key_value_heads": shape.kv_heads, "vocab_size": shape.vocab, "rms_norm_eps": 1e-5,
              "rope_theta": 500000.0, "max_position_embeddings": 8192, "tie_word_embeddings": False}
    files += [
        FilePlan("config.json", content=_json(config)),
        FilePlan("generation_config.json", content=_json({"bos_token_id": 128000, "eos_token_id": 128001})),
        FilePlan("model.safetensors.index.json", content=_json(
            {"metadata": {"total_size": sum(t.nbytes for t in weights)}, "weight_map": weight_map})),
        FilePlan("tokenizer_config.json", content=_json({"model_max_length": 8192, "padding_side": "right"})),
        FilePlan("trainer_state.json", content=_json({"global_step": 1000, "log_history": [
            {"step": s, "loss": round(3.0 / (1 + s / 100), 4), "learning_rate": 3e-4} for s in range(0, 1000, 10)]})),
        FilePlan("scheduler.pt", random_size=1064),
    ]
    return CheckpointPlan(shape, ranks, tuple(files))


SMALL_FILE_RANGE = (16 << 10, 1 << 20)
"""Sizes of the many-small-files layout: log-uniform between these (optimizer shards, DCP-style layouts)."""


def plan_small_files(count: int, seed: int = 0) -> CheckpointPlan:
    """``count`` files of 16 KiB-1 MiB (log-uniform, so most are small), 500 per directory, named as
    torch.distributed.checkpoint names its shards; about 240 KiB each on average."""
    import random

    rng = random.Random(seed)
    low, high = (math.log(x) for x in SMALL_FILE_RANGE)
    files = tuple(FilePlan(f"shards/{i // 500:02d}/__{i}_0.distcp", random_size=int(math.exp(rng.uniform(low, high))))
                  for i in range(count))
    return CheckpointPlan(scaled_shape(1), 1, files)


def plan_one_file(size: int) -> CheckpointPlan:
    """One file of random bytes of ``size`` (a consolidated checkpoint, a single large object)."""
    return CheckpointPlan(scaled_shape(1), 1, (FilePlan("model.bin", random_size=size),))


def generate(out_dir: str, size: int, *, ranks: int = 4, model_shards: int = 4, seed: int = 0,
             plan: CheckpointPlan | None = None) -> CheckpointPlan:
    """Write a synthetic checkpoint of about ``size`` bytes (or the files of ``plan``) into ``out_dir``
    (created; must be empty)."""
    os.makedirs(out_dir, exist_ok=True)
    if os.listdir(out_dir):
        raise FileExistsError(f"{out_dir} is not empty")
    plan = plan or plan_checkpoint(size, ranks=ranks, model_shards=model_shards)
    rnd = RandomWriter(seed)
    for fp in plan.files:
        path = os.path.join(out_dir, *fp.rel.split("/"))
        os.makedirs(os.path.dirname(path), exist_ok=True)
        if fp.tensors:
            write_safetensors(path, fp.tensors, rnd.tensor)
        else:
            with open(path, "wb") as f:
                if fp.content is not None:
                    f.write(fp.content)
                else:
                    rnd.write(f, fp.random_size)
    return plan


def main(argv: list[str] | None = None) -> int:
    """Command line: write one checkpoint and print its summary as JSON."""
    parser = argparse.ArgumentParser(prog="bench.generate", description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir")
    parser.add_argument("--size", default="1GiB", help="approximate total size, e.g. 256MiB, 4GiB")
    parser.add_argument("--ranks", type=int, default=4, help="optimizer shards (one per rank)")
    parser.add_argument("--model-shards", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    plan = generate(args.out_dir, parse_size(args.size), ranks=args.ranks, model_shards=args.model_shards,
                    seed=args.seed)
    print(json.dumps({"files": len(plan.files), "bytes": plan.total_bytes, "shape": asdict(plan.shape)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
