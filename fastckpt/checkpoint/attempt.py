"""Attempt ids: one per run of a job, the same on every rank, new on every restart (from the launcher's
environment, else drawn by rank 0)."""

from __future__ import annotations

import re
import secrets
import time
from collections.abc import Mapping

from ..config import environment
from .manifest import check_attempt

__all__ = ["ATTEMPT_TAG", "attempt_from_env", "new_attempt_id"]

ATTEMPT_TAG = "attempt"


def attempt_from_env(env: Mapping[str, str] | None = None) -> str | None:
    """An attempt id shared by all ranks of one job run, from the environment, else None.

    ``FASTCKPT_ATTEMPT`` as is; else torchelastic's run id plus its restart count; else SLURM's job
    id plus its restart count. (torchrun's default run id ``none`` is not unique and is ignored.)
    """
    env = environment() if env is None else env
    if env.get("FASTCKPT_ATTEMPT"):
        return check_attempt(env["FASTCKPT_ATTEMPT"])
    run = env.get("TORCHELASTIC_RUN_ID", "")
    if run and run != "none":
        return _safe(f"{run}-r{env.get('TORCHELASTIC_RESTART_COUNT', '0')}")
    if env.get("SLURM_JOB_ID"):
        return _safe(f"slurm-{env['SLURM_JOB_ID']}-r{env.get('SLURM_RESTART_COUNT', '0')}")
    return None


def _safe(text: str) -> str:
    return check_attempt(re.sub(r"[^A-Za-z0-9._-]", "-", text).lstrip("._-")[:128] or "attempt")


def new_attempt_id() -> str:
    """A fresh, unique attempt id (time + random)."""
    return f"{time.strftime('%Y%m%dT%H%M%S', time.gmtime())}-{secrets.token_hex(6)}"
