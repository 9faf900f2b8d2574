"""What fastckpt's Lightning plug-ins do, written once for both of Lightning's packages (``fastckpt.lightning`` for
``lightning``, ``fastckpt.pytorch_lightning`` for ``pytorch_lightning``): each of those modules only joins these
mixins to its package's own base classes, which Lightning checks plug-ins against. See ``fastckpt.lightning``."""

from __future__ import annotations

import contextlib
import io
import os
import shutil
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any, ClassVar

from ._loop import BackgroundLoop
from .checkpoint import open_checkpoint_async
from .checkpoint.manifest import marker_key
from .checkpoint.one_file import load_one_file, load_unverified, remove_one_file, save_one_file
from .config import TransferConfig
from .engine.layout import Layout, read_layout
from .engine.open_stores import store_for
from .engine.transfer import Transfer
from .errors import CheckpointError, ObjectNotFoundError, StoreError
from .stores.base import Store
from .threads import off_loop
from .uri import StorageURI, parse_uri

__all__ = ["FOLDER_FILE", "PREFIX", "FastckptAsyncCheckpointIO", "FastckptCheckpointIO", "checkpoint_uri"]

PREFIX = "fastckpt://"
FOLDER_FILE = "checkpoint.pt"
"""The one file of a checkpoint saved as a folder (fastckpt before the sidecar format)."""


def checkpoint_uri(path: str | Path) -> str:
    """The fastckpt URI of a Lightning checkpoint path (``fastckpt://`` taken off)."""
    text = str(path)
    return text[len(PREFIX):] if text.startswith(PREFIX) else text


class FastckptCheckpointIO:
    """Lightning's ``CheckpointIO`` over fastckpt: ``Trainer(plugins=[CheckpointIO()])``.

    ``allow_unverified``: load a checkpoint file that has no fastckpt record beside it (written by
    ``TorchCheckpointIO`` or another tool) as it is; by default that is a CheckpointError naming this option.
    """

    torch_load: ClassVar[Callable[..., Any]]
    """The Lightning package's ``cloud_io._load`` (``torch.load`` as Lightning calls it)."""

    def __init__(self, *, config: TransferConfig | None = None, allow_unverified: bool = False) -> None:
        super().__init__()
        if config is not None and not isinstance(config, TransferConfig):
            raise TypeError(f"config must be a fastckpt TransferConfig, not {type(config).__name__}")
        self.config = config
        self.allow_unverified = allow_unverified

    def save_checkpoint(self, checkpoint: dict[str, Any], path: str | Path, storage_options: Any = None) -> None:
        """Write ``checkpoint`` (``torch.save``) as the file at ``path``, replacing any there atomically.
        ``storage_options`` are refused, as ``TorchCheckpointIO`` refuses them: options come with the URI."""
        import torch

        if storage_options is not None:
            raise TypeError(f"{type(self).__name__}.save_checkpoint takes no storage_options (got "
                            f"{storage_options!r}): set store options in the URI or the config")
        buf = io.BytesIO()
        torch.save(checkpoint, buf)
        BackgroundLoop.get().run(self._save(_target(path), buf.getbuffer()))

    async def _save(self, target: StorageURI, data: memoryview) -> None:
        async with self._transfer(target) as transfer:
            if await _folder_committed(transfer.store, target):  # saved as a folder by an earlier version
                await _remove_folder(transfer.store, target)
            await save_one_file(transfer, target.key, Layout([data]))

    def load_checkpoint(self, path: str | Path, map_location: Any = None, weights_only: bool | None = None
                        ) -> dict[str, Any]:
        """The checkpoint saved at ``path``, every byte checked against its record (CheckpointError when it has
        none, IntegrityError when a byte differs)."""
        data = BackgroundLoop.get().run(self._load(_target(path, follow_links=True)))
        return type(self).torch_load(io.BytesIO(data), map_location=map_location, weights_only=weights_only)

    async def _load(self, target: StorageURI) -> bytearray:
        async with self._transfer(target) as transfer:
            try:
                return await load_one_file(transfer, target.key)
            except (CheckpointError, ObjectNotFoundError, IsADirectoryError) as exc:
                if await _folder_committed(transfer.store, target):
                    return await _load_folder(transfer, target)
                if self.allow_unverified and isinstance(exc, CheckpointError):
                    return await load_unverified(transfer, target.key)
                if isinstance(exc, CheckpointError):
                    raise CheckpointError(f"{exc}; CheckpointIO(allow_unverified=True) loads it unchecked") from None
                raise

    def remove_checkpoint(self, path: str | Path) -> None:
        """Delete the checkpoint at ``path``: its record first (no load takes the file from then on), then the file.
        A symbolic link (``save_last="link"``) is removed, not what it points to."""
        if _is_local(path) and os.path.islink(checkpoint_uri(path)):
            os.unlink(checkpoint_uri(path))
            return
        BackgroundLoop.get().run(self._remove(_target(path)))

    async def _remove(self, target: StorageURI) -> None:
        async with store_for(target, self._config()) as store:
            if await _folder_committed(store, target):
                await _remove_folder(store, target)
            await remove_one_file(store, target.key)

    def _config(self) -> TransferConfig:
        return self.config or TransferConfig.from_env()

    @contextlib.asynccontextmanager
    async def _transfer(self, target: StorageURI) -> AsyncIterator[Transfer]:
        """A ``Transfer`` on the kept store of ``target``."""
        config = self._config()
        async with store_for(target, config) as store:
            transfer = Transfer(store, config)
            try:
                yield transfer
            finally:
                transfer.close()


