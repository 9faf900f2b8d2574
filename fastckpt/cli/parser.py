"""The ``fastckpt`` command's arguments and their help: each verb in one line, each argument with an example."""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence

from .. import __version__
from ..config import parse_size
from ..tier.agent import IDLE_S
from ..tier.directory import KEEP

__all__ = ["LOCATIONS", "LOG_LEVELS", "Filter", "bench_root", "build_parser"]

LOG_LEVELS = ("debug", "info", "warning", "error")

LOCATIONS = """\
locations:
  a local path       ckpt/, /data/run/model.bin
  s3://BUCKET/KEY    s3://my-bucket/runs/step-100/      (endpoint: ?endpoint_override=http://host:9000)
  gs://BUCKET/KEY    gs://my-bucket/runs/
  az://CONTAINER/KEY az://ckpts/runs/ (also abfss://CONTAINER@ACCOUNT.dfs.core.windows.net/KEY)
  file:///ABS/PATH   the local directory as a store (checkpoints, digests in extended attributes)

paths, as `aws s3 cp` and s5cmd take them, on every store:
  a destination ending in '/' (or a folder that exists) receives a file under its own name;
  a folder source copies its contents (cp ckpt s3://b/run/  ->  s3://b/run/a.bin, s3://b/run/sub/b.bin);
  wildcards in a source: '*' and '?' within one path part, '**' across parts; quote them from the shell:
  'ckpt/*.safetensors', 's3://b/run/step-*' (a matching folder brings all below it), 's3://b/**/*.json'

exit status: 0 done, 1 failed (a one-line reason on stderr), 2 usage error, 130 interrupted (Ctrl-C; 143 SIGTERM):
an interrupted command leaves nothing half-written under a final name and resumes when run again."""


