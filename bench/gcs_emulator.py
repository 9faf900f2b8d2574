"""One file up to and down from fake-gcs-server: fastckpt vs gcsfs behind pyarrow (the path Ray takes).

    python -m bench.gcs_emulator [--size 512MiB] [--repeat 1] [--out bench/results/gcs_emulator.json]

Starts its own fake-gcs-server (in memory) on 127.0.0.1. Reports MiB/s and client CPU seconds per GiB
(``resource.getrusage`` of this process, all threads; the emulator's own CPU is not counted). The
emulator and the client share the machine's cores, so the numbers compare clients, not GCS.
fastckpt runs with its defaults (parallel composite upload, ranged parallel download) and
``fsync=False`` (the peer does not fsync either). gcsfs runs with its defaults through
``pyarrow.fs.PyFileSystem(FSSpecHandler(...))`` and ``pyarrow.fs.copy_files`` with 64 MiB chunks.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

import fastckpt
from bench.single_file import copy_files_runs, file_digest, timed
from fastckpt.config import parse_size
from harness.gcs import BUCKET, start_fake_gcs, stop_fake_gcs

MiB = 1 << 20
PEER_CHUNK = 64 * MiB


def fastckpt_runs(uri: str, src: Path, out: Path, size: int) -> tuple[dict, dict]:
    """Upload then download through fastckpt's sync API."""
    config = fastckpt.TransferConfig.from_env(fsync=False)
    up = timed(lambda: fastckpt.upload(src, uri, config=config), size)
    down = timed(lambda: fastckpt.download(uri, out, config=config), size)
    return up, down


def gcsfs_runs(endpoint: str, path: str, src: Path, out: Path, size: int) -> tuple[dict, dict]:
    """Upload then download through gcsfs wrapped as a pyarrow filesystem."""
    # gcsfs otherwise probes the bucket type over gRPC/TLS first, which an emulator never answers (60 s stall)
    os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
    import gcsfs
    import pyarrow.fs as pafs

    remote = pafs.PyFileSystem(pafs.FSSpecHandler(gcsfs.GCSFileSystem(endpoint_url=endpoint, token="anon")))
    return copy_files_runs(remote, path, src, out, size, PEER_CHUNK)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="512MiB", help="file size (256MiB..1GiB suggested)")
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--out", default="bench/results/gcs_emulator.json")
    args = parser.parse_args()
    size = parse_size(args.size)

    results = []
    with tempfile.TemporaryDirectory(prefix="fastckpt-gcsbench-") as tmp:
        work = Path(tmp)
        server = start_fake_gcs()
        try:
            src = work / "src.bin"
            with open(src, "wb") as f:
                for offset in range(0, size, 64 * MiB):
                    f.write(os.urandom(min(64 * MiB, size - offset)))
            expected = file_digest(src)
            for run in range(args.repeat):
                for name in ("fastckpt", "gcsfs+pyarrow"):
                    out = work / f"out-{name}-{run}.bin"
                    key = f"bench/{name}-{run}.bin"
                    if name == "fastckpt":
                        up, down = fastckpt_runs(f"gs://{BUCKET}/{key}?endpoint_override={server.url}",
                                                 src, out, size)
                    else:
                        up, down = gcsfs_runs(server.url, f"{BUCKET}/{key}", src, out, size)
                    if file_digest(out) != expected:
                        raise SystemExit(f"{name}: downloaded file differs from the source")
                    out.unlink()
                    for direction, r in (("upload", up), ("download", down)):
                        results.append({"engine": name, "direction": direction, "run": run, **r})
                        print(f"{name:14} {direction:8} {r['mib_s']:8.1f} MiB/s {r['cpu_s_per_gib']:6.2f} CPU-s/GiB "
                              f"({r['seconds']:.2f} s)", flush=True)
        finally:
            stop_fake_gcs(server)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"size": size, "cores": os.cpu_count(), "results": results}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
