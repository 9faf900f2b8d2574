"""``copy_files`` that never loses an upload error, installed over ``pyarrow.fs.copy_files``.

Arrow's C++ ``CopyFiles`` (pyarrow 26, ``arrow/filesystem/filesystem.cc``) closes each destination
stream with ``CloseAsync()`` and then only ``Wait()``s on those futures: a failure to complete an
upload is dropped and ``copy_files`` returns normally. Since a streamed object is completed in
``close()``, no output stream can make such a failure reach the caller. So when a facade filesystem is
the source or the destination, ``copy_files`` is done here instead, and every error is raised:

- local files -> facade: the engine's ``Transfer.upload_files`` (files and parts in parallel, digests);
- facade -> local files: ``Transfer.download_files`` (parallel ranged reads, verified, atomic renames);
- anything else involving a facade: stream copies (``use_threads``: several files at once), each
  output closed (raising) or aborted on error.

Other copies go to pyarrow's own function unchanged. Facade handlers install the guard when they are
created (also on unpickling in Ray workers); ``FASTCKPT_PATCH_COPY_FILES=0`` turns it off.
"""

from __future__ import annotations

import posixpath
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pyarrow.fs as pafs

from ..config import env_flag
from .base import FastckptHandler
from .files import OutputStream

__all__ = ["MAX_THREADS", "copy_files", "handler_of", "install_copy_files_guard", "plan_copy", "pyarrow_copy_files",
           "unimplied"]

_ORIGINAL: Any = None
MAX_THREADS = 8


def handler_of(fs: object) -> Any:
    """The FastckptHandler behind ``fs``, or None."""
    if isinstance(fs, pafs.PyFileSystem) and isinstance(fs.handler, FastckptHandler):
        return fs.handler
    return None


def install_copy_files_guard() -> None:
    """Make ``pyarrow.fs.copy_files`` this module's ``copy_files`` (idempotent)."""
    global _ORIGINAL
    if not env_flag("FASTCKPT_PATCH_COPY_FILES", True):
        return
    if getattr(pafs.copy_files, "fastckpt_guard", False):
        return
    _ORIGINAL = pafs.copy_files
    pafs.copy_files = copy_files


def pyarrow_copy_files() -> Any:
    """pyarrow's own ``copy_files`` (the one the guard replaced)."""
    return _ORIGINAL if _ORIGINAL is not None else pafs.copy_files


def copy_files(source: str, destination: str, source_filesystem: pafs.FileSystem | None = None,
               destination_filesystem: pafs.FileSystem | None = None, *, chunk_size: int = 1024 * 1024,
               use_threads: bool = True) -> None:
    """``pyarrow.fs.copy_files`` (same arguments and layout), raising every error when a fastckpt
    facade is involved."""
    src_h, dst_h = handler_of(source_filesystem), handler_of(destination_filesystem)
    if src_h is None and dst_h is None:  # a URI never resolves to a facade: nothing of ours involved
        pyarrow_copy_files()(source, destination, source_filesystem, destination_filesystem,
                             chunk_size=chunk_size, use_threads=use_threads)
        return
    src_fs, src_path = pafs._resolve_filesystem_and_path(source, source_filesystem)
    dst_fs, dst_path = pafs._resolve_filesystem_and_path(destination, destination_filesystem)
    pairs, dirs, sizes = plan_copy(src_fs, src_path, dst_path)
    upload = dst_h is not None and isinstance(src_fs, pafs.LocalFileSystem)
    download = src_h is not None and isinstance(dst_fs, pafs.LocalFileSystem)
    if upload or download or (dst_h is not None and not dst_h.local):
        dirs = unimplied(dirs, [dst for _, dst in pairs])  # engine transfers and object keys imply the rest
    else:
        dirs = unimplied(dirs + [posixpath.dirname(dst) for _, dst in pairs], [])
    for path in dirs:
        dst_fs.create_dir(path, recursive=True)
    if upload:
        dst_h.upload_files(pairs)
    elif download:
        src_h.download_files(pairs, sizes)
    else:
        _copy_streams(src_fs, dst_fs, pairs, chunk_size, use_threads)


copy_files.fastckpt_guard = True  # type: ignore[attr-defined]


def plan_copy(src_fs: pafs.FileSystem, src_path: str, dst_path: str
              ) -> tuple[list[tuple[str, str]], list[str], dict[str, int]]:
    """(source file, destination file) pairs and the destination directories of a copy, and the source files' sizes
    as the listing gave them."""
    info = src_fs.get_file_info(src_path)
    if info.type != pafs.FileType.Directory:
        return [(src_path, dst_path)], [], {src_path: info.size} if info.size is not None else {}
    base = src_path.rstrip("/")
    dst = dst_path.rstrip("/")
    pairs, dirs, sizes = [], [], {}
    for info in src_fs.get_file_info(pafs.FileSelector(base, recursive=True)):
        target = posixpath.join(dst, info.path[len(base) + 1:])
        if info.type == pafs.FileType.File:
            pairs.append((info.path, target))
            sizes[info.path] = info.size
        elif info.type == pafs.FileType.Directory:
            dirs.append(target)
    return pairs, dirs, sizes


def unimplied(dirs: list[str], files: list[str]) -> list[str]:
    """The directories of ``dirs`` that are neither an ancestor of another one nor of a file in ``files``
    (creating those, recursively, creates them all)."""
    implied: set[str] = set()
    for path in [posixpath.dirname(p) for p in files] + [posixpath.dirname(d) for d in dirs]:
        while path not in ("", "/") and path not in implied:
            implied.add(path)
            path = posixpath.dirname(path)
    return sorted({d for d in dirs if d not in implied})


def _copy_streams(src_fs: pafs.FileSystem, dst_fs: pafs.FileSystem, pairs: list[tuple[str, str]],
                  chunk_size: int, use_threads: bool) -> None:
    def one(pair: tuple[str, str]) -> None:
        src, dst = pair
        with src_fs.open_input_stream(src) as fin:
            out = dst_fs.open_output_stream(dst)
            try:
                while chunk := fin.read(chunk_size):
                    out.write(chunk)
            except BaseException:
                if isinstance(out, OutputStream):
                    out.abort()
                raise
            out.close()

    if use_threads and len(pairs) > 1:
        with ThreadPoolExecutor(max_workers=min(MAX_THREADS, len(pairs)), thread_name_prefix="fastckpt-copy") as pool:
            for _ in pool.map(one, pairs):
                pass
    else:
        for pair in pairs:
            one(pair)