class Filter(argparse.Action):
    """``--include`` / ``--exclude``: appended in order to ``filters`` (later ones win, as in ``aws s3``)."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: str | Sequence[object] | None, option_string: str | None = None) -> None:
        kind = "include" if option_string == "--include" else "exclude"
        namespace.filters = [*(getattr(namespace, "filters", None) or []), (kind, str(values))]


def _common() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--json", action="store_true", help="print machine-readable JSON")
    common.add_argument("--stats", action="store_true", help="print where the time went: requests by method, bytes, "
                        "retries and throttling, time per stage (with --json: a \"stats\" object)")
    common.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    common.add_argument("--progress", action="store_true", help="show a progress bar even when not on a terminal")
    common.add_argument("--part-size", type=parse_size, default=None, help="part size, e.g. 32MiB")
    common.add_argument("--concurrency", type=int, default=None,
                        help="most requests in flight (default: as many as the link carries, up to 256)")
    common.add_argument("--memory-limit", type=parse_size, default=None,
                        help="most bytes of buffers the transfer holds, e.g. 512MiB (default 1GiB)")
    common.add_argument("-v", "--verbose", action="count", default=0, help="log retries and more (-vv: debug)")
    common.add_argument("--log-level", choices=LOG_LEVELS, default=None, help="log level (default warning)")
    return common


def _selecting(dry_run: bool = True) -> argparse.ArgumentParser:
    sel = argparse.ArgumentParser(add_help=False)
    sel.add_argument("--include", action=Filter, metavar="PATTERN", dest="filters", default=[],
                     help="take back what an earlier --exclude dropped, e.g. --exclude '*' --include '*.safetensors'")
    sel.add_argument("--exclude", action=Filter, metavar="PATTERN", dest="filters", default=[],
                     help="leave out matching paths (a pattern without '/' matches a name at any depth: '*.tmp', "
                          "'.cache'); later filters win")
    if dry_run:
        sel.add_argument("-n", "--dry-run", action="store_true", help="print what would happen, do nothing")
    return sel


def _pair(cmd: argparse.ArgumentParser, what: str) -> None:
    cmd.add_argument("src", help=f"what to {what}: a local path or a store URI, wildcards allowed, e.g. "
                                 "ckpt/, 's3://b/run/*.safetensors'")
    cmd.add_argument("dst", help="where: a local path or a store URI; a trailing '/' puts a file inside, e.g. "
                                 "s3://b/run/, out/")


def build_parser(bench: bool = False) -> argparse.ArgumentParser:
    """The argument parser (``bench``: list ``fastckpt bench``, available in a source checkout)."""
    p = argparse.ArgumentParser(prog="fastckpt", description="Fast, verified checkpoint transfers to and from "
                                "object stores and filesystems.", epilog=LOCATIONS,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=f"fastckpt {__version__}")
    common, selecting = _common(), _selecting()
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def verb(name: str, line: str, *parents: argparse.ArgumentParser) -> argparse.ArgumentParser:
        return sub.add_parser(name, parents=[common, *parents], help=line, description=line, epilog=LOCATIONS,
                              formatter_class=argparse.RawDescriptionHelpFormatter)

    cp = verb("cp", "copy files or objects: local to store, store to local, store to store", selecting)
    _pair(cp, "copy")
    cp.add_argument("--base", default=None, metavar="URI",
                    help="upload: an earlier copy in the same bucket (a checkpoint, 'latest', or a prefix); files and "
                         "parts that did not change are copied by the store, not sent")
    cp.add_argument("--raw", action="store_true",
                    help="download: every object as it is, a checkpoint's .fastckpt/ records and uncommitted files "
                         "too (default: a committed checkpoint brings its committed files only, verified)")
    cp.add_argument("--durable", action="store_true",
                    help="fsync downloaded files before they take their names (default: as s5cmd and the AWS CLI, no)")
    mv = verb("mv", "move: copy (server-side within a store), then delete the source", selecting)
    _pair(mv, "move")
    sync = verb("sync", "send only what differs (by XXH3 digest where recorded, else size and time)", selecting)
    _pair(sync, "mirror (a folder)")
    sync.add_argument("--delete", action="store_true", help="also delete what the source does not hold")
    rm = verb("rm", "remove objects (a committed checkpoint loses its marker first)", selecting)
    rm.add_argument("uri", help="an object, or with --recursive a prefix, e.g. s3://b/run/step-100")
    rm.add_argument("-r", "--recursive", action="store_true", help="remove everything below the prefix")
    cat = verb("cat", "print an object to stdout (ranged reads in parallel, verified)")
    cat.add_argument("uri", help="an object, e.g. s3://b/run/config.json")
    ls = verb("ls", "list a prefix: objects and folders one level down", _selecting(dry_run=False))
    ls.add_argument("uri", help="a prefix or object, wildcards allowed, e.g. s3://b/run/, 's3://b/run/*.json'")
    ls.add_argument("-l", "--long", action="store_true", help="also show each object's time")
    ls.add_argument("-r", "--recursive", action="store_true", help="every object below, not one level")
    ls.add_argument("-c", "--checkpoints", action="store_true",
                    help="the checkpoints below: state, step (the number ending the name), files, size, commit time")
    ls.add_argument("-H", "--human", action="store_true", help="sizes as 1.5G, not bytes")
    du = verb("du", "sizes below a prefix, per folder one level down, then the total", _selecting(dry_run=False))
    du.add_argument("uri", help="a prefix, wildcards allowed, e.g. s3://b/runs/")
    du.add_argument("-H", "--human", action="store_true", help="sizes as 1.5G, not bytes")
    ver = verb("verify", "re-hash a checkpoint or objects against their recorded digests")
    ver.add_argument("uri", help="a checkpoint, a folder of checkpoints or a prefix, e.g. s3://b/run/step-100")
    ver.add_argument("--allow-uncommitted", action="store_true", help="also verify uncommitted checkpoints")
    gcp = verb("gc", "remove uncommitted attempts and stale uploads (and old checkpoints with --keep-last)")
    gcp.add_argument("uri", help="a folder of checkpoints, e.g. s3://b/run")
    gcp.add_argument("--older-than", type=float, default=24 * 3600.0, help="seconds (default 86400)")
    gcp.add_argument("-n", "--dry-run", action="store_true", help="only list what would be removed")
    gcp.add_argument("--keep-last", type=int, default=None, metavar="K",
                     help="also remove the committed checkpoints below URI but the newest K (marker first)")
    gcp.add_argument("--keep-every-steps", type=int, default=None, metavar="N",
                     help="with the other --keep rules: also keep those whose step (the number ending the name) is a "
                          "multiple of N")
    gcp.add_argument("--keep-every", type=float, default=None, metavar="SECONDS",
                     help="also keep the first checkpoint committed in each window of SECONDS")
    gcp.add_argument("--best", type=int, default=None, metavar="K",
                     help="also keep the best K by --metric (recorded at save time: save(..., metrics=))")
    gcp.add_argument("--metric", default=None, metavar="NAME", help="the metric --best ranks by, e.g. eval_loss")
    gcp.add_argument("--mode", choices=("min", "max"), default="min", help="min: lower is better (default), max")
    gcp.add_argument("--grace", type=float, default=0.0, metavar="SECONDS",
                     help="keep a checkpoint that was the newest less than SECONDS ago (a reader may hold it; "
                          "default 0)")
    agent = verb("agent", "drain a checkpoint tier to the durable store (the node agent; runs until idle)")
    agent.add_argument("tier", help="the tier directory, e.g. /dev/shm/fastckpt")
    agent.add_argument("--keep", type=int, default=KEEP, help=f"committed copies kept once drained ({KEEP})")
    agent.add_argument("--idle", type=float, default=IDLE_S, help=f"seconds with nothing queued before exiting "
                       f"({IDLE_S:g}; inf: never, for an agent run as a supervised service)")
    agent.add_argument("--status", action="store_true", help="only report the queue, failures and copies")
    agent.add_argument("--metrics-port", type=int, default=None, metavar="PORT",
                       help="serve Prometheus metrics (queue depth, oldest entry's age, drained bytes, failures, "
                       "requests) on http://ADDR:PORT/metrics while the agent runs")
    agent.add_argument("--metrics-addr", default="127.0.0.1", metavar="ADDR",
                       help="address the metrics are served on (127.0.0.1; 0.0.0.0 for a scraper on another host)")
    agent.add_argument("--lock-fd", type=int, default=None, help=argparse.SUPPRESS)  # handed over by ensure_agent
    bl = verb("bench-load", "time loading a safetensors model (one file or a Hugging Face folder) into tensors, "
              "as an inference server would (needs torch)")
    bl.add_argument("uri", help="a .safetensors object or a model folder, e.g. s3://b/models/llama-8b/")
    bl.add_argument("--rounds", type=int, default=3, help="loads to time (default 3; the median is reported)")
    bl.add_argument("--device", default="cpu", help="where the tensors land, e.g. cuda:0 (default cpu)")
    demo = verb("demo", "upload and download a synthetic checkpoint on the local disk, with timings")
    demo.add_argument("--size", default="1GiB", help="checkpoint size (default 1GiB)")
    demo.add_argument("--dir", default=None, help="scratch directory (default: system temp)")
    verb("doctor", "show versions, the native accelerator, backends and configuration")
    if bench:
        sub.add_parser("bench", help="benchmarks against peers (see bench/run.py --help)", add_help=False)
    return p


def bench_root() -> str | None:
    """The source checkout holding ``bench/`` beside this package, if any (the benchmarks are not shipped)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return root if os.path.isfile(os.path.join(root, "bench", "run.py")) else None
