"""Encryption and bucket policies (``stores.*.controls``): the headers each request class carries, seen on the wire
through a recording proxy in front of each emulator; what moto records of them; the options refused with a clear
error; and the customer keys never shown."""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import os
import urllib.request
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from pathlib import Path
from urllib.parse import parse_qsl, quote, urlsplit

import pytest

import fastckpt
from fastckpt import open_store, parse_uri
from fastckpt.errors import CopyUnsupportedError
from fastckpt.stores.base import CopySource
from fastckpt.uri import redact
from harness.proxy import FaultProxy

from ..conftest import small_config

KEY = base64.b64encode(bytes(range(32))).decode()
"""A customer key (AES-256, base64)."""
OTHER_KEY = base64.b64encode(bytes(range(1, 33))).decode()


def with_options(uri: str, **options: str) -> str:
    return uri + ("&" if "?" in uri else "?") + "&".join(f"{k}={v}" for k, v in options.items())


async def every_request_class(uri: str, tmp_path: Path) -> None:
    """Puts (whole and multipart), server-side copies (whole and of a part), ranged reads, HEADs, listings and
    deletes below ``uri``."""
    cfg = small_config()
    src = tmp_path / "src"
    src.mkdir(exist_ok=True)
    (src / "small.bin").write_bytes(os.urandom(1000))
    (src / "big.bin").write_bytes(os.urandom(700 << 10))
    await fastckpt.upload_async(src, uri, config=cfg)
    out = tmp_path / "out"
    await fastckpt.download_async(uri, out, config=cfg)
    assert (out / "big.bin").read_bytes() == (src / "big.bin").read_bytes()
    loc = parse_uri(uri)
    async with open_store(loc, config=cfg) as store:
        big = await store.head(f"{loc.key}/big.bin")
        small = await store.head(f"{loc.key}/small.bin")
        try:
            await store.copy(f"{loc.key}/copied.bin", CopySource(small.key, small.etag, 0, small.size))
        except CopyUnsupportedError:  # Azure with a customer key: callers fall back to reading and writing
            await store.put(f"{loc.key}/copied.bin", await store.get_range(small.key, 0, small.size))
        upload = await store.create_multipart(f"{loc.key}/parts.bin", store.min_part_size)
        try:
            part = await upload.copy_part(0, CopySource(big.key, big.etag, 0, store.min_part_size))
        except CopyUnsupportedError:  # GCS composes whole objects only; Azure with a customer key copies nothing
            part = await upload.put_part(0, os.urandom(100))
        await upload.complete([part])
        assert len(await store.get_range(f"{loc.key}/parts.bin", 0, 100)) == 100
        assert {m.key async for m in store.list(loc.key)} >= {big.key, small.key, f"{loc.key}/parts.bin"}
        await store.delete(f"{loc.key}/copied.bin")


def checked(proxy: FaultProxy, kind: Callable[[str, str, dict[str, str]], str],
            expect: Callable[[str, dict[str, str], str], list[str]]) -> set[str]:
    """The kinds of the requests the proxy saw (``kind(method, target, headers)``); an assertion names each request
    whose headers or target ``expect(kind, headers, target)`` finds wrong."""
    kinds, wrong = set(), []
    for line, headers in zip(proxy.requests, proxy.headers, strict=True):
        method, target = line.split(" ")[:2]
        k = kind(method, target, headers)
        kinds.add(k)
        problems = expect(k, headers, target)
        if problems:
            wrong.append(f"{k} {method} {target}: {problems}")
    assert not wrong, "\n".join(wrong)
    return kinds


# ----------------------------------------------------------------------------------------------- S3

def s3_kind(method: str, target: str, headers: dict[str, str]) -> str:
    path, _, query = target.partition("?")
    key = path.split("/", 2)[2] if path.count("/") >= 2 else ""
    copy = "x-amz-copy-source" in headers
    if not key:
        return "Bucket"
    if method == "PUT":
        return ("UploadPartCopy" if copy else "UploadPart") if "partNumber" in query else (
            "CopyObject" if copy else "PutObject")
    if method == "POST":
        return "CreateMultipartUpload" if "uploads" in query else "CompleteMultipartUpload"
    return {"GET": "ListParts" if "uploadId" in query else "GetObject", "HEAD": "HeadObject"}.get(method, "Delete")


S3_WRITES = {"PutObject", "CreateMultipartUpload", "CopyObject"}
S3_OF_OBJECT = S3_WRITES | {"UploadPart", "UploadPartCopy", "CompleteMultipartUpload", "GetObject", "HeadObject"}


