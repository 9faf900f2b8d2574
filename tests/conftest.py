"""Shared fixtures. Each module in tests/servers/ starts one real server and provides a backend.

A server module ``tests/servers/<name>.py`` (backend ``<name>``) defines a fixture ``<name>_uri`` returning the base URI
of a fresh, empty prefix on that server (creating the bucket / container as needed). The conformance
suite runs once per backend: memory, local, and every server module found; or, with
``--store-uri URI``, against that one location only (how a third-party backend runs the suite).
"""

from __future__ import annotations

import asyncio
import atexit
import os
import pkgutil
import shutil
import tempfile
import uuid

import pytest
import uvloop

from fastckpt import TransferConfig, open_store, parse_uri

from . import servers

# Persistent injected faults fail after ``retries`` attempts, not after the default two-minute retry budget
# (subprocesses and Ray workers read it from the environment too).
os.environ.setdefault("FASTCKPT_RETRY_FOR", "0")
# Upload journals (resume) of the whole session go to a scratch directory, not ~/.cache, removed at exit.
if "FASTCKPT_STATE_DIR" not in os.environ:
    os.environ["FASTCKPT_STATE_DIR"] = tempfile.mkdtemp(prefix="fastckpt-state-")
    atexit.register(shutil.rmtree, os.environ["FASTCKPT_STATE_DIR"], ignore_errors=True)

SERVER_BACKENDS = sorted(m.name for m in pkgutil.iter_modules(servers.__path__))
pytest_plugins = [f"tests.servers.{name}" for name in SERVER_BACKENDS]
BACKENDS = ["memory", "local", *SERVER_BACKENDS]


def pytest_asyncio_loop_factories(config: pytest.Config, item: pytest.Item) -> dict:
    """Async tests run on asyncio's event loop; those marked ``both_loops`` on uvloop's too (which the library's
    sync API and CLI use)."""
    if item.get_closest_marker("both_loops") is None:
        return {"asyncio": asyncio.new_event_loop}
    return {"asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}


@pytest.fixture
def sendfile_bytes(monkeypatch) -> list[int]:
    """The byte counts of each ``os.sendfile`` call made from here on (from any thread)."""
    sent: list[int] = []
    real = os.sendfile

    def counting(out: int, fd: int, offset: int, count: int) -> int:
        n = real(out, fd, offset, count)
        sent.append(n)
        return n

    monkeypatch.setattr(os, "sendfile", counting)
    return sent


def small_config(**overrides: object) -> TransferConfig:
    """Small parts so multipart paths run on small files (backends raise it to their minimum)."""
    base = {"part_size": 256 << 10, "multipart_threshold": 256 << 10, "max_in_flight": 4,
            "retries": 3, "retry_for": 0, "backoff_base": 0.01, "backoff_max": 0.05}
    base.update(overrides)
    return TransferConfig(**base)  # type: ignore[arg-type]


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--store-uri", default=None, help="run every per-backend test (the conformance suite and "
                     "the checkpoint writers) against this base URI only, e.g. a third-party backend's")


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """``backend``: each of BACKENDS, or ``custom`` (the ``--store-uri``) alone."""
    if "backend" not in metafunc.fixturenames:
        return
    if any("backend" in marker.args[0] for marker in metafunc.definition.iter_markers("parametrize")):
        return
    metafunc.parametrize("backend", ["custom"] if metafunc.config.getoption("store_uri") else BACKENDS)


@pytest.fixture
def store_uri(backend: str, tmp_path, request: pytest.FixtureRequest) -> str:
    """Base URI of a fresh prefix on ``backend``."""
    if backend == "custom":
        base, _, query = request.config.getoption("store_uri").partition("?")
        return f"{base.rstrip('/')}/t-{uuid.uuid4().hex[:8]}" + (f"?{query}" if query else "")
    if backend == "memory":
        return f"memory://conf-{uuid.uuid4().hex[:8]}/base"
    if backend == "local":
        return f"file://{tmp_path}/store"
    return request.getfixturevalue(f"{backend}_uri")


@pytest.fixture
async def store(store_uri: str):
    """(store, base key) for ``store_uri``; closed after the test."""
    uri = parse_uri(store_uri)
    async with open_store(uri, config=small_config()) as s:
        yield s, uri


@pytest.fixture(params=["memory", "local"])
def fast_uri(request: pytest.FixtureRequest, tmp_path) -> str:
    """A fresh base URI on the in-memory or the local store."""
    if request.param == "memory":
        return f"memory://ckpt-{os.urandom(4).hex()}/runs"
    return f"file://{tmp_path}/runs"
