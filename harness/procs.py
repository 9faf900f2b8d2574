"""Process helpers shared by the emulator launchers."""

from __future__ import annotations

import socket
import subprocess


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop_process(proc: subprocess.Popen, timeout: float = 10) -> None:
    """Terminate ``proc``; kill it if it has not exited after ``timeout`` seconds."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
