"""pytest fixtures for the s3 backend: one moto server per session (``harness.s3``), a fresh prefix per test.

``s3_uri`` returns ``s3://fastckpt-test/<unique prefix>?endpoint_override=http://127.0.0.1:PORT`` with
dummy credentials in the environment for the whole session.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from harness.s3 import BUCKET, CLEARED, CREDENTIALS, MotoServer, start_moto, stop_moto

__all__ = ["BUCKET", "MotoServer", "moto_server", "s3_uri", "start_moto", "stop_moto"]


@pytest.fixture(scope="session")
def moto_server() -> Iterator[MotoServer]:
    """The session's moto server, with dummy AWS credentials in the environment and the test bucket."""
    with pytest.MonkeyPatch.context() as mp:
        for name in CLEARED:
            mp.delenv(name, raising=False)
        for name, value in CREDENTIALS.items():
            mp.setenv(name, value)
        server = start_moto()
        try:
            server.create_bucket(BUCKET)
            yield server
        finally:
            stop_moto(server)


@pytest.fixture
def s3_uri(moto_server: MotoServer) -> str:
    """Base URI of a fresh prefix in the test bucket."""
    return moto_server.uri(BUCKET, f"t-{uuid.uuid4().hex[:12]}/base")
