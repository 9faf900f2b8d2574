"""The object-store half of the facade (s3, gcs, azure, memory): directories are emulated as pyarrow's
S3FileSystem does, with ``dir/`` markers and key prefixes."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import pyarrow.fs as pafs
from pyarrow.lib import ArrowNotImplementedError

from ..checkpoint.manifest import is_marker
from ..config import TransferConfig
from ..engine.stream import copy_object
from ..errors import ObjectNotFoundError
from ..stores.base import ObjectMeta, Store
from .base import Dir, FastckptHandler, File, NotFound, StoreWrapper
from .copy import install_copy_files_guard
from .files import OutputStream

__all__ = ["ObjectStoreHandler"]


class ObjectStoreHandler(FastckptHandler):
    """Handler for an object store: paths are ``bucket/key``."""

    local = False

    def __init__(self, uri: str, config: TransferConfig | None = None,
                 store_wrapper: StoreWrapper | None = None) -> None:
        super().__init__(uri, config, store_wrapper)
        install_copy_files_guard()

    # ----------------------------------------------------------------------------- paths

    def split(self, path: str) -> tuple[str, str]:
        """(bucket, key) of a ``bucket/key`` path."""
        if "://" in path:
            raise ValueError(f"Expected a {self.backend} path of the form 'bucket/key...', got a URI: {path!r}")
        if path.startswith("/"):
            raise ValueError(f"Path cannot start with a separator ({path!r})")
        trimmed = path.rstrip("/")
        if "//" in trimmed:
            raise ValueError(f"Empty path component in path {path}")
        bucket, _, key = trimmed.partition("/")
        return bucket, key

    async def kind(self, store: Store, key: str) -> tuple[pafs.FileType, ObjectMeta | None]:
        """Whether ``key`` is a file (with its metadata), a directory or nothing."""
        try:
            return File, await store.head(key)
        except ObjectNotFoundError:
            pass
        return (Dir if await self.is_dir(store, key) else NotFound), None

    async def is_dir(self, store: Store, key: str) -> bool:
        """A marker ``key/`` or any object below ``key``."""
        marker, below = await asyncio.gather(store.exists(key + "/"), self._has_children(store, key))
        return marker or below

    async def _has_children(self, store: Store, key: str) -> bool:
        async with contextlib.aclosing(store.list(key)) as found:
            async for meta in found:
                if meta.key != key:
                    return True
        return False

    async def bucket_exists(self, store: Store) -> bool:
        """Whether the store's bucket exists (a listing does not fail with 'not found')."""
        try:
            await self._has_children(store, "")
            return True
        except ObjectNotFoundError:
            return False

    def get_file_info(self, paths: list[str]) -> list[pafs.FileInfo]:
        return self.run(self._infos(paths))

    async def _infos(self, paths: list[str]) -> list[pafs.FileInfo]:
        return list(await asyncio.gather(*(self._info(p) for p in paths)))

    async def _info(self, path: str) -> pafs.FileInfo:
        bucket, key = self.split(path)
        if not bucket:
            return pafs.FileInfo(path, Dir)
        store = await self.store(bucket)
        if not key:
            return pafs.FileInfo(path, Dir if await self.bucket_exists(store) else NotFound)
        kind, meta = await self.kind(store, key)
        if meta is not None:
            return pafs.FileInfo(path, File, mtime=meta.mtime, size=meta.size)
        return pafs.FileInfo(path, kind)

    def get_file_info_selector(self, selector: pafs.FileSelector) -> list[pafs.FileInfo]:
        return self.run(self._select(selector.base_dir, selector.recursive, selector.allow_not_found))

    async def _select(self, base: str, recursive: bool, allow_not_found: bool) -> list[pafs.FileInfo]:
        bucket, key = self.split(base)
        if not bucket:
            raise ArrowNotImplementedError(f"listing all buckets is not supported by fastckpt's {self.backend} facade")
        store = await self.store(bucket)
        kind = (Dir if await self.bucket_exists(store) else NotFound) if not key else (await self.kind(store, key))[0]
        if kind == NotFound:
            if allow_not_found:
                return []
            raise FileNotFoundError(f"Path does not exist '{base}'")
        if kind == File:
            raise NotADirectoryError(f"Cannot list directory '{base}': it is a file")
        top = base.rstrip("/")
        cut = len(key) + 1 if key else 0
        infos: list[pafs.FileInfo] = []
        async for objects, dirs in self._walk(store, key, recursive):
            for meta in objects:
                infos.append(pafs.FileInfo(f"{top}/{meta.key[cut:]}", File, mtime=meta.mtime, size=meta.size))
            infos += [pafs.FileInfo(f"{top}/{sub[cut:]}", Dir) for sub in dirs]
        return infos

    async def _walk(self, store: Store, key: str, recursive: bool = True
                    ) -> AsyncIterator[tuple[list[ObjectMeta], list[str]]]:
        """(objects, subdirectories) of ``key`` and, if ``recursive``, of every directory below it,
        listed level by level with the levels' listings in parallel. Directory markers are left out
        (a marker is its directory, listed by the parent)."""
        seen, level = {key}, [key]
        while level:
            listings = await asyncio.gather(*(store.list_dir(k) for k in level))
            level = []
            for objects, dirs in listings:
                subs = [d for d in dirs if d not in seen]  # some stores list a marker as its own subdirectory
                seen.update(subs)
                yield [m for m in objects if not m.key.endswith("/")], subs
                if recursive:
                    level += subs

    def create_dir(self, path: str, recursive: bool) -> None:
        return self.run(self._create_dir(path, recursive))

    async def _create_dir(self, path: str, recursive: bool) -> None:
        bucket, key = self.split(path)
        if not bucket:
            return
        store = await self.store(bucket)
        if not key:
            if not await self.bucket_exists(store):
                raise FileNotFoundError(f"Cannot create directory '{path}': bucket {bucket!r} does not exist "
                                        f"(fastckpt does not create buckets)")
            return
        kind, _ = await self.kind(store, key)
        if kind == Dir:
            return
        if kind == File:
            raise FileExistsError(f"Cannot create directory '{path}': non-directory entry exists")
        parts = key.split("/")
        parents = ["/".join(parts[:i]) for i in range(1, len(parts))]
        if not recursive:
            parents = parents[-1:]
        kinds = [k for k, _ in await asyncio.gather(*(self.kind(store, p) for p in parents))]
        if File in kinds:
            raise NotADirectoryError(f"Cannot create directory '{path}': a parent is a file")
        if not recursive:
            if (kinds and kinds[0] == NotFound) or (not kinds and not await self.bucket_exists(store)):
                raise FileNotFoundError(f"Cannot create directory '{path}': parent directory does not exist")
            missing = [key]
        else:
            missing = [p for p, k in zip(parents, kinds, strict=True) if k == NotFound] + [key]
        await asyncio.gather(*(store.put(m + "/", b"") for m in missing))

    def delete_dir(self, path: str) -> None:
        return self.run(self._delete_dir(path, contents_only=False, missing_ok=False))

    def delete_dir_contents(self, path: str, missing_dir_ok: bool = False) -> None:
        return self.run(self._delete_dir(path, contents_only=True, missing_ok=missing_dir_ok))

    async def _delete_dir(self, path: str, *, contents_only: bool, missing_ok: bool) -> None:
        bucket, key = self.split(path)
        if not bucket:
            return self.delete_root_dir_contents()
        if not key and not contents_only:
            raise PermissionError(f"Cannot delete directory '{path}': deleting buckets is not supported")
        store = await self.store(bucket)
        kind = (Dir if await self.bucket_exists(store) else NotFound) if not key else (await self.kind(store, key))[0]
        if kind == NotFound:
            if missing_ok:
                return None
            raise FileNotFoundError(f"Path does not exist '{path}'")
        if kind == File:
            raise NotADirectoryError(f"Cannot delete directory '{path}': it is a file")
        doomed = await self._tree(store, key)
        if not contents_only and key:
            doomed.append(key + "/")
        markers = [k for k in doomed if is_marker(k)]
        if markers:  # checkpoints below stop being committed before any of their files go (Ray's num_to_keep)
            await store.delete_many(markers)
        await store.delete_many([k for k in doomed if not is_marker(k)])
        if key:
            await (self._keep_dir(store, key) if contents_only else self._keep_parent(store, key))
        return None

    async def _tree(self, store: Store, key: str) -> list[str]:
        """Every object key and directory marker below ``key``."""
        found: list[str] = []
        async for objects, dirs in self._walk(store, key):
            found += [m.key for m in objects] + [d + "/" for d in dirs]
        return found

    async def _keep_dir(self, store: Store, key: str) -> None:
        """Write the marker of ``key`` unless the directory still exists (S3FileSystem's behaviour)."""
        if not await self.is_dir(store, key):
            await store.put(key + "/", b"")

    async def _keep_parent(self, store: Store, key: str) -> None:
        parent = key.rpartition("/")[0]
        if parent:
            await self._keep_dir(store, parent)

    def delete_file(self, path: str) -> None:
        return self.run(self._delete_file(path))

    async def _delete_file(self, path: str) -> None:
        store, key = await self._file(path)
        await store.delete(key)
        await self._keep_parent(store, key)

    def delete_objects(self, paths: list[str]) -> None:
        """Delete the objects at ``paths`` and nothing else: no directory marker is left in their place (fsspec's
        object stores, where a directory is only the prefix of what is below it)."""
        self.run(self._delete_objects(paths))

    async def _delete_objects(self, paths: list[str]) -> None:
        keys: dict[str, list[str]] = {}
        for path in paths:
            bucket, key = self.split(path)
            keys.setdefault(bucket, []).append(key)
        for bucket, found in keys.items():
            await (await self.store(bucket)).delete_many(found)

    async def _file(self, path: str) -> tuple[Store, str]:
        """Store and key of the file at ``path``; FileNotFoundError / IsADirectoryError otherwise."""
        bucket, key = self.split(path)
        if not key:
            raise IsADirectoryError(f"Path '{path}' is a directory")
        store = await self.store(bucket)
        kind, _ = await self.kind(store, key)
        if kind == Dir:
            raise IsADirectoryError(f"Path '{path}' is a directory")
        if kind == NotFound:
            raise FileNotFoundError(f"Path does not exist '{path}'")
        return store, key

    async def _is_dir_at(self, store: Store, key: str) -> bool:
        return not key or await self.is_dir(store, key)

    async def _write_target(self, path: str) -> tuple[Store, str]:
        return await self._target(path)

    async def _target(self, path: str) -> tuple[Store, str]:
        """Store and key to write a file at ``path``; IsADirectoryError when a directory is there."""
        bucket, key = self.split(path)
        if not key:
            raise IsADirectoryError(f"Cannot write a file at '{path}': it names a bucket")
        store = await self.store(bucket)
        if await self.is_dir(store, key):
            raise IsADirectoryError(f"Cannot write a file at '{path}': it is a directory")
        return store, key

    def move(self, src: str, dest: str) -> None:
        return self.run(self._move(src, dest))

    async def _move(self, src: str, dest: str) -> None:
        bucket, key = self.split(src)
        if key and await self.is_dir(await self.store(bucket), key):
            raise IsADirectoryError(f"Cannot move '{src}': moving directories is not supported on object stores")
        store, key = await self._copy(src, dest)
        await store.delete(key)
        await self._keep_parent(store, key)

    def copy_file(self, src: str, dest: str) -> None:
        self.run(self._copy(src, dest))
        return None

    async def _copy(self, src: str, dest: str) -> tuple[Store, str]:
        (src_store, src_key), (dst_store, dst_key) = await asyncio.gather(self._file(src), self._target(dest))
        await copy_object(src_store, src_key, dst_store, dst_key, self.config)
        return src_store, src_key

    def open_append_stream(self, path: str, metadata: Any = None) -> OutputStream:
        """Not on object stores, as with pyarrow's own (ArrowNotImplementedError)."""
        raise ArrowNotImplementedError(f"It is not possible to append efficiently to {self.backend} objects")

    def normalize_path(self, path: str) -> str:
        return path
