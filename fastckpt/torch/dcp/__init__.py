"""A ``torch.distributed.checkpoint`` storage plugin: ``dcp.save`` / ``async_save`` / ``load`` on any backend, a
drop-in for ``FileSystemWriter`` / ``FileSystemReader`` (same arguments, same meaning where fastckpt has one).

What it writes is DCP's open format (``format``): each rank's items in one file, ``rank-NNNNN.distcp`` (in
incremental saves its items of 1 MiB and more in ``rank-NNNNN-large.distcp``; with ``single_file_per_rank=False``
one file per item), each tensor as ``torch.save`` bytes, and DCP's own ``.metadata``, so ``FileSystemReader``,
``FsspecReader`` and ``dcp_to_torch_save`` read it. Beside it: the chunk digests in each rank's manifest, fastckpt's
index of where tensors' raw bytes lie (``.metadata.fastckpt``), the commit marker. The ranks' manifests reach the
coordinator through DCP's own gather; in ``finish`` it writes ``.metadata`` and every manifest, then the marker: a
save is visible only once the marker exists, and a rank that dies mid-save leaves an attempt that ``gc`` removes.

Saving again to the same path (``overwrite=True``, DCP's default) writes the new checkpoint's files into a folder of
their own beside the old ones and switches with one write of the marker (``CheckpointWriter(overwrite=True)``), then
replaces the top-level ``.metadata`` that the stock readers open, then deletes the old files: a reader sees the old
checkpoint or the new one, and a save that dies leaves the old one loadable.

The reader opens committed checkpoints (``allow_uncommitted=True``: also those the stock writer wrote, checked
against their sizes only). Any rank may read any part of any file (DCP reshards on load); every chunk read is
checked against its recorded digest. ``.metadata`` is unpickled allowing DCP's metadata classes and nothing else
(``format.load_metadata``). With ``group=`` (``Reader(uri, group=pg)``), the metadata is read once for the
group and each byte that several ranks need is read from storage once (``group_read``).

``writer`` (``Writer``), ``reader`` (``Reader``), ``format`` (DCP's open format, both ways), ``location`` (where a
checkpoint and its items lie), ``files`` (which items go into which file), ``group_read`` (reads shared over a
process group).
"""

from .location import StoredItem
from .reader import Reader
from .writer import Writer

__all__ = ["Reader", "StoredItem", "Writer"]
