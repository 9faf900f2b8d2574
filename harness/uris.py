"""Storage URIs of a prefix on each emulator, reached at a given endpoint (the emulator, or a proxy before it)."""

from __future__ import annotations

from . import azure, gcs, s3


def emulator_uri(backend: str, endpoint: str, prefix: str) -> str:
    """``prefix`` in the test bucket (container) of ``backend``'s emulator at ``endpoint``."""
    if backend == "s3":
        return f"s3://{s3.BUCKET}/{prefix}?endpoint_override={endpoint}"
    if backend == "gcs":
        return f"gs://{gcs.BUCKET}/{prefix}?endpoint_override={endpoint}"
    return f"az://{azure.CONTAINER}/{prefix}?account={azure.EMULATOR_ACCOUNT}&endpoint_override={endpoint}"


def below(base: str, name: str) -> str:
    """URI of ``name`` below ``base`` (a checkpoint below its run), keeping ``base``'s query options."""
    path, _, query = base.partition("?")
    return f"{path.rstrip('/')}/{name}" + (f"?{query}" if query else "")
