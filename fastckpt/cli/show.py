"""The ``fastckpt`` verbs' results as people read them (``--json`` prints them as they are)."""

from __future__ import annotations

import time
from collections.abc import Callable

__all__ = ["human", "show"]


def human(size: int) -> str:
    """``size`` bytes as ``du -h`` writes it (1024-based: 512B, 1.5K, 2.0G)."""
    value = float(size)
    for unit in "BKMGTP":
        if value < 1024 or unit == "P":
            return f"{size}B" if unit == "B" else f"{value:.1f}{unit}"
        value /= 1024
    raise AssertionError("unreachable")


def _when(mtime: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(mtime)) if mtime else " " * 19


def _ls(out: dict, size: Callable[[int], str], long: bool) -> None:
    if "checkpoints" in out:
        for c in out["checkpoints"]:
            step = "" if c["step"] is None else c["step"]
            print(f"{c['state']:<12} {step!s:>8} {c['files']:>6} files {size(c['bytes']):>14}  "
                  f"{_when(c['committed_at'])}  {c['name']}")
        return
    for folder in out["folders"]:
        print(f"{'' if not long else ' ' * 21}{'DIR':>14}  {folder}")
    for o in out["objects"]:
        print((f"{_when(o['mtime'])}  " if long else "") + f"{size(o['size']):>14}  {o['uri']}")


def _moves(name: str, out: dict) -> None:
    verb = {"cp": "copy", "mv": "move", "sync": "send"}[name]
    for m in out["moves"]:
        print(f"{'would ' + verb if out['dry_run'] else verb} {m['from']} -> {m['to']}")
    for gone in out["deleted"]:
        print(f"{'would delete' if out['dry_run'] else 'delete'} {gone}")
    if not out["dry_run"]:
        print(f"{name}: {out['files']} file(s), {out['bytes']} bytes" +
              (f"; {out['unchanged']} unchanged" if name == "sync" else "") +
              (f"; {len(out['deleted'])} deleted" if out["deleted"] else ""))


def show(name: str, out: dict, args: object) -> None:
    """Print the result ``out`` of verb ``name`` (run with ``args``)."""
    size: Callable[[int], str] = human if getattr(args, "human", False) else str
    if name == "ls":
        _ls(out, size, getattr(args, "long", False))
    elif name in ("mv", "sync") or (name == "cp" and "moves" in out):
        _moves(name, out)
    elif name == "cp":
        print(f"copied {out['files']} file(s), {out['bytes']} bytes"
              + (f" ({out['sent']} sent, {out['copied']} copied in the store from the base)" if out["copied"] else ""))
    elif name == "rm":
        for key in out["removed"]:
            print(f"{'would remove' if out['dry_run'] else 'removed'} {key}")
    elif name == "du":
        for row in out["folders"]:
            print(f"{size(row['bytes']):>14} {row['objects']:>9} objects  {row['name']}")
        print(f"{size(out['bytes']):>14} {out['objects']:>9} objects  total")
    elif name == "verify":
        for o in out["objects"]:
            print(("OK    " if o["ok"] else "FAIL  ") + o["key"] + ("" if o["ok"] else f"  {o['error']}"))
        print("verified" if out["ok"] else "verification FAILED")
    elif name == "demo":
        print(f"demo: {out['files']} files, {out['bytes'] / (1 << 30):.2f} GiB via {out['store']}")
        print(f"  upload   {out['upload_s']:.2f} s  {out['upload_mib_s']:.0f} MiB/s")
        print(f"  download {out['download_s']:.2f} s  {out['download_mib_s']:.0f} MiB/s")
        print(f"  digests verified: {out['verified']}")
    elif name == "bench-load":
        print(f"{out['uri']}: {out['files']} file(s), {out['tensor_bytes'] / 1e9:.2f} GB of tensors to {out['device']}")
        for r in out["rounds"]:
            print(f"  {r['seconds']:.2f} s  {r['gb_per_s']:.2f} GB/s  first file's tensors after "
                  f"{r['first_shard_s']:.2f} s")
        print(f"median {out['median_gb_per_s']:.2f} GB/s; first file's tensors after "
              f"{out['median_first_shard_s']:.2f} s")
    elif name == "gc":
        _gc(out)
    elif name == "agent":
        _agent(out)
    elif name != "cat":
        for k, v in out.items():
            print(f"{k}: {v}")


def _gc(out: dict) -> None:
    verb = "would remove" if out["dry_run"] else "removed"
    print(f"{verb} {len(out['removed'])} object(s), {out['bytes']} bytes; "
          f"aborted {len(out['aborted_uploads'])} upload(s)")
    for key in out["removed"]:
        print(f"  {key}")
    for line in out["skipped"]:
        print(f"  skipped {line}")


def _agent(out: dict) -> None:
    oldest = out["oldest_queued_s"]
    print(f"tier {out['tier']}: {out['pending']} rank copies queued"
          + (f" (the oldest for {oldest:.0f} s)" if oldest is not None else "")
          + f", {out['handed']} being handed over, agent "
          f"{'pid ' + str(out['agent_pid']) if out['agent_pid'] else 'not running'}")
    for c in out["copies"]:
        print(f"  copy of {c}")
    for f in out["failed"]:
        print(f"  FAILED {f.get('durable', '?')}: {f['error']}")
