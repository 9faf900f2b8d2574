"""What each ``fastckpt`` verb does: arguments in, a JSON-able result out (``show`` prints it for people)."""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
from collections.abc import Callable

from .. import __version__
from .._loop import run_sync
from ..api import download, plan_download_async, plan_upload_async, source_of, upload
from ..checkpoint import Retention, gc, list_checkpoints, verify
from ..checkpoint.catalog import target_of
from ..config import TransferConfig, parse_size
from ..engine.progress import ProgressCallback
from ..engine.transfer import Transfer
from ..errors import FastckptError
from ..folder_sync import sync
from ..mirror import Moved, copy, is_local, move
from ..objects import at, cat, disk_usage, list_objects
from ..removal import remove
from ..stores import open_store
from ..uri import parse_uri

__all__ = ["COMMANDS", "Result", "cmd_agent", "cmd_bench_load", "cmd_cat", "cmd_cp", "cmd_demo", "cmd_doctor", "cmd_du",
           "cmd_gc", "cmd_ls", "cmd_mv", "cmd_rm", "cmd_sync", "cmd_verify", "config_of"]

Result = dict[str, object]


def config_of(args: argparse.Namespace) -> TransferConfig:
    """The transfer configuration: the environment's, with the command line's settings on top."""
    return TransferConfig.from_env(part_size=args.part_size, max_in_flight=args.concurrency,
                                   memory_limit=args.memory_limit,
                                   fsync=True if getattr(args, "durable", False) else None)


def _progress(args: argparse.Namespace, label: str) -> ProgressCallback | None:
    """A tqdm bar on a terminal (or when forced), nothing otherwise."""
    if args.json or args.quiet or not (sys.stderr.isatty() or args.progress):
        return None
    from tqdm import tqdm

    bar = tqdm(desc=label, unit="B", unit_scale=True, unit_divisor=1024, total=0, file=sys.stderr,
               leave=True, mininterval=0.2)

    def update(done: int, total: int) -> None:
        bar.total = total
        bar.update(done - bar.n)
        if done >= total > 0:
            bar.refresh()

    return update


def _moved(done: Moved, dry_run: bool) -> Result:
    return {"dry_run": dry_run, "files": len(done.sent), "bytes": done.bytes, "unchanged": done.unchanged,
            "deleted": done.deleted, "moves": [{"from": a, "to": b} for a, b in done.sent]}


def cmd_cp(args: argparse.Namespace) -> Result:
    config, progress, filters = config_of(args), _progress(args, "cp"), args.filters
    if args.base is not None and not is_local(args.src):
        raise ValueError("--base applies to uploads (a local source); this copy's source is a store URI")
    if args.raw and is_local(args.src):
        raise ValueError("--raw applies to downloads (a store URI source); this copy's source is a local path")
    if not is_local(args.src) and not is_local(args.dst):
        return _moved(copy(args.src, args.dst, filters=filters, dry_run=args.dry_run, config=config), args.dry_run)
    if args.dry_run:
        return _moved(Moved(run_sync(_plan_cp(args, config))), True)
    if not is_local(args.src):
        results = download(args.src, args.dst, config=config, progress=progress, raw=args.raw, filters=filters)
    else:
        results = upload(args.src, args.dst, config=config, progress=progress, base=args.base, filters=filters)
    total, copied = sum(r.digest.size for r in results), sum(r.copied for r in results)
    return {"files": len(results), "bytes": total, "sent": total - copied, "copied": copied,
            "results": [{"key": r.key, "path": r.path, "size": r.digest.size, "xxh3": r.digest.digest,
                         "copied": r.copied} for r in results]}


async def _plan_cp(args: argparse.Namespace, config: TransferConfig) -> list[tuple[str, str]]:
    if not is_local(args.src):
        plan = await plan_download_async(args.src, args.dst, raw=args.raw, filters=args.filters, config=config)
        source = source_of(args.src, ())[0]
        return [*((at(source, k), path) for k, path in plan.pairs),
                *((f"{uri} (committed files, verified)", path) for uri, path in plan.checkpoints)]
    pairs = await plan_upload_async(args.src, args.dst, filters=args.filters, config=config)
    target = target_of(args.dst)
    return [(path, at(target, key)) for path, key in pairs]


def cmd_mv(args: argparse.Namespace) -> Result:
    return _moved(move(args.src, args.dst, filters=args.filters, dry_run=args.dry_run, config=config_of(args)),
                  args.dry_run)


def cmd_sync(args: argparse.Namespace) -> Result:
    return _moved(sync(args.src, args.dst, delete=args.delete, filters=args.filters, dry_run=args.dry_run,
                       config=config_of(args)), args.dry_run)


def cmd_rm(args: argparse.Namespace) -> Result:
    keys = remove(args.uri, recursive=args.recursive, filters=args.filters, dry_run=args.dry_run,
                  config=config_of(args))
    return {"dry_run": args.dry_run, "removed": keys}


def cmd_cat(args: argparse.Namespace) -> Result:
    out = sys.stdout.buffer
    size = cat(args.uri, out.write, config=config_of(args))
    out.flush()
    return {"bytes": size}




def cmd_ls(args: argparse.Namespace) -> Result:
    if args.checkpoints:
        found = list_checkpoints(args.uri, config=config_of(args))
        return {"checkpoints": [{**c.__dict__, "step": c.step} for c in found]}
    objects, folders = list_objects(args.uri, recursive=args.recursive, filters=args.filters, config=config_of(args))
    base = source_of(args.uri, ())[0]
    return {"objects": [{"key": m.key, "uri": at(base, m.key), "size": m.size, "mtime": m.mtime} for m in objects],
            "folders": [at(base, f) + "/" for f in folders]}


