"""PyTorch Lightning checkpoints through fastckpt, on any backend: a drop-in for ``TorchCheckpointIO``.

    from lightning.pytorch import Trainer
    from lightning.pytorch.callbacks import ModelCheckpoint
    import fastckpt.lightning

    trainer = Trainer(plugins=[fastckpt.lightning.CheckpointIO()],   # or AsyncCheckpointIO(): saves off the loop
                      callbacks=[ModelCheckpoint(dirpath="fastckpt://s3://bucket/run/ckpts", save_top_k=3, ...)])
    trainer.fit(model, ckpt_path="last")

A checkpoint is the file Lightning expects at its path: the ``torch.save`` bytes ``TorchCheckpointIO`` writes, so
``torch.load``, ``load_from_checkpoint`` and every tool that reads a ``.ckpt`` read it. fastckpt uploads it in
parallel parts and records its digests in a hidden sidecar beside it (``.NAME.ckpt.fastckpt``,
``checkpoint.one_file``): saving over a path replaces the file atomically (``last.ckpt`` every epoch), a load
through the plugin checks every byte against the record, and a removal leaves neither file nor sidecar. Paths are
fastckpt URIs, or ``fastckpt://`` URLs so that Lightning's own fsspec calls (``ModelCheckpoint``'s listing and
existence checks, ``load_from_checkpoint``) reach fastckpt too. Checkpoints that earlier fastckpt versions saved as
a folder at the path still load and remove.
"""

from __future__ import annotations

from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO as _BaseCheckpointIO
from lightning.fabric.utilities.cloud_io import _load
from lightning.pytorch.plugins.io import AsyncCheckpointIO as _AsyncCheckpointIO
from lightning.pytorch.plugins.io import CheckpointIO as _CheckpointIO

from .lightning_io import PREFIX, FastckptAsyncCheckpointIO, FastckptCheckpointIO, checkpoint_uri

__all__ = ["PREFIX", "AsyncCheckpointIO", "CheckpointIO", "checkpoint_uri"]


class CheckpointIO(FastckptCheckpointIO, _CheckpointIO):
    __doc__ = FastckptCheckpointIO.__doc__
    torch_load = staticmethod(_load)


class AsyncCheckpointIO(FastckptAsyncCheckpointIO, _AsyncCheckpointIO):
    __doc__ = FastckptAsyncCheckpointIO.__doc__
    base, wrapped = _BaseCheckpointIO, CheckpointIO
