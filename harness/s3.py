"""moto's S3 server on 127.0.0.1 (free port), with the dummy credentials the clients use."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

from .procs import free_port, stop_process

BUCKET = "fastckpt-test"
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing-access-key", "AWS_SECRET_ACCESS_KEY": "testing-secret-key",
               "AWS_DEFAULT_REGION": "us-east-1"}
CLEARED = ("AWS_SESSION_TOKEN", "AWS_PROFILE", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_REGION",
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
