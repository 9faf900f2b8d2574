"""The ``pyarrow.fs.FileSystemHandler`` backed by fastckpt stores and the engine.

Paths carry no scheme. On object stores (s3, gcs, azure, memory) the first component is the bucket
(``bucket/key``, as in pyarrow's S3FileSystem) and directories are implied by key prefixes;
``create_dir`` writes empty ``key/`` marker objects for each missing level, and deleting the last entry
of a directory leaves a marker for it, as S3FileSystem does. On the local backend paths are absolute:
directory operations, moves, copies and appends are pyarrow's LocalFileSystem's, while file data is
read and written by the engine (atomic, fsynced, hashed).

Every store call runs on the process's background loop thread (``fastckpt._loop.BackgroundLoop``);
stores are created there, per bucket, and recreated after a fork or unpickling.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import functools
import os
import threading
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from typing import Any, TypeVar
from urllib.parse import urlsplit

import pyarrow.fs as pafs
from pyarrow.lib import ArrowNotImplementedError

from .._loop import BackgroundLoop
from ..config import TransferConfig
from ..engine.retry import with_retries
from ..engine.stream import StreamReader, StreamWriter, copy_object
from ..engine.tasks import gather_all
from ..engine.transfer import FileResult, Transfer
from ..errors import ObjectNotFoundError
from ..stores import open_store
from ..stores.base import ObjectMeta, Store
from ..uri import BACKEND_OF_SCHEME, StorageURI, parse_uri
from .files import InputFile, OutputStream, ReaderHandle, WriterHandle

T = TypeVar("T")
StoreWrapper = Callable[[Store], Store]
Dir, File, NotFound = pafs.FileType.Directory, pafs.FileType.File, pafs.FileType.NotFound


def location(uri: str) -> StorageURI:
    """Parse a filesystem URI; object-store URIs may omit the bucket (paths name it)."""
    parts = urlsplit(uri)
    if "://" in uri and not parts.netloc and BACKEND_OF_SCHEME.get(parts.scheme.lower()) in ("s3", "gcs", "azure"):
        probe = parse_uri(uri.replace("://", "://bucket", 1))
        return StorageURI(uri, probe.scheme, probe.backend, "", "", probe.options)
    return parse_uri(uri)


class FastckptHandler(pafs.FileSystemHandler):
    """Filesystem handler for one backend (``s3``, ``gcs``, ``azure``, ``memory`` or ``local``).

    ``uri`` names the backend and its options (``s3://bucket?endpoint_override=...``); its bucket and
    key do not restrict the paths. Handlers compare equal when backend, options, transfer config and
    store wrapper are equal; they pickle as that configuration. ``store_wrapper`` (picklable) wraps
    every store the handler opens, e.g. in a ``FaultInjectingStore``.
    """

    def __init__(self, uri: str, config: TransferConfig | None = None,
                 store_wrapper: StoreWrapper | None = None) -> None:
        loc = location(uri)
        if loc.backend == "delegate":
            raise ValueError(f"{uri!r}: no fastckpt backend for scheme {loc.scheme!r}; use fastckpt.fs.filesystem()")
        self.uri, self.backend, self.scheme, self.options = uri, loc.backend, loc.scheme, dict(loc.options)
        self.config = config or TransferConfig.from_env()
        self.store_wrapper = store_wrapper
        self.local = loc.backend == "local"
        self._localfs = pafs.LocalFileSystem() if self.local else None
        self._stores: dict[str, Store] = {}
        self._owner: tuple[int, object] | None = None
        self._lock = threading.Lock()
        _LIVE[id(self)] = self
        from .copy import install_copy_files_guard

        install_copy_files_guard()

    # ----------------------------------------------------------------------------- identity

    def _identity(self) -> tuple[object, ...]:
        return (self.backend, tuple(sorted(self.options.items())), self.config)

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, FastckptHandler) and self._identity() == other._identity()
                and _same_callable(self.store_wrapper, other.store_wrapper))

    def __hash__(self) -> int:
        return hash(self._identity())

    def __reduce__(self) -> tuple[type, tuple[object, ...]]:
        return FastckptHandler, (self.uri, self.config, self.store_wrapper)

    def __repr__(self) -> str:
        return f"FastckptHandler({self.uri!r})"

    def get_type_name(self) -> str:
        return f"fastckpt+{self.backend}"

    # ----------------------------------------------------------------------------- loop and stores

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the background loop (fastckpt's storage and integrity errors are OSErrors)."""
        bg = BackgroundLoop.get()
        owner = (os.getpid(), bg.loop)
        with self._lock:
            if self._owner != owner:  # first use, or a fork / new loop: old clients belong elsewhere
                self._stores, self._owner = {}, owner
        return bg.run(coro)

    async def store(self, bucket: str) -> Store:
        """The store of ``bucket`` (created on first use, on the loop)."""
        store = self._stores.get(bucket)
        if store is None:
            store = open_store(StorageURI(self.uri, self.scheme, self.backend, bucket, "", self.options), self.config)
            if self.store_wrapper is not None:
                store = self.store_wrapper(store)
            self._stores[bucket] = store
        return store

    def close(self, timeout: float | None = None) -> None:
        """Close the stores opened so far in this process (they are reopened on next use)."""
        with self._lock:
            stores, self._stores = self._stores, {}
            mine = self._owner is not None and self._owner[0] == os.getpid()
        if stores and mine:
            future = asyncio.run_coroutine_threadsafe(_close_stores(list(stores.values())), BackgroundLoop.get().loop)
            with contextlib.suppress(Exception):
                future.result(timeout)

    async def _retry(self, op: Callable[[], Awaitable[T]], what: str) -> T:
        return await with_retries(op, self.config, what)

    # ----------------------------------------------------------------------------- paths

    def split(self, path: str) -> tuple[str, str]:
        """(bucket, key) of a path; for the local backend ("", absolute path without the leading '/')."""
        if "://" in path:
            raise ValueError(f"Expected a {self.backend} path of the form 'bucket/key...', got a URI: {path!r}")
        if self.local:
            return "", os.path.abspath(path).strip("/")
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
            return File, await self._retry(lambda: store.head(key), f"stat of {key}")
        except ObjectNotFoundError:
            pass
        return (Dir if await self.is_dir(store, key) else NotFound), None

    async def is_dir(self, store: Store, key: str) -> bool:
        """A marker ``key/`` or any object below ``key``."""
        marker, below = await asyncio.gather(self._exists(store, key + "/"), self._has_children(store, key))
        return marker or below

    async def _exists(self, store: Store, key: str) -> bool:
        try:
            await self._retry(lambda: store.head(key), f"stat of {key}")
            return True
        except ObjectNotFoundError:
            return False

    async def _has_children(self, store: Store, key: str) -> bool:
        async def first() -> bool:
            async with contextlib.aclosing(store.list(key)) as found:
                async for meta in found:
                    if meta.key != key:
                        return True
            return False

        return await self._retry(first, f"listing of {key}")

    async def bucket_exists(self, store: Store) -> bool:
        """Whether the store's bucket exists (a listing does not fail with 'not found')."""
        try:
            await self._has_children(store, "")
            return True
        except ObjectNotFoundError:
            return False

    # ----------------------------------------------------------------------------- file info

    def get_file_info(self, paths: list[str]) -> list[pafs.FileInfo]:
        if self._localfs is not None:
            return self._localfs.get_file_info(paths)
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
        if self._localfs is not None:
            return self._localfs.get_file_info(selector)
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
            listings = await asyncio.gather(*(self._retry(lambda k=k: store.list_dir(k), f"listing of {k}")
                                              for k in level))
            level = []
            for objects, dirs in listings:
                subs = [d for d in dirs if d not in seen]  # some stores list a marker as its own subdirectory
                seen.update(subs)
                yield [m for m in objects if not m.key.endswith("/")], subs
                if recursive:
                    level += subs

    # ----------------------------------------------------------------------------- directories

    def create_dir(self, path: str, recursive: bool) -> None:
        if self._localfs is not None:
            return self._localfs.create_dir(path, recursive=recursive)
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
        await asyncio.gather(*(self._retry(lambda m=m: store.put(m + "/", b""), f"create_dir {path}")
                               for m in missing))

    def delete_dir(self, path: str) -> None:
        if self._localfs is not None:
            return self._localfs.delete_dir(path)
        return self.run(self._delete_dir(path, contents_only=False, missing_ok=False))

    def delete_dir_contents(self, path: str, missing_dir_ok: bool = False) -> None:
        if self._localfs is not None:
            return self._localfs.delete_dir_contents(path, missing_dir_ok=missing_dir_ok)
        return self.run(self._delete_dir(path, contents_only=True, missing_ok=missing_dir_ok))

    def delete_root_dir_contents(self) -> None:
        raise PermissionError(f"fastckpt's {self.backend} facade refuses to delete the contents of the root "
                              f"directory (every bucket / the whole filesystem)")

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
        await self._retry(lambda: store.delete_many(doomed), f"delete of {path}")
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
            await self._retry(lambda: store.put(key + "/", b""), f"create_dir {key}")

    async def _keep_parent(self, store: Store, key: str) -> None:
        parent = key.rpartition("/")[0]
        if parent:
            await self._keep_dir(store, parent)

    # ----------------------------------------------------------------------------- files

    def delete_file(self, path: str) -> None:
        if self._localfs is not None:
            return self._localfs.delete_file(path)
        return self.run(self._delete_file(path))

    async def _delete_file(self, path: str) -> None:
        store, key = await self._file(path)
        await self._retry(lambda: store.delete(key), f"delete of {path}")
        await self._keep_parent(store, key)

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
        if self._localfs is not None:
            return self._localfs.move(src, dest)
        return self.run(self._move(src, dest))

    async def _move(self, src: str, dest: str) -> None:
        bucket, key = self.split(src)
        if key and await self.is_dir(await self.store(bucket), key):
            raise IsADirectoryError(f"Cannot move '{src}': moving directories is not supported on object stores")
        store, key = await self._copy(src, dest)
        await self._retry(lambda: store.delete(key), f"delete of {src}")
        await self._keep_parent(store, key)

    def copy_file(self, src: str, dest: str) -> None:
        if self._localfs is not None:
            return self._localfs.copy_file(src, dest)
        self.run(self._copy(src, dest))
        return None

    async def _copy(self, src: str, dest: str) -> tuple[Store, str]:
        (src_store, src_key), (dst_store, dst_key) = await asyncio.gather(self._file(src), self._target(dest))
        await copy_object(src_store, src_key, dst_store, dst_key, self.config)
        return src_store, src_key

    # ----------------------------------------------------------------------------- streams

    def open_input_stream(self, path: str) -> InputFile:
        return self.open_input_file(path)

    def open_input_file(self, path: str) -> InputFile:
        return InputFile(ReaderHandle(self.run, self.run(self._reader(path)), path), mode="r")

    async def _reader(self, path: str) -> StreamReader:
        bucket, key = self.split(path)
        store = await self.store(bucket)
        try:
            meta = await self._retry(lambda: store.head(key), f"open of {path}") if key else None
        except ObjectNotFoundError:
            meta = None
        if meta is None:
            if self.local:
                is_dir = await asyncio.to_thread(os.path.isdir, "/" + key)
            else:
                is_dir = not key or await self.is_dir(store, key)
            if is_dir:
                raise IsADirectoryError(f"Cannot open for reading: path '{path}' is a directory")
            raise FileNotFoundError(f"Path does not exist '{path}'")
        return StreamReader(store, meta, self.config)

    def open_output_stream(self, path: str, metadata: Any = None) -> OutputStream:
        if self._localfs is not None:
            self._check_local_target(path)
        writer = self.run(self._writer(path, _metadata(metadata)))
        return OutputStream(WriterHandle(self.run, writer, path), mode="w")

    async def _writer(self, path: str, metadata: dict[str, str], *, append: bool = False) -> StreamWriter:
        if self.local:
            store, key = await self.store(""), self.split(path)[1]
        else:
            store, key = await self._target(path)
        writer = StreamWriter(store, key, self.config, metadata)
        if append:
            await self._prefill(writer, store, key)
        return writer

    async def _prefill(self, writer: StreamWriter, store: Store, key: str) -> None:
        """Stream the current content of ``key`` (verified) into ``writer``."""
        try:
            meta = await self._retry(lambda: store.head(key), f"open of {key}")
        except ObjectNotFoundError:
            return
        reader = StreamReader(store, meta, self.config)
        try:
            for index in range(reader.count):
                await writer.write(await reader.part(index, reader.count - index))
        except BaseException:
            await writer.abort()
            raise
        finally:
            await reader.close()

    def _check_local_target(self, path: str) -> None:
        """LocalFileSystem's rules: the parent must be an existing directory, the path not a directory."""
        assert self._localfs is not None
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
        if self._localfs is None:
            raise ArrowNotImplementedError(f"It is not possible to append efficiently to {self.backend} objects")
        self._check_local_target(path)
        writer = self.run(self._writer(path, _metadata(metadata), append=True))
        return OutputStream(WriterHandle(self.run, writer, path), mode="w")

    def normalize_path(self, path: str) -> str:
        if self._localfs is not None:
            return self._localfs.normalize_path(path)
        return path

    # ----------------------------------------------------------------------------- bulk transfers

    def upload_files(self, pairs: list[tuple[str, str]]) -> list[FileResult]:
        """Upload (local file, path on this filesystem) pairs through the engine."""
        return self.run(self._bulk(pairs, upload=True))

    def download_files(self, pairs: list[tuple[str, str]]) -> list[FileResult]:
        """Download (path on this filesystem, local file) pairs through the engine, verified."""
        return self.run(self._bulk(pairs, upload=False))

    async def _bulk(self, pairs: list[tuple[str, str]], *, upload: bool) -> list[FileResult]:
        by_bucket: dict[str, list[tuple[str, str]]] = {}
        for a, b in pairs:
            bucket, key = self.split(b if upload else a)
            by_bucket.setdefault(bucket, []).append((a, key) if upload else (key, b))

        async def one(bucket: str, items: list[tuple[str, str]]) -> list[FileResult]:
            transfer = Transfer(await self.store(bucket), self.config)
            try:
                if upload:
                    return await transfer.upload_files(items)
                return await transfer.download_files(items)
            finally:
                transfer.close()

        results = await gather_all(one(b, items) for b, items in by_bucket.items())
        return [r for rs in results for r in rs]


def _same_callable(a: object, b: object) -> bool:
    """Equal callables; ``functools.partial`` objects (equal only to themselves) by function and arguments,
    so that a handler and its unpickled copy compare equal."""
    if isinstance(a, functools.partial) and isinstance(b, functools.partial):
        return a.func == b.func and a.args == b.args and a.keywords == b.keywords
    return a == b


async def _close_stores(stores: list[Store]) -> None:
    for store in stores:
        with contextlib.suppress(Exception):
            await store.close()


_LIVE: weakref.WeakValueDictionary[int, FastckptHandler] = weakref.WeakValueDictionary()


@atexit.register
def _close_all() -> None:
    """Close every live handler's clients while the loop still runs (no 'unclosed connector' noise)."""
    for handler in list(_LIVE.values()):
        handler.close(timeout=5)


def _metadata(metadata: Any) -> dict[str, str]:
    """pyarrow KeyValueMetadata (bytes or str) as a str dict."""
    if metadata is None:
        return {}
    return {(k.decode() if isinstance(k, bytes) else k): (v.decode() if isinstance(v, bytes) else v)
            for k, v in metadata.items()}
