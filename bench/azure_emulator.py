"""One file up to and down from Azurite: fastckpt vs adlfs behind pyarrow (the path Ray takes).

    python -m bench.azure_emulator [--size 512MiB] [--repeat 1] [--out bench/results/azure_emulator.json]

Starts its own Azurite (in memory) on 127.0.0.1. Reports MiB/s and client CPU seconds per GiB
(``resource.getrusage`` of this process, all threads; Azurite's own CPU is not counted). The emulator
and the client share the machine's cores, so the numbers compare clients, not Azure.
fastckpt runs with its defaults and ``fsync=False`` (the peer does not fsync either), once with its
per-block Content-MD5 and once without. adlfs runs with its defaults through
``pyarrow.fs.PyFileSystem(FSSpecHandler(...))`` and ``pyarrow.fs.copy_files`` with 64 MiB chunks.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from pathlib import Path

import fastckpt
from bench.single_file import copy_files_runs, file_digest, timed
from fastckpt.config import parse_size
from harness.azure import CONTAINER, start_azurite, stop_azurite

MiB = 1 << 20
PEER_CHUNK = 64 * MiB


def fastckpt_runs(uri: str, src: Path, out: Path, size: int, md5: bool) -> tuple[dict, dict]:
    os.environ["FASTCKPT_AZURE_CONTENT_MD5"] = "1" if md5 else "0"
    config = fastckpt.TransferConfig.from_env(fsync=False)
    up = timed(lambda: fastckpt.upload(src, uri, config=config), size)
    down = timed(lambda: fastckpt.download(uri, out, config=config), size)
    return up, down


def adlfs_runs(conn: str, path: str, src: Path, out: Path, size: int) -> tuple[dict, dict]:
    import adlfs
    import pyarrow.fs as pafs

    remote = pafs.PyFileSystem(pafs.FSSpecHandler(adlfs.AzureBlobFileSystem(connection_string=conn)))
    return copy_files_runs(remote, path, src, out, size, PEER_CHUNK)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="512MiB", help="file size (256MiB..1GiB suggested)")
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--out", default="bench/results/azure_emulator.json")
    args = parser.parse_args()
    size = parse_size(args.size)

    with tempfile.TemporaryDirectory(prefix="fastckpt-azbench-") as tmp:
        work = Path(tmp)
        (work / "azurite").mkdir()
        server = start_azurite(str(work / "azurite"))
        try:
            server.create_container(CONTAINER)
            src = work / "src.bin"
            with open(src, "wb") as f:
                for offset in range(0, size, 64 * MiB):
                    f.write(os.urandom(min(64 * MiB, size - offset)))
            expected = file_digest(src)
            base = f"az://{CONTAINER}/bench?account=devstoreaccount1&endpoint_override={server.endpoint}"
            results = []
            for run in range(args.repeat):
                for name in ("fastckpt", "fastckpt-no-md5", "adlfs+pyarrow"):
                    out = work / f"out-{name}-{run}.bin"
                    if name.startswith("fastckpt"):
                        uri = base.replace("/bench?", f"/bench/{name}-{run}.bin?")
                        up, down = fastckpt_runs(uri, src, out, size, md5=name == "fastckpt")
                    else:
                        up, down = adlfs_runs(server.connection_string, f"{CONTAINER}/bench/{name}-{run}.bin",
                                              src, out, size)
                    if file_digest(out) != expected:
                        raise SystemExit(f"{name}: downloaded file differs from the source")
                    out.unlink()
                    for direction, r in (("upload", up), ("download", down)):
                        results.append({"engine": name, "direction": direction, "run": run, **r})
                        print(f"{name:16} {direction:8} {r['mib_s']:8.1f} MiB/s {r['cpu_s_per_gib']:6.2f} CPU-s/GiB "
                              f"({r['seconds']:.2f} s)", flush=True)
        finally:
            stop_azurite(server)
    summary = {}
    for key in dict.fromkeys((r["engine"], r["direction"]) for r in results):
        runs = [r for r in results if (r["engine"], r["direction"]) == key]
        med = summary[" ".join(key)] = {m: statistics.median(r[m] for r in runs) for m in ("mib_s", "cpu_s_per_gib")}
        print(f"median {' '.join(key):25} {med['mib_s']:8.1f} MiB/s {med['cpu_s_per_gib']:6.2f} CPU-s/GiB")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"size": size, "cores": os.cpu_count(), "median": summary,
                                          "results": results}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
