"""A real moto S3 server on 127.0.0.1 for the s3 backend (session-scoped, free port).

``s3_uri`` returns ``s3://fastckpt-test/<unique prefix>?endpoint_override=http://127.0.0.1:PORT`` with
dummy credentials in the environment for the whole session.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from tests.procs import stop_process

BUCKET = "fastckpt-test"
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing-access-key", "AWS_SECRET_ACCESS_KEY": "testing-secret-key",
               "AWS_DEFAULT_REGION": "us-east-1"}
_CLEARED = ("AWS_SESSION_TOKEN", "AWS_PROFILE", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_REGION",
            "AWS_REQUEST_CHECKSUM_CALCULATION", "AWS_RESPONSE_CHECKSUM_VALIDATION")


@dataclass
class MotoServer:
    """A running ``moto.server`` process."""

    endpoint: str
    proc: subprocess.Popen[bytes]

    def uri(self, bucket: str, prefix: str) -> str:
        """``s3://bucket/prefix`` pointing at this server."""
        return f"s3://{bucket}/{prefix}?endpoint_override={self.endpoint}"

    def create_bucket(self, bucket: str) -> None:
        """Create ``bucket`` (moto accepts the unsigned request while auth is off)."""
        req = urllib.request.Request(f"{self.endpoint}/{bucket}", method="PUT")
        with urllib.request.urlopen(req, timeout=30) as resp:
            resp.read()


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_moto(env: dict[str, str] | None = None, timeout: float = 60.0) -> MotoServer:
    """Start ``python -m moto.server`` on a free port and wait until it answers."""
    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ, **(env or {})})
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"moto server exited with status {proc.returncode} before answering on {endpoint}")
        try:
            with urllib.request.urlopen(f"{endpoint}/moto-api/data.json", timeout=2) as resp:
                resp.read()
            return MotoServer(endpoint, proc)
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            if time.monotonic() > deadline:
                stop_moto(MotoServer(endpoint, proc))
                raise RuntimeError(f"moto server did not answer on {endpoint} within {timeout:.0f}s") from None
            time.sleep(0.2)


def stop_moto(server: MotoServer) -> None:
    """Terminate the server process (kill it if it does not exit)."""
    stop_process(server.proc)


@pytest.fixture(scope="session")
def moto_server() -> Iterator[MotoServer]:
    """The session's moto server, with dummy AWS credentials in the environment and the test bucket."""
    with pytest.MonkeyPatch.context() as mp:
        for name in _CLEARED:
            mp.delenv(name, raising=False)
        for name, value in CREDENTIALS.items():
            mp.setenv(name, value)
        server = start_moto()
        try:
            server.create_bucket(BUCKET)
            yield server
        finally:
            stop_moto(server)


@pytest.fixture
def s3_uri(moto_server: MotoServer) -> str:
    """Base URI of a fresh prefix in the test bucket."""
    return moto_server.uri(BUCKET, f"t-{uuid.uuid4().hex[:12]}/base")
