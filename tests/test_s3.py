"""S3 backend against real moto servers: multipart, retries, aborts, conditional writes, config, errors."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import http.client
import json
import logging
import os
import subprocess
import sys
import threading
import traceback
import urllib.request
import uuid
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

import boto3
import pytest
from botocore.credentials import EnvProvider

import fastckpt
from fastckpt import (
    AccessDeniedError,
    AlreadyExistsError,
    IntegrityError,
    ObjectNotFoundError,
    StoreError,
    TransferConfig,
    TransientStoreError,
    open_store,
    parse_uri,
)
from fastckpt.engine import upload as upload_module
from fastckpt.engine.plan import plan_upload
from fastckpt.engine.select import keys_below
from fastckpt.engine.transfer import Transfer
from fastckpt.integrity import META_CHUNK, META_DIGEST, FileDigest
from fastckpt.stores.s3 import RECORD_DIR, RECORD_ETAG, RECORD_MARK, S3Store, resolve_endpoint
from fastckpt.stores.s3.options import env_credentials
from fastckpt.stores.s3.sigv4 import StaticCredentials
from harness.faults import FaultInjectingStore
from harness.procs import free_port
from harness.s3 import BUCKET, MotoServer, start_moto, stop_moto

from .conftest import small_config

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


# --------------------------------------------------------------------------------- multipart


async def test_many_parts_in_flight_on_one_client(s3_uri, tmp_path) -> None:
    uri = parse_uri(s3_uri)
    store = open_store(uri, config=small_config())
    client = await store.client.sdk()
    assert client.meta.config.max_pool_connections == small_config().max_in_flight + 16
    want, waiting, gate = 4, [0], asyncio.Event()

    async def hold_until_parallel(**_: object) -> None:
        # Every UploadPart about to be sent waits here until ``want`` of them are pending at once.
        waiting[0] += 1
        if waiting[0] >= want:
            gate.set()
        await asyncio.wait_for(gate.wait(), timeout=60)

    await record_data_path(store, "PUT", hold_until_parallel)
    path, data = make_file(tmp_path, "big", 5 * PART + 123)
    transfer = Transfer(store, small_config())
    try:
        result = await transfer.upload_file(path, uri.join("big"))
        assert waiting[0] == 6 + 1 and gate.is_set()  # six parts, then the record of the completion
        assert await store.client.sdk() is client  # one client per store, no per-part clients
        assert await store.get_range(uri.join("big"), 0, len(data)) == data
    finally:
        transfer.close()
        await store.close()
    assert FileDigest.from_metadata(len(data), (await store.head(uri.join("big"))).metadata) == result.digest


async def test_transient_part_failures_are_retried(s3, moto_server, tmp_path) -> None:
    store, uri = s3
    faulty = FaultInjectingStore(store, error_rate=0.5, ops={"put_part"}, seed=7)
    path, data = make_file(tmp_path, "flaky", 3 * PART + 1)
    transfer = Transfer(faulty, small_config(retries=8))
    await transfer.upload_file(path, uri.join("flaky"))
    transfer.close()
    assert faulty.injected >= 1
    assert await store.get_range(uri.join("flaky"), 0, len(data)) == data
    assert pending_on_server(moto_server, uri.key) == []


@pytest.mark.parametrize("failing", ["put_part", "complete"])
async def test_permanent_failure_aborts_upload(s3, moto_server, tmp_path, failing: str) -> None:
    store, uri = s3
    faulty = FaultInjectingStore(store, fail_after=1 if failing == "put_part" else 0, ops={failing})
    path, _ = make_file(tmp_path, "doomed", 3 * PART + 1)
    transfer = Transfer(faulty, small_config())
    with pytest.raises(StoreError, match="injected permanent failure"):
        await transfer.upload_file(path, uri.join("doomed"))
    transfer.close()
    assert pending_on_server(moto_server, uri.key) == []
    assert await store.list_pending_uploads(uri.key) == []
    with pytest.raises(ObjectNotFoundError):
        await store.head(uri.join("doomed"))
    assert [m async for m in store.list(uri.key)] == []


@pytest.fixture
def bytes_read(monkeypatch) -> list[int]:
    """A one-item list counting the bytes uploads read (and hash) from their files, into a buffer or through a
    mapping."""
    read = [0]
    read_and_hash, hash_file_range = upload_module.read_and_hash, upload_module.hash_file_range

    def counting(fd: int, offset: int, buf: memoryview) -> bytes:
        read[0] += buf.nbytes
        return read_and_hash(fd, offset, buf)

    def counting_mapped(fd: int, offset: int, length: int, chunk: int) -> list[bytes] | None:
        read[0] += length
        return hash_file_range(fd, offset, length, chunk)

    monkeypatch.setattr(upload_module, "read_and_hash", counting)
    monkeypatch.setattr(upload_module, "hash_file_range", counting_mapped)
    return read


async def test_multipart_digest_is_recorded_after_the_data(s3, moto_server, tmp_path, bytes_read) -> None:
    """S3 takes metadata at creation only: the digest goes into a record beside the object once it is complete,
    so the upload reads the file once (it read it twice, hashing it before the upload began)."""
    store, uri = s3
    path, data = make_file(tmp_path, "mp", 2 * PART + 99)
    transfer = Transfer(store, small_config())
    result = await transfer.upload_file(path, uri.join("dir", "mp"))
    transfer.close()
    assert bytes_read[0] == len(data)
    raw = raw_client(moto_server)
    own = raw.head_object(Bucket=BUCKET, Key=uri.join("dir", "mp"))
    assert own["ContentLength"] == len(data) and own["Metadata"] == {RECORD_MARK: "1"}
    record = raw.head_object(Bucket=BUCKET, Key=uri.join("dir", RECORD_DIR, "mp"))
    assert record["Metadata"] == {META_DIGEST: result.digest.digest, META_CHUNK: str(PART), RECORD_ETAG: own["ETag"]}
    meta = await store.head(uri.join("dir", "mp"))
    assert meta.metadata == {META_DIGEST: result.digest.digest, META_CHUNK: str(PART)}
    assert [m.key async for m in store.list(uri.join("dir"))] == [uri.join("dir", "mp")]
    objects, dirs = await store.list_dir(uri.join("dir"))
    assert [m.key for m in objects] == [uri.join("dir", "mp")] and dirs == []
    await store.delete(uri.join("dir", "mp"))
    assert raw.list_objects_v2(Bucket=BUCKET, Prefix=uri.join("dir")).get("KeyCount") == 0


async def test_parts_go_from_the_file_to_the_socket(s3, moto_server, tmp_path, sendfile_bytes) -> None:
    """On a plain-HTTP endpoint with unsigned payloads each part is hashed through a mapping of the file and sent
    by the kernel (``sendfile``): no pooled buffer holds it."""
    store, uri = s3
    path, data = make_file(tmp_path, "sent", 2 * PART + 99)
    transfer = Transfer(store, small_config())
    up = await transfer.upload_file(path, uri.join("sent"))
    assert transfer.pool.allocated == 0
    down = await transfer.download_file(uri.join("sent"), str(tmp_path / "back"))
    transfer.close()
    assert sum(sendfile_bytes) == len(data) and store.client.sends_files
    assert (tmp_path / "back").read_bytes() == data and up.digest == down.digest


@pytest.mark.parametrize("refused", ["sendfile", "mapping"])
async def test_files_the_kernel_cannot_send_go_from_buffers(s3, tmp_path, monkeypatch, refused: str) -> None:
    """A filesystem that refuses ``sendfile`` (EINVAL) or a mapping (ENODEV): the parts go from buffers."""
    store, uri = s3

    def refuse(*args: object) -> None:
        raise OSError(errno.EINVAL if refused == "sendfile" else errno.ENODEV, f"no {refused} here")

    monkeypatch.setattr(*((os, "sendfile") if refused == "sendfile" else (upload_module, "hash_file_range")),
                        refuse)
    path, data = make_file(tmp_path, "plain", 3 * PART + 7)
    transfer = Transfer(store, small_config())
    up = await transfer.upload_file(path, uri.join("plain"))
    assert transfer.pool.allocated > 0
    down = await transfer.download_file(uri.join("plain"), str(tmp_path / "back"))
    transfer.close()
    assert (tmp_path / "back").read_bytes() == data and up.digest == down.digest


async def test_a_file_written_during_its_upload_fails_it(s3, moto_server, tmp_path, monkeypatch) -> None:
    """A part sent from the file is hashed a moment before the kernel sends it: a file written while it is being
    uploaded fails the upload (IntegrityError) and leaves nothing on the server."""
    store, uri = s3
    path, _ = make_file(tmp_path, "moving", 3 * PART + 1)
    os.utime(path, (1_000_000_000, 1_000_000_000))
    hash_file_range = upload_module.hash_file_range

    def writing(fd: int, offset: int, length: int, chunk: int) -> list[bytes] | None:
        digests = hash_file_range(fd, offset, length, chunk)
        if offset == PART:
            with open(path, "r+b") as out:
                out.write(b"changed")
        return digests

    monkeypatch.setattr(upload_module, "hash_file_range", writing)
    transfer = Transfer(store, small_config())
    with pytest.raises(IntegrityError, match="changed while it was being uploaded"):
        await transfer.upload_file(path, uri.join("moving"))
    transfer.close()
    assert pending_on_server(moto_server, uri.key) == []
    assert raw_client(moto_server).list_objects_v2(Bucket=BUCKET, Prefix=uri.key).get("KeyCount") == 0


async def test_without_digest_records_the_objects_stand_alone(s3_uri, moto_server, tmp_path, monkeypatch,
                                                             bytes_read) -> None:
    """``FASTCKPT_S3_DIGEST_RECORDS=0``: nothing but the objects (for readers that list with other tools); the
    digest goes with the upload's creation, so the file is hashed before it is sent (read twice)."""
    monkeypatch.setenv("FASTCKPT_S3_DIGEST_RECORDS", "0")
    uri = parse_uri(s3_uri)
    path, data = make_file(tmp_path, "alone", 2 * PART + 5)
    async with open_store(uri, config=small_config()) as store:
        assert not store.metadata_on_complete
        transfer = Transfer(store, small_config())
        result = await transfer.upload_file(path, uri.join("alone"))
        transfer.close()
        assert (await store.head(uri.join("alone"))).metadata == result.digest.metadata()
    assert bytes_read[0] == 2 * len(data)
    listed = raw_client(moto_server).list_objects_v2(Bucket=BUCKET, Prefix=uri.key)["Contents"]
    assert [o["Key"] for o in listed] == [uri.join("alone")]


