"""``fastckpt.huggingface_models``: real ``transformers`` models (tiny configs built here, no downloads) saved to a
store in the Hugging Face layout and built back from it, with tied weights and sharding, on the local store and
moto; what it wrote loads with transformers' own ``from_pretrained`` too."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("transformers")

import torch
from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

import fastckpt
from fastckpt import CheckpointError
from fastckpt.huggingface_models import from_pretrained, save_pretrained
from harness.uris import below

pytestmark = pytest.mark.slow


def tiny_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, vocab_size=512))


def same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.mark.parametrize("backend", ["local", "s3"])
def test_a_model_round_trips_through_a_store(backend: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    base = f"file://{tmp_path}/store" if backend == "local" else request.getfixturevalue("s3_uri")
    model, uri = tiny_llama(), below(base, "llama")
    result = save_pretrained(model, uri, max_shard_size="100KB")  # several shards and an index
    assert result.files > 3 and fastckpt.verify(uri).ok
    back = from_pretrained(AutoModelForCausalLM, uri, local_dir=tmp_path / "small")
    assert isinstance(back, LlamaForCausalLM) and same_weights(model, back)
    tokens = torch.tensor([[1, 5, 9, 300]])
    with torch.no_grad():
        assert torch.equal(model(tokens).logits, back(tokens).logits)
    assert (tmp_path / "small" / "config.json").exists()
    assert not list((tmp_path / "small").glob("*.safetensors"))  # the weights never touched the disk
    half = from_pretrained(LlamaForCausalLM, uri, dtype=torch.bfloat16)
    assert half.model.embed_tokens.weight.dtype == torch.bfloat16

    with pytest.raises(CheckpointError, match="overwrite=True"):
        save_pretrained(model, uri)
    torch.manual_seed(1)
    other = tiny_llama().apply(lambda m: torch.nn.init.normal_(m.weight) if hasattr(m, "weight") else None)
    save_pretrained(other, uri, overwrite=True)
    assert same_weights(other, from_pretrained(AutoModelForCausalLM, uri))


def test_tied_weights_and_transformers_own_loader(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=300, n_positions=64))
    uri = str(tmp_path / "gpt2")
    save_pretrained(model, uri)
    back = from_pretrained(GPT2LMHeadModel, uri)
    assert same_weights(model, back)
    assert back.lm_head.weight.data_ptr() == back.transformer.wte.weight.data_ptr()  # still tied
    assert same_weights(model, GPT2LMHeadModel.from_pretrained(uri))  # the stock loader reads it as a folder
