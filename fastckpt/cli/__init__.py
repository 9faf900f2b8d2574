"""The ``fastckpt`` command: cp, mv, sync, rm, cat, ls, du, verify, gc, agent, bench-load, demo, doctor, bench."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
from collections.abc import Sequence

from .. import stats
from ..errors import FastckptError
from .commands import COMMANDS, config_of
from .parser import LOG_LEVELS, bench_root
from .parser import build_parser as _build_parser
from .show import show


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (exposed for tests and docs)."""
    return _build_parser(bench=bench_root() is not None)


def _bench(argv: list[str]) -> int:
    """``fastckpt bench ...``: the benchmark suite in ``bench/`` of a source checkout."""
    root = bench_root()
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
    """Entry point; returns the exit status (0 ok, 1 failure, 130 / 143 stopped by SIGINT / SIGTERM; a usage error
    exits 2, as argparse does)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"] and bench_root() is not None:
        return _bench(argv[1:])
    args = build_parser().parse_args(argv)
    _setup_logging(args)
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        with stats.observe(args.command) as summary:
            out = COMMANDS[args.command](args)
    except BrokenPipeError:  # the reader went away (`fastckpt cat ... | head`): as cat does, quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
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
        out = {**out, "stats": summary.as_dict()} if args.stats else out
        print(json.dumps(out, indent=2, default=str), file=sys.stderr if args.command == "cat" else sys.stdout)
    else:
        show(args.command, out, args)
        if args.stats:
            print(summary, file=sys.stderr)
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


__all__ = ["build_parser", "config_of", "main", "run"]
