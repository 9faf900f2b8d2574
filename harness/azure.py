"""Azurite (the Azure Blob emulator, from npm) on 127.0.0.1 for the conformance suite and Azure tests.

Azurite is looked up in ``.ci/node/node_modules/.bin`` (``npm install --prefix .ci/node azurite@3.35.0``)
and then on PATH; without it the fixtures fail with that instruction.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.error import HTTPError, URLError
from urllib.request import urlopen

from fastckpt.stores.azure import EMULATOR_ACCOUNT, EMULATOR_KEY

from .procs import free_port, stop_process

CONTAINER = "fastckpt-test"
_LOCAL_BIN = Path(__file__).resolve().parents[1] / ".ci" / "node" / "node_modules" / ".bin" / "azurite-blob"


@dataclass
class Azurite:
    """A running Azurite blob service."""

    process: subprocess.Popen
    port: int

    @property
    def endpoint(self) -> str:
        """Host URL, without the account (``endpoint_override`` appends it)."""
        return f"http://127.0.0.1:{self.port}"

    @property
    def account_url(self) -> str:
        """Blob service URL of the emulator account."""
        return f"{self.endpoint}/{EMULATOR_ACCOUNT}"

    @property
    def connection_string(self) -> str:
        """Connection string of the emulator account."""
        return (f"DefaultEndpointsProtocol=http;AccountName={EMULATOR_ACCOUNT};AccountKey={EMULATOR_KEY};"
                f"BlobEndpoint={self.account_url};")

    def create_container(self, name: str) -> None:
        """Create container ``name`` (no error when it exists)."""
        from azure.core.exceptions import ResourceExistsError
        from azure.storage.blob import BlobServiceClient

        with BlobServiceClient.from_connection_string(self.connection_string, retry_total=0) as client:
            try:
                client.create_container(name)
            except ResourceExistsError:
                pass


def azurite_binary() -> str | None:
    """Path of ``azurite-blob``: the project-local npm install, else PATH."""
    return str(_LOCAL_BIN) if os.access(_LOCAL_BIN, os.X_OK) else shutil.which("azurite-blob")



def start_azurite(workdir: str, timeout: float = 60.0) -> Azurite:
    """Start Azurite's blob service on a free port of 127.0.0.1, data in memory, and wait until it answers."""
    binary = azurite_binary()
    if binary is None:
        raise RuntimeError("Azurite is not installed: run `npm install --prefix .ci/node azurite@3.35.0` "
                           "in the repository root (needs Node >= 18), or put azurite-blob on PATH")
    port = free_port()
    with open(os.path.join(workdir, "azurite.log"), "wb") as log:
        process = subprocess.Popen(
            [binary, "--blobHost", "127.0.0.1", "--blobPort", str(port), "--inMemoryPersistence",
             "--skipApiVersionCheck", "--disableTelemetry", "--silent"],
            cwd=workdir, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    server = Azurite(process, port)
    deadline = time.monotonic() + timeout
    while True:
        try:
            urlopen(f"{server.account_url}?comp=list", timeout=2).close()
            return server
        except HTTPError:
            return server  # an answer (403 without credentials) means it is up
        except (URLError, OSError):
            pass
        if process.poll() is not None or time.monotonic() > deadline:
            stop_azurite(server)
            output = Path(workdir, "azurite.log").read_text(errors="replace")[-2000:]
            raise RuntimeError(f"Azurite did not start on 127.0.0.1:{port}: {output}")
        time.sleep(0.2)


def stop_azurite(server: Azurite) -> None:
    """Terminate Azurite (kill it if it does not exit)."""
    stop_process(server.process)
