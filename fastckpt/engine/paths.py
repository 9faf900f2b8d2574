"""Local directory trees: the files an upload reads, the paths a download writes (names from storage checked)."""

from __future__ import annotations

import os
from collections.abc import Iterable

__all__ = ["local_files", "paths_below", "prune_empty"]


def local_files(src: str) -> list[tuple[str, str]]:
    """(path, relative '/'-path) of every file below directory ``src``, sorted.

    A symlink is uploaded as the file it points to when that file lies inside ``src``; a symlink that
    points outside the tree, to a directory or nowhere is refused (ValueError naming it): a tree's upload
    never reads outside the tree.
    """
    root = os.path.realpath(src)
    out = []
    for dirpath, dirnames, filenames in os.walk(src):
        dirnames.sort()
        for name in sorted(filenames) + [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]:
            path = os.path.join(dirpath, name)
            if os.path.islink(path):
                target = os.path.realpath(path)
                if not os.path.isfile(target) or os.path.commonpath([root, target]) != root:
                    raise ValueError(f"refusing to upload symlink {path} -> {os.readlink(path)}: it points outside "
                                     f"{src}, to a directory or nowhere")
            out.append((path, os.path.relpath(path, src).replace(os.sep, "/")))
    return out


def paths_below(root: str, rels: list[str]) -> list[str]:
    """The local paths of the '/'-separated names ``rels`` below directory ``root`` (download targets).

    The names come from storage, so they are untrusted: ValueError when one has an empty, '.' or '..'
    part or a NUL, or would land outside ``root`` through a symlinked directory already there.
    """
    real_root = os.path.realpath(root)
    inside: dict[str, bool] = {}  # parent directory -> whether it resolves below root (one check per directory)
    out = []
    for rel in rels:
        parts = rel.split("/")
        if any(p in ("", ".", "..") or "\0" in p for p in parts):
            raise ValueError(f"refusing unsafe object name {rel!r} (below {root})")
        path = os.path.join(root, *parts)
        parent = os.path.dirname(path)
        if parent not in inside:
            inside[parent] = os.path.commonpath([real_root, os.path.realpath(parent)]) == real_root
        if not inside[parent]:
            raise ValueError(f"refusing to write {rel!r}: {parent} leads outside {root} (a symlink)")
        out.append(path)
    return out


def prune_empty(folders: Iterable[str], top: str, *, keep_top: bool) -> None:
    """Remove each of ``folders`` that is empty, then its parents while they are, up to ``top`` (``top`` itself too
    unless ``keep_top``); nothing outside ``top``."""
    top = top.rstrip(os.sep) or os.sep
    for folder in sorted(set(folders), key=len, reverse=True):
        while folder.startswith(top + os.sep) or (folder == top and not keep_top):
            try:
                os.rmdir(folder)
            except OSError:
                break
            folder = os.path.dirname(folder)
