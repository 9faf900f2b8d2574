"""What ``sync`` learnt of the files it compared or sent, so that the next sync need not ask again.

For one prefix of one store, each relative name maps to the object's version (ETag) when a HEAD found it holding the
bytes of recorded digest ``digest``, and the version of the local file (device, inode, size, mtime) that held the same
bytes. A later sync whose listing shows that ETag and whose local file has that version skips the file with no request
and no read; one whose local file changed hashes it against ``digest``; any other goes back to a HEAD. An entry's
ETag comes from a HEAD's answer (whose ETag and digest describe one version of the object), or is the MD5 of the local
bytes just sent (what S3 names a whole object of those bytes: only an object holding them shows it). Kept as JSON in
the state directory (``TransferConfig.state_dir``); a lost or unreadable cache only costs the HEADs.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
from dataclasses import asdict, dataclass

__all__ = ["Known", "LocalVersion", "SyncCache", "local_version"]

LocalVersion = tuple[int, int, int, int]


def local_version(path: str) -> LocalVersion:
    """(device, inode, size, mtime in ns) of ``path``: any write or replacement changes it."""
    st = os.stat(path)
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


@dataclass(frozen=True)
class Known:
    """One file and object found to hold the same bytes."""

    etag: str
    digest: str
    chunk_size: int
    local: LocalVersion


class SyncCache:
    """The entries of one ``(store location, prefix)`` below ``state_dir``."""

    def __init__(self, state_dir: str, location: object, prefix: str) -> None:
        name = hashlib.sha256(repr((location, prefix)).encode()).hexdigest()[:32]
        self.path = os.path.join(state_dir, "sync", f"{name}.json")

    def load(self) -> dict[str, Known]:
        """The entries, or none when there is no readable cache."""
        try:
            with open(self.path) as f:
                doc = json.load(f)
            return {rel: Known(e["etag"], e["digest"], int(e["chunk_size"]), tuple(e["local"]))  # type: ignore[arg-type]
                    for rel, e in doc.items()}
        except (OSError, ValueError, KeyError, TypeError):
            return {}

    def save(self, entries: dict[str, Known]) -> None:
        """Replace the entries (atomically: a reader sees the old or the new ones)."""
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(self.path), prefix=".tmp-")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump({rel: asdict(k) for rel, k in entries.items()}, f)
            os.replace(tmp, self.path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
