"""Tensor state saved from memory and loaded straight into tensors (needs the ``torch`` extra).

``save`` / ``async_save`` write each rank's state dict as one safetensors file and commit the checkpoint
with the other ranks; ``load`` reads it back into tensors with parallel ranged reads, verified against the
manifest. With ``tier=``, saves commit into the node's tier and a node agent drains them (``fastckpt.tier``);
``restore_tier`` brings a lost node's copies back from its peers. ``load_safetensors`` streams a safetensors model
(one file, or the Hugging Face layout) from any store into tensors. ``fastckpt.torch.dcp`` holds the
``torch.distributed.checkpoint`` storage plugin.
"""

from .load import load, load_async
from .model_load import load_safetensors, load_safetensors_async
from .save import SaveHandle, async_save, rank_file, save
from .staging import Staging
from .tiered import restore_tier

__all__ = ["SaveHandle", "Staging", "async_save", "load", "load_async", "load_safetensors", "load_safetensors_async",
           "rank_file", "restore_tier", "save"]
