"""fastckpt as an fsspec filesystem: ``fsspec.filesystem("fastckpt")`` takes fastckpt URIs as its paths.

    fs = fsspec.filesystem("fastckpt", endpoint_override="http://127.0.0.1:9000")
    fs.put("ckpt/", "s3://bucket/run/step-100/", recursive=True)   # the engine: parallel parts, digests, resume
    with fs.open("s3://bucket/run/step-100/config.json") as f: ...  # read ahead in parallel parts
    fsspec.open("fastckpt://gs://bucket/model.safetensors")          # one URL, wherever fsspec takes URLs

Paths are ``s3://``, ``gs://``, ``az://`` (and the other fastckpt schemes), ``memory://`` and local paths; backend
options come from ``storage_options`` (``endpoint_override``, ``region``, ...) and the environment, as everywhere in
fastckpt. ``s3://`` stays s3fs's: only ``fastckpt://`` paths (or this class) reach fastckpt. Each backend is served by
the pyarrow facade's handler (``fastckpt.fs``): ``get`` / ``put`` / ``cp`` of files go through the engine, ``open()``
reads ahead in parallel parts and writes objects that appear whole on close or not at all (an exception inside the
``with`` block discards them), directories are prefixes.
"""

from __future__ import annotations

import asyncio
import datetime
import io
import os
from collections.abc import Callable
from contextvars import ContextVar
from typing import Any, TypeVar
from urllib.parse import urlencode

import pyarrow.fs as pafs
from fsspec.asyn import AsyncFileSystem

try:
    from fsspec.implementations.chained import ChainedFileSystem
except ImportError:  # an fsspec before the chaining marker: fastckpt:// URLs still work, the :: chain does not
    from fsspec import AbstractFileSystem as ChainedFileSystem

from .config import TransferConfig
from .fs import handler
from .fs.base import FastckptHandler
from .fs.files import ReaderHandle, WriterHandle
from .uri import parse_uri

T = TypeVar("T")
PROTOCOL = "fastckpt"
__all__ = ["PROTOCOL", "FastckptFileSystem"]
_BATCH: ContextVar[list[tuple[FastckptHandler, str, str, int | None]] | None] = ContextVar("fastckpt_fsspec_batch",
                                                                                           default=None)
"""The files of the ``put`` / ``get`` running in this task: (handler, source, destination, size when known)."""


