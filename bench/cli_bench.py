"""The command line against s5cmd's: whole processes, rounds interleaved, medians.

    python -m bench.cli_bench --server juicefs --objects 20000 --files 2000 --rounds 3 --out bench/results/cli.json

Rows (each tool at its defaults, on its own copy of the data, each command in its own process):

- ``ls``: a recursive listing of ``--objects`` objects (``fastckpt ls -r`` / ``s5cmd ls 'prefix/*'``), a line each;
- ``rm``: removing them (``fastckpt rm -r`` / ``s5cmd rm 'prefix/*'``), a line each, put back before each round
  (untimed);
- ``sync``: a ``--files``-file tree (64 KiB each) with 5% of its files rewritten (same size, new bytes) since the
  last sync (``fastckpt sync`` / ``s5cmd sync``); the files each tool sent are counted from its own report;
- ``cp *``: downloading the ``--files`` objects a wildcard matches (``fastckpt cp 'prefix/*.bin' out/`` /
  ``s5cmd cp``) into a fresh folder.

``--server``: ``moto`` (``harness.s3``, semantics; slow) or ``juicefs`` (the JuiceFS S3 gateway, speed).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from bench.engines import s5cmd_path  # noqa: E402
from bench.juicefs import JuiceFSGateway  # noqa: E402
from bench.state_bench import s3_env  # noqa: E402

BUCKET = "bench"
FILE_SIZE = 64 << 10
FASTCKPT = [sys.executable, "-m", "fastckpt.cli"]


class Server:
    """An S3 endpoint with the bucket, and the environment both tools take it from."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        if kind == "juicefs":
            self.gateway = JuiceFSGateway(buckets=(BUCKET,)).start()
            self.endpoint = self.gateway.endpoint
        else:
            from harness.s3 import start_moto

            self.moto = start_moto()
            self.moto.create_bucket(BUCKET)
            self.endpoint = self.moto.endpoint
        self.env = {**os.environ, **s3_env(self.endpoint)}

    def uri(self, prefix: str) -> str:
        return f"s3://{BUCKET}/{prefix}?endpoint_override={self.endpoint}"

    def s5(self, *args: str) -> list[str]:
        return [s5cmd_path(), "--endpoint-url", self.endpoint, *args]

    def stop(self) -> None:
        if self.kind == "juicefs":
            self.gateway.stop()
        else:
            from harness.s3 import stop_moto

            stop_moto(self.moto)


def run(argv: list[str], env: dict[str, str]) -> tuple[float, str]:
    """Wall seconds of the whole process and its stdout; RuntimeError when it fails."""
    t0 = time.perf_counter()
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, check=False)
    took = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv[:4])}... exited with {proc.returncode}: {proc.stderr.strip()[-1500:]}")
    return took, proc.stdout


def write_tree(root: str, count: int, size: int) -> list[str]:
    """``count`` files of ``size`` random bytes below ``root`` (in 20 folders); their paths."""
    paths = []
    for i in range(count):
        path = os.path.join(root, f"d{i % 20:02d}", f"f{i:05d}.bin")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(os.urandom(size))
        paths.append(path)
    return paths


def interleaved(rounds: int, engines: dict[str, Callable[[], float]], before: Callable[[], None] | None = None
                ) -> dict[str, list[float]]:
    """Each engine's times, the engines' order alternating round by round (``before`` runs before each round)."""
    times: dict[str, list[float]] = {name: [] for name in engines}
    for r in range(rounds):
        if before is not None:
            before()
        for name in (list(engines) if r % 2 == 0 else list(reversed(engines))):
            times[name].append(engines[name]())
    return times


def bench_listing_and_rm(server: Server, scratch: str, objects: int, rounds: int) -> dict[str, Any]:
    tree = os.path.join(scratch, "many")
    write_tree(tree, objects, 1)
    prefixes = {"fastckpt": "many-f", "s5cmd": "many-s"}

    def put_back() -> None:
        for prefix in prefixes.values():
            run(server.s5("cp", f"{tree}/*", f"s3://{BUCKET}/{prefix}/"), server.env)

    def ls_fastckpt() -> float:
        took, out = run([*FASTCKPT, "ls", "-r", server.uri(prefixes["fastckpt"])], server.env)
        assert out.count("\n") == objects, out[-500:]
        return took

    def ls_s5cmd() -> float:
        took, out = run(server.s5("ls", f"s3://{BUCKET}/{prefixes['s5cmd']}/*"), server.env)
        assert out.count("\n") == objects, out[-500:]
        return took

    def rm_fastckpt() -> float:
        took, out = run([*FASTCKPT, "rm", "-r", server.uri(prefixes["fastckpt"])], server.env)
        assert out.count("\n") == objects, out[-500:]
        return took

    def rm_s5cmd() -> float:
        return run(server.s5("rm", f"s3://{BUCKET}/{prefixes['s5cmd']}/*"), server.env)[0]

    put_back()
    ls = interleaved(rounds, {"fastckpt": ls_fastckpt, "s5cmd": ls_s5cmd})
    rm = interleaved(rounds, {"fastckpt": rm_fastckpt, "s5cmd": rm_s5cmd}, put_back)
    return {f"ls -r {objects} objects": ls, f"rm -r {objects} objects": rm}


