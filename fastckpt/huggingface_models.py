"""Hugging Face models to and from any store: ``save_pretrained`` commits the Hugging Face layout as a checkpoint,
``from_pretrained`` builds the model from it with its weights streamed straight into tensors.

    from transformers import AutoModelForCausalLM
    from fastckpt.huggingface_models import from_pretrained, save_pretrained

    save_pretrained(model, "s3://bucket/models/llama-ft")                    # committed atomically
    model = from_pretrained(AutoModelForCausalLM, "s3://bucket/models/llama-ft", dtype=torch.bfloat16)

``save_pretrained`` runs the model's own ``save_pretrained`` (safetensors shards, index, config, tied weights as
transformers handles them) into a temporary folder and commits it with ``CheckpointWriter``: a half-written model
is never served, and ``overwrite=True`` replaces one atomically. ``from_pretrained`` fetches the small files
(``config.json``, tokenizer files; kept in ``local_dir`` when given) and loads the weights with
``fastckpt.torch.load_safetensors``: no local copy of the weights, every chunk checked against the digests.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

from ._loop import BackgroundLoop
from .checkpoint import CommitResult, SyncCheckpointWriter
from .checkpoint.manifest import META_DIR, marker_key
from .checkpoint.reader import open_checkpoint_async
from .config import TransferConfig
from .engine.open_stores import store_for
from .engine.paths import paths_below
from .engine.transfer import Transfer
from .torch.model_load import SUFFIX, load_safetensors
from .uri import StorageURI, parse_uri

__all__ = ["from_pretrained", "save_pretrained"]


def save_pretrained(model: Any, uri: str, *, overwrite: bool = False, transfer_config: TransferConfig | None = None,
                    **kwargs: Any) -> CommitResult:
    """Commit ``model`` (a ``transformers`` model) at ``uri`` in the Hugging Face layout; ``kwargs`` go to the
    model's ``save_pretrained`` (``max_shard_size``...). ``overwrite``: replace a model committed there atomically."""
    with tempfile.TemporaryDirectory(prefix="fastckpt-hf-") as folder:
        model.save_pretrained(folder, safe_serialization=True, **kwargs)
        with SyncCheckpointWriter(uri, config=transfer_config, overwrite=overwrite) as writer:
            writer.put_dir(folder)
    assert writer.result is not None
    return writer.result


def from_pretrained(model_cls: Any, uri: str, *, local_dir: str | os.PathLike[str] | None = None,
                    transfer_config: TransferConfig | None = None, **kwargs: Any) -> Any:
    """``model_cls.from_pretrained`` of the model at ``uri`` (a fastckpt checkpoint or any prefix in the Hugging Face
    layout): its files other than the weights fetched into ``local_dir`` (a temporary folder when None), the weights
    streamed from the store (``load_safetensors``, cast to ``dtype`` / ``torch_dtype`` when given); ``kwargs`` go to
    ``from_pretrained``."""
    from transformers import AutoConfig

    dtype = kwargs.get("dtype", kwargs.get("torch_dtype"))
    with tempfile.TemporaryDirectory(prefix="fastckpt-hf-") as scratch:
        folder = os.fspath(local_dir) if local_dir is not None else scratch
        BackgroundLoop.get().run(_fetch_small_files(parse_uri(uri), folder, transfer_config))
        config = kwargs.pop("config", None) or AutoConfig.from_pretrained(folder)
        state = load_safetensors(uri, dtype=dtype if not isinstance(dtype, str) else None, config=transfer_config)
        mapping = getattr(model_cls, "_model_mapping", None)  # an Auto class: the model class of this config
        concrete = mapping[type(config)] if mapping is not None else model_cls
        return concrete.from_pretrained(None, config=config, state_dict=state, **kwargs)


async def _fetch_small_files(target: StorageURI, dst: str, config: TransferConfig | None) -> None:
    """Every file of the model at ``target`` but its weights into ``dst`` (verified where recorded)."""
    cfg = config or TransferConfig.from_env()
    async with store_for(target, cfg) as store:
        if await store.exists(marker_key(target.key)):
            ckpt = await open_checkpoint_async(target, config=cfg, store=store)
            names = sorted(n for n in ckpt.files if not n.endswith(SUFFIX))
            keys, expected = [ckpt.file_key(n) for n in names], {ckpt.file_key(n): ckpt.files[n] for n in names}
        else:
            found = [m.key async for m in store.list(target.key)]
            keys = [k for k in found if not k.endswith(SUFFIX) and f"/{META_DIR}/" not in f"/{k}"]
            names, expected = [k[len(target.key):].lstrip("/") for k in keys], {}
        transfer = Transfer(store, cfg)
        try:
            await transfer.download_files(list(zip(keys, paths_below(dst, names), strict=True)),
                                          {k: d for k, d in expected.items() if d is not None})
        finally:
            transfer.close()
