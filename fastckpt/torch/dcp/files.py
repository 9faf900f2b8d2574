"""Where DCP items lie: the files a rank writes (``rank_files``) and the spans a reader reads (``Span``)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from ...engine.layout import Layout
from ..format import SMALL
from ..staging import byte_view

__all__ = ["Span", "rank_file", "rank_files"]


def rank_files(rank: int, sizes: list[int], split: bool, single: bool = True) -> list[tuple[str, list[int]]]:
    """The files rank ``rank`` writes, each with the indexes of the items it holds (in plan order, which is the same
    save after save for the same state): one per item unless ``single``; else one file; with ``split`` (incremental
    saves), the items of at least ``SMALL``
    bytes (the weights of a fine-tune, frozen or not) in ``rank-NNNNN-large.distcp`` and the others (adapters,
    optimizer state of small tensors, byte items) in ``rank-NNNNN.distcp``, so that an unchanged large file is copied
    whole by the store, in one request (an S3 ``CopyObject`` moves no bytes on gateways that only relink them)."""
    if not single:
        return [(rank_file(rank, str(i)), [i]) for i in range(len(sizes))]
    if not split:
        return [(rank_file(rank), list(range(len(sizes))))]
    large = [i for i, n in enumerate(sizes) if n >= SMALL]
    small = [i for i, n in enumerate(sizes) if n < SMALL]
    return [(name, group) for name, group in ((rank_file(rank, "large"), large), (rank_file(rank), small)) if group]


def rank_file(rank: int, part: str = "") -> str:
    """Name of one of rank ``rank``'s files."""
    return f"rank-{rank:05d}{'-' + part if part else ''}.distcp"


@dataclass
class Span:
    """``[start, end)`` of file ``name`` (chunk-aligned), read in one go for ``items`` (request, offset, length).

    ``direct`` maps an item's index to the destination tensor its bytes are received into (a whole stored
    tensor going to a contiguous CPU tensor); the rest of the span is received into scratch buffers.
    """

    name: str
    start: int
    end: int
    items: list[tuple[Any, int, int]]
    direct: dict[int, torch.Tensor] = dataclasses.field(default_factory=dict)

    def layout(self) -> Layout:
        """Where the span's bytes go: the direct destinations, scratch buffers around them."""
        views: list[memoryview | bytearray] = []
        pos = self.start
        for i, (_, offset, length) in enumerate(self.items):
            target = self.direct.get(i)
            if target is None:
                continue
            if offset < pos:  # overlaps bytes already placed: read into scratch like the others
                del self.direct[i]
                continue
            if offset > pos:
                views.append(bytearray(offset - pos))
            views.append(byte_view(target))
            pos = offset + length
        if pos < self.end:
            views.append(bytearray(self.end - pos))
        return Layout(views)