async def test_gc_removes_records_no_object_uses(s3, moto_server, tmp_path) -> None:
    """Records of objects deleted or replaced by other tools go with gc; a record in use stays."""
    store, uri = s3
    transfer = Transfer(store, small_config())
    for name in ("kept", "deleted", "replaced"):
        path, _ = make_file(tmp_path, name, PART + 3)
        await transfer.upload_file(path, uri.join("d", name))
    transfer.close()
    raw = raw_client(moto_server)
    raw.delete_object(Bucket=BUCKET, Key=uri.join("d", "deleted"))
    raw.put_object(Bucket=BUCKET, Key=uri.join("d", "replaced"), Body=b"plain")
    records = sorted(uri.join("d", RECORD_DIR, n) for n in ("deleted", "replaced"))
    below = uri.with_key(uri.join("d")).uri()
    report = await fastckpt.gc_async(below, older_than=0, dry_run=True, config=small_config())
    assert sorted(report.removed) == records
    assert len(raw.list_objects_v2(Bucket=BUCKET, Prefix=uri.join("d"))["Contents"]) == 5
    report = await fastckpt.gc_async(below, older_than=0, config=small_config())
    assert sorted(report.removed) == records
    left = [o["Key"] for o in raw.list_objects_v2(Bucket=BUCKET, Prefix=uri.join("d"))["Contents"]]
    assert sorted(left) == sorted([uri.join("d", n) for n in ("kept", f"{RECORD_DIR}/kept", "replaced")])
    assert FileDigest.from_metadata(PART + 3, (await store.head(uri.join("d", "kept"))).metadata) is not None


async def test_a_record_checks_only_the_object_it_was_written_for(s3, moto_server, tmp_path) -> None:
    """A download verifies a multipart object against its record (a wrong digest there fails it); a record left
    by an earlier version of the object is not used for a later one that stopped before writing its own."""
    store, uri = s3
    key = uri.join("rec")
    path, _ = make_file(tmp_path, "rec", PART + 7)
    transfer = Transfer(store, small_config())
    await transfer.upload_file(path, key)
    raw = raw_client(moto_server)
    record = raw.head_object(Bucket=BUCKET, Key=uri.join(RECORD_DIR, "rec"))["Metadata"]
    raw.put_object(Bucket=BUCKET, Key=uri.join(RECORD_DIR, "rec"), Body=b"",
                   Metadata={**record, META_DIGEST: "0" * 32})
    with pytest.raises(IntegrityError, match="digest mismatch"):
        await transfer.download_file(key, str(tmp_path / "back"))
    assert not (tmp_path / "back").exists()
    raw.put_object(Bucket=BUCKET, Key=key, Body=b"other bytes", Metadata={RECORD_MARK: "1"})
    assert (await store.head(key)).metadata == {}
    await transfer.download_file(key, str(tmp_path / "back"))
    transfer.close()
    assert (tmp_path / "back").read_bytes() == b"other bytes"


