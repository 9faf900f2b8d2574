"""A stopped command stops: SIGINT / SIGTERM at each stage of a download and an upload (the first request, a
body stalled mid-way, a retry's backoff), taken by the main thread or by a thread fastckpt did not start, ends
``fastckpt cp`` with its exit code and one line (two when a clean-up waited on the stall) long before the stalled
transfer would have ended, and the same command run again resumes. A call whose clean-up hangs still returns: at
once on a second Ctrl-C, else after a bounded grace.

The bounds are generous (a loaded 2-core host must not break them); what they catch is a hang: a command that
misses its signal waits for a stall of ``STALL_S``. The stop itself takes about 0.1 s here.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlsplit

import pytest

import fastckpt
from harness.proxy import Fault, FaultProxy

from ..servers.s3 import BUCKET as S3_BUCKET
from ..stores.test_wire_faults import fault_config

pytestmark = pytest.mark.timeout(240)

STALL_S = 600
BOUND_S = 20.0
SIZE = 24 << 20
GOING = 12 << 20
"""Bytes that go through before the stage under test begins (two 5 MiB parts and some)."""

FOREIGN = """
import signal, sys, threading
from fastckpt.cli import run

def relay():  # a thread fastckpt did not start (a library's, the user's) takes the signal
    sys.stdin.readline()
    signal.pthread_kill(threading.get_ident(), signal.{sig})

threading.Thread(target=relay, daemon=True).start()
run()
"""


def _command(delivery: str, sig: str, args: list[str]) -> list[str]:
    if delivery == "main":
        return [sys.executable, "-m", "fastckpt.cli", *args]
    return [sys.executable, "-c", FOREIGN.format(sig=sig), *args]


def _wait_for(what: str, ready: Callable[[], object], proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + 60
    while not ready() and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.02)
    assert ready(), f"the transfer never reached {what} (exit {proc.poll()})"


@pytest.mark.parametrize("delivery", ["main", "foreign"])
@pytest.mark.parametrize("stage", ["first-request", "mid-body", "backoff"])
@pytest.mark.parametrize(("direction", "sig", "code"), [("upload", "SIGTERM", 143), ("download", "SIGINT", 130)])
def test_cp_stops_at_every_stage(moto_server, tmp_path: Path, direction: str, sig: str, code: int, stage: str,
                                 delivery: str) -> None:
    import boto3

    src, data = tmp_path / "big.bin", os.urandom(SIZE)
    src.write_bytes(data)
    prefix = f"sig-{os.urandom(4).hex()}"
    direct = f"s3://{S3_BUCKET}/{prefix}/big.bin?endpoint_override={moto_server.endpoint}"
    if direction == "download":
        fastckpt.upload(src, direct, config=fault_config())
    kind = "stall" if direction == "upload" else "stall_response"
    fault = Fault(kind, after=0 if stage == "first-request" else GOING, seconds=STALL_S, across=True)
    out = tmp_path / "out"
    client = boto3.client("s3", endpoint_url=moto_server.endpoint, region_name="us-east-1")
    env = {**os.environ, "FASTCKPT_MULTIPART_THRESHOLD": "5MiB", "FASTCKPT_RETRIES": "100",
           "FASTCKPT_BACKOFF_BASE": "30", "FASTCKPT_BACKOFF_MAX": "60"}
    with FaultProxy(urlsplit(moto_server.endpoint).port, lambda n: fault) as proxy:
        uri = direct.replace(moto_server.endpoint, proxy.url)
        args = ["cp", *([str(src), uri] if direction == "upload" else [uri, str(out / "big.bin")]),
                "--part-size", "5MiB", "--concurrency", "1"]
        proc = subprocess.Popen(_command(delivery, sig, args), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, env=env)
        _wait_for(f"the stall of the {stage}", lambda: proxy.triggered, proc)
        if stage == "backoff":  # then every connection is reset and every new one refused: the client backs off
            proxy.outage(STALL_S)
        time.sleep(0.5)
        sent = time.monotonic()
        if delivery == "main":
            proc.send_signal(getattr(signal, sig))
        else:
            assert proc.stdin is not None
            proc.stdin.write("go\n")
            proc.stdin.flush()
        try:
            _, stderr = proc.communicate(timeout=BOUND_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            pytest.fail(f"{sig} ({delivery} thread) during the {stage} of a {direction} was not answered within "
                        f"{BOUND_S:.0f} s")
        took = time.monotonic() - sent
        print(f"{sig} ({delivery}) during the {stage} of a {direction}: exit {proc.returncode} after {took:.2f} s")
        assert proc.returncode == code, stderr
        *before, last = stderr.strip().splitlines()
        assert f"stopped by {sig}" in last and "resume" in last, stderr
        assert all("still cleaning up" in line for line in before), stderr  # a clean-up that waits on the stall
        if direction == "upload":
            assert client.list_objects_v2(Bucket=S3_BUCKET, Prefix=prefix).get("KeyCount") == 0
        else:
            assert not (out / "big.bin").exists()
        if stage != "mid-body":
            return
        assert len(client.list_multipart_uploads(Bucket=S3_BUCKET, Prefix=prefix).get("Uploads", [])) == (
            1 if direction == "upload" else 0)
        proxy.rule = lambda n: None
        again = subprocess.run([sys.executable, "-m", "fastckpt.cli", *args, "-v"], capture_output=True, text=True,
                               timeout=120, env=env)
    assert again.returncode == 0 and "resuming" in again.stderr, again.stderr
    assert client.list_multipart_uploads(Bucket=S3_BUCKET, Prefix=prefix).get("Uploads", []) == []
    if direction == "download":
        assert (out / "big.bin").read_bytes() == data and os.listdir(out) == ["big.bin"]


STUCK = """
import asyncio, signal, sys, threading, time
from fastckpt import _loop

