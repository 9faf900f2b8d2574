"""The rank file: a safetensors file holding a state dict's tensors, with its non-tensor skeleton.

Layout (the safetensors format): 8 bytes little-endian header length, the JSON header (padded with spaces), then
the tensors' bytes back to back. The skeleton is the state dict as JSON, each tensor replaced by ``{"T": name}``;
containers and scalars are tagged so they come back as they went in (``{"d": [[key, value], ...]}`` for a dict of
any keys, ``{"t": [...]}`` for a tuple, ``{"f": "nan"}`` for non-finite floats, ``{"b": base64}`` for bytes);
nothing is pickled, so loading never runs code. It is stored as the last tensor, ``__fastckpt_state__`` (U8, named
by the header's ``fastckpt.state_tensor``), so that the header of a state whose values change stays the same and
an incremental save copies every chunk of unchanged tensors (``build_header``; the large tensors then have a file of
their own, ``split_large``). Files of earlier versions hold it in the header's ``fastckpt.state``; both are read.
"""
from __future__ import annotations

import base64
import itertools
import json
import math
import struct
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import CheckpointError

__all__ = [
    "BY_NAME",
    "DTYPES",
    "MAX_HEADER",
    "SMALL",
    "STATE_AT",
    "STATE_KEY",
    "STATE_TENSOR",
    "Header",
    "TensorEntry",
    "build_header",
    "flatten",
    "header_length",
    "parse_header",
    "split_large",
    "state_of",
    "unflatten",
    "with_state",
]

STATE_KEY = "fastckpt.state"
"""Header metadata of files that hold the skeleton in their header (written before fastckpt 0.x kept it apart)."""
STATE_AT = "fastckpt.state_tensor"
"""Header metadata naming the tensor that holds the skeleton."""
STATE_TENSOR = "__fastckpt_state__"
SMALL = 1 << 20
"""Tensors of at least this many bytes go to a file of their own in incremental saves (``split_large``)."""
MAX_HEADER = 256 << 20
"""Largest header accepted when reading (untrusted input)."""

DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
    torch.uint16: "U16", torch.uint32: "U32", torch.uint64: "U64", torch.float8_e4m3fnuz: "F8_E4M3FNUZ",
    torch.float8_e5m2fnuz: "F8_E5M2FNUZ", torch.complex64: "C64",
}
BY_NAME = {v: k for k, v in DTYPES.items()}


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor's bytes lie in the file's data section."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        """Size of the tensor's bytes."""
        return self.end - self.start


@dataclass(frozen=True)
class Header:
    """A parsed (or built) rank file header: tensors, the skeleton (None while it is in ``state_tensor``, read with
    the tensors), and where the data section starts."""

    tensors: dict[str, TensorEntry]
    skeleton: Any
    data_start: int
    raw: bytes
    state_tensor: str = ""

    @property
    def size(self) -> int:
        """Size of the whole file."""
        return self.data_start + max((t.end for t in self.tensors.values()), default=0)


def flatten(state: Any) -> tuple[Any, dict[str, torch.Tensor]]:
    """The JSON skeleton of ``state`` and its tensors by name (names are the dotted key paths)."""
    tensors: dict[str, torch.Tensor] = {}

    def enc(value: Any, path: str) -> Any:
        if isinstance(value, torch.Tensor):
            name = path or "tensor"
            while name in tensors:
                name += "_"
            if value.dtype not in DTYPES:
                raise TypeError(f"state at {path or '<root>'!r}: tensor dtype {value.dtype} is not storable "
                                f"in a safetensors file")
            tensors[name] = value
            return {"T": name}
        if value is None or isinstance(value, (bool, int, str)):
            return value
        if isinstance(value, float):
            return value if math.isfinite(value) else {"f": repr(value)}
        if isinstance(value, list):
            return [enc(v, f"{path}.{i}" if path else str(i)) for i, v in enumerate(value)]
        if isinstance(value, tuple):
            return {"t": [enc(v, f"{path}.{i}" if path else str(i)) for i, v in enumerate(value)]}
        if isinstance(value, dict):
            return {"d": [[enc(k, path), enc(v, f"{path}.{k}" if path else str(k))] for k, v in value.items()]}
        if isinstance(value, bytes):
            return {"b": base64.b64encode(value).decode()}
        if isinstance(value, torch.dtype):
            return {"dtype": str(value).removeprefix("torch.")}
        raise TypeError(f"state at {path or '<root>'!r}: {type(value).__name__} cannot be stored without pickle "
                        f"(tensors, numbers, strings, bytes, None, lists, tuples and dicts can)")

    return enc(state, ""), tensors


def unflatten(skeleton: Any, tensors: dict[str, torch.Tensor], what: str) -> Any:
    """The state a skeleton describes, with its tensors taken from ``tensors``."""
    def dec(node: Any) -> Any:
        if isinstance(node, list):
            return [dec(v) for v in node]
        if not isinstance(node, dict):
            return node
        if len(node) != 1:
            raise CheckpointError(f"{what}: malformed state skeleton (object with keys {sorted(node)[:4]})")
        (tag, value), = node.items()
        if tag == "T":
            return tensors[value]
        if tag == "d":
            return {_key(dec(k)): dec(v) for k, v in value}
        if tag == "t":
            return tuple(dec(v) for v in value)
        if tag == "f":
            return float(value)
        if tag == "b":
            return base64.b64decode(value)
        if tag == "dtype" and isinstance(getattr(torch, value, None), torch.dtype):
            return getattr(torch, value)
        raise CheckpointError(f"{what}: malformed state skeleton (unknown tag {tag!r})")

    try:
        return dec(skeleton)
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"{what}: malformed state skeleton ({exc!r})") from None


