"""The ``fastckpt`` command: cp, ls, verify, gc, demo, doctor, bench."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable, Sequence

from . import __version__
from ._loop import run_sync
from .api import download, upload
from .checkpoint import gc, list_checkpoints, verify
from .config import TransferConfig, parse_size
from .engine.progress import ProgressCallback
from .engine.transfer import Transfer
from .errors import FastckptError
from .stores import open_store
from .tier.agent import IDLE_S
from .tier.layout import KEEP
from .uri import parse_uri

LOG_LEVELS = ("debug", "info", "warning", "error")


def _is_remote(path: str) -> bool:
    return "://" in path and not path.startswith("file://")


def _config(args: argparse.Namespace) -> TransferConfig:
    return TransferConfig.from_env(part_size=args.part_size, max_in_flight=args.concurrency,
                                   memory_limit=args.memory_limit,
                                   fsync=True if getattr(args, "durable", False) else None)


def _progress_factory(args: argparse.Namespace) -> Callable[[str], ProgressCallback | None]:
    """A tqdm bar per phase on a terminal (or when forced), nothing otherwise."""

    def make(label: str) -> ProgressCallback | None:
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

    return make


def cmd_cp(args: argparse.Namespace) -> dict[str, object]:
    config, progress = _config(args), _progress_factory(args)("cp")
    if _is_remote(args.src) and _is_remote(args.dst):
        raise ValueError("copying between two remote stores is not supported; download then upload")
    if _is_remote(args.src):
        results = download(args.src, args.dst, config=config, progress=progress, raw=args.raw)
    else:
        src = args.src[len("file://"):] if args.src.startswith("file://") else args.src
        results = upload(src, args.dst, config=config, progress=progress, base=args.base)
    total, copied = sum(r.digest.size for r in results), sum(r.copied for r in results)
    return {"files": len(results), "bytes": total, "sent": total - copied, "copied": copied,
            "results": [{"key": r.key, "path": r.path, "size": r.digest.size, "xxh3": r.digest.digest,
                         "copied": r.copied} for r in results]}


def cmd_ls(args: argparse.Namespace) -> dict[str, object]:
    uri = parse_uri(args.uri)
    checkpoints = list_checkpoints(uri, config=_config(args))
    if checkpoints:
        return {"checkpoints": [c.__dict__ for c in checkpoints]}

    async def go() -> list[dict[str, object]]:
        async with open_store(uri) as store:
            return [{"key": m.key, "size": m.size, "mtime": m.mtime} async for m in store.list(uri.key)]

    return {"objects": run_sync(go())}


def cmd_verify(args: argparse.Namespace) -> dict[str, object]:
    """A checkpoint (or every checkpoint below the URI) against its manifests, else each object's digest."""
    uri, config = parse_uri(args.uri), _config(args)
    checkpoints = list_checkpoints(uri, config=config)
    if checkpoints:
        reports = [verify(c.uri, allow_uncommitted=args.allow_uncommitted, config=config) for c in checkpoints
                   if c.state != "uncommitted" or args.allow_uncommitted]
        objects = [{"key": r.uri, "ok": r.ok, "files": r.files, "bytes": r.bytes,
                    "error": "; ".join(f"{b.name}: {b.reason}" for b in r.bad)} for r in reports]
        return {"ok": bool(reports) and all(r.ok for r in reports), "objects": objects}

    async def go() -> list[dict[str, object]]:
        async with open_store(uri) as store:
            transfer = Transfer(store, config)
            keys = [m.key async for m in store.list(uri.key)]
            out = []
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


def cmd_gc(args: argparse.Namespace) -> dict[str, object]:
    report = gc(args.uri, args.older_than, args.dry_run, config=_config(args), keep_last=args.keep_last)
    return report.__dict__


def cmd_agent(args: argparse.Namespace) -> dict[str, object]:
    from .tier import Tier, run_agent
    from .tier.agent import agent_pid, oldest_queued_s
    from .tier.handoff import handoffs

    tier = Tier(args.tier, args.keep)
    served = False if args.status else run_agent(tier, args.idle, _config(args), args.lock_fd)
    return {"tier": tier.root, "served": served, "agent_pid": agent_pid(tier), "pending": len(tier.pending()),
            "oldest_queued_s": oldest_queued_s(tier), "handed": len(handoffs(tier)), "failed": tier.failures(),
            "copies": [str(c["durable"]) for c in tier.copies()]}


def cmd_demo(args: argparse.Namespace) -> dict[str, object]:
    from .demo import run_demo

    result = run_demo(parse_size(args.size), args.dir, _config(args), _progress_factory(args))
    return result.summary()


def cmd_doctor(args: argparse.Namespace) -> dict[str, object]:
    from . import native
    from ._loop import uvloop
    from .stores import backend_status

    return {"version": __version__, "python": sys.version.split()[0], "native_accelerator": native.native_info(),
            "uvloop": uvloop is not None, "backends": backend_status(), "config": TransferConfig.from_env().__dict__}


