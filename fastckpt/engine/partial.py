"""Partial files of downloads: the hidden file a download writes before it is renamed into place, locked so that
two downloads to one path never share it, and the journal that lets a rerun of a killed download continue it."""

from __future__ import annotations

import fcntl
import os
from collections.abc import Mapping

from ..stores.local import partial_path
from .journal import Journal, resumable_paths

__all__ = ["close_partial", "open_partial"]


def open_partial(path: str, dirs: set[str], header: Mapping[str, object] | None) -> tuple[str, int, Journal | None]:
    """On an I/O thread: the hidden partial file a download to ``path`` writes (open, locked; its directory made
    once, remembered in ``dirs``) and, with ``header`` (a resumable download), its journal: the one a killed run with
    the same header left, else a new one.

    The partial file's name is fixed, so a rerun finds it (a concurrent download to the same path, holding its
    lock, makes this one use a name of its own, without a journal)."""
    if os.path.isdir(path):
        raise IsADirectoryError(f"destination {path} is a directory")
    parent = os.path.dirname(os.path.abspath(path))
    if parent not in dirs:  # many files share a directory: made (or found) once
        os.makedirs(parent, exist_ok=True)
        dirs.add(parent)
    tmp, journal_path = resumable_paths(path)
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        tmp = partial_path(os.path.abspath(path))
        return tmp, os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644), None
    except OSError:  # a filesystem without locks (some NFS mounts): go on unlocked
        pass
    journal = None
    if header is not None:
        journal = Journal(journal_path, header)
        journal.load()
        if not journal.resumed:
            journal.start()
    if (journal is None or not journal.resumed) and os.fstat(fd).st_size:
        os.ftruncate(fd, 0)  # only a stale file: ext4 flushes a file cut to 0 bytes when it is closed
    return tmp, fd, journal


def close_partial(opened: tuple[str, int, Journal | None]) -> None:
    """Close what ``open_partial`` opened for a download cancelled meanwhile (the file stays, as an
    interrupted download's does)."""
    _, fd, journal = opened
    os.close(fd)
    if journal is not None:
        journal.close()
