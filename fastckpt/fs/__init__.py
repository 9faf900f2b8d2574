"""pyarrow filesystem facade: ``RunConfig(storage_filesystem=fastckpt.fs.filesystem("s3://bucket?..."))``.

``filesystem(uri)`` returns a ``pyarrow.fs.PyFileSystem`` whose handler moves data with fastckpt's
engine (parallel parts, XXH3 digests, retries, bounded memory), or pyarrow's own filesystem for schemes
fastckpt has no backend for (``hdfs://``, ``viewfs://``, ``mock://`` ...). It pickles (Ray sends it to
every worker) and compares equal to any facade of the same configuration.

- Paths and directories: ``objects`` (pyarrow S3FileSystem's rules on object stores) and ``local``
  (LocalFileSystem's on local paths), over what they share in ``base``. Errors are pyarrow's:
  FileNotFoundError, NotADirectoryError, IsADirectoryError, FileExistsError, ArrowNotImplementedError,
  and fastckpt's storage and integrity errors, which are OSErrors.
- Streams: ``files`` and ``fastckpt.engine.stream``. An object is written whole on ``close()``, which
  raises if any part failed; ``abort()`` or an exception leaving a ``with`` block discards it.
- Integrity: every object written records its digest, except streamed multipart uploads on S3, whose
  metadata is fixed before the first part is sent (objects smaller than one part, and every file
  ``copy_files`` uploads, do record one). A read of a whole object checks it.
- ``pyarrow.fs.copy_files`` is replaced by ``copy.copy_files`` once a facade exists, because Arrow's
  own drops the errors of ``close()`` (see ``copy``); local <-> facade copies then run on the engine.
"""

from __future__ import annotations

import os

import pyarrow as pa
import pyarrow.fs as pafs

from ..config import TransferConfig
from ..deprecation import keywords_only
from ..uri import with_options
from .base import FastckptHandler, StoreWrapper, location
from .copy import copy_files, install_copy_files_guard, pyarrow_copy_files
from .files import InputFile, OutputStream
from .local import LocalHandler
from .objects import ObjectStoreHandler


class FacadeFileSystem(pafs.PyFileSystem):
    """The facade's ``PyFileSystem``: output and append streams are fastckpt's own ``OutputStream``
    (pyarrow would wrap it in a plain NativeFile), so that leaving a ``with`` block by an exception,
    or calling ``abort()``, discards the object instead of writing what was written so far."""

    def open_output_stream(self, path: str | os.PathLike[str], compression: str | None = "detect",
                           buffer_size: int | None = None, metadata: dict[str, str] | None = None) -> pa.NativeFile:
        meta = pa.KeyValueMetadata(metadata) if metadata is not None else None
        stream = self.handler.open_output_stream(os.fspath(path), meta)
        return self._wrap_output_stream(stream, path=path, compression=compression, buffer_size=buffer_size)

    def open_append_stream(self, path: str | os.PathLike[str], compression: str | None = "detect",
                           buffer_size: int | None = None, metadata: dict[str, str] | None = None) -> pa.NativeFile:
        meta = pa.KeyValueMetadata(metadata) if metadata is not None else None
        stream = self.handler.open_append_stream(os.fspath(path), meta)
        return self._wrap_output_stream(stream, path=path, compression=compression, buffer_size=buffer_size)

    def __reduce__(self) -> tuple[type, tuple[FastckptHandler]]:
        return FacadeFileSystem, (self.handler,)

    def close(self) -> None:
        """Close the clients this facade opened (a later call opens them again); a facade that is garbage-collected
        closes them too."""
        self.handler.close()

    def __enter__(self) -> FacadeFileSystem:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@keywords_only(1, "config")
def filesystem(uri: str, *, config: TransferConfig | None = None,
               store_wrapper: StoreWrapper | None = None, **options: object) -> pafs.FileSystem:
    """A pyarrow filesystem for ``uri``'s backend (its bucket and key do not restrict paths). ``options``: store
    options, as the URI's query takes them (``server_side_encryption="aws:kms"``, ``region=...``)."""
    uri = with_options(uri, options)
    if location(uri).backend == "delegate":
        return pafs.FileSystem.from_uri(uri)[0]
    return FacadeFileSystem(handler(uri, config=config, store_wrapper=store_wrapper))


@keywords_only(1, "config")
def handler(uri: str, *, config: TransferConfig | None = None,
            store_wrapper: StoreWrapper | None = None) -> FastckptHandler:
    """The facade handler for ``uri``'s backend: ``LocalHandler`` for local paths, else ``ObjectStoreHandler``."""
    cls = LocalHandler if location(uri).backend == "local" else ObjectStoreHandler
    return cls(uri, config, store_wrapper)


@keywords_only(1, "config")
def from_uri(uri: str, *, config: TransferConfig | None = None,
             store_wrapper: StoreWrapper | None = None) -> tuple[pafs.FileSystem, str]:
    """Like ``pyarrow.fs.FileSystem.from_uri``: the filesystem and the path ``uri`` names on it."""
    loc = location(uri)
    if loc.backend == "delegate":
        return pafs.FileSystem.from_uri(uri)
    path = "/" + loc.key if loc.backend == "local" else "/".join(p for p in (loc.bucket, loc.key) if p)
    return filesystem(uri, config=config, store_wrapper=store_wrapper), path


__all__ = [
    "FacadeFileSystem",
    "FastckptHandler",
    "InputFile",
    "LocalHandler",
    "ObjectStoreHandler",
    "OutputStream",
    "copy_files",
    "filesystem",
    "from_uri",
    "handler",
    "install_copy_files_guard",
    "pyarrow_copy_files",
]
