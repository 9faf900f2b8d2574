"""Progress reporting: a callback receives (bytes done, bytes total)."""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["Progress", "ProgressCallback"]

ProgressCallback = Callable[[int, int], None]


class Progress:
    """Counts bytes moved and forwards the totals to an optional callback."""

    def __init__(self, callback: ProgressCallback | None = None) -> None:
        self.callback = callback
        self.done = 0
        self.total = 0

    def expect(self, nbytes: int) -> None:
        """Add ``nbytes`` to the total still to move."""
        self.total += nbytes
        if self.callback:
            self.callback(self.done, self.total)

    def advance(self, nbytes: int) -> None:
        """Record ``nbytes`` moved."""
        self.done += nbytes
        if self.callback:
            self.callback(self.done, self.total)
