"""Amazon S3 and S3-compatible stores (MinIO, Ceph, B2, R2, moto ...).

``options`` holds what configures a store, from the URI (``?endpoint_override=``, ``region``, ``scheme``,
``profile``, ``anonymous``, ``addressing_style``, as in Arrow's ``S3FileSystem``) and the environment (the AWS
variables botocore reads, and the ``FASTCKPT_S3_*`` knobs in the README); credentials come from botocore's chain,
and a custom endpoint is path-style. ``client`` sends: ranged GETs, HEADs, puts, part uploads, ListObjectsV2 and
the multipart upload's create, complete and abort go through the shared HTTP data path, signed with SigV4
(``sigv4``) for the bucket's region, bodies sent from the caller's buffer and received into the caller's receiver,
with no SDK checksum (fastckpt's XXH3 digests check every byte end to end); the rest (deletes, ListParts, listing
uploads, metadata a header cannot carry) through aiobotocore. ``errors`` translates every failure; ``upload`` is
the multipart upload; ``records`` keeps the digest beside each object; ``store`` is the store protocol.
Create-if-absent sends ``If-None-Match: *``; ``stores.conditional`` makes it safe on servers that ignore it.
"""

from __future__ import annotations

from ...config import TransferConfig
from ...uri import StorageURI
from .errors import LAZY_IMPORTS
from .options import S3Options, resolve_endpoint
from .records import RECORD_DIR, RECORD_ETAG, RECORD_MARK, record_of
from .store import POOL_HEADROOM, S3Store
from .upload import S3Upload

__all__ = ["LAZY_IMPORTS", "RECORD_DIR", "RECORD_ETAG", "RECORD_MARK", "S3Options", "S3Store", "S3Upload",
           "from_uri", "record_of", "resolve_endpoint"]


def from_uri(uri: StorageURI, config: TransferConfig) -> S3Store:
    """S3 store for ``uri``'s bucket, configured from its options and the AWS environment variables."""
    return S3Store(uri.bucket, S3Options.from_uri(uri), max_pool_connections=config.max_in_flight + POOL_HEADROOM)