_loop.STOP_GRACE_S = {grace}

async def stuck():  # a clean-up that does not end: every cancellation is ignored for a minute
    end = time.monotonic() + 60
    while time.monotonic() < end:
        try:
            await asyncio.sleep(end - time.monotonic())
        except asyncio.CancelledError:
            pass

def interrupt(*at):
    for t in at:
        time.sleep(t)
        signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)

threading.Thread(target=interrupt, args={at}, daemon=True).start()
started = time.monotonic()
try:
    _loop.BackgroundLoop.get().run(stuck())
except KeyboardInterrupt:
    print(f"{{time.monotonic() - started:.2f}}")
"""


@pytest.mark.parametrize(("at", "grace", "within"), [((0.3,), 3.0, (3.3, BOUND_S)), ((0.3, 0.7), 60.0, (1.0, BOUND_S))])
def test_an_interrupted_call_returns_when_its_clean_up_hangs(at: tuple[float, ...], grace: float,
                                                            within: tuple[float, float]) -> None:
    """The first interrupt cancels the call and waits up to the grace for its clean-up; a second stops waiting."""
    done = subprocess.run([sys.executable, "-c", STUCK.format(grace=grace, at=at)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0 and done.stdout.strip(), done.stderr
    took = float(done.stdout)
    assert within[0] <= took < within[1], f"the call returned after {took:.2f} s"
    assert ("still cleaning up" in done.stderr) == (len(at) == 1), done.stderr


TAKEN = """
import asyncio, signal, threading, time
from fastckpt._loop import BackgroundLoop
from fastckpt.threads import io_executor

def take() -> None:  # the kernel gave the signal to this worker thread, not to the main thread waiting on the call
    time.sleep(0.3)
    signal.pthread_kill(threading.get_ident(), signal.SIGINT)

io_executor().submit(take)
started = time.monotonic()
try:
    BackgroundLoop.get().run(asyncio.sleep(60))
except KeyboardInterrupt:
    print(f"{time.monotonic() - started:.2f}")
"""


def test_a_signal_taken_by_a_worker_thread_interrupts_the_waiting_caller() -> None:
    """The race of a stalled ``fastckpt cp`` that ignored Ctrl-C: a signal the kernel handed to one of fastckpt's
    worker threads interrupts the main thread's wait for its call at once (before, only once the call ended)."""
    done = subprocess.run([sys.executable, "-c", TAKEN], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip(), done.stderr
    assert float(done.stdout) < BOUND_S