@pytest.mark.parametrize("size", [100_000, PART + 4321], ids=["single_put", "multipart"])
async def test_flipped_byte_fails_download(s3, tmp_path, size: int) -> None:
    store, uri = s3
    key = uri.join("dir", "victim.bin")
    path, data = make_file(tmp_path, "victim", size)
    transfer = Transfer(store, small_config())
    await transfer.upload_file(path, key)
    meta = await store.head(key)
    corrupted = bytearray(data)
    corrupted[size // 2] ^= 0x01
    await store.put(key, corrupted, metadata=meta.metadata)  # same digest metadata, one bit off
    assert (await store.head(key)).metadata == meta.metadata
    with pytest.raises(IntegrityError, match=key):
        await transfer.download_file(key, str(tmp_path / "out.bin"))
    transfer.close()
    assert not (tmp_path / "out.bin").exists()


# --------------------------------------------------------------------------------- conditional writes


async def test_create_if_absent_race_between_two_writers(s3_uri: str, moto_server) -> None:
    uri = parse_uri(s3_uri)
    writers = [open_store(uri, config=small_config()) for _ in range(2)]
    try:
        for round_ in range(10):
            key = uri.join(f"marker-{round_}")
            results = await asyncio.gather(*(w.put(key, f"writer-{i}".encode(), if_absent=True)
                                             for i, w in enumerate(writers)), return_exceptions=True)
            winners = [i for i, r in enumerate(results) if r is None]
            assert len(winners) == 1, results
            loser = results[1 - winners[0]]
            assert isinstance(loser, AlreadyExistsError) and key in one_line(loser)
            body = raw_client(moto_server).get_object(Bucket=BUCKET, Key=key)["Body"].read()
            assert body == f"writer-{winners[0]}".encode()
    finally:
        for w in writers:
            await w.close()


class _DropIfNoneMatch(BaseHTTPRequestHandler):
    """Forwards to moto without the If-None-Match header: an S3 server lacking conditional writes."""

    protocol_version = "HTTP/1.1"
    upstream = ("127.0.0.1", 0)

    def _forward(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else None
        headers = {k: v for k, v in self.headers.items() if k.lower() != "if-none-match"}
        conn = http.client.HTTPConnection(*self.upstream, timeout=60)
        try:
            conn.request(self.command, self.path, body=body, headers=headers)
            resp = conn.getresponse()
            data = resp.read()
            self.send_response(resp.status)
            for k, v in resp.getheaders():
                if k.lower() not in ("transfer-encoding", "connection", "content-length", "server", "date"):
                    self.send_header(k, v)
            self.send_header("Content-Length", resp.getheader("Content-Length", "0") if self.command == "HEAD"
                             else str(len(data)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(data)
        finally:
            conn.close()

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _forward

    def log_message(self, format: str, *args: object) -> None:
        """Quiet."""


@contextlib.contextmanager
def proxy_to(moto_server: MotoServer, handler: type[_DropIfNoneMatch]) -> Iterator[str]:
    """Endpoint of a ``handler`` proxy in front of moto."""
    upstream = urlsplit(moto_server.endpoint)
    bound = type("Handler", (handler,), {"upstream": (upstream.hostname, upstream.port)})
    server = ThreadingHTTPServer(("127.0.0.1", 0), bound)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


@pytest.fixture(scope="module")
def no_conditional_endpoint(moto_server: MotoServer) -> Iterator[str]:
    """Endpoint of a proxy in front of moto that drops If-None-Match."""
    with proxy_to(moto_server, _DropIfNoneMatch) as endpoint:
        yield endpoint


class _FailingCompletes(_DropIfNoneMatch):
    """Answers the first ``fail`` CompleteMultipartUploads with 200 and an error body, as S3 answers a complete
    that failed after it began."""

    fail = [0]

    def do_POST(self) -> None:
        if "uploadId=" not in self.path or self.fail[0] <= 0:
            self._forward()
            return
        self.fail[0] -= 1
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        body = b"<?xml version='1.0'?>\n<Error><Code>InternalError</Code><Message>try again</Message></Error>"
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.mark.parametrize("failures", [1, 99])
async def test_a_complete_that_fails_in_a_200_answer_is_retried_or_aborted(moto_server, tmp_path, failures) -> None:
    prefix = f"t-{uuid.uuid4().hex[:12]}"
    _FailingCompletes.fail[0] = failures
    path, data = make_file(tmp_path, "f", 2 * PART + 1)
    with proxy_to(moto_server, _FailingCompletes) as endpoint:
        store = open_store(f"s3://{BUCKET}/{prefix}?endpoint_override={endpoint}", config=small_config(retries=2))
        transfer = Transfer(store, small_config(retries=2))
        try:
            if failures == 1:
                await transfer.upload_file(path, f"{prefix}/f")
                assert await store.get_range(f"{prefix}/f", 0, len(data)) == data
            else:
                with pytest.raises(TransientStoreError, match="InternalError"):
                    await transfer.upload_file(path, f"{prefix}/f")
                assert [m async for m in store.list(prefix)] == [] and pending_on_server(moto_server, prefix) == []
        finally:
            transfer.close()
            await store.close()


async def test_server_ignoring_if_none_match_is_detected(no_conditional_endpoint, moto_server,
                                                         monkeypatch) -> None:
    prefix = f"t-{uuid.uuid4().hex[:12]}"
    raw_client(moto_server).put_object(Bucket=BUCKET, Key=f"{prefix}/marker", Body=b"first")
    store = open_store(f"s3://{BUCKET}/{prefix}?endpoint_override={no_conditional_endpoint}", config=small_config())
    try:
        with pytest.raises(StoreError, match="ignores If-None-Match") as info:
            await store.put(f"{prefix}/marker", b"second", if_absent=True)
        assert not isinstance(info.value, TransientStoreError)
        with pytest.raises(StoreError, match="ignores If-None-Match"):
            await store.put(f"{prefix}/fresh", b"x", if_absent=True)
        assert [m.key async for m in store.list(prefix)] == [f"{prefix}/marker"]  # probe object removed
        assert await store.get_range(f"{prefix}/marker", 0, 10) == b"first"  # nothing overwritten
    finally:
        await store.close()
    monkeypatch.setenv("FASTCKPT_S3_IF_ABSENT", "best-effort")
    store = open_store(f"s3://{BUCKET}/{prefix}?endpoint_override={no_conditional_endpoint}", config=small_config())
    try:
        with pytest.raises(AlreadyExistsError):
            await store.put(f"{prefix}/marker", b"second", if_absent=True)
        await store.put(f"{prefix}/fresh", b"x", if_absent=True)
        with pytest.raises(AlreadyExistsError):
            await store.put(f"{prefix}/fresh", b"y", if_absent=True)
        assert await store.get_range(f"{prefix}/fresh", 0, 10) == b"x"
    finally:
        await store.close()


# --------------------------------------------------------------------------------- configuration


@pytest.mark.parametrize(("text", "options", "env", "expected"), [
    ("uri", {"endpoint_override": "http://h:1"}, {"AWS_ENDPOINT_URL_S3": "http://e:2"}, "http://h:1"),
    ("scheme", {"endpoint_override": "h:1", "scheme": "http"}, {}, "http://h:1"),
    ("https default", {"endpoint_override": "h:1/"}, {}, "https://h:1"),
    ("s3 env first", {}, {"AWS_ENDPOINT_URL_S3": "http://e:2", "AWS_ENDPOINT_URL": "http://g:3"}, "http://e:2"),
    ("global env", {}, {"AWS_ENDPOINT_URL": "http://g:3"}, "http://g:3"),
    ("ignored env", {}, {"AWS_ENDPOINT_URL": "http://g:3", "AWS_IGNORE_CONFIGURED_ENDPOINT_URLS": "true"}, None),
    ("aws", {}, {}, None),
])
def test_resolve_endpoint(text: str, options: dict, env: dict, expected: str | None) -> None:
    assert resolve_endpoint(options, env) == expected


def test_part_size_scales_to_s3_limits() -> None:
    store = S3Store(BUCKET)
    assert (store.min_part_size, store.max_parts, store.max_part_size) == (5 << 20, 10_000, 5 << 30)
    small = plan_upload(100 << 20, TransferConfig(part_size=1 << 20), store)
    assert small.part_size == 5 << 20  # raised to S3's minimum
    huge = plan_upload(1 << 40, TransferConfig(part_size=32 << 20), store)  # 1 TiB
    assert huge.count <= 10_000 and huge.part_size % (1 << 20) == 0 and huge.part_size > 32 << 20
    with pytest.raises(ValueError, match="10000 parts"):
        plan_upload(50 << 40, TransferConfig(), store)  # beyond 10,000 x 5 GiB


@pytest.mark.parametrize("source", ["env_with_session_token", "profile_option", "AWS_PROFILE", "anonymous"])
async def test_credential_sources(moto_server, monkeypatch, tmp_path, source: str) -> None:
    prefix = f"t-{uuid.uuid4().hex[:12]}"
    uri = moto_server.uri(BUCKET, prefix)
    if source == "env_with_session_token":
        monkeypatch.setenv("AWS_SESSION_TOKEN", "session-token-123")
    elif source == "anonymous":
        uri += "&anonymous=true"
    else:  # credentials and region from a profile in the shared files, none in the environment
        monkeypatch.delenv("AWS_ACCESS_KEY_ID")
        monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
        monkeypatch.delenv("AWS_DEFAULT_REGION")
        (tmp_path / "credentials").write_text(
            "[ckpt]\naws_access_key_id = profile-key\naws_secret_access_key = profile-secret\n")
        (tmp_path / "config").write_text("[profile ckpt]\nregion = eu-west-3\n")
        monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "credentials"))
        monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "config"))
        if source == "AWS_PROFILE":
            monkeypatch.setenv("AWS_PROFILE", "ckpt")
        else:
            uri += "&profile=ckpt"
    store = open_store(uri, config=small_config())
    try:
        client = await store.client.sdk()
        sent = await record_data_path(store, "GET")
        if source == "anonymous":  # unsigned reads of a public object
            raw_client(moto_server).put_object(Bucket=BUCKET, Key=f"{prefix}/obj", Body=b"payload",
                                               ACL="public-read")
        else:
            await store.put(f"{prefix}/obj", b"payload")
        assert await store.get_range(f"{prefix}/obj", 0, 100) == b"payload"
    finally:
        await store.close()
    [headers] = sent
    if source == "anonymous":
        assert "authorization" not in headers
    elif source == "env_with_session_token":
        assert headers["x-amz-security-token"] == "session-token-123"
        assert "Credential=testing-access-key/" in headers["authorization"]
    else:  # the profile's region for the client; the data path signs for the bucket's (us-east-1)
        assert "Credential=profile-key/" in headers["authorization"]
        assert client.meta.region_name == "eu-west-3" and "/us-east-1/s3/" in headers["authorization"]


