"""The HTTP data path shared by the cloud backends: ranged GETs into, and part PUTs from, pooled buffers."""

from .client import HttpClient
from .connection import ProtocolError, Response

__all__ = ["HttpClient", "ProtocolError", "Response"]
