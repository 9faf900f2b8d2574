"""One timed transfer in its own process: ``python -m bench.worker SPEC_JSON``.

The engine's setup (imports, clients' inputs) is untimed; the transfer is timed, and the CPU used by
this process and by the children it waited for during the transfer is measured with ``getrusage``, and the
share of the whole machine's CPU time left idle meanwhile (``/proc/stat``): near 0, the machine was the bound.
With ``spec["syncfs"]`` the timed window ends only once the destination's filesystem is synced.
An engine may return a ``check`` callable with its result; it runs after the timed window and its
problems are reported. The result is written as JSON to ``spec["result"]``; the parent adds the
whole-process CPU (wait4).
"""

from __future__ import annotations

import ctypes
import json
import os
import resource
import sys
import time
import traceback
from typing import Any


def vm_hwm_mib() -> float:
    """Peak RSS of this process image (``VmHWM``; unlike ``ru_maxrss`` it does not inherit the parent's peak)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _cpu(who: int) -> tuple[float, float]:
    r = resource.getrusage(who)
    return r.ru_utime, r.ru_stime


def machine_cpu() -> tuple[int, int] | None:
    """(idle, total) clock ticks of all CPUs so far, from ``/proc/stat`` (iowait counts as idle); None off Linux."""
    try:
        with open("/proc/stat") as f:
            ticks = [int(t) for t in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    return ticks[3] + ticks[4], sum(ticks[:8])  # guest time is already in user and nice


def syncfs(path: str) -> None:
    """Flush the filesystem holding ``path`` to disk (Linux ``syncfs``)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        if ctypes.CDLL(None, use_errno=True).syncfs(fd) != 0:
            raise OSError(ctypes.get_errno(), f"syncfs({path}) failed")
    finally:
        os.close(fd)


def measure(spec: dict[str, Any]) -> dict[str, Any]:
    """Prepare the engine, run its transfer and return timings and CPU."""
    if spec.get("direction") == "gpu":
        from bench.gpu import prepare
    else:
        from bench.engines import ENGINES

        prepare = ENGINES[spec["engine"]].prepare
    run = prepare(spec)
    rss_before = vm_hwm_mib()
    s0, c0, m0 = _cpu(resource.RUSAGE_SELF), _cpu(resource.RUSAGE_CHILDREN), machine_cpu()
    t0 = time.perf_counter()
    extra = run()
    if spec.get("syncfs"):
        syncfs(spec["syncfs"])
    wall = time.perf_counter() - t0
    s1, c1, m1 = _cpu(resource.RUSAGE_SELF), _cpu(resource.RUSAGE_CHILDREN), machine_cpu()
    if m0 is not None and m1 is not None and m1[1] > m0[1]:
        extra["machine_idle"] = (m1[0] - m0[0]) / (m1[1] - m0[1])
    check = extra.pop("check", None)
    if check is not None:
        extra["check_problems"] = check()
    return {
        "wall_s": wall,
        "cpu_user_s": (s1[0] - s0[0]) + (c1[0] - c0[0]),
        "cpu_sys_s": (s1[1] - s0[1]) + (c1[1] - c0[1]),
        "rss_before_mib": rss_before,
        # children forked from this small process inherit at most its peak, so theirs is nearly exact
        "maxrss_mib": max(vm_hwm_mib(), resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024),
        **extra,
    }


def main(argv: list[str] | None = None) -> int:
    """Run the spec given as the first argument; exit 1 (with the error in the result) on failure."""
    spec = json.loads((argv or sys.argv[1:])[0])
    try:
        result = {"ok": True, **measure(spec)}
    except Exception as exc:
        result = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-4000:]}
    with open(spec["result"], "w") as f:
        json.dump(result, f)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    raise SystemExit(main())