async def test_region_option_and_missing_profile(moto_server) -> None:
    store = open_store(moto_server.uri(BUCKET, "p") + "&region=ap-south-1", config=small_config())
    try:
        assert (await store.client.sdk()).meta.region_name == "ap-south-1"
    finally:
        await store.close()
    store = open_store(moto_server.uri(BUCKET, "p") + "&profile=no-such-profile", config=small_config())
    try:
        with pytest.raises(StoreError, match="AWS profile 'no-such-profile' not found") as info:
            await store.head("p/x")
        one_line(info.value)
    finally:
        await store.close()


@pytest.mark.parametrize("how", ["uri_without_scheme", "AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL", "both_env"])
async def test_endpoint_override_reaches_local_server(moto_server, monkeypatch, how: str) -> None:
    prefix = f"t-{uuid.uuid4().hex[:12]}"
    uri = f"s3://{BUCKET}/{prefix}"
    if how == "uri_without_scheme":
        uri += f"?endpoint_override={moto_server.endpoint.removeprefix('http://')}&scheme=http"
    elif how == "both_env":  # the S3-specific variable wins over the global one
        monkeypatch.setenv("AWS_ENDPOINT_URL_S3", moto_server.endpoint)
        monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")
    else:
        monkeypatch.setenv(how, moto_server.endpoint)
    store = open_store(uri, config=small_config(), retry=False)
    try:
        assert isinstance(store, S3Store)
        assert store.options.endpoint_url == moto_server.endpoint and store.client.addressing_style == "path"
        await store.put(f"{prefix}/hello", b"hi", metadata={"k": "v"})
    finally:
        await store.close()
    raw = raw_client(moto_server).get_object(Bucket=BUCKET, Key=f"{prefix}/hello")
    assert raw["Body"].read() == b"hi" and raw["Metadata"] == {"k": "v"}


