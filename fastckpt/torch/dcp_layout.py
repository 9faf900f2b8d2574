"""Where DCP items lie in a rank file: the writer's order (``lay_out``) and the reader's spans (``Span``)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from ..engine.layout import Layout
from .format import ALIGN_FROM, SMALL
from .staging import byte_view


def lay_out(views: list[memoryview], align: int) -> tuple[list[memoryview], list[int]]:
    """The file's views and the offset of each item of ``views``: items of at least ``SMALL`` bytes first (in plan
    order, which is the same save after save for the same state), then the small ones, which start a part of
    ``align`` bytes when there are enough large ones (zeros between): a changed adapter or optimizer state then
    shares no part with an unchanged weight, and an incremental save copies every part of the weights."""
    big = [i for i, v in enumerate(views) if len(v) >= SMALL]
    small = [i for i, v in enumerate(views) if len(v) < SMALL]
    bulk = sum(len(views[i]) for i in big)
    out, offsets, pos = [], [0] * len(views), 0
    for group in (big, small):
        if group is small and align and bulk >= ALIGN_FROM * align and bulk % align:
            out.append(memoryview(bytes(align - bulk % align)))
            pos += len(out[-1])
        for i in group:
            offsets[i] = pos
            out.append(views[i])
            pos += len(views[i])
    return out, offsets


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
