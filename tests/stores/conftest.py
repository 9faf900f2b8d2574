"""What the S3 store tests share: a fresh store on moto (the ``s3`` fixture), a plain boto3 client to check what
fastckpt did independently of it, and a recorder of the requests on the store's HTTP data path."""

from __future__ import annotations

import os

import boto3
import pytest

from fastckpt import open_store, parse_uri
from harness.s3 import BUCKET, MotoServer

from ..conftest import small_config

PART = 5 << 20


def raw_client(server: MotoServer):
    """A plain boto3 client on the server, to check what fastckpt did independently of it."""
    return boto3.client("s3", endpoint_url=server.endpoint, region_name="us-east-1")


def make_file(tmp_path, name: str, size: int) -> tuple[str, bytes]:
    data = os.urandom(size)
    path = tmp_path / name
    path.write_bytes(data)
    return str(path), data


def one_line(exc: BaseException) -> str:
    text = str(exc)
    assert "\n" not in text, text
    return text


@pytest.fixture
async def s3(s3_uri: str):
    """(S3Store, parsed URI) on a fresh prefix."""
    uri = parse_uri(s3_uri)
    async with open_store(uri, config=small_config()) as store:
        yield store, uri


async def record_data_path(store, method: str, hold=None) -> list[dict]:
    """Headers (lower-case names) of each ``method`` request the store sends on its HTTP data path, its target
    under ``:target``; ``hold``: an async callable each such request awaits before it goes out."""
    await store.client._data_path()
    http = store.client.data.client
    sent: list[dict] = []
    send = http.request

    async def recording(verb, target, headers, **kwargs):
        if verb == method:
            sent.append({":target": target, **{k.lower(): v for k, v in headers.items()}})
            if hold is not None:
                await hold()
        return await send(verb, target, headers, **kwargs)

    http.request = recording
    return sent


def pending_on_server(server: MotoServer, prefix: str) -> list[dict]:
    return raw_client(server).list_multipart_uploads(Bucket=BUCKET, Prefix=prefix).get("Uploads", [])