def test_a_restore_with_the_keys_in_the_environment_imports_no_sdk(moto_server, tmp_path) -> None:
    """From an endpoint of one's own, with the keys in the environment, a restore (listing, GETs, a missing key's
    error) runs on the data path alone: botocore, aiobotocore and aiohttp (~0.45 s of imports) stay unloaded."""
    prefix = f"t-{uuid.uuid4().hex[:12]}"
    data = os.urandom(3 * PART + 5)
    raw_client(moto_server).put_object(Bucket=BUCKET, Key=f"{prefix}/d/big", Body=data)
    script = f"""
import sys, fastckpt
fastckpt.download({moto_server.uri(BUCKET, prefix + "/d")!r}, {str(tmp_path / "out")!r})
try:
    fastckpt.download({moto_server.uri(BUCKET, prefix + "/gone")!r}, {str(tmp_path / "gone")!r})
except fastckpt.ObjectNotFoundError as exc:
    print("missing:", exc)
print(sorted({{m.partition(".")[0] for m in sys.modules}} & {{"botocore", "aiobotocore", "aiohttp"}}))
"""
    env = {**os.environ, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
           "AWS_DEFAULT_REGION": "us-east-1"}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[-1] == "[]" and "missing: nothing found below" in out.stdout
    assert (tmp_path / "out" / "big").read_bytes() == data


def test_doctor_names_an_sdk_the_store_imports_only_when_used(monkeypatch) -> None:
    import importlib.util

    from fastckpt.stores import backend_status

    assert backend_status()["s3"] == "available"
    found = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "aiobotocore" else found(name))
    assert backend_status()["s3"] == "unavailable: No module named 'aiobotocore'"


def test_keys_from_the_environment_as_botocore_takes_them() -> None:
    env = {"AWS_ACCESS_KEY_ID": "AK", "AWS_SECRET_ACCESS_KEY": "SK"}
    assert env_credentials(env) == StaticCredentials("AK", "SK")
    assert env_credentials({**env, "AWS_SESSION_TOKEN": "session"}).token == "session"
    both = {**env, "AWS_SECURITY_TOKEN": "security", "AWS_SESSION_TOKEN": "session"}
    assert env_credentials(both).token == "security" == EnvProvider(both).load().get_frozen_credentials().token
    assert "SK" not in repr(env_credentials(env))
    for left_to_botocore in ({"AWS_ACCESS_KEY_ID": "AK"}, {**env, "AWS_CREDENTIAL_EXPIRATION": "2030-01-01T00:00:00Z"},
                             {**env, "AWS_SECRET_ACCESS_KEY": ""}):
        assert env_credentials(left_to_botocore) is None


def test_sync_calls_keep_one_store_per_location(moto_server, monkeypatch, tmp_path) -> None:
    """``fastckpt.upload`` / ``download`` called again on a location reuse its open store (one client, one
    connection pool); the same URI reaching another endpoint through the environment gets a store of its own."""
    from fastckpt.engine import open_stores as cache

    def kept(endpoint: str) -> list:  # what earlier tests' blocking calls kept stays: only this location's counts
        return [s for (_, config), s in cache._open.items() if config == fastckpt.TransferConfig.from_env()
                and s.bucket == BUCKET and getattr(s.options, "endpoint_url", None) == endpoint]

    path, data = make_file(tmp_path, "step.bin", 3)
    base = f"s3://{BUCKET}/t-{uuid.uuid4().hex[:12]}"
    monkeypatch.setenv("AWS_ENDPOINT_URL", moto_server.endpoint)
    for step in range(3):
        fastckpt.upload(path, f"{base}/step-{step}/w.bin")
        fastckpt.download(f"{base}/step-{step}/w.bin", tmp_path / f"back-{step}")
        assert (tmp_path / f"back-{step}").read_bytes() == data
        if step == 0:
            first = kept(moto_server.endpoint)
    [store] = kept(moto_server.endpoint)
    assert [store] == first and store.client.data.started
    other = f"http://127.0.0.1:{free_port()}"
    monkeypatch.setenv("AWS_ENDPOINT_URL", other)
    with pytest.raises(StoreError, match="cannot reach S3 endpoint"):
        fastckpt.download(f"{base}/step-0/w.bin", tmp_path / "nowhere", config=small_config(retries=0))
    assert len(kept(moto_server.endpoint)) == 1 and len([s for s in cache._open.values()
                                                         if getattr(s.options, "endpoint_url", None) == other]) == 1


