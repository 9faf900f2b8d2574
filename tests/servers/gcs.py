"""pytest fixtures for the gcs backend: one fake-gcs-server per session (``harness.gcs``), a fresh prefix per test."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from harness.gcs import BUCKET, start_fake_gcs, stop_fake_gcs

__all__ = ["BUCKET", "gcs_server", "gcs_uri"]


@pytest.fixture(scope="session")
def gcs_server() -> Iterator[str]:
    """Base URL (``http://127.0.0.1:PORT``) of a fake-gcs-server with bucket ``BUCKET``.

    fake-gcs-server ignores ``ifGenerationMatch=0`` on compose (real GCS honours it), so the session runs
    with ``FASTCKPT_GCS_IF_ABSENT=best-effort``; test_gcs.py checks that the default refuses there.
    """
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FASTCKPT_GCS_IF_ABSENT", "best-effort")
        server = start_fake_gcs()
        try:
            yield server.url
        finally:
            stop_fake_gcs(server)


@pytest.fixture
def gcs_uri(gcs_server: str) -> str:
    """A fresh, empty prefix on the emulator, reached through ``?endpoint_override=``."""
    return f"gs://{BUCKET}/t-{uuid.uuid4().hex[:12]}?endpoint_override={gcs_server}"