def s3_expect_kms(kind: str, h: dict[str, str], _target: str) -> list[str]:
    want = {"x-amz-request-payer": "requester", "x-amz-expected-bucket-owner": "111122223333"}
    if kind in S3_WRITES:
        want |= {"x-amz-server-side-encryption": "aws:kms", "x-amz-server-side-encryption-aws-kms-key-id": "alias/ck",
                 "x-amz-server-side-encryption-bucket-key-enabled": "true", "x-amz-storage-class": "STANDARD_IA",
                 "x-amz-tagging": "team=ml&run=7"}
    if kind in ("CopyObject", "UploadPartCopy"):
        want["x-amz-source-expected-bucket-owner"] = "111122223333"
    problems = [f"{k}={h.get(k)!r}" for k, v in want.items() if h.get(k) != v]
    if kind not in S3_WRITES and "x-amz-server-side-encryption" in h:
        problems.append("SSE header where S3 refuses it")
    return problems


def s3_expect_customer(kind: str, h: dict[str, str], _target: str) -> list[str]:
    prefixes = ["x-amz-server-side-encryption-customer-"] if kind in S3_OF_OBJECT else []
    if kind in ("CopyObject", "UploadPartCopy"):
        prefixes.append("x-amz-copy-source-server-side-encryption-customer-")
    problems = [p for p in prefixes if (h.get(p + "algorithm"), h.get(p + "key")) != ("AES256", KEY)]
    if kind not in S3_OF_OBJECT and any(k.startswith("x-amz-server-side-encryption-customer") for k in h):
        problems.append("a customer key on a request that needs none")
    return problems


@pytest.mark.parametrize("mode", ["kms", "customer"])
async def test_s3_controls_on_every_request_class(moto_server, s3_uri: str, tmp_path: Path, mode: str,
                                                  caplog) -> None:
    """SSE-KMS (key, bucket key), storage class, tags, requester pays and the expected owner on the requests that
    take them; or SSE-C on every request that touches an object's bytes, copies' sources included (and the key in
    no debug line: botocore's included)."""
    caplog.set_level(logging.DEBUG)
    options = ({"server_side_encryption": "aws:kms", "sse_kms_key_id": "alias/ck", "bucket_key_enabled": "true",
                "storage_class": "STANDARD_IA", "tagging": "team%3Dml%26run%3D7", "request_payer": "requester",
                "expected_bucket_owner": "111122223333"} if mode == "kms" else {"sse_customer_key": KEY})
    with FaultProxy(urlsplit(moto_server.endpoint).port) as proxy:
        proxy.throttle(1000)  # records each request; throttles none
        uri = with_options(s3_uri.replace(moto_server.endpoint, proxy.url), **options)
        await every_request_class(uri, tmp_path)
        async with open_store(uri, config=small_config()) as store:  # metadata only botocore sends: the SDK's requests
            await store.put(f"{parse_uri(uri).key}/sdk.bin", b"x", metadata={"note": "a\tb"})
    kinds = checked(proxy, s3_kind, s3_expect_kms if mode == "kms" else s3_expect_customer)
    assert kinds >= S3_OF_OBJECT | {"Bucket"}, kinds
    assert KEY not in caplog.text


async def test_moto_records_sse_kms_on_whole_and_multipart_writes(moto_server, s3_uri: str, tmp_path: Path) -> None:
    import boto3

    src = tmp_path / "src"
    src.mkdir()
    (src / "small.bin").write_bytes(b"x" * 100)
    (src / "big.bin").write_bytes(os.urandom(700 << 10))
    uri = with_options(s3_uri, server_side_encryption="aws:kms", sse_kms_key_id="alias/ck")
    await fastckpt.upload_async(src, uri, config=small_config())
    client = boto3.client("s3", endpoint_url=moto_server.endpoint, region_name="us-east-1")
    loc = parse_uri(s3_uri)
    for name in ("small.bin", "big.bin"):
        head = client.head_object(Bucket=loc.bucket, Key=f"{loc.key}/{name}")
        assert (head["ServerSideEncryption"], head.get("SSEKMSKeyId", "").endswith("alias/ck")) == ("aws:kms", True)


@pytest.mark.parametrize(("options", "message"), [
    ({"server_side_encryption": "aes"}, "server_side_encryption='aes'"),
    ({"sse_kms_key_id": "k"}, "need server_side_encryption=aws:kms"),
    ({"sse_customer_key": "bm90IGEga2V5"}, "AES-256 key has 32"),
    ({"sse_customer_key": KEY, "server_side_encryption": "AES256"}, "exclude each other"),
    ({"request_payer": "me"}, "only value is 'requester'"),
    ({"sse_kms_encryption_context": "[1]", "server_side_encryption": "aws:kms"}, "JSON object of strings"),
])
def test_s3_bad_controls_are_named(options: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError, match=message) as info:
        open_store(with_options("s3://b/k?endpoint_override=http://127.0.0.1:1", **options))
    assert KEY not in str(info.value)


