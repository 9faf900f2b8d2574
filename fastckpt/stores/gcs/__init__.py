"""Google Cloud Storage (``gs://bucket/prefix``) on gcloud-aio-storage and the shared HTTP data path.

``options``: the endpoint (``?endpoint_override=`` in the URI, else ``STORAGE_EMULATOR_HOST``, else
https://storage.googleapis.com) and whether to send credentials (they come the usual way through gcloud-aio-auth,
and are skipped for ``STORAGE_EMULATOR_HOST``, plain-http endpoints and ``?anonymous=true``). ``client``: the
requests and their errors. ``upload``: parallel composite uploads. ``store``: the store protocol; ``list`` /
``list_dir`` never show the temporary parts, ``list_pending_uploads`` finds them. Create-if-absent uses
``ifGenerationMatch=0``, on uploads and on the final compose; some emulators (fake-gcs-server) ignore it on
compose, and ``FASTCKPT_GCS_IF_ABSENT`` decides what happens there (modes in ``stores.conditional``).
"""

from __future__ import annotations

from ...config import TransferConfig
from ...uri import StorageURI
from .options import GCSOptions
from .store import GCSStore
from .upload import COMPOSE_LIMIT, PARTS_DIR, GCSUpload, parts_prefix

__all__ = ["COMPOSE_LIMIT", "PARTS_DIR", "GCSOptions", "GCSStore", "GCSUpload", "from_uri", "parts_prefix"]


def from_uri(uri: StorageURI, config: TransferConfig) -> GCSStore:
    """Store for ``gs://bucket/...``, configured by ``GCSOptions``."""
    return GCSStore(uri.bucket, GCSOptions.from_uri(uri), max_connections=max(64, 2 * config.max_in_flight))
