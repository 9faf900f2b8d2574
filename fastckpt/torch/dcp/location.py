"""What the DCP writer and reader share: the checkpoint they work on (``_Location``: its URI, config and store), how
a stored item is found (``StoredItem``), and running on fastckpt's loop."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.futures import Future

from ..._loop import BackgroundLoop
from ...config import TransferConfig
from ...engine.open_stores import store_for
from ...stores.base import Store
from ...stores.controls import OPTIONS as CONTROLS
from ...uri import StorageURI, option_text, parse_uri, with_options

__all__ = ["METADATA", "StoredItem", "storage_query"]

METADATA = ".metadata"


@dataclass(frozen=True)
class StoredItem:
    """Where one DCP item lies: ``name`` (file in the checkpoint), byte ``offset`` and ``length``; for tensors
    their dtype and shape.

    Its bytes are raw (a tensor's, or a byte item's) unless ``encoded``: then they are what DCP's ``FileSystemWriter``
    stores (``torch.save`` of a tensor), passed through the extensions ``descriptors`` name (``format``). Between
    a rank's ``write_data`` and the coordinator's ``finish`` it describes a stored item: ``offset``/``length`` its
    stored bytes, ``raw`` where a tensor's raw bytes lie among them, ``manifest`` the rank's manifest (on its first
    item). (Checkpoints of fastckpt before DCP's open format pickled it into ``.metadata``.)"""

    name: str
    offset: int
    length: int
    dtype: torch.dtype | None = None
    shape: tuple[int, ...] | None = None
    manifest: bytes | None = None
    descriptors: tuple[str, ...] | None = None
    encoded: bool = False
    raw: tuple[int, int] | None = None


StoredItem.__module__ = "fastckpt.torch.dcp"  # the name DCP's ``.metadata`` pickles it under (re-exported there)


def _run(coro: Any) -> Any:
    return asyncio.run_coroutine_threadsafe(coro, BackgroundLoop.get().loop).result()


def _done(value: Any) -> Future:
    fut: Future = Future()
    fut.set_result(value)
    return fut


_FSSPEC_OPTIONS = {"endpoint_url": "endpoint_override", "anon": "anonymous", "profile": "profile",
                   "project": "project", "account_name": "account",
                   **{n: n for names in CONTROLS.values() for n in names}}
"""fsspec storage options (s3fs, gcsfs, adlfs: what ``FsspecWriter(path, **storage_options)`` takes) and the URI
option each is."""
_S3FS_EXTRA = {"ServerSideEncryption": "server_side_encryption", "SSEKMSKeyId": "sse_kms_key_id",
               "SSEKMSEncryptionContext": "sse_kms_encryption_context", "BucketKeyEnabled": "bucket_key_enabled",
               "StorageClass": "storage_class", "Tagging": "tagging", "ExpectedBucketOwner": "expected_bucket_owner",
               "RequestPayer": "request_payer"}
"""s3fs's ``s3_additional_kwargs`` (botocore's names) and the URI option each is."""


def storage_query(options: dict[str, Any]) -> dict[str, str]:
    """URI options for fsspec ``storage_options``; ValueError naming those fastckpt does not take."""
    flat = {**options}
    client = flat.pop("client_kwargs", None) or {}
    for key, name in (("endpoint_url", "endpoint_url"), ("region_name", "region")):
        if key in client:
            flat[name] = client.pop(key)
    extra = dict(flat.pop("s3_additional_kwargs", None) or {})  # s3fs: botocore's parameter names
    flat |= {_S3FS_EXTRA[k]: extra.pop(k) for k in list(extra) if k in _S3FS_EXTRA}
    if flat.pop("requester_pays", False):
        flat["request_payer"] = "requester"
    client |= {f"s3_additional_kwargs.{k}": v for k, v in extra.items()}
    unknown = sorted(k for k in flat if k not in _FSSPEC_OPTIONS and k != "region") + sorted(client)
    if unknown:
        raise ValueError(f"storage options {unknown} are not taken by fastckpt: credentials come from the environment "
                         "(AWS_*, GOOGLE_*, AZURE_STORAGE_*) or the URI's options, as for every fastckpt URI")
    query = {_FSSPEC_OPTIONS.get(k, k): v for k, v in flat.items()}
    return {k: option_text(v) for k, v in query.items()}


class _Location:
    """The checkpoint a DCP writer or reader works on: its URI (with the fsspec storage options given, as URI
    options), its config, and fastckpt's kept store for it."""

    uri: str | None
    config: TransferConfig | None
    storage_options: dict[str, str]

    def _target(self) -> StorageURI:
        if self.uri is None:
            raise ValueError(f"fastckpt.torch.dcp.{type(self).__name__} needs a checkpoint URI "
                             "(path, uri= or checkpoint_id=)")
        return parse_uri(with_options(self.uri, self.storage_options))

    def _where(self) -> tuple[StorageURI, TransferConfig]:
        """The checkpoint's URI and the config (the given one, else the environment's)."""
        return self._target(), self.config or TransferConfig.from_env()

    @contextlib.asynccontextmanager
    async def _store(self) -> AsyncIterator[tuple[StorageURI, TransferConfig, Store]]:
        """(the checkpoint's URI, the config, the open store of its location)."""
        target, cfg = self._where()
        async with store_for(target, cfg) as store:
            yield target, cfg, store

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        """Whether ``checkpoint_id`` is a URI of a fastckpt backend."""
        try:
            return parse_uri(os.fspath(checkpoint_id)).backend != "delegate"
        except ValueError:
            return False


