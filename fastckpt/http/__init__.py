"""The HTTP data path shared by the cloud backends: ranged GETs into pooled buffers or files, part PUTs from
pooled buffers or files."""

from .client import HttpClient
from .connection import FileRange, ProtocolError, Response, SendfileUnsupported, body_size

__all__ = ["FileRange", "HttpClient", "ProtocolError", "Response", "SendfileUnsupported", "body_size"]