@pytest.mark.parametrize("uri", ["file:///tmp/x?server_side_encryption=AES256", "memory://b/k?storage_class=X",
                                 "gs://b/k?sse_customer_key=x", "s3://b/k?kms_key_name=x"])
def test_a_control_a_backend_does_not_take_is_refused(uri: str) -> None:
    with pytest.raises(ValueError, match="unknown option"):
        open_store(uri)


def test_customer_keys_never_shown(monkeypatch, caplog) -> None:
    """A customer key is neither in a store's repr, its URI (the environment gives it again), nor in debug logs."""
    caplog.set_level(logging.DEBUG, logger="fastckpt")
    monkeypatch.setenv("FASTCKPT_S3_SSE_CUSTOMER_KEY", OTHER_KEY)
    store = open_store(f"s3://b/k?endpoint_override=http://127.0.0.1:1&sse_customer_key={KEY}")
    assert store.options.controls.sse_customer_key == KEY  # the URI's before the environment's
    shown = repr(store) + repr(store.options) + store.uri("x") + redact(f"s3://b/k?sse_customer_key={KEY}")
    assert KEY not in shown + caplog.text


# ----------------------------------------------------------------------------------------------- GCS

def gcs_kind(method: str, target: str, headers: dict[str, str]) -> str:
    path, _, query = target.partition("?")
    if path.startswith("/upload/"):
        return "upload"
    if path.endswith("/compose"):
        return "compose"
    if "/o/" in path:
        return {"GET": "media" if "alt=media" in query else "metadata", "DELETE": "delete"}.get(method, method)
    return "list" if path.endswith("/o") else "bucket"


@pytest.mark.parametrize("mode", ["kms", "customer"])
async def test_gcs_controls_on_every_request_class(gcs_server: str, gcs_uri: str, tmp_path: Path, mode: str,
                                                   caplog) -> None:
    """CMEK and a storage class on what creates an object, a customer key (CSEK) on every object read and write,
    ``userProject`` on every request: requests of the data path, the SDK and its session alike."""
    options = ({"kms_key_name": "projects/p/locations/l/keyRings/r/cryptoKeys/k", "storage_class": "NEARLINE",
                "user_project": "billed"} if mode == "kms" else {"encryption_key": KEY, "user_project": "billed"})

    def expect(kind: str, h: dict[str, str], target: str) -> list[str]:
        query = dict(parse_qsl(urlsplit(target).query))
        problems = [] if query.get("userProject") == "billed" else ["userProject"]
        if mode == "kms" and kind in ("upload", "compose") and query.get("kmsKeyName") != options["kms_key_name"]:
            problems.append("kmsKeyName")
        keyed = (h.get("x-goog-encryption-algorithm"), h.get("x-goog-encryption-key")) == ("AES256", KEY)
        if mode == "customer" and kind in ("upload", "compose", "media", "metadata") and not keyed:
            problems.append("customer key")
        return problems

    caplog.set_level(logging.DEBUG)
    with FaultProxy(urlsplit(gcs_server).port) as proxy:
        proxy.throttle(1000)
        uri = with_options(gcs_uri.replace(gcs_server, proxy.url), **options)
        await every_request_class(uri, tmp_path)
    kinds = checked(proxy, gcs_kind, expect)
    assert kinds >= {"upload", "compose", "media", "metadata", "list", "delete"}, kinds
    assert KEY not in caplog.text
    if mode == "kms":  # the new objects' resource names the class: the emulator keeps an upload's, not a compose's
        loc = parse_uri(gcs_uri)
        url = f"{gcs_server}/storage/v1/b/{loc.bucket}/o/{quote(f'{loc.key}/small.bin', safe='')}"
        assert (await asyncio.to_thread(stored, url)).get("storageClass") == "NEARLINE"
        composes = [json.loads(body) for line, body in zip(proxy.requests, proxy.bodies, strict=True)
                    if line.split("?")[0].endswith("/compose")]
        assert composes and all(c["destination"]["storageClass"] == "NEARLINE" for c in composes)


def stored(url: str) -> dict[str, object]:
    """The JSON an emulator answers at ``url``."""
    with urllib.request.urlopen(url) as answer:
        return json.load(answer)


# ----------------------------------------------------------------------------------------------- Azure

def azure_kind(method: str, target: str, headers: dict[str, str]) -> str:
    query = urlsplit(target).query
    if "comp=list" in query or "restype=container" in query:
        return "container"
    if "comp=blocklist" in query:
        return "Get Block List" if method == "GET" else "Put Block List"
    if "comp=block" in query:
        return "Put Block From URL" if "x-ms-copy-source" in headers else "Put Block"
    if method == "PUT":
        return "Copy Blob" if "x-ms-copy-source" in headers else "Put Blob"
    return {"GET": "Get Blob", "HEAD": "Get Blob Properties", "DELETE": "Delete Blob"}[method]


