"""A third-party backend as a plug-in would ship it: files below ``$FASTCKPT_DEMO_ROOT/<bucket>``,
registered for the ``demo://`` scheme through the ``fastckpt.stores`` entry-point group (see the
dist-info beside this file). Not imported by fastckpt itself: only found through the entry point."""

from __future__ import annotations

import os

from fastckpt import TransferConfig
from fastckpt.stores.local import LocalStore
from fastckpt.uri import StorageURI, check_options


class DemoStore(LocalStore):
    """One bucket: a directory below the demo root."""

    name = "demo"
    scheme = "demo"

    def __init__(self, bucket: str) -> None:
        super().__init__(os.path.join(os.environ["FASTCKPT_DEMO_ROOT"], bucket), fsync=False)
        self.bucket = bucket

    @property
    def location(self) -> tuple[object, ...]:
        return (self.name, self.bucket)

    def uri(self, key: str = "") -> str:
        return StorageURI("", self.scheme, self.name, self.bucket, key.strip("/")).uri()


def from_uri(uri: StorageURI, config: TransferConfig) -> DemoStore:
    check_options(uri, frozenset())
    return DemoStore(uri.bucket)
