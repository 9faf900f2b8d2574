"""Serving what was trained: a safetensors model (one file, or the Hugging Face layout) from any store straight into
tensors, as ``safetensors.torch.load_file`` returns them, without a local copy.

``load_safetensors(uri)``: ``uri`` is one ``.safetensors`` object, or a prefix holding ``model.safetensors.index.json``
and its shards (or ``*.safetensors`` without an index). Each file's header is read and checked (untrusted input:
offsets inside the file, no overlaps, sizes that fit dtype and shape, a bounded header), then its tensors' bytes are
received by parallel ranged reads straight into the tensors (``load.load_file``). Verified against fastckpt's chunk
digests where the files carry them: the manifests when ``uri`` is (in) a committed fastckpt checkpoint, else the
digest a fastckpt upload records on each object; files without one are checked against their sizes and headers.

With ``group=`` (the ranks of one server: tensor-parallel workers, or replicas), every rank calls it and ends with
the whole model; each file is cut into one range per rank, each range read from the store by one rank and sent to the
others over the group (``group_load``), so the store serves each byte once; a failure on any rank fails every rank.
"""

from __future__ import annotations

import json
import posixpath
from collections.abc import Callable
from typing import Any

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
from .load import StoredFile, load_file

INDEX = "model.safetensors.index.json"
SUFFIX = ".safetensors"

__all__ = ["load_safetensors", "load_safetensors_async"]


def load_safetensors(uri: str | StorageURI, *, device: str | torch.device = "cpu", dtype: torch.dtype | None = None,
                     group: Any = None, config: TransferConfig | None = None,
                     on_shard: Callable[[str], None] | None = None) -> dict[str, torch.Tensor]:
    """The tensors of the safetensors model at ``uri`` by name, as ``safetensors.torch.load_file`` returns them
    (``dtype``: floating tensors cast to it, as ``from_pretrained(torch_dtype=)``; ``device``: where they land;
    ``group``: a ``torch.distributed`` process group whose every rank calls this, each byte read from the store once
    for all of them; ``on_shard(uri)``: called as each file's tensors are all in place, verified)."""
    return BackgroundLoop.get().run(load_safetensors_async(uri, device=device, dtype=dtype, group=group,
                                                           config=config, on_shard=on_shard))


@stats.summarized("load_safetensors")
async def load_safetensors_async(uri: str | StorageURI, *, device: str | torch.device = "cpu",
                                 dtype: torch.dtype | None = None, group: Any = None,
                                 config: TransferConfig | None = None, on_shard: Callable[[str], None] | None = None
                                 ) -> dict[str, torch.Tensor]:
    """Async twin of ``load_safetensors``."""
    done = on_shard or (lambda what: None)
    target = parse_uri(uri) if not isinstance(uri, StorageURI) else uri
    cfg = config or TransferConfig.from_env()
    async with store_for(target, cfg) as store:
        if group is not None:
            found = await _load_in_group(target, cfg, store, group, device, done)
        else:
            files = await model_files(store, target, cfg)
            found = [{} for _ in files]
            transfer = Transfer(store, cfg)

            async def one(f: StoredFile, into: dict[str, torch.Tensor]) -> None:
                await load_file(transfer, f.key, f.digest, f.what, {}, device, None, into)
                done(f.what)

            try:  # the shards side by side: each one's header, then its tensors' parts, share the transfer's limits
                await gather_all(one(f, into) for f, into in zip(files, found, strict=True))
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


async def _load_in_group(target: StorageURI, cfg: TransferConfig, store: Store, group: Any,
                         device: str | torch.device, done: Callable[[str], None]) -> list[dict[str, torch.Tensor]]:
    """Each file's tensors, by file, loaded by every rank of ``group`` with each byte read from the store once: group
    rank 0 finds the files and their digests and tells the others, then the ranks load the files one by one, each
    reading its range and sending it to the rest."""
    from ..checkpoint.group import GroupCall
    from .group_load import Loading, load_shared_file

    call = await GroupCall.of(group, f"load of model {target.raw} by its process group")
    files = await call.from_root(lambda: model_files(store, target, cfg), store)
    stored = {f.key: f for f in files}
    found: list[dict[str, torch.Tensor]] = []
    for f in files:
        into = Loading(store, cfg, {}, device)
        await load_shared_file(call, stored, f.key, into)
        found.append(into.loaded)
        done(f.what)
    return found


async def model_files(store: Store, target: StorageURI, cfg: TransferConfig) -> list[StoredFile]:
    """Each safetensors file of the model at ``target``: the object itself, the shards its index names, or every
    ``*.safetensors`` below it; digests from a committed checkpoint's manifests, else the objects'."""
    ckpt = await _checkpoint(store, target, cfg)
    if target.key.endswith(SUFFIX):
        base, names = posixpath.dirname(target.key), [posixpath.basename(target.key)]
    else:
        base, names = target.key, await _shard_names(store, target, ckpt)

    async def located(name: str) -> StoredFile:
        recorded = ckpt.files.get(name) if ckpt is not None else None
        if ckpt is not None and recorded is not None:
            key = ckpt.file_key(name)
            return StoredFile(key, recorded, ckpt.chunks.get(name), target.with_key(key).uri())
        key = posixpath.join(base, name) if base else name
        meta = await store.head(key)  # the shards' heads side by side: one round trip for all
        digest = FileDigest.from_metadata(meta.size, meta.metadata) or FileDigest(meta.size, cfg.part_size, "")
        return StoredFile(key, digest, None, target.with_key(key).uri())

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

