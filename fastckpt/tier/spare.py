"""Files of a tier recycled save after save: a dropped copy's data files become spare files, and the next save
writes into one of them, so its pages are already allocated (and, in the process that wrote them before, mapped).

Filling fresh tmpfs pages costs about 4.7x a copy into memory already mapped (measured here: 0.36 s against 0.074 s
per GiB); a spare file mapped anew costs 2x (0.15 s). Spare files live in ``.agent/spare/``, named after the file
they held (``{name}.{token}``) so that a rank gets back its own file; they are kept up to the size of the newest copy
and removed when a save needs their room (``Tier.check_room``).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil

__all__ = ["TMP_SUFFIX", "claim", "fits", "prepare", "retire", "spare_dir", "spare_files"]

TMP_SUFFIX = ".fastckpt-part"
"""The local store's suffix of partial files (so ``gc`` and listings treat a staged file as one)."""


def spare_dir(root: str) -> str:
    """The spare files of tier ``root``."""
    return os.path.join(root, ".agent", "spare")


def spare_files(root: str) -> list[tuple[str, int]]:
    """(path, size) of every spare file."""
    out = []
    with contextlib.suppress(FileNotFoundError):
        for name in os.listdir(spare_dir(root)):
            with contextlib.suppress(FileNotFoundError):
                out.append((os.path.join(spare_dir(root), name), os.stat(os.path.join(spare_dir(root), name)).st_size))
    return out


def retire(root: str, copy: str, cap: int) -> None:
    """Drop copy directory ``copy``: its data files become spare files while the spare files total at most ``cap``
    bytes; everything else goes."""
    os.makedirs(spare_dir(root), exist_ok=True)
    held = sum(size for _, size in spare_files(root))
    for top, _, names in os.walk(copy):
        for name in names:
            path = os.path.join(top, name)
            with contextlib.suppress(FileNotFoundError):
                size = os.lstat(path).st_size
                if name.endswith(TMP_SUFFIX) or held + size > cap or os.path.relpath(path, copy).startswith("."):
                    continue
                os.rename(path, os.path.join(spare_dir(root), f"{name}.{secrets.token_hex(6)}"))
                held += size
    shutil.rmtree(copy, ignore_errors=True)


def fits(root: str, sizes: list[int]) -> bool:
    """Whether spare files can take files of every one of ``sizes`` (``claim`` then recycles them all)."""
    spare = sorted(size for _, size in spare_files(root))
    for size in sorted(sizes, reverse=True):
        fit = next((i for i, s in enumerate(spare) if s >= size), None)
        if fit is None:
            return False
        spare.pop(fit)
    return True


def prepare(root: str, name: str, size: int) -> str | None:
    """A new spare file of ``size`` bytes named after file ``name`` (for the next save of it), unless a spare file
    already held such a file and is large enough; its path (None: none made)."""
    if any(os.path.basename(p).startswith(name + ".") and s >= size for p, s in spare_files(root)):
        return None
    os.makedirs(spare_dir(root), exist_ok=True)
    path = os.path.join(spare_dir(root), f"{name}.{secrets.token_hex(6)}")
    with open(path, "wb") as f:
        f.truncate(size)
    return path


def claim(root: str, final: str, size: int) -> str:
    """A partial file beside ``final`` of ``size`` bytes to fill: a spare file when one is large enough (one that
    held a file of the same name first, then the smallest), else a new one. Returns its path."""
    head, tail = os.path.split(final)
    os.makedirs(head, exist_ok=True)
    tmp = os.path.join(head, f".{tail}.{secrets.token_hex(6)}{TMP_SUFFIX}")
    fits = [(not os.path.basename(p).startswith(tail + "."), s, p) for p, s in spare_files(root) if s >= size]
    for _, _, path in sorted(fits):
        try:
            os.rename(path, tmp)
        except FileNotFoundError:  # taken meanwhile by another rank of this node
            continue
        os.truncate(tmp, size)
        return tmp
    with open(tmp, "wb") as f:
        f.truncate(size)
    return tmp
