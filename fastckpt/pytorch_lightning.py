"""fastckpt's Lightning plug-ins for projects that import ``pytorch_lightning`` (the package Lightning shipped before
``lightning``, still published): the same ``CheckpointIO`` and ``AsyncCheckpointIO`` as ``fastckpt.lightning``, on
``pytorch_lightning``'s base classes, which its ``Trainer`` checks plug-ins against.

    import pytorch_lightning as pl
    import fastckpt.pytorch_lightning

    trainer = pl.Trainer(plugins=[fastckpt.pytorch_lightning.CheckpointIO()], ...)
"""

from __future__ import annotations

from lightning_fabric.plugins.io.checkpoint_io import CheckpointIO as _BaseCheckpointIO
from lightning_fabric.utilities.cloud_io import _load
from pytorch_lightning.plugins.io import AsyncCheckpointIO as _AsyncCheckpointIO
from pytorch_lightning.plugins.io import CheckpointIO as _CheckpointIO

from .lightning_io import PREFIX, FastckptAsyncCheckpointIO, FastckptCheckpointIO, checkpoint_uri

__all__ = ["PREFIX", "AsyncCheckpointIO", "CheckpointIO", "checkpoint_uri"]


class CheckpointIO(FastckptCheckpointIO, _CheckpointIO):
    __doc__ = FastckptCheckpointIO.__doc__
    torch_load = staticmethod(_load)


class AsyncCheckpointIO(FastckptAsyncCheckpointIO, _AsyncCheckpointIO):
    __doc__ = FastckptAsyncCheckpointIO.__doc__
    base, wrapped = _BaseCheckpointIO, CheckpointIO
