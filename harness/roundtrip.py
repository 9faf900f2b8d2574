"""Round-trip a multipart file through every backend's emulator with a given ``fastckpt`` executable.

``python -m harness.roundtrip /path/to/venv/bin/fastckpt`` starts moto (S3), fake-gcs-server (GCS) and
Azurite (Azure) from this environment, then with the given CLI (e.g. a wheel installed into a clean venv)
uploads a file to each, verifies it, downloads it and compares the bytes. Exit status 1 if any fails.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager

from . import azure, gcs, s3
from .uris import emulator_uri

SIZE = 40 << 20
"""Bytes of the test file: several parts on every backend."""


@contextmanager
def _moto() -> Iterator[tuple[str, dict[str, str | None]]]:
    server = s3.start_moto()
    try:
        server.create_bucket(s3.BUCKET)
        env: dict[str, str | None] = {**dict.fromkeys(s3.CLEARED), **s3.CREDENTIALS}
        yield server.uri(s3.BUCKET, f"rt-{uuid.uuid4().hex[:8]}"), env
    finally:
        s3.stop_moto(server)


@contextmanager
def _fake_gcs() -> Iterator[tuple[str, dict[str, str | None]]]:
    server = gcs.start_fake_gcs()
    try:
        yield emulator_uri("gcs", server.url, f"rt-{uuid.uuid4().hex[:8]}"), {}
    finally:
        gcs.stop_fake_gcs(server)


@contextmanager
def _azurite(workdir: str) -> Iterator[tuple[str, dict[str, str | None]]]:
    server = azure.start_azurite(workdir)
    try:
        server.create_container(azure.CONTAINER)
        yield emulator_uri("azure", server.endpoint, f"rt-{uuid.uuid4().hex[:8]}"), {}
    finally:
        azure.stop_azurite(server)


def _round_trip(cli: str, base: str, env: dict[str, str | None], src: str, workdir: str) -> str | None:
    """None when ``src`` goes up, verifies and comes back intact through ``base``; else what failed.

    ``env`` is laid over this process's environment; a None value unsets that variable.
    """
    path, _, query = base.partition("?")
    uri = f"{path}/big.bin" + (f"?{query}" if query else "")
    out = os.path.join(workdir, f"back-{uuid.uuid4().hex[:6]}")
    full_env = {k: v for k, v in {**os.environ, **env}.items() if v is not None}
    for args in (["cp", src, uri], ["verify", uri], ["cp", uri, out]):
        done = subprocess.run([cli, *args, "-q"], env=full_env, capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            return f"fastckpt {args[0]} failed ({done.returncode}): {done.stderr.strip()[-500:]}"
    with open(src, "rb") as a, open(out, "rb") as b:
        return None if a.read() == b.read() else "downloaded bytes differ"


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m harness.roundtrip FASTCKPT_EXECUTABLE", file=sys.stderr)
        return 2
    cli = argv[0]
    with tempfile.TemporaryDirectory(prefix="fastckpt-roundtrip-") as workdir:
        src = os.path.join(workdir, "big.bin")
        with open(src, "wb") as f:
            f.write(os.urandom(SIZE))
        servers: dict[str, Callable[[], object]] = {"s3": _moto, "gcs": _fake_gcs,
                                                     "azure": lambda: _azurite(workdir)}
        failures = 0
        for name, start in servers.items():
            with ExitStack() as stack:
                base, env = stack.enter_context(start())  # type: ignore[arg-type]
                problem = _round_trip(cli, base, env, src, workdir)
            print(f"round trip {name:<6} {'ok' if problem is None else 'FAILED: ' + problem}")
            failures += problem is not None
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
