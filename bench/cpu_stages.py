"""Where the client's CPU goes, per stage, for one S3 upload and download of a single file (Linux ``perf``).

    python -m bench.cpu_stages --endpoint http://127.0.0.1:PORT [--size 1GiB] [--python-path DIR]

Runs ``fastckpt.upload`` then ``fastckpt.download`` (to /dev/shm, fsync off) of one random file in a
child process under ``perf record -g`` and sorts every sample by the first frame of its call chain that
names a stage: socket send / receive (``tcp_sendmsg`` / ``tcp_recvmsg`` or ``tcp_splice_read``), file read /
write (``vfs_read`` / ``vfs_write`` of the file, or a splice into it), hashing (XXH3), Python (the interpreter),
page faults of the buffers and mappings, and the rest (scheduling, futexes, the event loop's epoll).
``--python-path`` runs another checkout of fastckpt (an older commit) for a before / after table.
Credentials come from the AWS_* environment; the bucket ``bench`` must exist. Needs ``perf`` (Debian:
linux-perf) and permission to sample the kernel.
"""

from __future__ import annotations

import argparse
import collections
import os
import subprocess
import sys
import tempfile

from fastckpt.config import parse_size

STAGES = (  # (stage, substrings of a frame), first match from the leaf up wins
    ("hash", ("XXH3", "xxh3", "libxxhash")),
    ("socket receive", ("tcp_recvmsg", "sock_recvmsg", "sock_read_iter", "tcp_splice_read")),
    ("socket send", ("tcp_sendmsg", "sock_sendmsg", "sock_write_iter")),
    ("file write", ("vfs_write", "__x64_sys_pwrite", "copy_file_range", "iter_file_splice_write")),
    ("file read", ("vfs_read", "filemap_read", "__x64_sys_pread")),
    ("buffer page faults", ("exc_page_fault", "do_user_addr_fault")),
    ("Python", ("_PyEval", "libpython", "PyObject", "python3")),
)
CHILD = """
import sys, time
import fastckpt, fastckpt.stores.s3
direction, uri, src, dst, mark = sys.argv[1:6]
cfg = fastckpt.TransferConfig.from_env(fsync=False)
open(mark, "w").write(repr(time.monotonic()))
if direction == "upload":
    fastckpt.upload(src, uri, config=cfg)
else:
    fastckpt.download(uri, dst, config=cfg)
"""


def stage_of(chain: list[str]) -> str:
    """The stage of one sample from its frames, leaf first."""
    for frame in chain:
        for stage, marks in STAGES:
            if any(mark in frame for mark in marks):
                return stage
    return "other (scheduling, futex, epoll, ...)"


def profile(direction: str, uri: str, src: str, dst: str, python_path: str | None, workdir: str
            ) -> dict[str, float]:
    """CPU seconds per stage of one transfer (perf samples at 999 Hz), from the moment the child has imported
    fastckpt and its S3 backend (perf's clock is CLOCK_MONOTONIC, the child notes when its transfer starts)."""
    data, mark = os.path.join(workdir, f"{direction}.perf"), os.path.join(workdir, f"{direction}.start")
    env = {**os.environ, **({"PYTHONPATH": python_path} if python_path else {})}
    subprocess.run(["perf", "record", "-q", "-k", "CLOCK_MONOTONIC", "-F", "999", "-g", "-o", data, "--",
                    sys.executable, "-c", CHILD, direction, uri, src, dst, mark], check=True, env=env,
                   cwd=workdir)  # not the caller's directory: a checkout there would come before PYTHONPATH
    with open(mark) as f:
        start = float(f.read())
    script = subprocess.run(["perf", "script", "-i", data, "-F", "comm,time,ip,sym,dso"], check=True,
                            capture_output=True, text=True).stdout
    counts: collections.Counter[str] = collections.Counter()
    for sample in script.split("\n\n"):
        lines = [ln.strip() for ln in sample.strip().splitlines()]
        if len(lines) > 1 and float(lines[0].rstrip(":").split()[-1]) >= start:
            counts[stage_of(lines[1:])] += 1
    return {stage: n / 999 for stage, n in counts.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench.cpu_stages", description=__doc__.split("\n\n")[0])
    parser.add_argument("--endpoint", required=True)
    parser.add_argument("--size", default="1GiB")
    parser.add_argument("--python-path", help="run this checkout of fastckpt instead (PYTHONPATH)")
    args = parser.parse_args(argv)
    size = parse_size(args.size)
    with tempfile.TemporaryDirectory(prefix="fastckpt-stages-") as workdir:
        src = os.path.join(workdir, "src.bin")
        with open(src, "wb") as f:
            for _ in range(0, size, 64 << 20):
                f.write(os.urandom(min(64 << 20, size)))
        uri = f"s3://bench/stages/{os.getpid()}.bin?endpoint_override={args.endpoint}"
        dst = f"/dev/shm/fastckpt-stages-{os.getpid()}.bin"
        try:
            rows = {d: profile(d, uri, src, dst, args.python_path, workdir) for d in ("upload", "download")}
        finally:
            if os.path.exists(dst):
                os.unlink(dst)
    gib = size / (1 << 30)
    stages = [s for s, _ in STAGES] + ["other (scheduling, futex, epoll, ...)"]
    print("| stage | upload CPU s/GiB | download CPU s/GiB |\n|---|---|---|")
    for stage in stages:
        print(f"| {stage} | {rows['upload'].get(stage, 0) / gib:.2f} | {rows['download'].get(stage, 0) / gib:.2f} |")
    print(f"| **total** (client creation and transfer) | {sum(rows['upload'].values()) / gib:.2f} | "
          f"{sum(rows['download'].values()) / gib:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
