"""``Transfer``: a session on one store that uploads and downloads (``engine.upload``, ``engine.download``)."""

from __future__ import annotations

from .download import Downloads
from .upload import Uploads

__all__ = ["Transfer"]


class Transfer(Uploads, Downloads):
    """A transfer session on one store: shared buffer pool, file limit, retries and progress."""
