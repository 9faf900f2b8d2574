"""The local / NFS half of the facade: directory operations, moves and copies are pyarrow's
LocalFileSystem's; file data goes through the engine (parallel ``pwrite``, digests, atomic rename)."""

from __future__ import annotations

import os
from typing import Any

import pyarrow.fs as pafs

from ..config import TransferConfig
from ..stores.base import Store
from ..threads import off_loop
from .base import Dir, FastckptHandler, NotFound, StoreWrapper, _metadata
from .copy import install_copy_files_guard
from .files import OutputStream, WriterHandle

__all__ = ["LocalHandler"]


class LocalHandler(FastckptHandler):
    """Handler for the local filesystem: paths are absolute paths."""

    local = True

    def __init__(self, uri: str, config: TransferConfig | None = None,
                 store_wrapper: StoreWrapper | None = None) -> None:
        super().__init__(uri, config, store_wrapper)
        self._localfs = pafs.LocalFileSystem()
        install_copy_files_guard()

    # ----------------------------------------------------------------------------- paths and operations

    def split(self, path: str) -> tuple[str, str]:
        """("", absolute path without the leading '/')."""
        if "://" in path:
            raise ValueError(f"Expected a local path, got a URI: {path!r}")
        return "", os.path.abspath(path).strip("/")

    async def _write_target(self, path: str) -> tuple[Store, str]:
        return await self.store(""), self.split(path)[1]

    async def _is_dir_at(self, store: Store, key: str) -> bool:
        return await off_loop(os.path.isdir, "/" + key)

    def get_file_info(self, paths: list[str]) -> list[pafs.FileInfo]:
        return self._localfs.get_file_info(paths)

    def get_file_info_selector(self, selector: pafs.FileSelector) -> list[pafs.FileInfo]:
        return self._localfs.get_file_info(selector)

    def create_dir(self, path: str, recursive: bool) -> None:
        return self._localfs.create_dir(path, recursive=recursive)

    def delete_dir(self, path: str) -> None:
        return self._localfs.delete_dir(path)

    def delete_dir_contents(self, path: str, missing_dir_ok: bool = False) -> None:
        return self._localfs.delete_dir_contents(path, missing_dir_ok=missing_dir_ok)

    def delete_file(self, path: str) -> None:
        return self._localfs.delete_file(path)

    def move(self, src: str, dest: str) -> None:
        return self._localfs.move(src, dest)

    def copy_file(self, src: str, dest: str) -> None:
        return self._localfs.copy_file(src, dest)

    def _check_target(self, path: str) -> None:
        """LocalFileSystem's rules: the parent must be an existing directory, the path not a directory."""
        target, parent = self._localfs.get_file_info([path, os.path.dirname(os.path.abspath(path))])
        if target.type == Dir:
            raise IsADirectoryError(f"Failed to open local file '{path}': is a directory")
        if parent.type == NotFound:
            raise FileNotFoundError(f"Failed to open local file '{path}': parent directory does not exist")
        if parent.type != Dir:
            raise NotADirectoryError(f"Failed to open local file '{path}': parent is not a directory")

    def open_append_stream(self, path: str, metadata: Any = None) -> OutputStream:
        """Local files only, as with pyarrow's object stores: the file is rewritten (its content
        streamed, verified, then the appended bytes) and replaced atomically on close."""
        self._check_target(path)
        writer = self.run(self._writer(path, _metadata(metadata), append=True))
        return OutputStream(WriterHandle(self.run, writer, path), mode="w")

    def normalize_path(self, path: str) -> str:
        return self._localfs.normalize_path(path)
