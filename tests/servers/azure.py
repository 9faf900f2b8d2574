"""pytest fixtures for the azure backend: one Azurite per session (``harness.azure``), a fresh prefix per test."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from fastckpt.stores.azure import EMULATOR_ACCOUNT
from harness.azure import CONTAINER, Azurite, start_azurite, stop_azurite

__all__ = ["CONTAINER", "Azurite", "azure_uri", "azurite"]


@pytest.fixture(scope="session")
def azurite(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Azurite]:
    """Azurite for the whole session, with container ``fastckpt-test``."""
    try:
        server = start_azurite(str(tmp_path_factory.mktemp("azurite")))
    except RuntimeError as exc:
        pytest.fail(str(exc), pytrace=False)
    try:
        server.create_container(CONTAINER)
        yield server
    finally:
        stop_azurite(server)


@pytest.fixture
def azure_uri(azurite: Azurite) -> str:
    """A fresh prefix in the test container (emulator account, well-known key via endpoint_override)."""
    return (f"az://{CONTAINER}/t-{uuid.uuid4().hex[:12]}"
            f"?account={EMULATOR_ACCOUNT}&endpoint_override={azurite.endpoint}")
