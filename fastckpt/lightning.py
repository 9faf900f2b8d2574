"""PyTorch Lightning checkpoints through fastckpt, on any backend.

    from lightning.pytorch import Trainer
    from lightning.pytorch.callbacks import ModelCheckpoint
    import fastckpt.lightning

    trainer = Trainer(plugins=[fastckpt.lightning.CheckpointIO()],   # or AsyncCheckpointIO(): saves off the loop
                      callbacks=[ModelCheckpoint(dirpath="fastckpt://s3://bucket/run/ckpts", save_top_k=3, ...)])
    trainer.fit(model, ckpt_path="fastckpt://s3://bucket/run/ckpts/epoch=3-step=400.ckpt")

Each Lightning checkpoint is a committed fastckpt checkpoint at its path: the dict ``torch.save``d into one file,
``checkpoint.pt``, uploaded in parallel parts with its chunk digests in the manifest, then the commit marker; a save
that fails or dies midway leaves nothing a load would take. Loads read it back verified; removals (Lightning's
``save_top_k``) delete the marker first, then the files. Paths are fastckpt URIs, or ``fastckpt://`` URLs so that
Lightning's own fsspec calls (``ModelCheckpoint``'s listing and existence checks) reach fastckpt too.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

from lightning.fabric.utilities.cloud_io import _load
from lightning.pytorch.plugins.io import AsyncCheckpointIO as _AsyncCheckpointIO
from lightning.pytorch.plugins.io import CheckpointIO as _CheckpointIO

from ._loop import BackgroundLoop
from .checkpoint import CheckpointWriter, open_checkpoint_async
from .checkpoint.manifest import marker_key
from .config import TransferConfig
from .engine.layout import Layout, read_layout
from .engine.open_stores import store_for
from .engine.transfer import Transfer
from .uri import parse_uri

NAME = "checkpoint.pt"
"""The one file of a Lightning checkpoint inside its fastckpt checkpoint."""
PREFIX = "fastckpt://"


def checkpoint_uri(path: str | Path) -> str:
    """The fastckpt URI of a Lightning checkpoint path (``fastckpt://`` taken off)."""
    text = str(path)
    return text[len(PREFIX):] if text.startswith(PREFIX) else text


class CheckpointIO(_CheckpointIO):
    """Lightning's ``CheckpointIO`` over fastckpt: ``Trainer(plugins=[CheckpointIO()])``."""

    def __init__(self, config: TransferConfig | None = None) -> None:
        super().__init__()
        self.config = config

    def save_checkpoint(self, checkpoint: dict[str, Any], path: str | Path, storage_options: Any = None) -> None:
        """Commit ``checkpoint`` at ``path`` (``storage_options`` are not used: options come with the URI)."""
        import torch

        buf = io.BytesIO()
        torch.save(checkpoint, buf)
        BackgroundLoop.get().run(self._save(checkpoint_uri(path), buf.getbuffer()))

    async def _save(self, uri: str, data: memoryview) -> None:
        async with CheckpointWriter(uri, config=self._config()) as writer:
            await writer.put_layout(NAME, Layout([data]))

    def load_checkpoint(self, path: str | Path, map_location: Any = None, weights_only: bool | None = None
                        ) -> dict[str, Any]:
        """The checkpoint committed at ``path``, every chunk checked against the manifest (CheckpointError when
        it is not committed, IntegrityError when a byte differs)."""
        data = BackgroundLoop.get().run(self._load(checkpoint_uri(path)))
        return _load(io.BytesIO(data), map_location=map_location, weights_only=weights_only)

    async def _load(self, uri: str) -> bytearray:
        target, cfg = parse_uri(uri), self._config()
        async with store_for(target, cfg) as store:
            ckpt = await open_checkpoint_async(target, config=cfg, store=store)
            digest = ckpt.files.get(NAME)
            if digest is None:
                raise FileNotFoundError(f"{uri} is a fastckpt checkpoint, but not one saved by fastckpt.lightning")
            data = bytearray(digest.size)
            transfer = Transfer(store, cfg)
            try:
                digest.check(await read_layout(transfer, ckpt.file_key(NAME), 0, Layout([data]), digest.chunk_size),
                             f"{uri}/{NAME}")
            finally:
                transfer.close()
        return data

    def remove_checkpoint(self, path: str | Path) -> None:
        """Delete the checkpoint at ``path``: its commit marker first (no reader takes it from then on), then the
        rest."""
        BackgroundLoop.get().run(self._remove(checkpoint_uri(path)))

    async def _remove(self, uri: str) -> None:
        target, cfg = parse_uri(uri), self._config()
        async with store_for(target, cfg) as store:
            keys = [m.key async for m in store.list(target.key)]
            marker = marker_key(target.key)
            if marker in keys:
                await store.delete(marker)
            await store.delete_many([k for k in keys if k != marker])

    def _config(self) -> TransferConfig:
        return self.config or TransferConfig.from_env()


class AsyncCheckpointIO(_AsyncCheckpointIO):
    """``CheckpointIO`` whose saves run on a background thread: training goes on while a checkpoint uploads
    (Lightning waits for the last one before it exits)."""

    def __init__(self, config: TransferConfig | None = None) -> None:
        super().__init__(CheckpointIO(config))

    def remove_checkpoint(self, path: str | Path) -> None:
        """Queued behind the saves submitted before it. (Lightning's own removes at once, while the save it removes
        may still be running: that save then commits after the delete, and the checkpoint comes back half.)"""
        self._ensure_setup()
        inner = self.checkpoint_io
        assert inner is not None and self._executor is not None

        def remove() -> None:
            try:
                inner.remove_checkpoint(path)
            except BaseException as exc:
                self._error = exc

        self._executor.submit(remove)
        if self._error:
            raise self._error