def _key(key: Any) -> Any:
    return tuple(key) if isinstance(key, list) else key


def with_state(skeleton: Any, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``tensors`` and the skeleton as the U8 tensor ``STATE_TENSOR``: its JSON padded with spaces to a power of two,
    so that a state whose values change keeps the header (and every offset) of the save before."""
    text = json.dumps(skeleton, separators=(",", ":")).encode()
    blob = bytearray(text + b" " * ((1 << max(8, (len(text) * 9 // 8).bit_length())) - len(text)))
    return {**tensors, STATE_TENSOR: torch.frombuffer(blob, dtype=torch.uint8)}


def build_header(tensors: dict[str, torch.Tensor]) -> Header:
    """The header of a rank file holding ``tensors`` (with their skeleton in ``STATE_TENSOR``, see ``with_state``),
    stored by falling element size, which keeps every tensor aligned, the skeleton last. The same tensors (names,
    shapes, dtypes) always give the same header and offsets, so an unchanged tensor lands in the same chunks save
    after save."""
    order = sorted((n for n in tensors if n != STATE_TENSOR), key=lambda n: -tensors[n].element_size())
    meta = {"format": "pt"}
    if STATE_TENSOR in tensors:
        order.append(STATE_TENSOR)
        meta[STATE_AT] = STATE_TENSOR
    doc: dict[str, Any] = {"__metadata__": meta}
    entries: dict[str, TensorEntry] = {}
    pos = 0
    for name in order:
        t = tensors[name]
        nbytes = t.numel() * t.element_size()
        entries[name] = TensorEntry(name, t.dtype, tuple(t.shape), pos, pos + nbytes)
        doc[name] = {"dtype": DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [pos, pos + nbytes]}
        pos += nbytes
    body = json.dumps(doc, separators=(",", ":")).encode()
    body += b" " * (-len(body) % 8)
    raw = struct.pack("<Q", len(body)) + body
    return Header(entries, None, len(raw), raw, STATE_TENSOR if STATE_TENSOR in tensors else "")


def split_large(tensors: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """``tensors`` cut in two for an incremental save: those of at least ``SMALL`` bytes (the weights of a fine-tune,
    frozen or not), and the others with the skeleton (adapters, their optimizer state, scalars), which change at every
    save. Each half is a file of its own, so that an unchanged half is copied whole by the store."""
    large = {n: t for n, t in tensors.items() if n != STATE_TENSOR and t.numel() * t.element_size() >= SMALL}
    return large, {n: t for n, t in tensors.items() if n not in large}


def state_of(header: Header, tensors: dict[str, torch.Tensor], what: str) -> Any:
    """The state a rank file holds, its tensors taken from ``tensors`` (all of the header's, read)."""
    skeleton = header.skeleton
    if header.state_tensor:
        blob = tensors.pop(header.state_tensor).cpu().numpy().tobytes()
        try:
            skeleton = json.loads(blob)
        except ValueError as exc:
            raise CheckpointError(f"{what}: malformed state skeleton ({exc})") from None
    return unflatten(skeleton, tensors, what)


def header_length(prefix: bytes, what: str) -> int:
    """Total header size (length field included) from the file's first 8 bytes."""
    if len(prefix) < 8:
        raise CheckpointError(f"{what}: too short to be a safetensors file")
    (n,) = struct.unpack("<Q", prefix[:8])
    if n > MAX_HEADER:
        raise CheckpointError(f"{what}: header of {n} bytes is larger than the {MAX_HEADER} accepted")
    return 8 + n


def parse_header(raw: bytes, file_size: int, what: str) -> Header:
    """Parse and check a rank file header (untrusted input): every tensor lies inside the file and its
    size matches its dtype and shape."""
    try:
        doc = json.loads(raw[8:])
        meta = doc.pop("__metadata__", None) or {}
        skeleton = json.loads(meta[STATE_KEY]) if STATE_KEY in meta else None
        state_tensor = str(meta.get(STATE_AT, ""))
        entries = {}
        for name, info in doc.items():
            dtype, shape = BY_NAME[info["dtype"]], tuple(int(s) for s in info["shape"])
            start, end = (int(x) for x in info["data_offsets"])
            numel = math.prod(shape)
            if min(shape, default=0) < 0 or not 0 <= start <= end or end - start != numel * dtype.itemsize:
                raise ValueError(f"tensor {name!r}: offsets {start}..{end} do not fit {info['dtype']}{list(shape)}")
            entries[name] = TensorEntry(name, dtype, shape, start, end)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise CheckpointError(f"{what}: malformed safetensors header ({exc!r})") from None
    spans = sorted((e.start, e.end, e.name) for e in entries.values())
    for (_, end, first), (start, _, second) in itertools.pairwise(spans):
        if start < end:
            raise CheckpointError(f"{what}: tensors {first!r} and {second!r} overlap")
    if state_tensor:
        entry = entries.get(state_tensor)
        if entry is None or entry.dtype != torch.uint8 or len(entry.shape) != 1 or entry.nbytes > MAX_HEADER:
            raise CheckpointError(f"{what}: the state tensor {state_tensor!r} is missing or not a U8 vector")
    header = Header(entries, skeleton, len(raw), raw, state_tensor)
    if header.size > file_size:
        raise CheckpointError(f"{what}: header describes {header.size} bytes, the file holds {file_size}")
    if skeleton is None and not state_tensor:  # a plain safetensors file: a flat dict of its tensors
        header = Header(entries, {"d": [[n, {"T": n}] for n in entries]}, len(raw), raw)
    return header
