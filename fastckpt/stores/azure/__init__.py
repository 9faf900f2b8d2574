"""Azure Blob Storage on ``azure-storage-blob``'s asyncio client and the shared HTTP data path.

``options``: account, endpoint and credentials. ``client``: the SDK client, the data path's signed requests and the
metadata names. ``errors``: one translation of every failure. ``upload``: staged blocks, committed at once.
``store``: the store protocol.
"""

from __future__ import annotations

from ...config import TransferConfig
from ...uri import StorageURI
from .client import decode_metadata_key, encode_metadata_key, shared_key_signer
from .options import EMULATOR_ACCOUNT, EMULATOR_KEY, AzureOptions, resolve_endpoint
from .store import AzureStore
from .upload import AzureUpload

__all__ = ["EMULATOR_ACCOUNT", "EMULATOR_KEY", "AzureOptions", "AzureStore", "AzureUpload", "decode_metadata_key",
           "encode_metadata_key", "from_uri", "resolve_endpoint", "shared_key_signer"]


def from_uri(uri: StorageURI, config: TransferConfig) -> AzureStore:
    """Store for ``uri``'s container, configured by ``AzureOptions``."""
    return AzureStore(uri.bucket, AzureOptions.from_uri(uri), max_connections=config.max_in_flight + 8)
