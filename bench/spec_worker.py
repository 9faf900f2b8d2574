"""A bench measurement in a process of its own: the parent runs ``python -m MODULE --worker SPEC_JSON OUT`` from the
repository and reads the JSON result the child wrote to ``OUT`` (``run_spec``); the child's ``main`` hands its
``--worker`` arguments to ``answer``."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_spec(module: str, spec: dict[str, Any], env: dict[str, str] | None = None, timeout: float = 1800
             ) -> dict[str, Any]:
    """The result of ``module``'s worker for ``spec`` (``env`` added to this process's environment), or
    ``{"error": the end of its output}`` when it failed."""
    with tempfile.NamedTemporaryFile("r", suffix=".json") as out:
        proc = subprocess.run([sys.executable, "-m", module, "--worker", json.dumps(spec), out.name], cwd=REPO,
                              env={**os.environ, **(env or {})}, capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0:
            return {"error": (proc.stderr or proc.stdout)[-1500:]}
        return json.load(out)


def worker_flag(parser: argparse.ArgumentParser) -> None:
    """``--worker SPEC_JSON OUT``, the hidden argument ``run_spec`` starts a module's worker with."""
    parser.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)


def answer(worker_args: list[str], worker: Callable[[dict[str, Any]], dict[str, Any]]) -> int:
    """In the child: ``worker(spec)`` for ``[SPEC_JSON, OUT]``, its result written to ``OUT`` as JSON; exit status."""
    spec_json, out = worker_args
    with open(out, "w") as f:
        json.dump(worker(json.loads(spec_json)), f)
    return 0