def cmd_du(args: argparse.Namespace) -> Result:
    rows = disk_usage(args.uri, filters=args.filters, config=config_of(args))
    return {"folders": [r.__dict__ for r in rows[:-1]], "objects": rows[-1].objects, "bytes": rows[-1].bytes}


def cmd_verify(args: argparse.Namespace) -> Result:
    """A checkpoint (or every checkpoint below the URI) against its manifests, else each object's digest."""
    uri, config = parse_uri(args.uri), config_of(args)
    checkpoints = list_checkpoints(uri, config=config)
    if checkpoints:
        reports = [verify(c.uri, allow_uncommitted=args.allow_uncommitted, config=config) for c in checkpoints
                   if c.state != "uncommitted" or args.allow_uncommitted]
        objects = [{"key": r.uri, "ok": r.ok, "files": r.files, "bytes": r.bytes,
                    "error": "; ".join(f"{b.name}: {b.reason}" for b in r.bad)} for r in reports]
        return {"ok": bool(reports) and all(r.ok for r in reports), "objects": objects}

    async def go() -> list[Result]:
        async with open_store(uri) as store:
            transfer = Transfer(store, config)
            keys = [m.key async for m in store.list(uri.key)]
            out: list[Result] = []
            for key in keys:
                try:
                    digest = await transfer.verify_object(key)
                    out.append({"key": key, "ok": True, "xxh3": digest.digest})
                except FastckptError as exc:
                    out.append({"key": key, "ok": False, "error": str(exc)})
            transfer.close()
            return out

    results = run_sync(go())
    return {"ok": all(r["ok"] for r in results) and bool(results), "objects": results}


def cmd_gc(args: argparse.Namespace) -> Result:
    rules = (args.keep_last, args.keep_every_steps, args.keep_every, args.best)
    retention = None if all(r is None for r in rules) else Retention(
        keep_last=args.keep_last, keep_every_steps=args.keep_every_steps, keep_every=args.keep_every, best=args.best,
        metric=args.metric, mode=args.mode, grace=args.grace)
    report = gc(args.uri, older_than=args.older_than, dry_run=args.dry_run, config=config_of(args),
                retention=retention)
    return report.__dict__


def cmd_agent(args: argparse.Namespace) -> Result:
    from ..tier import Tier, run_agent
    from ..tier.agent import agent_pid, oldest_queued_s
    from ..tier.handoff import handoffs

    tier = Tier(args.tier, args.keep)
    if args.metrics_port is not None and not args.status:
        from ..monitoring import serve

        serve(args.metrics_port, args.metrics_addr, tier=tier)
    served = False if args.status else run_agent(tier, idle=args.idle, config=config_of(args), lock_fd=args.lock_fd)
    return {"tier": tier.root, "served": served, "agent_pid": agent_pid(tier), "pending": len(tier.pending()),
            "oldest_queued_s": oldest_queued_s(tier), "handed": len(handoffs(tier)), "failed": tier.failures(),
            "copies": [str(c["durable"]) for c in tier.copies()]}


def cmd_bench_load(args: argparse.Namespace) -> Result:
    rounds = [_timed_load(args) for _ in range(args.rounds)]
    return {"uri": args.uri, "device": args.device, "files": rounds[0]["files"],
            "tensor_bytes": rounds[0]["tensor_bytes"],
            "median_gb_per_s": statistics.median(r["gb_per_s"] for r in rounds),
            "median_first_shard_s": statistics.median(r["first_shard_s"] for r in rounds), "rounds": rounds}


def _timed_load(args: argparse.Namespace) -> Result:
    """One ``load_safetensors`` of ``args.uri``, timed: seconds, GB/s, and when the first file's tensors were in."""
    try:
        from ..torch.model_load import load_safetensors
    except ImportError as exc:
        raise ImportError(f"fastckpt bench-load needs torch ({exc}): pip install 'fastckpt[torch]'") from None
    started, shards = time.perf_counter(), []
    tensors = load_safetensors(args.uri, device=args.device, config=config_of(args),
                               on_shard=lambda what: shards.append(time.perf_counter() - started))
    seconds = time.perf_counter() - started
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    return {"seconds": seconds, "first_shard_s": min(shards), "gb_per_s": nbytes / seconds / 1e9,
            "files": len(shards), "tensor_bytes": nbytes}


def cmd_demo(args: argparse.Namespace) -> Result:
    from ..demo import run_demo

    result = run_demo(parse_size(args.size), args.dir, config_of(args), lambda label: _progress(args, label))
    return result.summary()


def cmd_doctor(args: argparse.Namespace) -> Result:
    from .. import native
    from .._loop import uvloop
    from ..stores import backend_status

    extras = {name: importlib.util.find_spec(module) is not None
              for name, module in (("opentelemetry", "opentelemetry"), ("prometheus", "prometheus_client"))}
    return {"version": __version__, "python": sys.version.split()[0], "native_accelerator": native.native_info(),
            "uvloop": uvloop is not None, "backends": backend_status(), "monitoring": extras,
            "config": TransferConfig.from_env().__dict__}


COMMANDS: dict[str, Callable[[argparse.Namespace], Result]] = {
    "cp": cmd_cp, "mv": cmd_mv, "sync": cmd_sync, "rm": cmd_rm, "cat": cmd_cat, "ls": cmd_ls, "du": cmd_du,
    "verify": cmd_verify, "gc": cmd_gc, "agent": cmd_agent, "demo": cmd_demo, "doctor": cmd_doctor,
    "bench-load": cmd_bench_load,
}