def _print_human(name: str, out: dict[str, object]) -> None:
    if name == "ls" and "checkpoints" in out:
        for c in out["checkpoints"]:  # type: ignore[union-attr]
            print(f"{c['state']:<12} {c['files']:>6} files {c['bytes']:>16} bytes  {c['name']}")
    elif name == "ls":
        for o in out["objects"]:  # type: ignore[union-attr]
            print(f"{o['size']:>14}  {o['key']}")
    elif name == "verify":
        for o in out["objects"]:  # type: ignore[union-attr]
            print(("OK    " if o["ok"] else "FAIL  ") + o["key"] + ("" if o["ok"] else f"  {o['error']}"))
        print("verified" if out["ok"] else "verification FAILED")
    elif name == "demo":
        print(f"demo: {out['files']} files, {out['bytes'] / (1 << 30):.2f} GiB via {out['store']}")
        print(f"  upload   {out['upload_s']:.2f} s  {out['upload_mib_s']:.0f} MiB/s")
        print(f"  download {out['download_s']:.2f} s  {out['download_mib_s']:.0f} MiB/s")
        print(f"  digests verified: {out['verified']}")
    elif name == "gc":
        verb = "would remove" if out["dry_run"] else "removed"
        print(f"{verb} {len(out['removed'])} object(s), {out['bytes']} bytes; "  # type: ignore[arg-type]
              f"aborted {len(out['aborted_uploads'])} upload(s)")  # type: ignore[arg-type]
        for key in out["removed"]:  # type: ignore[union-attr]
            print(f"  {key}")
        for line in out["skipped"]:  # type: ignore[union-attr]
            print(f"  skipped {line}")
    elif name == "agent":
        oldest = out["oldest_queued_s"]
        print(f"tier {out['tier']}: {out['pending']} rank copies queued"
              + (f" (the oldest for {oldest:.0f} s)" if oldest is not None else "")
              + f", {out['handed']} being handed over, agent "
              f"{'pid ' + str(out['agent_pid']) if out['agent_pid'] else 'not running'}")
        for c in out["copies"]:  # type: ignore[union-attr]
            print(f"  copy of {c}")
        for f in out["failed"]:  # type: ignore[union-attr]
            print(f"  FAILED {f.get('durable', '?')}: {f['error']}")
    elif name == "cp":
        print(f"copied {out['files']} file(s), {out['bytes']} bytes"
              + (f" ({out['sent']} sent, {out['copied']} copied in the store from the base)" if out["copied"] else ""))
    else:
        for k, v in out.items():
            print(f"{k}: {v}")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (exposed for tests and docs)."""
    p = argparse.ArgumentParser(prog="fastckpt", description="Fast, verified checkpoint transfers.")
    p.add_argument("--version", action="version", version=f"fastckpt {__version__}")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--json", action="store_true", help="print machine-readable JSON")
    common.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    common.add_argument("--progress", action="store_true", help="show a progress bar even when not on a terminal")
    common.add_argument("--part-size", type=parse_size, default=None, help="part size, e.g. 32MiB")
    common.add_argument("--concurrency", type=int, default=None,
                        help="most requests in flight (default: as many as the link carries, up to 256)")
    common.add_argument("--memory-limit", type=parse_size, default=None,
                        help="most bytes of buffers the transfer holds, e.g. 512MiB (default 1GiB)")
    common.add_argument("-v", "--verbose", action="count", default=0, help="log retries and more (-vv: debug)")
    common.add_argument("--log-level", choices=LOG_LEVELS, default=None, help="log level (default warning)")
    sub = p.add_subparsers(dest="command", required=True)
    cp = sub.add_parser("cp", parents=[common], help="copy a file or directory to or from a store")
    cp.add_argument("src")
    cp.add_argument("dst")
    cp.add_argument("--base", default=None, metavar="URI",
                    help="upload: an earlier copy in the same bucket (a checkpoint, 'latest', or a prefix); files and "
                         "parts that did not change are copied by the store, not sent")
    cp.add_argument("--raw", action="store_true",
                    help="download: every object as it is, a checkpoint's .fastckpt/ records and uncommitted files "
                         "too (default: a committed checkpoint brings its committed files only, verified)")
    cp.add_argument("--durable", action="store_true",
                    help="fsync downloaded files before they take their names (default: as s5cmd and the AWS CLI, no)")
    ls = sub.add_parser("ls", parents=[common], help="list objects below a URI")
    ls.add_argument("uri")
    ver = sub.add_parser("verify", parents=[common], help="re-hash a checkpoint or objects against their digests")
    ver.add_argument("uri")
    ver.add_argument("--allow-uncommitted", action="store_true", help="also verify uncommitted checkpoints")
    gcp = sub.add_parser("gc", parents=[common], help="remove uncommitted attempts and stale uploads")
    gcp.add_argument("uri")
    gcp.add_argument("--older-than", type=float, default=24 * 3600.0, help="seconds (default 86400)")
    gcp.add_argument("--dry-run", action="store_true", help="only list what would be removed")
    gcp.add_argument("--keep-last", type=int, default=None, metavar="K",
                     help="also remove the committed checkpoints below URI but the newest K (marker first)")
    agent = sub.add_parser("agent", parents=[common], help="drain a checkpoint tier to the durable store (the node "
                           "agent that saves with tier= start; runs until idle)")
    agent.add_argument("tier", help="the tier directory, e.g. /dev/shm/fastckpt")
    agent.add_argument("--keep", type=int, default=KEEP, help=f"committed copies kept once drained ({KEEP})")
    agent.add_argument("--idle", type=float, default=IDLE_S, help=f"seconds with nothing queued before exiting "
                       f"({IDLE_S:g}; inf: never, for an agent run as a supervised service)")
    agent.add_argument("--status", action="store_true", help="only report the queue, failures and copies")
    agent.add_argument("--lock-fd", type=int, default=None, help=argparse.SUPPRESS)  # handed over by ensure_agent
    demo = sub.add_parser("demo", parents=[common], help="upload + download a synthetic checkpoint locally")
    demo.add_argument("--size", default="1GiB", help="checkpoint size (default 1GiB)")
    demo.add_argument("--dir", default=None, help="scratch directory (default: system temp)")
    sub.add_parser("doctor", parents=[common], help="show versions, accelerator and configuration")
    if _bench_root() is not None:
        sub.add_parser("bench", help="benchmarks against peers (see bench/run.py --help)", add_help=False)
    return p


COMMANDS: dict[str, Callable[[argparse.Namespace], dict[str, object]]] = {
    "cp": cmd_cp, "ls": cmd_ls, "verify": cmd_verify, "gc": cmd_gc, "agent": cmd_agent, "demo": cmd_demo,
    "doctor": cmd_doctor,
}


def _bench_root() -> str | None:
    """The source checkout holding ``bench/`` beside this package, if any (the benchmarks are not shipped)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return root if os.path.isfile(os.path.join(root, "bench", "run.py")) else None


