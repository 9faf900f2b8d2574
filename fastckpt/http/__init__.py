"""The HTTP data path shared by the cloud backends: ranged GETs into pooled buffers or files, part PUTs from
pooled buffers or files (the body and receiver types are ``fastckpt.transport``'s)."""

from .client import HttpClient
from .connection import Response

__all__ = ["HttpClient", "Response"]
