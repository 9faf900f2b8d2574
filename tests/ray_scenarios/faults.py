"""A store wrapper that fails the N-th matching request once, counted across processes (Ray workers
are separate processes and are restarted after a failure), with token files created O_EXCL."""

from __future__ import annotations

import os

from fastckpt.errors import StoreError, TransientStoreError
from fastckpt.stores.base import Store
from harness.faults import FaultInjectingStore


class NthRequestFault(FaultInjectingStore):
    """Raise on the ``nth`` ``op`` request whose key contains ``match``; never again after that."""

    def __init__(self, inner: Store, *, tokens: str, op: str, match: str, nth: int = 1,
                 transient: bool = False) -> None:
        super().__init__(inner)
        self.tokens, self.op, self.match, self.nth, self.transient = tokens, op, match, nth, transient

    async def fault(self, op: str, key: str) -> None:
        if op == self.op and self.match in key and self._claim(key) == self.nth:
            kind = TransientStoreError if self.transient else StoreError
            raise kind(f"injected {'transient' if self.transient else 'permanent'} failure: {op} {key}")

    def _claim(self, key: str) -> int:
        """This request's number among the matching ones (all processes); the N-th is recorded."""
        os.makedirs(self.tokens, exist_ok=True)
        count = 1
        while True:
            try:
                os.close(os.open(os.path.join(self.tokens, str(count)), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
                break
            except FileExistsError:
                count += 1
        if count == self.nth:
            with open(os.path.join(self.tokens, "fired"), "w") as f:
                f.write(key)
        return count