def _bench(argv: list[str]) -> int:
    """``fastckpt bench ...``: the benchmark suite in ``bench/`` of a source checkout."""
    root = _bench_root()
    assert root is not None
    sys.path.insert(0, root)
    from bench.run import main as bench_main

    return bench_main(argv)


def _setup_logging(args: argparse.Namespace) -> None:
    """fastckpt's own log at the chosen level on stderr; the SDKs' loggers stay at warning (at debug
    they print request headers, signatures included)."""
    level = args.log_level or LOG_LEVELS[max(0, 2 - args.verbose)]
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("fastckpt").setLevel(level.upper())


def _on_sigterm(signum: int, frame: object) -> None:
    """SIGTERM (what schedulers send before preemption) stops a command the way Ctrl-C does: the running
    transfer is cancelled, keeping what it stored for a resume (nothing incomplete becomes visible)."""
    _stopped_by.append("SIGTERM")
    handler = signal.getsignal(signal.SIGINT)
    if callable(handler):  # Python's (KeyboardInterrupt), or the agent's asyncio.Runner's (it cancels the main task)
        handler(signal.SIGINT, frame)
    else:
        raise KeyboardInterrupt


_stopped_by: list[str] = []


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit status (0 ok, 1 failure, 130 / 143 stopped by SIGINT / SIGTERM)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"] and _bench_root() is not None:
        return _bench(argv[1:])
    args = build_parser().parse_args(argv)
    _setup_logging(args)
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        out = COMMANDS[args.command](args)
    except (FastckptError, OSError, ValueError, ImportError) as exc:
        print(f"fastckpt {args.command}: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        by = _stopped_by[0] if _stopped_by else "SIGINT"
        print(f"fastckpt {args.command}: stopped by {by}: nothing incomplete appears under its final name; what "
              "was already transferred is kept: run the same command again to resume, or `fastckpt gc` to discard "
              "it", file=sys.stderr)
        return 143 if by == "SIGTERM" else 130
    if args.json:
        print(json.dumps(out, indent=2, default=str))
    else:
        _print_human(args.command, out)
    ok = out.get("ok", True) if args.command == "verify" else out.get("verified", True)
    return 0 if ok else 1


def run() -> None:
    """The console script: ``main``, then the process ends; a stopped command ends it at once.

    A stopped command has cancelled its work and waited a bounded time for it to settle (``_loop.STOP_GRACE_S``);
    what is left (a thread finishing a file write, stores being closed) is not waited for: everything a
    transfer leaves behind survives a kill (hidden partial files, journals, open multipart uploads)."""
    code = main()
    if code in (130, 143):
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    run()
