"""DCP's open format, as ``FileSystemWriter`` stores it: each tensor item is ``torch.save`` of the tensor, each byte
item its bytes, both passed through the writer's stream extensions (``_extensions``: ZStandard, user transforms);
``.metadata`` is DCP's pickled ``Metadata`` whose ``storage_data`` maps every item to a ``_StorageInfo`` (file,
offset, length, the extensions' descriptors). So ``FileSystemReader``, ``FsspecReader`` and DCP's tools read what
fastckpt writes.

A tensor's ``torch.save`` bytes are produced without copying the tensor: the stream ``torch.save`` writes into keeps
its small records and refers to the tensor's own memory for the storage record (``tensor_blob``), so parts are still
sent straight from the tensor. Where the raw bytes lie inside each blob goes into fastckpt's index beside
``.metadata`` (``INDEX``), so that fastckpt's reader receives them straight into tensors; items without it (written
by the stock writer, or transformed) are decoded as DCP decodes them (``decode_tensor``).
"""

from __future__ import annotations

import io
import json
import math
import pathlib
import pickle
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint import metadata as dcp_meta
from torch.distributed.checkpoint.filesystem import _StorageInfo, _StorageReaderTransforms, _StorageWriterTransforms
from torch.distributed.checkpoint.planner import WriteItem, WriteItemType

from ...errors import CheckpointError
from ...integrity import FileDigest
from .location import StoredItem

__all__ = [
    "INDEX",
    "INDEX_FORMAT",
    "Buffer",
    "Encoded",
    "decode_bytes",
    "decode_index",
    "decode_tensor",
    "encode",
    "encode_index",
    "exact",
    "load_metadata",
    "stored_items",
]

INDEX = ".metadata.fastckpt"
"""fastckpt's index beside DCP's ``.metadata``: where each tensor's raw bytes lie inside its stored blob."""
INDEX_FORMAT = "fastckpt.dcp-index/1"
Buffer = bytes | bytearray | memoryview


@dataclass(frozen=True)
class Encoded:
    """One item as stored: its pieces (in order), where a tensor's raw bytes lie in them (start, length; None: not raw,
    e.g. compressed), and the extensions' descriptors (None: no extension)."""

    pieces: list[Buffer]
    raw: tuple[int, int] | None
    descriptors: list[str] | None

    @property
    def size(self) -> int:
        """Bytes stored."""
        return sum(len(memoryview(p).cast("B")) for p in self.pieces)


class _Capture(io.RawIOBase):
    """The stream ``torch.save`` writes one tensor into: small records copied, the tensor's storage referenced."""

    def __init__(self, tensor: torch.Tensor, view: memoryview) -> None:
        super().__init__()
        self._address, self._view = tensor.data_ptr(), view
        self.pieces: list[Buffer] = []
        self._small = bytearray()
        self.raw_start: int | None = None
        self._pos = 0

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        mv = memoryview(data).cast("B")
        if self.raw_start is None and len(mv) == len(self._view) and len(mv) and _address(mv) == self._address:
            self.pieces += [bytes(self._small), self._view]
            self._small = bytearray()
            self.raw_start = self._pos
        else:
            self._small += mv
        self._pos += len(mv)
        return len(mv)

    def tell(self) -> int:
        return self._pos

    def finish(self) -> list[Buffer]:
        """The pieces written."""
        return [p for p in [*self.pieces, bytes(self._small)] if len(p)]


def _address(mv: memoryview) -> int:
    with warnings.catch_warnings():  # a read-only buffer: only its address is looked at
        warnings.simplefilter("ignore")
        return torch.frombuffer(mv, dtype=torch.uint8).data_ptr()


