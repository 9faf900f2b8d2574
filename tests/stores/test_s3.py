"""S3 backend against real moto servers: multipart, retries, aborts, conditional writes, config, errors."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import http.client
import os
import threading
import uuid
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

import pytest

import fastckpt
from fastckpt import (
    AlreadyExistsError,
    IntegrityError,
    ObjectNotFoundError,
    StoreError,
    TransientStoreError,
    open_store,
    parse_uri,
)
from fastckpt.engine import upload as upload_module
from fastckpt.engine.transfer import Transfer
from fastckpt.integrity import META_CHUNK, META_DIGEST, FileDigest
from fastckpt.stores.s3 import RECORD_DIR, RECORD_ETAG, RECORD_MARK
from harness.faults import FaultInjectingStore
from harness.s3 import BUCKET, MotoServer

from ..conftest import small_config
from .conftest import PART, make_file, one_line, pending_on_server, raw_client, record_data_path

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
