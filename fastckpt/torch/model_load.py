"""Serving what was trained: a safetensors model (one file, or the Hugging Face layout) from any store straight into
tensors, as ``safetensors.torch.load_file`` returns them, without a local copy.

``load_safetensors(uri)``: ``uri`` is one ``.safetensors`` object, or a prefix holding ``model.safetensors.index.json``
and its shards (or ``*.safetensors`` without an index). Each file's header is read and checked (untrusted input:
offsets inside the file, no overlaps, sizes that fit dtype and shape, a bounded header), then its tensors' bytes are
received by parallel ranged reads straight into the tensors (``load.load_file``). Verified against fastckpt's chunk
digests where the files carry them: the manifests when ``uri`` is (in) a committed fastckpt checkpoint, else the
digest a fastckpt upload records on each object; files without one are checked against their sizes and headers.
"""

from __future__ import annotations

import json
import posixpath

import torch

from .. import stats
from .._loop import BackgroundLoop
from ..checkpoint.documents import read_object
from ..checkpoint.manifest import marker_key
from ..checkpoint.reader import Checkpoint, open_checkpoint_async
from ..config import TransferConfig
from ..engine.open_stores import store_for
from ..engine.transfer import Transfer
from ..errors import CheckpointError, ObjectNotFoundError
from ..integrity import FileDigest
from ..stores.base import Store
from ..tasks import gather_all
from ..uri import StorageURI, parse_uri
from .load import load_file

INDEX = "model.safetensors.index.json"
SUFFIX = ".safetensors"

__all__ = ["load_safetensors", "load_safetensors_async"]


def load_safetensors(uri: str | StorageURI, *, device: str | torch.device = "cpu", dtype: torch.dtype | None = None,
                     config: TransferConfig | None = None) -> dict[str, torch.Tensor]:
    """The tensors of the safetensors model at ``uri`` by name, as ``safetensors.torch.load_file`` returns them
    (``dtype``: floating tensors cast to it, as ``from_pretrained(torch_dtype=)``; ``device``: where they land)."""
    return BackgroundLoop.get().run(load_safetensors_async(uri, device=device, dtype=dtype, config=config))


@stats.summarized("load_safetensors")
async def load_safetensors_async(uri: str | StorageURI, *, device: str | torch.device = "cpu",
                                 dtype: torch.dtype | None = None, config: TransferConfig | None = None
                                 ) -> dict[str, torch.Tensor]:
    """Async twin of ``load_safetensors``."""
    target = parse_uri(uri) if not isinstance(uri, StorageURI) else uri
    cfg = config or TransferConfig.from_env()
    async with store_for(target, cfg) as store:
        files = await model_files(store, target, cfg)
        found: list[dict[str, torch.Tensor]] = [{} for _ in files]
        transfer = Transfer(store, cfg)
        try:  # the shards side by side: each one's header, then its tensors' parts, share the transfer's limits
            await gather_all(load_file(transfer, key, digest, target.with_key(key).uri(), {}, device, None, into)
                             for (key, digest), into in zip(files, found, strict=True))
        finally:
            transfer.close()
    loaded: dict[str, torch.Tensor] = {}
    for shard in found:
        twice = sorted(set(shard) & set(loaded))
        if twice:
            raise CheckpointError(f"{target.raw}: tensor(s) {twice[:5]} stored in more than one shard")
        loaded.update(shard)
    if dtype is not None:
        loaded = {n: t.to(dtype) if t.is_floating_point() else t for n, t in loaded.items()}
    return loaded


async def model_files(store: Store, target: StorageURI, cfg: TransferConfig) -> list[tuple[str, FileDigest]]:
    """(key, digest) of each safetensors file of the model at ``target``: the object itself, the shards its index
    names, or every ``*.safetensors`` below it; digests from a committed checkpoint's manifests, else the objects'."""
    ckpt = await _checkpoint(store, target, cfg)
    if target.key.endswith(SUFFIX):
        base, names = posixpath.dirname(target.key), [posixpath.basename(target.key)]
    else:
        base, names = target.key, await _shard_names(store, target, ckpt)

    async def located(name: str) -> tuple[str, FileDigest]:
        recorded = ckpt.files.get(name) if ckpt is not None else None
        if ckpt is not None and recorded is not None:
            return ckpt.file_key(name), recorded
        key = posixpath.join(base, name) if base else name
        meta = await store.head(key)  # the shards' heads side by side: one round trip for all
        return key, FileDigest.from_metadata(meta.size, meta.metadata) or FileDigest(meta.size, cfg.part_size, "")

    return await gather_all(located(n) for n in names)


async def _shard_names(store: Store, target: StorageURI, ckpt: Checkpoint | None) -> list[str]:
    """The shard names of the model below ``target`` (the checkpoint ``ckpt``, when committed): its index's, else
    every ``*.safetensors`` directly below."""
    index_key = ckpt.file_key(INDEX) if ckpt is not None else target.join(INDEX)
    try:
        doc = json.loads(await read_object(store, index_key))
        shards = sorted(set(doc["weight_map"].values()))
    except ObjectNotFoundError:
        if ckpt is not None:
            shards = sorted(n for n in ckpt.files if n.endswith(SUFFIX) and "/" not in n)
        else:
            shards = sorted([posixpath.basename(m.key) async for m in store.list(target.key)
                             if m.key.endswith(SUFFIX) and posixpath.dirname(m.key) == target.key])
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CheckpointError(f"{target.raw}/{INDEX}: not a safetensors index ({exc!r})") from None
    if not shards:
        raise ObjectNotFoundError(f"no safetensors model at {target.raw}: no {INDEX} and no *{SUFFIX} there")
    for name in shards:
        if not isinstance(name, str) or "/" in name or name in (".", "..") or not name.endswith(SUFFIX):
            raise CheckpointError(f"{target.raw}/{INDEX}: shard name {name!r} is not a file beside the index")
    return shards


async def _checkpoint(store: Store, target: StorageURI, cfg: TransferConfig) -> Checkpoint | None:
    """The committed fastckpt checkpoint that ``target`` is, or that holds the file ``target`` at its top (None when
    neither)."""
    where = posixpath.dirname(target.key) if target.key.endswith(SUFFIX) else target.key
    if not await store.exists(marker_key(where)):
        return None
    return await open_checkpoint_async(target.with_key(where), config=cfg, store=store)

