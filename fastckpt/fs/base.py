"""What both halves of the pyarrow facade share: ``FastckptHandler``, a ``pyarrow.fs.FileSystemHandler``
over the transfer engine, and its configuration, identity and pickling, stores, streams and bulk copies.

The halves: ``fs.objects.ObjectStoreHandler`` (s3, gcs, azure, memory: directories emulated with
markers and prefixes, as pyarrow's S3FileSystem does) and ``fs.local.LocalHandler`` (local / NFS:
directory operations, moves and copies are pyarrow's LocalFileSystem's, file data goes through the
engine). ``handler(uri)`` picks one. pyarrow calls handlers from its own threads and from threads that
run an event loop, so every operation runs on fastckpt's background loop (``run``).
"""

from __future__ import annotations

import abc
import asyncio
import atexit
import concurrent.futures
import contextlib
import functools
import os
import threading
import weakref
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar
from urllib.parse import urlsplit

import pyarrow.fs as pafs

from .._loop import BackgroundLoop
from ..config import TransferConfig
from ..engine.session import FileResult
from ..engine.stream import StreamReader, StreamWriter
from ..engine.transfer import Transfer
from ..errors import ObjectNotFoundError
from ..stores import open_store
from ..stores.base import Store
from ..stores.retry import retrying
from ..tasks import gather_all
from ..uri import BACKEND_OF_SCHEME, StorageURI, parse_uri, redact
from .files import InputFile, OutputStream, ReaderHandle, WriterHandle