def bench_sync(server: Server, scratch: str, files: int, rounds: int) -> dict[str, Any]:
    tree = os.path.join(scratch, "tree")
    paths = write_tree(tree, files, FILE_SIZE)
    run([*FASTCKPT, "sync", tree, server.uri("sync-f")], server.env)
    run(server.s5("sync", f"{tree}/", f"s3://{BUCKET}/sync-s/"), server.env)
    rng = random.Random(0)
    sent: dict[str, list[int]] = {"fastckpt": [], "s5cmd": []}

    def change() -> None:
        time.sleep(1.1)  # the rewrites are newer than the last sync's objects, to the second (s5cmd's resolution)
        for path in rng.sample(paths, files // 20):
            with open(path, "r+b") as f:
                f.write(os.urandom(FILE_SIZE))

    def fastckpt() -> float:
        took, out = run([*FASTCKPT, "sync", "--json", tree, server.uri("sync-f")], server.env)
        sent["fastckpt"].append(json.loads(out)["files"])
        return took

    def s5cmd() -> float:
        took, out = run(server.s5("sync", f"{tree}/", f"s3://{BUCKET}/sync-s/"), server.env)
        sent["s5cmd"].append(sum(line.startswith("cp ") for line in out.splitlines()))
        return took

    times = interleaved(rounds, {"fastckpt": fastckpt, "s5cmd": s5cmd}, change)
    return {f"sync {files} files, 5% changed": times, "sync files sent": sent}


def bench_wildcard_cp(server: Server, scratch: str, files: int, rounds: int) -> dict[str, Any]:
    tree = os.path.join(scratch, "wild")
    write_tree(tree, files, FILE_SIZE)
    run([*FASTCKPT, "cp", tree, server.uri("wild/")], server.env)

    def fresh() -> str:
        out = os.path.join(scratch, f"out-{os.urandom(4).hex()}")
        return out

    def fastckpt() -> float:
        out = fresh()
        took, _ = run([*FASTCKPT, "cp", server.uri("wild/**/*.bin"), out + "/"], server.env)
        assert sum(len(f) for _, _, f in os.walk(out)) == files
        shutil.rmtree(out)
        return took

    def s5cmd() -> float:
        out = fresh()
        took, _ = run(server.s5("cp", f"s3://{BUCKET}/wild/*.bin", out + "/"), server.env)
        assert sum(len(f) for _, _, f in os.walk(out)) == files
        shutil.rmtree(out)
        return took

    return {f"cp wildcard, {files} objects down": interleaved(rounds, {"fastckpt": fastckpt, "s5cmd": s5cmd})}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--server", choices=["juicefs", "moto"], default="juicefs")
    p.add_argument("--objects", type=int, default=20000)
    p.add_argument("--files", type=int, default=2000)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    scratch = tempfile.mkdtemp(prefix="fastckpt-cli-bench-")
    server = Server(args.server)
    try:
        rows: dict[str, Any] = {}
        rows.update(bench_listing_and_rm(server, scratch, args.objects, args.rounds))
        rows.update(bench_sync(server, scratch, args.files, args.rounds))
        rows.update(bench_wildcard_cp(server, scratch, args.files, args.rounds))
    finally:
        server.stop()
        shutil.rmtree(scratch, ignore_errors=True)
    report = {"server": args.server, "rounds": args.rounds, "rows": rows}
    for name, times in rows.items():
        if name == "sync files sent":
            print(f"{name:<36} fastckpt {times['fastckpt']}  s5cmd {times['s5cmd']}")
            continue
        f, s = statistics.median(times["fastckpt"]), statistics.median(times["s5cmd"])
        print(f"{name:<36} fastckpt {f:7.2f} s   s5cmd {s:7.2f} s   s5cmd/fastckpt {s / f:5.2f}x")
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(report, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