def test_sync_api_with_env_endpoint(moto_server, monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL", moto_server.endpoint)
    path, data = make_file(tmp_path, "model.bin", PART + 17)
    dst = f"s3://{BUCKET}/t-{uuid.uuid4().hex[:12]}/model.bin"
    [up] = fastckpt.upload(path, dst, config=small_config())
    [down] = fastckpt.download(dst, tmp_path / "back.bin", config=small_config())
    assert (tmp_path / "back.bin").read_bytes() == data and up.digest == down.digest


@pytest.mark.parametrize("knobs", ["defaults", "botocore_checksums_and_signed_payloads"])
async def test_client_settings_and_knobs(s3_uri: str, monkeypatch, tmp_path, knobs: str) -> None:
    if knobs != "defaults":
        monkeypatch.setenv("AWS_REQUEST_CHECKSUM_CALCULATION", "WHEN_SUPPORTED")
        monkeypatch.setenv("AWS_RESPONSE_CHECKSUM_VALIDATION", "when_supported")
        monkeypatch.setenv("FASTCKPT_S3_PAYLOAD_SIGNING", "auto")
    uri = parse_uri(s3_uri)
    store = open_store(uri, config=small_config())
    try:
        client = await store.client.sdk()
        config = client.meta.config
        assert config.retries["total_max_attempts"] == 1  # the engine retries, botocore does not
        if knobs == "defaults":
            assert config.request_checksum_calculation == "when_required"
            assert config.response_checksum_validation == "when_required"
            assert config.s3["payload_signing_enabled"] is False
        else:
            assert config.request_checksum_calculation == "when_supported"
            assert config.response_checksum_validation == "when_supported"
            assert "payload_signing_enabled" not in config.s3
        sent = await record_data_path(store, "PUT")  # parts go through the HTTP data path, signed by botocore's signer
        path, data = make_file(tmp_path, "knobs", PART + 5)
        transfer = Transfer(store, small_config())
        await transfer.upload_file(path, uri.join("knobs"))
        await transfer.download_file(uri.join("knobs"), str(tmp_path / "knobs.out"))
        transfer.close()
        assert (tmp_path / "knobs.out").read_bytes() == data
        assert len(sent) == 2 + 1  # two parts and the record; no SDK checksum on the data path: XXH3 digests
        # check the bytes end to end
        assert not any(k.startswith(("x-amz-checksum-", "x-amz-trailer")) for h in sent for k in h)
        assert store.client.sends_files == (knobs == "defaults")  # a signed payload is read to be hashed: from buffers
        signed = {h["x-amz-content-sha256"] for h in sent}
        assert signed == ({"UNSIGNED-PAYLOAD"} if knobs == "defaults" else signed - {"UNSIGNED-PAYLOAD"})
    finally:
        await store.close()


@pytest.mark.parametrize("origin", ["http://127.0.0.1:9000", "https://bucket.s3.eu-west-1.amazonaws.com"])
@pytest.mark.parametrize("token", [None, "FwoGZXIvYXdzEJr//////////wEaDH+tok/en="])
def test_the_data_path_signs_as_botocore_does(monkeypatch, origin: str, token: str | None) -> None:
    """fastckpt's SigV4 signer gives the very headers botocore's S3 signer gives, request for request: methods,
    keys that need encoding, queries out of order, extra headers, a session token, signed and unsigned payloads."""
    import datetime
    import hashlib
    from urllib.parse import quote

    import botocore.auth
    from botocore.awsrequest import AWSRequest
    from botocore.config import Config
    from botocore.credentials import Credentials

    from fastckpt.stores.s3.sigv4 import UNSIGNED_PAYLOAD, S3Signer

    now = datetime.datetime(2026, 12, 4, 23, 59, 58, tzinfo=datetime.timezone.utc)
    monkeypatch.setattr(botocore.auth, "get_current_datetime", lambda: now)
    credentials = Credentials("AKIDEXAMPLE", "wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY", token).get_frozen_credentials()
    host = urlsplit(origin).netloc
    signer = S3Signer(host, "eu-west-1")
    requests = [
        ("GET", "run1/step-1/model.safetensors", {}, {"Range": "bytes=0-1048575"}, b""),
        ("HEAD", "a key/with spaces/ünïcode/+plus=&?#%.bin", {}, {}, b""),
        ("PUT", "run1/part", {"uploadId": "2~Ab+c/d=e f", "partNumber": "7"}, {}, b"x" * 1000),
        ("PUT", "run1/obj", {}, {"If-None-Match": "*", "x-amz-meta-fastckpt-digest": "  ab  cd ",
                                 "User-Agent": "fastckpt"}, b"payload"),
        ("POST", "run1/obj", {"uploads": ""}, {}, b""),
    ]
    for payload_signing in (False, True):
        config = Config(s3={"payload_signing_enabled": payload_signing})
        for method, key, query, headers, body in requests:
            target = "/bucket/" + quote(key, safe="/~")
            if query:
                target += "?" + "&".join(f"{k}={quote(v, safe='-_.~')}" for k, v in query.items())
            expected = AWSRequest(method=method, url=origin + target, headers=dict(headers), data=body)
            expected.context["client_config"] = config
            botocore.auth.S3SigV4Auth(credentials, "s3", "eu-west-1").add_auth(expected)
            ours = dict(headers)
            payload = hashlib.sha256(body).hexdigest() if payload_signing else UNSIGNED_PAYLOAD
            signer.sign(method, target, ours, credentials, payload, now=now)
            assert ours == dict(expected.headers.items()), (method, key, payload_signing)


async def test_a_bucket_in_another_region_is_followed_there(moto_server, tmp_path) -> None:
    """botocore follows a bucket to its region, and so does the data path: a bucket HeadBucket places elsewhere
    is signed for its own region, and works."""
    bucket = f"eu-{uuid.uuid4().hex[:8]}"
    raw_client(moto_server).create_bucket(Bucket=bucket, CreateBucketConfiguration={"LocationConstraint": "eu-west-1"})
    store = open_store(moto_server.uri(bucket, "p"), config=small_config())
    try:
        client, (_, _, signer) = await store.client.sdk(), await store.client._data_path()
        assert client.meta.region_name == "us-east-1" and signer.region == "eu-west-1"
        path, data = make_file(tmp_path, "f", PART + 9)
        transfer = Transfer(store, small_config())
        await transfer.upload_file(path, "p/f")
        await transfer.download_file("p/f", str(tmp_path / "back"))
        transfer.close()
        assert (tmp_path / "back").read_bytes() == data
    finally:
        await store.close()


async def test_a_store_takes_what_another_learned_of_its_bucket(moto_server) -> None:
    """A group read's other ranks take the bucket's region from rank 0's store (``learned`` / ``assume``) and make
    no HeadBucket of their own; what another bucket's store learned is ignored."""
    bucket = f"eu-{uuid.uuid4().hex[:8]}"
    raw_client(moto_server).create_bucket(Bucket=bucket, CreateBucketConfiguration={"LocationConstraint": "eu-west-1"})
    raw_client(moto_server).put_object(Bucket=bucket, Key="p/o", Body=b"payload")
    first, second, other = (open_store(moto_server.uri(b, "p"), config=small_config())
                            for b in (bucket, bucket, BUCKET))
    try:
        assert first.learned() == {}  # nothing asked yet
        assert await first.get_range("p/o", 0, 7) == b"payload"
        second.assume(first.learned())
        other.assume(first.learned())
        sent: list[tuple[str, str]] = []
        for store in (second, other):
            send = store.client._sign_and_send

            async def recording(method, target, *args, _send=send, **kwargs):  # type: ignore[no-untyped-def]
                sent.append((method, target))
                return await _send(method, target, *args, **kwargs)

            store.client._sign_and_send = recording
        assert await second.get_range("p/o", 0, 7) == b"payload"
        assert sent == [("GET", f"/{bucket}/p/o")] and (await second.client._data_path())[2].region == "eu-west-1"
        with pytest.raises(ObjectNotFoundError):
            await other.get_range("p/absent", 0, 1)
        assert sent[1] == ("HEAD", f"/{BUCKET}/")  # its own bucket's region asked for as before
    finally:
        for store in (first, second, other):
            await store.close()


async def test_small_files_come_down_in_one_request_each(s3, tmp_path) -> None:
    """A directory of small objects: each object comes with its metadata in its GET, no HEAD per object."""
    store, uri = s3
    src = tmp_path / "src"
    src.mkdir()
    for i in range(5):
        (src / f"g{i}").write_bytes(os.urandom(2000 + i))
    base = uri.raw.split("?")[0] + "/up"
    query = "?" + uri.raw.split("?")[1]
    await fastckpt.upload_async(str(src), base + query, config=small_config())
    transfer = Transfer(store, small_config())
    found = await keys_below(store, uri.join("up"))
    heads, gets = await record_data_path(store, "HEAD"), await record_data_path(store, "GET")
    results = await transfer.download_files([(k, str(tmp_path / "out" / rel)) for k, rel, _ in found],
                                            sizes={k: size for k, _, size in found})
    transfer.close()
    assert len(results) == 5 and all((tmp_path / "out" / f"g{i}").read_bytes() == (src / f"g{i}").read_bytes()
                                     for i in range(5))
    assert (len(heads), len(gets)) == (0, 5)


async def test_a_restore_from_an_endpoint_of_ones_own_builds_no_botocore_client(s3, moto_server, tmp_path) -> None:
    """Listing, HEADs and ranged GETs of a restore all take the data path: on a path-style endpoint botocore's
    client (~0.2 CPU-s to build, most of a small restore's CPU) is never created."""
    store, uri = s3
    data = {f"r/{name}": os.urandom(size) for name, size in (("a", 10), ("b/c", 3 * PART + 1), ("d", 0))}
    for key, body in data.items():
        raw_client(moto_server).put_object(Bucket=BUCKET, Key=uri.join(key), Body=body)
    transfer = Transfer(store, small_config())
    found = await keys_below(store, uri.join("r"))
    await transfer.download_files([(k, str(tmp_path / rel)) for k, rel, _ in found],
                                  sizes={k: size for k, _, size in found})
    transfer.close()
    assert {rel: (tmp_path / rel).read_bytes() for rel in ("a", "b/c", "d")} == {
        key[2:]: body for key, body in data.items()}
    assert store.inner.client._sdk is None and store.inner.client.data.started


async def test_list_pagination_and_batched_deletes(s3) -> None:
    store, uri = s3
    heads = await record_data_path(store, "HEAD")  # HEADs, listings and deletes take the HTTP data path
    gets = await record_data_path(store, "GET")
    posts = await record_data_path(store, "POST")
    keys = [uri.join(f"p/{i:02d}") for i in range(7)]
    await asyncio.gather(*(store.put(k, b"x") for k in keys))
    store.inner.page_size = 2  # the backend behind the retry layer
    assert [m.key async for m in store.list(uri.join("p"))] == keys
    listings = [g for g in gets if "list-type=2" in g[":target"]]
    assert (len(heads), len(listings)) == (1, 4)  # the exact key, then four pages of two
    assert sum("continuation-token=" in g[":target"] for g in listings) == 3
    objects, dirs = await store.list_dir(uri.key)
    assert objects == [] and dirs == [uri.join("p")]
    absent = [uri.join(f"gone/{i}") for i in range(2500 - len(keys))]
    await store.delete_many(keys + absent)
    deletes = [p for p in posts if p[":target"].endswith("?delete")]
    assert len(deletes) == 5 and all(p.get("content-md5") for p in deletes)  # 1000 keys a request: 2500 and records
    assert [m async for m in store.list(uri.key)] == []
    for i in range(3):
        await store.put(uri.join(f"q/{i}"), b"y")
    listed = [m async for m in store.list(uri.join("q"))]
    await store.delete_listed(listed)  # objects written whole have no records: one request for the three
    assert len([p for p in posts if p[":target"].endswith("?delete")]) == 6
    assert [m async for m in store.list(uri.key)] == []


# --------------------------------------------------------------------------------- errors


async def test_missing_bucket_is_named(moto_server, tmp_path) -> None:
    bucket = f"no-such-{uuid.uuid4().hex[:8]}"
    store = open_store(moto_server.uri(bucket, "p"), config=small_config())
    expected = f"bucket {bucket!r} does not exist at endpoint {moto_server.endpoint}"
    try:
        for op in (lambda: store.head("p/x"), lambda: store.get_range("p/x", 0, 5), lambda: store.put("p/x", b"1"),
                   lambda: store.create_multipart("p/x", PART), lambda: store.list_dir("p")):
            with pytest.raises(ObjectNotFoundError) as info:
                await op()
            assert one_line(info.value) == expected
        with pytest.raises(ObjectNotFoundError, match="does not exist at endpoint"):
            [m async for m in store.list("p")]
    finally:
        await store.close()
    path, _ = make_file(tmp_path, "f", 10)
    with pytest.raises(ObjectNotFoundError) as info:
        await fastckpt.upload_async(path, moto_server.uri(bucket, "p/f"), config=small_config())
    assert one_line(info.value) == expected


async def test_missing_key_is_not_a_missing_bucket(s3) -> None:
    store, uri = s3
    with pytest.raises(ObjectNotFoundError) as info:
        await store.head(uri.join("nope"))
    assert one_line(info.value) == f"s3://{BUCKET}/{uri.join('nope')} does not exist"


@pytest.fixture(scope="module")
def auth_server() -> Iterator[tuple[MotoServer, dict[str, tuple[str, str]]]]:
    """A second moto server that checks signatures and IAM policies, with a writer and a reader user."""
    server = start_moto()
    try:
        iam = boto3.client("iam", endpoint_url=server.endpoint, region_name="us-east-1")
        keys = {}
        for name, actions in {"writer": ["s3:*"], "reader": ["s3:GetObject", "s3:ListBucket"]}.items():
            iam.create_user(UserName=name)
            iam.put_user_policy(UserName=name, PolicyName="p", PolicyDocument=json.dumps({
                "Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": actions, "Resource": "*"}]}))
            key = iam.create_access_key(UserName=name)["AccessKey"]
            keys[name] = (key["AccessKeyId"], key["SecretAccessKey"])
        server.create_bucket(BUCKET)
        req = urllib.request.Request(f"{server.endpoint}/moto-api/reset-auth", data=b"0", method="POST",
                                     headers={"Content-Type": "text/plain"})
        with urllib.request.urlopen(req, timeout=30) as resp:  # from now on every request is authenticated
            resp.read()
        yield server, keys
    finally:
        stop_moto(server)