__all__ = ["FastckptHandler", "StoreWrapper", "location"]

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
    key do not restrict the paths. Handlers compare equal when class, backend, options, transfer config
    and store wrapper are equal; they pickle as that configuration. ``store_wrapper`` (picklable) wraps
    every store the handler opens, e.g. in a ``FaultInjectingStore``.
    """

    local: bool
    """Whether paths are local files (directories real, not implied by the keys below them)."""

    def __init__(self, uri: str, config: TransferConfig | None = None,
                 store_wrapper: StoreWrapper | None = None) -> None:
        loc = location(uri)
        if loc.backend == "delegate":
            raise ValueError(f"{uri!r}: no fastckpt backend for scheme {loc.scheme!r}; use fastckpt.fs.filesystem()")
        self.uri, self.backend, self.scheme, self.options = uri, loc.backend, loc.scheme, dict(loc.options)
        self.config = config or TransferConfig.from_env()
        self.store_wrapper = store_wrapper
        self._stores: dict[str, Store] = {}
        """The stores opened so far (one dict for the handler's life: its finalizer closes what is in it)."""
        self._owner: tuple[int, object] | None = None
        self._lock = threading.Lock()
        _LIVE[id(self)] = self
        # a handler dropped (Ray copies the filesystem into every task and actor) closes its clients
        weakref.finalize(self, _close_dropped, self._stores, os.getpid()).atexit = False

    # ----------------------------------------------------------------------------- identity

    def _identity(self) -> tuple[object, ...]:
        return (self.backend, tuple(sorted(self.options.items())), self.config)

    def __eq__(self, other: object) -> bool:
        return (type(other) is type(self) and self._identity() == other._identity()
                and _same_callable(self.store_wrapper, other.store_wrapper))

    def __hash__(self) -> int:
        return hash(self._identity())

    def __reduce__(self) -> tuple[type, tuple[object, ...]]:
        return type(self), (self.uri, self.config, self.store_wrapper)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({redact(self.uri)!r})"

    def get_type_name(self) -> str:
        return f"fastckpt+{self.backend}"

    # ----------------------------------------------------------------------------- loop and stores

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the background loop (fastckpt's storage and integrity errors are OSErrors)."""
        bg = BackgroundLoop.get()
        owner = (os.getpid(), bg.loop)
        with self._lock:
            if self._owner != owner:  # first use, or a fork / new loop: old clients belong elsewhere
                self._stores.clear()
                self._owner = owner
        return bg.run(coro)

    async def store(self, bucket: str) -> Store:
        """The store of ``bucket`` (created on first use, on the loop)."""
        store = self._stores.get(bucket)
        if store is None:
            store = open_store(StorageURI(self.uri, self.scheme, self.backend, bucket, "", self.options),
                               config=self.config, retry=False)
            if self.store_wrapper is not None:
                store = self.store_wrapper(store)
            store = retrying(store, self.config)
            self._stores[bucket] = store
        return store

    def close(self, timeout: float | None = None) -> None:
        """Close the stores opened so far in this process (they are reopened on next use)."""
        with self._lock:
            stores = dict(self._stores)
            self._stores.clear()
            mine = self._owner is not None and self._owner[0] == os.getpid()
        if stores and mine:
            with contextlib.suppress(Exception):
                _close_soon(stores).result(timeout)

    # ----------------------------------------------------------------------------- what each half supplies

    @abc.abstractmethod
    def split(self, path: str) -> tuple[str, str]:
        """(bucket, key) of a path."""

    @abc.abstractmethod
    async def _write_target(self, path: str) -> tuple[Store, str]:
        """Store and key a file written at ``path`` goes to (errors as pyarrow raises them)."""

    @abc.abstractmethod
    async def _is_dir_at(self, store: Store, key: str) -> bool:
        """Whether a directory is at ``key`` (asked when no file is there)."""

    def _check_target(self, path: str) -> None:
        """Refuse, before any request, to write a file at ``path`` (hook; nothing by default)."""

    # ----------------------------------------------------------------------------- streams

    def delete_root_dir_contents(self) -> None:
        raise PermissionError(f"fastckpt's {self.backend} facade refuses to delete the contents of the root "
                              f"directory (every bucket / the whole filesystem)")

    def open_input_stream(self, path: str) -> InputFile:
        return self.open_input_file(path)

    def open_input_file(self, path: str) -> InputFile:
        return InputFile(self.reader(path), mode="r")

    def reader(self, path: str) -> ReaderHandle:
        """The file at ``path``, opened for reading (parts fetched ahead in parallel, its digest checked)."""
        return ReaderHandle(self.run, self.run(self._reader(path)), path)

    def writer(self, path: str, metadata: dict[str, str] | None = None) -> WriterHandle:
        """A new object at ``path`` being written: it appears whole when the handle is closed."""
        self._check_target(path)
        return WriterHandle(self.run, self.run(self._writer(path, metadata or {})), path)

    async def _reader(self, path: str) -> StreamReader:
        bucket, key = self.split(path)
        store = await self.store(bucket)
        try:
            meta = await store.head(key) if key else None
        except ObjectNotFoundError:
            meta = None
        if meta is None:
            if await self._is_dir_at(store, key):
                raise IsADirectoryError(f"Cannot open for reading: path '{path}' is a directory")
            raise FileNotFoundError(f"Path does not exist '{path}'")
        return StreamReader(store, meta, self.config)

    def open_output_stream(self, path: str, metadata: Any = None) -> OutputStream:
        return OutputStream(self.writer(path, _metadata(metadata)), mode="w")

    async def _writer(self, path: str, metadata: dict[str, str], *, append: bool = False) -> StreamWriter:
        store, key = await self._write_target(path)
        writer = StreamWriter(store, key, self.config, metadata)
        if append:
            await self._prefill(writer, store, key)
        return writer

    async def _prefill(self, writer: StreamWriter, store: Store, key: str) -> None:
        """Stream the current content of ``key`` (verified) into ``writer``."""
        try:
            meta = await store.head(key)
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

    # ----------------------------------------------------------------------------- bulk transfers

    def upload_files(self, pairs: list[tuple[str, str]]) -> list[FileResult]:
        """Upload (local file, path on this filesystem) pairs through the engine."""
        return self.run(self._bulk(pairs, upload=True))

    def download_files(self, pairs: list[tuple[str, str]], sizes: dict[str, int] | None = None) -> list[FileResult]:
        """Download (path on this filesystem, local file) pairs through the engine, verified. ``sizes`` (by path, as a
        listing gave them) let the engine plan the parts of all files together, as ``fastckpt.download`` does."""
        return self.run(self._bulk(pairs, upload=False, sizes=sizes or {}))

    async def _bulk(self, pairs: list[tuple[str, str]], *, upload: bool, sizes: dict[str, int] | None = None
                    ) -> list[FileResult]:
        by_bucket: dict[str, list[tuple[str, str]]] = {}
        known: dict[str, int] = {}
        for a, b in pairs:
            bucket, key = self.split(b if upload else a)
            by_bucket.setdefault(bucket, []).append((a, key) if upload else (key, b))
            if not upload and sizes and a in sizes:
                known[key] = sizes[a]

        async def one(bucket: str, items: list[tuple[str, str]]) -> list[FileResult]:
            transfer = Transfer(await self.store(bucket), self.config)
            try:
                if upload:
                    return await transfer.upload_files(items, snapshot=True)
                return await transfer.download_files(items, sizes={k: known[k] for k, _ in items if k in known})
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


def _close_soon(stores: dict[str, Store]) -> concurrent.futures.Future[None]:
    """Start closing ``stores`` on the background loop, where their connections live."""
    return asyncio.run_coroutine_threadsafe(_close_stores(list(stores.values())), BackgroundLoop.get().loop)


def _close_dropped(stores: dict[str, Store], pid: int) -> None:
    """A garbage-collected handler's ``stores`` closed (not waited for: the collection may run on any thread, the
    loop's included), so no client session is left for aiohttp to report unclosed."""
    if stores and os.getpid() == pid:
        _close_soon(stores)


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
