"""Process helpers shared by the test servers."""

from __future__ import annotations

import subprocess


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