@pytest.mark.parametrize(("who", "match"), [
    ("wrong_secret", "SignatureDoesNotMatch"),
    ("unknown_key", "InvalidAccessKeyId"),
    ("read_only", "access denied to"),
])
async def test_bad_credentials_and_access_denied(auth_server, monkeypatch, caplog, tmp_path,
                                                 who: str, match: str) -> None:
    server, keys = auth_server
    key_id, secret = {"wrong_secret": (keys["writer"][0], "wrongSecretKey0123456789abcdefghijklmnopq"),
                      "unknown_key": ("AKIAUNKNOWNUNKNOWN00", keys["writer"][1]),
                      "read_only": keys["reader"]}[who]
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", key_id)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    caplog.set_level(logging.DEBUG)
    path, _ = make_file(tmp_path, "f", PART + 1)
    with pytest.raises(AccessDeniedError, match=match) as info:
        await fastckpt.upload_async(path, server.uri(BUCKET, "denied/f"), config=small_config())
    text = one_line(info.value)
    assert "attempts" not in text  # failed at once, not after a stack of retries
    assert secret not in "".join(traceback.format_exception(info.value)) and secret not in caplog.text
    store = open_store(server.uri(BUCKET, "denied"), config=small_config())
    try:
        if who != "read_only":
            with pytest.raises(AccessDeniedError) as info:
                await store.head("denied/f")  # HEAD carries no error body: HTTP 403 only
            assert secret not in one_line(info.value)
    finally:
        await store.close()