def exact(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` on the CPU, contiguous, and alone in its storage (``torch.save`` writes a view's whole storage; DCP's
    writer clones such views too)."""
    tensor = tensor.detach().to("cpu").contiguous()
    if tensor.storage_offset() or tensor.untyped_storage().nbytes() != tensor.nbytes:
        tensor = tensor.clone()
    return tensor


def encode(item: WriteItem, data: torch.Tensor | io.BytesIO, transforms: _StorageWriterTransforms,
           view: memoryview | None = None) -> Encoded:
    """What ``FileSystemWriter`` stores for ``item`` (``data``: its tensor, made ``exact``, with ``view`` its bytes; or
    its ``BytesIO``)."""
    if not transforms.extensions:
        if item.type == WriteItemType.BYTE_IO:
            assert isinstance(data, io.BytesIO)
            return Encoded([data.getbuffer()], None, None)
        assert isinstance(data, torch.Tensor) and view is not None
        capture = _Capture(data, view)
        torch.save(data, capture)
        raw = None if capture.raw_start is None else (capture.raw_start, len(view))
        return Encoded(capture.finish(), raw, None)
    out = io.BytesIO()
    stream, descriptors = transforms.transform_save_stream(item, out)
    if item.type == WriteItemType.BYTE_IO:
        assert isinstance(data, io.BytesIO)
        stream.write(data.getbuffer())
    else:
        torch.save(data, stream)
    stream.close()
    return Encoded([out.getbuffer()], None, descriptors or None)


def decode_tensor(data: memoryview, descriptors: Sequence[str] | None, transforms: _StorageReaderTransforms,
                  req: Any, what: str) -> torch.Tensor:
    """A stored tensor item (``torch.save`` bytes, through ``descriptors``' extensions) as DCP's reader decodes it."""
    stream = transforms.transform_load_stream(req, descriptors or (), io.BytesIO(data))
    if not stream.seekable():
        stream = io.BytesIO(stream.read(-1))
    tensor = torch.load(stream, map_location="cpu", weights_only=True)
    if not isinstance(tensor, torch.Tensor):
        raise CheckpointError(f"{what}: item {req.storage_index} does not hold a tensor")
    return tensor


def decode_bytes(data: memoryview, descriptors: Sequence[str] | None, transforms: _StorageReaderTransforms,
                 req: Any) -> io.BytesIO:
    """A stored byte item, through ``descriptors``' extensions."""
    if not descriptors:
        return io.BytesIO(data)
    return io.BytesIO(transforms.transform_load_stream(req, descriptors, io.BytesIO(data)).read(-1))


def encode_index(raw: dict[str, list[tuple[int, int, int]]]) -> bytes:
    """The index: for each file (its path in ``.metadata``), (item offset, raw start, raw length) of its tensors."""
    return json.dumps({"format": INDEX_FORMAT, "files": raw}, sort_keys=True, separators=(",", ":")).encode()


def decode_index(data: bytes, what: str) -> dict[tuple[str, int], tuple[int, int]]:
    """(file, item offset) -> (raw start, raw length); CheckpointError naming ``what`` when malformed."""
    try:
        doc = json.loads(data)
        if doc.get("format") != INDEX_FORMAT:
            raise ValueError(f"format {doc.get('format')!r}")
        return {(str(path), int(o)): (int(s), int(n)) for path, items in doc["files"].items() for o, s, n in items}
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CheckpointError(f"{what}: not a fastckpt DCP index ({exc})") from None


_METADATA_CLASSES = [dcp_meta.Metadata, dcp_meta.TensorStorageMetadata, dcp_meta.BytesStorageMetadata,
                     dcp_meta.ChunkStorageMetadata, dcp_meta.TensorProperties, dcp_meta.MetadataIndex,
                     dcp_meta.StorageMeta, dcp_meta._MEM_FORMAT_ENCODING, _StorageInfo]
_ALLOWED: dict[tuple[str, str], Any] = {
    **{(c.__module__, c.__qualname__): c for c in _METADATA_CLASSES},
    **{("torch", name): getattr(torch, name) for name in dir(torch) if isinstance(getattr(torch, name), torch.dtype)},
    ("torch", "Size"): torch.Size,
    ("torch.serialization", "_get_layout"): torch.serialization._get_layout,
    ("pathlib", "PosixPath"): pathlib.PosixPath, ("pathlib", "PurePosixPath"): pathlib.PurePosixPath,
    ("pathlib", "WindowsPath"): pathlib.PurePosixPath, ("collections", "OrderedDict"): dict,
}
"""What DCP's ``.metadata`` may name: its metadata classes, dtypes, sizes, layouts, paths; nothing that runs code."""


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        found = _ALLOWED.get((module, name))
        if found is None:
            raise pickle.UnpicklingError(f"{module}.{name} is not a DCP metadata class; refusing to load it")
        return found


def load_metadata(raw: bytes, what: str) -> dcp_meta.Metadata:
    """DCP's ``Metadata`` from ``.metadata`` bytes (DCP's pickle; fastckpt's ``torch.save`` of earlier versions),
    loading DCP's metadata classes and nothing else; CheckpointError naming ``what`` otherwise."""
    try:
        if raw[:2] == b"PK":  # written by fastckpt before DCP's open format
            with torch.serialization.safe_globals([*_METADATA_CLASSES, StoredItem]):
                metadata = torch.load(io.BytesIO(raw), weights_only=True)
        else:
            metadata = _MetadataUnpickler(io.BytesIO(raw)).load()
    except Exception as exc:
        raise CheckpointError(f"{what}: not DCP metadata ({type(exc).__name__}: {exc})") from None
    if not isinstance(metadata, dcp_meta.Metadata) or not isinstance(metadata.storage_data, dict):
        raise CheckpointError(f"{what} does not hold DCP metadata")
    return metadata


def stored_items(metadata: dcp_meta.Metadata, index: dict[tuple[str, int], tuple[int, int]], root: str,
                 files: dict[str, FileDigest | None], what: str) -> dict[dcp_meta.MetadataIndex, StoredItem]:
    """Where each item of ``metadata`` lies among the checkpoint's ``files`` (whose folder is ``root``): a tensor
    that ``index`` locates is read raw, others are decoded as DCP decodes them. CheckpointError for an item outside
    the checkpoint's files or their sizes."""
    out: dict[dcp_meta.MetadataIndex, StoredItem] = {}
    for idx, info in metadata.storage_data.items():
        if isinstance(info, StoredItem):
            item = info
        elif isinstance(info, _StorageInfo):
            item = _item(idx, info, metadata.state_dict_metadata.get(idx.fqn), index, root)
        else:
            raise CheckpointError(f"{what}: item {idx} has storage data of type {type(info).__name__}")
        digest = files.get(item.name)
        if digest is None or item.offset < 0 or item.length < 0 or item.offset + item.length > digest.size:
            raise CheckpointError(f"{what}: item {idx} lies outside the checkpoint's files ({item.name}, bytes "
                                  f"{item.offset}-{item.offset + item.length})")
        out[idx] = item
    return out


def _item(idx: dcp_meta.MetadataIndex, info: _StorageInfo, md: Any,
          index: dict[tuple[str, int], tuple[int, int]], root: str) -> StoredItem:
    path = str(info.relative_path)
    name = path[len(root) + 1:] if root and path.startswith(root + "/") else path
    descriptors = tuple(info.transform_descriptors) if info.transform_descriptors else None
    raw = index.get((path, info.offset))
    if isinstance(md, dcp_meta.TensorStorageMetadata) and raw is not None and descriptors is None:
        sizes = next((tuple(c.sizes) for c in md.chunks if tuple(c.offsets) == tuple(idx.offset or ())), None)
        start, length = raw
        dtype = md.properties.dtype
        if sizes is not None and info.offset <= start and start + length <= info.offset + info.length \
                and length == math.prod(sizes) * dtype.itemsize:
            return StoredItem(name, start, length, dtype, sizes)
    encoded = isinstance(md, dcp_meta.TensorStorageMetadata) or descriptors is not None
    return StoredItem(name, info.offset, info.length, descriptors=descriptors, encoded=encoded)