class FastckptAsyncCheckpointIO:
    """Lightning's ``AsyncCheckpointIO``: saves run on a background thread while training goes on (Lightning waits
    for the last one before it exits). ``checkpoint_io`` is the ``CheckpointIO`` it wraps (fastckpt's, with
    ``config``, by default)."""

    base: ClassVar[type]
    """The Lightning package's ``CheckpointIO`` base (what ``checkpoint_io`` must be)."""
    wrapped: ClassVar[Callable[..., Any]]
    """The package's fastckpt ``CheckpointIO`` (made when none is given)."""

    def __init__(self, checkpoint_io: Any = None, *, config: TransferConfig | None = None) -> None:
        if checkpoint_io is not None and not isinstance(checkpoint_io, self.base):
            raise TypeError(f"checkpoint_io must be a Lightning CheckpointIO, not {type(checkpoint_io).__name__}"
                            + (" (pass a fastckpt TransferConfig as config=)"
                               if isinstance(checkpoint_io, TransferConfig) else ""))
        if checkpoint_io is not None and config is not None:
            raise ValueError("config= configures the CheckpointIO made here: pass it to your checkpoint_io instead")
        inner = checkpoint_io if checkpoint_io is not None else self.wrapped(config=config)
        super().__init__(inner)  # type: ignore[call-arg]

    def save_checkpoint(self, checkpoint: dict[str, Any], path: str | Path, storage_options: Any = None) -> None:
        """Queued to the background thread; on a local disk the folder is made first, as Lightning links
        ``last.ckpt`` to the new file (``save_last="link"``) before it is written."""
        if _is_local(path):
            os.makedirs(os.path.dirname(os.path.abspath(checkpoint_uri(path))), exist_ok=True)
        super().save_checkpoint(checkpoint, path, storage_options)  # type: ignore[misc]

    def remove_checkpoint(self, path: str | Path) -> None:
        """Queued behind the saves submitted before it. (Lightning's own removes at once, while the save it removes
        may still be running: that save then lands after the delete, and the checkpoint comes back.)"""
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


def _is_local(path: str | Path) -> bool:
    return parse_uri(checkpoint_uri(path)).backend == "local"


def _target(path: str | Path, follow_links: bool = False) -> StorageURI:
    """The URI of ``path``; a local symbolic link (``save_last="link"``) resolved when ``follow_links``, so that the
    record beside the file it names is found."""
    uri = checkpoint_uri(path)
    if follow_links and _is_local(path) and os.path.islink(uri):
        uri = os.path.realpath(uri)
    return parse_uri(uri)


async def _folder_committed(store: Store, target: StorageURI) -> bool:
    """Whether ``target`` is a checkpoint saved as a folder (fastckpt before the sidecar format); a failed look (a
    file at the path, on a local disk) counts as no."""
    try:
        await store.head(marker_key(target.key))
    except StoreError:
        return False
    return True


async def _load_folder(transfer: Transfer, target: StorageURI) -> bytearray:
    ckpt = await open_checkpoint_async(target, config=transfer.config, store=transfer.store)
    digest = ckpt.files.get(FOLDER_FILE)
    if digest is None:
        raise FileNotFoundError(f"{target.raw} is a fastckpt checkpoint, but not one saved by fastckpt.lightning")
    data = bytearray(digest.size)
    chunks = await read_layout(transfer, ckpt.file_key(FOLDER_FILE), 0, Layout([data]), digest.chunk_size)
    digest.check(chunks, f"{target.raw}/{FOLDER_FILE}")
    return data


async def _remove_folder(store: Store, target: StorageURI) -> None:
    """Delete a checkpoint saved as a folder: its commit marker first, then the rest (on a local disk, the folder)."""
    keys = [m.key async for m in store.list(target.key)]
    marker = marker_key(target.key)
    if marker in keys:
        await store.delete(marker)
    await store.delete_many([k for k in keys if k != marker])
    if target.backend == "local":
        await off_loop(shutil.rmtree, "/" + target.key, True)
