"""Multi-rank jobs the tests launch as real processes."""

from __future__ import annotations

import json
import multiprocessing
import sys
from collections.abc import Callable


def run_ranks(target: Callable[..., None], world: int, *args: object, timeout: float = 240) -> list[int | None]:
    """``target(rank, *args)`` in ``world`` forked processes (fork keeps start-up cheap on a loaded machine); their
    exit codes, printed too (a process still running after ``timeout`` is killed)."""
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=target, args=(r, *args)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout)
        if p.is_alive():
            p.kill()
            p.join()
    codes = [p.exitcode for p in procs]
    print("exit codes:", codes, flush=True)
    return codes


def spec_main(rank_main: Callable[[int, dict], None], timeout: float = 120) -> int:
    """``python -m tests.ranks.JOB SPEC_JSON``: ``rank_main(rank, spec)`` on ``spec["world"]`` ranks."""
    spec = json.loads(sys.argv[1])
    run_ranks(rank_main, spec["world"], spec, timeout=timeout)
    return 0