async def test_good_credentials_on_auth_server(auth_server, monkeypatch) -> None:
    server, keys = auth_server
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", keys["writer"][0])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", keys["writer"][1])
    store = open_store(server.uri(BUCKET, "ok"), config=small_config())
    try:
        await store.put("ok/x", b"fine", if_absent=True)
        assert await store.get_range("ok/x", 0, 10) == b"fine"
    finally:
        await store.close()


# moto's signature check mis-handles keys with spaces, '+', '%' or non-ASCII even for botocore's own requests;
# such keys are covered by the conformance suite (unsigned checks) and against the bench's JuiceFS gateway.
@pytest.mark.parametrize("name", ["plain", "dash-under_dot.tilde~/deep"])
async def test_data_path_requests_pass_signature_checks(auth_server, monkeypatch, tmp_path, name: str) -> None:
    """Parts, whole-object PUTs (with metadata, create-if-absent) and ranged GETs on the HTTP data path are
    signed by botocore's SigV4 signer: a server that checks every signature accepts them, whatever the key."""
    server, keys = auth_server
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", keys["writer"][0])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", keys["writer"][1])
    store = open_store(server.uri(BUCKET, "signed"), config=small_config())
    try:
        await store.client.sdk()
        puts = await record_data_path(store, "PUT")
        gets = await record_data_path(store, "GET")
        path, data = make_file(tmp_path, "f", 2 * PART + 3)
        transfer = Transfer(store, small_config())
        up = await transfer.upload_file(path, f"signed/{name}/multi")
        down = await transfer.download_file(f"signed/{name}/multi", str(tmp_path / "back"))
        transfer.close()
        assert (tmp_path / "back").read_bytes() == data and up.digest == down.digest
        await store.put(f"signed/{name}/small", b"tiny", if_absent=True, metadata={"fastckpt-k": "v 1"})
        assert (await store.head(f"signed/{name}/small")).metadata == {"fastckpt-k": "v 1"}
        assert await store.get_range(f"signed/{name}/small", 1, 2) == b"in"
        with pytest.raises(AlreadyExistsError):
            await store.put(f"signed/{name}/small", b"other", if_absent=True)
        assert len(puts) >= 4 and len(gets) >= 2 and all("authorization" in h for h in puts + gets)
    finally:
        await store.close()
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrongSecretKey0123456789abcdefghijklmnopq")
    store = open_store(server.uri(BUCKET, "signed"), config=small_config())
    try:
        with pytest.raises(AccessDeniedError, match="SignatureDoesNotMatch"):
            await store.put(f"signed/{name}/denied", b"x")
        with pytest.raises(AccessDeniedError, match="SignatureDoesNotMatch"):
            await store.get_range(f"signed/{name}/small", 0, 4)
    finally:
        await store.close()


def test_hash_in_uri_is_an_error_not_a_request_to_aws(moto_server: MotoServer, tmp_path) -> None:
    """``#`` used to drop the query (endpoint_override included) and send signed requests to AWS."""
    import subprocess
    import sys

    src = tmp_path / "ok.txt"
    src.write_bytes(b"payload")
    cli = [sys.executable, "-m", "fastckpt.cli", "cp", str(src)]
    bad = subprocess.run([*cli, f"s3://{BUCKET}/hash/k#1?endpoint_override={moto_server.endpoint}"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 1
    assert "'#' starts a URL fragment" in bad.stderr and "%23" in bad.stderr
    good = subprocess.run([*cli, f"s3://{BUCKET}/hash/k%231?endpoint_override={moto_server.endpoint}"],
                          capture_output=True, text=True, timeout=120)
    assert good.returncode == 0, good.stderr
    client = boto3.client("s3", endpoint_url=moto_server.endpoint)
    assert client.get_object(Bucket=BUCKET, Key="hash/k#1")["Body"].read() == b"payload"


@pytest.mark.parametrize("signing", ["0", "1"])
async def test_a_part_spanning_several_buffers_is_sent_as_they_lie(moto_server, monkeypatch, signing: str) -> None:
    """A layout's part that spans tensors goes up as its views (``Pieces``), with no copy into a pooled buffer; with
    payload signing on, the signature covers the pieces as one body."""
    from fastckpt.engine.layout import Layout, upload_layout
    from fastckpt.stores.s3.upload import S3Upload

    monkeypatch.setenv("FASTCKPT_S3_PAYLOAD_SIGNING", signing)
    sent: list[type] = []
    original = S3Upload.put_part

    async def spy(self, index, data):
        sent.append(type(data))
        return await original(self, index, data)

    monkeypatch.setattr(S3Upload, "put_part", spy)
    uri = fastckpt.parse_uri(moto_server.uri(BUCKET, f"pieces-{uuid.uuid4().hex[:8]}/x"))
    views = [os.urandom(n) for n in (100_000, PART, 3 * PART // 5 + 7, 6 * PART // 5)]
    store = open_store(uri, config=small_config())
    transfer = Transfer(store, small_config(part_size=PART, multipart_threshold=PART))
    try:
        digest, _ = await upload_layout(transfer, Layout(views), uri.key)
        assert await store.get_range(uri.key, 0, digest.size + 1) == b"".join(views)
    finally:
        transfer.close()
        await store.close()
    assert tuple in sent, sent