class FastckptFileSystem(AsyncFileSystem, ChainedFileSystem):
    """An fsspec ``AsyncFileSystem`` over every fastckpt backend; its paths are fastckpt URIs.

    In a chained URL (``fastckpt::s3://bucket/key``) fsspec hands it the inner protocol (``target_protocol``) and
    the inner filesystem's form of the path (``bucket/key``); paths without a scheme are then in that protocol.
    fsspec asks the inner protocol's own class for that form, so the chain needs it installed (s3fs for ``s3``);
    ``fastckpt://s3://bucket/key`` needs nothing else."""

    protocol = (PROTOCOL,)
    root_marker = ""
    cachable = True

    def __init__(self, *args: Any, config: TransferConfig | None = None, asynchronous: bool = False,
                 loop: Any = None, batch_size: int | None = None, target_protocol: str | None = None,
                 target_options: dict[str, Any] | None = None, fo: str | None = None,
                 **storage_options: Any) -> None:
        super().__init__(*args, asynchronous=asynchronous, loop=loop, batch_size=batch_size)
        self.config = config or TransferConfig.from_env()
        if target_options and target_options.get("endpoint_url"):  # the inner filesystem's name for it (s3fs)
            storage_options.setdefault("endpoint_override", target_options["endpoint_url"])
        self.options = {k: str(v) for k, v in storage_options.items() if v is not None}
        self.target_protocol = None if target_protocol in (None, "file", "local") else target_protocol
        """The scheme of scheme-less paths (a chained URL's inner protocol; local paths need none)."""
        self._handlers: dict[tuple[str, str], FastckptHandler] = {}

    # ----------------------------------------------------------------------------- paths

    @classmethod
    def _strip_protocol(cls, path: Any) -> Any:
        if isinstance(path, list):
            return [cls._strip_protocol(p) for p in path]
        path = str(path)
        for prefix in (f"{PROTOCOL}://", f"{PROTOCOL}::"):
            if path.startswith(prefix):
                path = path[len(prefix):]
        return path.rstrip("/") or "/" if path.startswith("/") else path.rstrip("/")

    def unstrip_protocol(self, name: str) -> str:
        return f"{PROTOCOL}://{name}"

    def _target(self, path: str) -> tuple[FastckptHandler, str, Callable[[str], str]]:
        """The facade handler serving ``path``, the path as it names it, and the way back to a path of ours."""
        path = self._strip_protocol(path)
        if self.target_protocol and "://" not in path and not path.startswith("/"):
            path = f"{self.target_protocol}://{path}"
        uri = parse_uri(path)
        if uri.backend == "local":
            local = "/" + uri.key
            return self._handler("file", "file:///"), local, lambda p: p
        options = {**self.options, **dict(uri.options)}
        base = f"{uri.scheme}://" + (f"?{urlencode(sorted(options.items()))}" if options else "")
        prefix = f"{uri.scheme}://"
        return self._handler(uri.scheme, base), f"{uri.bucket}/{uri.key}".rstrip("/"), lambda p: prefix + p

    def _write_target(self, path: str) -> tuple[FastckptHandler, str]:
        """``_target`` for a file about to be written: on a local filesystem its directory is made first, as object
        stores need none."""
        h, p, _ = self._target(path)
        if h.local:
            os.makedirs(os.path.dirname(p), exist_ok=True)
        return h, p

    def _handler(self, scheme: str, base: str) -> FastckptHandler:
        found = self._handlers.get((scheme, base))
        if found is None:
            found = self._handlers[(scheme, base)] = handler(base, config=self.config)
        return found

    @staticmethod
    async def _call(fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)``, a facade call that blocks until fastckpt's loop has done it, on a worker thread."""
        return await asyncio.to_thread(fn, *args)

    # ----------------------------------------------------------------------------- metadata

    def _entry(self, info: pafs.FileInfo, back: Callable[[str], str]) -> dict[str, Any]:
        kind = "directory" if info.type == pafs.FileType.Directory else "file"
        entry: dict[str, Any] = {"name": back(info.path), "size": info.size if kind == "file" else 0, "type": kind}
        if info.mtime is not None:
            entry["mtime"] = info.mtime.timestamp()
        return entry

    async def _info(self, path: str, **kwargs: Any) -> dict[str, Any]:
        h, p, back = self._target(path)
        info = (await self._call(h.get_file_info, [p]))[0]
        if info.type == pafs.FileType.NotFound:
            raise FileNotFoundError(path)
        return self._entry(info, back)

    def modified(self, path: str) -> datetime.datetime:
        """When the file at ``path`` was last written (UTC): Lightning's ``ckpt_path="last"`` picks by it."""
        info = self.info(path)
        if info["type"] != "file" or "mtime" not in info:
            raise IsADirectoryError(path) if info["type"] != "file" else NotImplementedError(path)
        return datetime.datetime.fromtimestamp(info["mtime"], tz=datetime.timezone.utc)

    async def _ls(self, path: str, detail: bool = True, **kwargs: Any) -> list[Any]:
        h, p, back = self._target(path)
        info = (await self._call(h.get_file_info, [p]))[0]
        if info.type == pafs.FileType.NotFound:
            raise FileNotFoundError(path)
        if info.type == pafs.FileType.File:
            entries = [self._entry(info, back)]
        else:
            found = await self._call(h.get_file_info_selector, pafs.FileSelector(p, recursive=False))
            entries = sorted((self._entry(i, back) for i in found), key=lambda e: e["name"])
        return entries if detail else [e["name"] for e in entries]

    async def _find(self, path: str, maxdepth: int | None = None, withdirs: bool = False, detail: bool = False,
                    **kwargs: Any) -> Any:
        if maxdepth is not None:
            return await super()._find(path, maxdepth=maxdepth, withdirs=withdirs, detail=detail, **kwargs)
        h, p, back = self._target(path)
        info = (await self._call(h.get_file_info, [p]))[0]
        out: dict[str, dict[str, Any]] = {}
        if info.type == pafs.FileType.File:
            out[back(info.path)] = self._entry(info, back)
        elif info.type == pafs.FileType.Directory:
            if withdirs:
                out[back(p)] = self._entry(info, back)
            found = await self._call(h.get_file_info_selector,
                                     pafs.FileSelector(p, recursive=True, allow_not_found=True))
            for i in found:
                if withdirs or i.type == pafs.FileType.File:
                    out[back(i.path)] = self._entry(i, back)
        names = sorted(out)
        return {n: out[n] for n in names} if detail else names

    # ----------------------------------------------------------------------------- whole objects

    async def _cat_file(self, path: str, start: int | None = None, end: int | None = None, **kwargs: Any) -> bytes:
        h, p, _ = self._target(path)

        def read() -> bytes:
            reader = h.reader(p)
            try:
                size = reader.size()
                lo = 0 if start is None else (start if start >= 0 else max(0, size + start))
                hi = size if end is None else (end if end >= 0 else max(0, size + end))
                reader.seek(lo)
                return bytes(reader.read(max(0, min(hi, size) - lo)))
            finally:
                reader.close()

        return await self._call(read)

    async def _pipe_file(self, path: str, value: bytes, mode: str = "overwrite", **kwargs: Any) -> None:
        if mode == "create" and await self._exists(path):
            raise FileExistsError(path)
        h, p = await asyncio.to_thread(self._write_target, path)

        def write() -> None:
            writer = h.writer(p)
            try:
                writer.write(value)
            except BaseException:
                writer.abort()
                raise
            writer.close()

        await self._call(write)

    async def _put(self, lpath: Any, rpath: Any, *args: Any, **kwargs: Any) -> Any:
        """fsspec's ``put`` (its rules for paths and directories), the files then sent as one engine transfer."""
        return await self._batched(super()._put(lpath, rpath, *args, **kwargs), upload=True)

    async def _get(self, rpath: Any, lpath: Any, *args: Any, **kwargs: Any) -> Any:
        """fsspec's ``get``, the files then fetched as one engine transfer (each checked against its digest)."""
        return await self._batched(super()._get(rpath, lpath, *args, **kwargs), upload=False)

    async def _batched(self, planning: Any, *, upload: bool) -> Any:
        """Run fsspec's ``put`` / ``get`` with ``_put_file`` / ``_get_file`` collecting their files, then move them
        in one engine transfer per backend: parts of all files in flight together, as ``fastckpt.upload`` does."""
        pairs: list[tuple[FastckptHandler, str, str, int | None]] = []
        token = _BATCH.set(pairs)
        try:
            result = await planning
        finally:
            _BATCH.reset(token)
        by_handler: dict[int, tuple[FastckptHandler, list[tuple[str, str]], dict[str, int]]] = {}
        for h, a, b, size in pairs:
            group = by_handler.setdefault(id(h), (h, [], {}))
            group[1].append((a, b))
            if size is not None:
                group[2][a] = size
        for h, items, sizes in by_handler.values():
            if upload:
                await self._call(h.upload_files, items)
            else:
                await self._call(h.download_files, items, sizes)
        return result

    async def _put_file(self, lpath: str, rpath: str, mode: str = "overwrite", **kwargs: Any) -> None:
        if await asyncio.to_thread(os.path.isdir, lpath):
            await self._makedirs(rpath, exist_ok=True)
            return
        if mode == "create" and await self._exists(rpath):
            raise FileExistsError(rpath)
        h, p = await asyncio.to_thread(self._write_target, rpath)
        await self._move(h, lpath, p, upload=True)

    async def _get_file(self, rpath: str, lpath: str, **kwargs: Any) -> None:
        h, p, _ = self._target(rpath)
        info = await self._info(rpath)
        if info["type"] == "directory":
            await asyncio.to_thread(os.makedirs, lpath, exist_ok=True)
            return
        await self._move(h, p, lpath, upload=False, size=info["size"])

    async def _move(self, h: FastckptHandler, src: str, dst: str, *, upload: bool, size: int | None = None) -> None:
        """One file through the engine now, or into the batch of the ``put`` / ``get`` running (``size``: the
        remote file's, which lets the engine plan the parts of the whole batch together)."""
        batch = _BATCH.get()
        if batch is not None:
            batch.append((h, src, dst, size))
        elif upload:
            await self._call(h.upload_files, [(src, dst)])
        else:
            await self._call(h.download_files, [(src, dst)], {src: size} if size is not None else None)

    async def _cp_file(self, path1: str, path2: str, **kwargs: Any) -> None:
        if (await self._info(path1))["type"] == "directory":
            await self._makedirs(path2, exist_ok=True)
            return
        h1, p1, _ = self._target(path1)
        h2, p2 = await asyncio.to_thread(self._write_target, path2)
        if h1 is not h2:
            raise NotImplementedError(f"fastckpt copies within one backend and its options: {path1} -> {path2}")
        await self._call(h1.copy_file, p1, p2)

    # ----------------------------------------------------------------------------- changes

    async def _rm_file(self, path: str, **kwargs: Any) -> None:
        h, p, _ = self._target(path)
        await self._call(h.delete_file if h.local else h.delete_objects, p if h.local else [p])

    async def _rm(self, path: Any, recursive: bool = False, maxdepth: int | None = None, **kwargs: Any) -> None:
        paths = await self._expand_path(path, recursive=recursive, maxdepth=maxdepth)
        infos = [await self._info(p) for p in paths]
        objects: dict[int, tuple[FastckptHandler, list[str]]] = {}
        for info in sorted(infos, key=lambda i: len(i["name"]), reverse=True):  # files before their directories
            h, target, _ = self._target(info["name"])
            if not h.local:  # one batch per handler; an object store's directories are only prefixes
                if info["type"] == "file":
                    objects.setdefault(id(h), (h, []))[1].append(target)
                continue
            await self._call(h.delete_file if info["type"] == "file" else h.delete_dir, target)
        for h, targets in objects.values():
            await self._call(h.delete_objects, targets)

    async def _mkdir(self, path: str, create_parents: bool = True, **kwargs: Any) -> None:
        """A local directory is made; in an object store, a directory is the prefix of the objects below it (none
        is made, as with s3fs and gcsfs)."""
        h, p, _ = self._target(path)
        if h.local:
            await self._call(h.create_dir, p, create_parents)

    async def _makedirs(self, path: str, exist_ok: bool = False) -> None:
        if not exist_ok and await self._exists(path):
            raise FileExistsError(path)
        await self._mkdir(path, create_parents=True)

    # ----------------------------------------------------------------------------- files

    def _open(self, path: str, mode: str = "rb", block_size: Any = None, autocommit: bool = True,
              cache_options: Any = None, **kwargs: Any) -> io.RawIOBase:
        if mode == "rb":
            h, p, _ = self._target(path)
            return io.BufferedReader(_Reading(h.reader(p), path), buffer_size=1 << 20)  # type: ignore[arg-type]
        if mode in ("wb", "xb"):
            if mode == "xb" and self.exists(path):
                raise FileExistsError(path)
            h, p = self._write_target(path)
            return _Writing(h.writer(p), path)
        raise ValueError(f"fastckpt opens files in mode 'rb', 'wb' or 'xb', not {mode!r}")


class _Reading(io.RawIOBase):
    """A file being read: parts fetched ahead in parallel, the digest checked when read whole."""

    def __init__(self, handle: ReaderHandle, name: str) -> None:
        self.handle, self.name = handle, name

    @property
    def size(self) -> int:
        return self.handle.size()

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, buf: Any) -> int:
        data = self.handle.read(len(memoryview(buf)))
        memoryview(buf).cast("B")[:len(data)] = data
        return len(data)

    def seek(self, offset: int, whence: int = 0) -> int:
        return self.handle.seek(offset, whence)

    def tell(self) -> int:
        return self.handle.tell()

    def close(self) -> None:
        self.handle.close()
        super().close()


class _Writing(io.RawIOBase):
    """A file being written: the object appears whole on ``close()``, and not at all when the ``with`` block
    around it raises (or ``discard()`` is called)."""

    def __init__(self, handle: WriterHandle, name: str) -> None:
        self.handle, self.name = handle, name

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        return self.handle.write(data)

    def discard(self) -> None:
        """Drop what was written: no object appears."""
        self.handle.abort()
        super().close()

    def close(self) -> None:
        if not self.closed:
            try:
                self.handle.close()
            finally:
                super().close()

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is not None:
            self.discard()
        else:
            self.close()