AZURE_WRITES = {"Put Blob", "Put Block", "Put Block From URL", "Put Block List", "Copy Blob"}
AZURE_CREATES = {"Put Blob", "Put Block List", "Copy Blob"}


@pytest.mark.parametrize("mode", ["scope", "customer"])
async def test_azure_controls_on_every_request_class(azurite, azure_uri: str, tmp_path: Path, mode: str,
                                                     monkeypatch, caplog) -> None:
    """An encryption scope on every write and the access tier on what creates a blob; or a customer key (CPK) on
    every read and write, copies then made by reading and writing (the service cannot read a CPK source)."""
    options = {"encryption_scope": "ckpt-scope", "access_tier": "cool"} if mode == "scope" else {"customer_key": KEY}

    def expect(kind: str, h: dict[str, str], _target: str) -> list[str]:
        problems = []
        if mode == "scope" and kind in AZURE_WRITES and h.get("x-ms-encryption-scope") != "ckpt-scope":
            problems.append("scope")
        if mode == "scope" and kind in AZURE_CREATES and h.get("x-ms-access-tier") != "Cool":
            problems.append("tier")
        keyed = (h.get("x-ms-encryption-algorithm"), h.get("x-ms-encryption-key")) == ("AES256", KEY)
        if mode == "customer" and kind not in ("container", "Delete Blob", "Get Block List") and not keyed:
            problems.append("customer key")
        if mode == "customer" and kind in ("Copy Blob", "Put Block From URL"):
            problems.append("a copy by the service")
        return problems

    caplog.set_level(logging.DEBUG)
    port = urlsplit(azurite.endpoint).port
    with FaultProxy(port) as proxy:
        proxy.throttle(1000)
        if mode == "customer":  # Azurite refuses CPK: the proxy records it, then takes it off (a SAS signs no header)
            proxy.strip = frozenset({"x-ms-encryption-key", "x-ms-encryption-key-sha256", "x-ms-encryption-algorithm"})
            monkeypatch.setenv("AZURE_STORAGE_SAS_TOKEN", account_sas())
        uri = with_options(azure_uri.replace(str(port), str(proxy.port)), **options)
        await every_request_class(uri, tmp_path)
    kinds = checked(proxy, azure_kind, expect)
    wanted = {"Put Blob", "Put Block", "Put Block List", "Get Blob", "Get Blob Properties", "container"}
    assert kinds >= wanted | ({"Copy Blob", "Put Block From URL"} if mode == "scope" else set()), kinds
    assert KEY not in caplog.text


def account_sas() -> str:
    """A SAS for the emulator's account, allowing everything for an hour."""
    from azure.storage.blob import AccountSasPermissions, ResourceTypes, generate_account_sas

    from fastckpt.stores.azure.options import EMULATOR_ACCOUNT, EMULATOR_KEY

    return generate_account_sas(EMULATOR_ACCOUNT, EMULATOR_KEY, ResourceTypes(service=True, container=True,
                                object=True), AccountSasPermissions(read=True, write=True, delete=True, list=True,
                                add=True, create=True), datetime.now(timezone.utc) + timedelta(hours=1))


def test_the_faces_pass_controls_through(moto_server, s3_uri: str) -> None:
    """The pyarrow facade's constructor, fsspec's storage options and DCP's (s3fs's names included) take the same
    options as a URI."""
    import boto3
    import fsspec

    from fastckpt.fs import filesystem
    from fastckpt.torch.dcp.location import storage_query

    loc = parse_uri(s3_uri)
    facade = filesystem(s3_uri, server_side_encryption="aws:kms", sse_kms_key_id="alias/ck")
    with facade.open_output_stream(f"{loc.bucket}/{loc.key}/f") as out:
        out.write(b"x" * 100)
    client = boto3.client("s3", endpoint_url=moto_server.endpoint, region_name="us-east-1")
    assert client.head_object(Bucket=loc.bucket, Key=f"{loc.key}/f")["ServerSideEncryption"] == "aws:kms"
    fs = fsspec.filesystem("fastckpt", storage_class="STANDARD_IA", skip_instance_cache=True)
    assert fs.options["storage_class"] == "STANDARD_IA"
    assert storage_query({"requester_pays": True, "s3_additional_kwargs": {
        "ServerSideEncryption": "aws:kms", "SSEKMSKeyId": "alias/ck"}}) == {
        "request_payer": "requester", "server_side_encryption": "aws:kms", "sse_kms_key_id": "alias/ck"}
    with pytest.raises(ValueError, match=r"s3_additional_kwargs\.ACL"):
        storage_query({"s3_additional_kwargs": {"ACL": "private"}})
