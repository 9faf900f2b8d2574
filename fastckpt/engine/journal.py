"""Journals that let a killed transfer resume (like ``gcloud storage``'s tracker files).

A journal is a small JSON-lines file: a header naming the transfer (what must not have changed for a
resume to be safe), then one line per part once it is stored, with the part's XXH3 digest. A resumed
transfer trusts a journaled part only after checking it again: an upload re-hashes the local part and
asks the store whether it still holds that part; a download re-hashes the bytes in its partial file.

Upload journals live in ``TransferConfig.journal_dir``, one per (destination URI, source path); a download's
journal lies beside its partial file, both hidden (``.<name>.*.fastckpt-part``) and removed once the file is in place.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping

from ..fileio import write_whole
from ..stores.local import TMP_SUFFIX

__all__ = ["Journal", "resumable_paths"]


def resumable_paths(path: str) -> tuple[str, str]:
    """(partial file, journal) of a resumable download to ``path``: hidden, beside it, named the same on every run."""
    head, tail = os.path.split(os.path.abspath(path))
    return os.path.join(head, f".{tail}.dl{TMP_SUFFIX}"), os.path.join(head, f".{tail}.journal{TMP_SUFFIX}")


class Journal:
    """One transfer's journal at ``path``: ``header`` identifies the transfer, ``parts`` maps a part index
    to what was recorded when it was stored (``{"token": ..., "digest": ...}``)."""

    def __init__(self, path: str, header: Mapping[str, object]) -> None:
        self.path, self.header = path, dict(header)
        self.parts: dict[int, dict[str, str]] = {}
        self.resumed = False
        """Whether an earlier journal of the same transfer was found (its parts are in ``parts``)."""
        self._fd: int | None = None

    @classmethod
    def for_upload(cls, directory: str, uri: str, path: str, header: Mapping[str, object]) -> Journal:
        """The journal of uploading local ``path`` to ``uri``."""
        name = hashlib.sha256(f"{uri}\0{os.path.abspath(path)}".encode()).hexdigest()[:32]
        return cls(os.path.join(directory, f"{name}.json"), {"uri": uri, "path": os.path.abspath(path), **header})

    def load(self) -> dict[str, object] | None:
        """The header of the journal already at ``path`` (its parts go to ``parts`` when it is this transfer's),
        or None when there is none or it is unreadable."""
        try:
            with open(self.path, encoding="utf-8") as f:
                lines = f.read().splitlines()
            found = json.loads(lines[0])
            parts = {}
            for line in lines[1:]:
                try:
                    entry = json.loads(line)
                except ValueError:  # the last line of a killed writer may be cut short
                    break
                parts[int(entry.pop("part"))] = entry
        except (OSError, ValueError, IndexError, KeyError, TypeError):
            return None
        if not isinstance(found, dict):
            return None
        if all(found.get(k) == v for k, v in self.header.items()):
            self.header, self.parts, self.resumed = found, parts, True
        return found

    def start(self, **fields: object) -> None:
        """Begin a fresh journal (header + ``fields``), replacing any older one."""
        self.header.update(fields)
        self.parts, self.resumed = {}, False
        write_whole(self.path, (json.dumps(self.header, sort_keys=True) + "\n").encode())

    def record(self, index: int, **entry: str) -> None:
        """Note that part ``index`` is stored (one appended line)."""
        if self._fd is None:
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)
        os.write(self._fd, (json.dumps({"part": index, **entry}, sort_keys=True) + "\n").encode())
        self.parts[index] = dict(entry)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def remove(self) -> None:
        """The transfer is done (or abandoned): forget it."""
        self.close()
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
