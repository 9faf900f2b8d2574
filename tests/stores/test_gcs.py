"""GCS backend against fake-gcs-server: composite uploads, temporary parts, errors, endpoints."""

from __future__ import annotations

import asyncio
import json
import os
import urllib.parse
import urllib.request
import uuid

import pytest

import fastckpt
from fastckpt import AccessDeniedError, ObjectNotFoundError, StoreError, TransientStoreError, open_store, parse_uri
from fastckpt.engine.transfer import Transfer
from fastckpt.integrity import FileDigest
from fastckpt.stores.gcs import COMPOSE_LIMIT, PARTS_DIR, GCSOptions, GCSStore, parts_prefix
from harness.faults import FaultInjectingStore
from harness.procs import free_port

from ..conftest import small_config
from ..servers.gcs import BUCKET

pytestmark = pytest.mark.timeout(120)


def server_names(server: str, prefix: str) -> list[str]:
    """Every object name below ``prefix`` as the emulator itself lists it (hidden parts included)."""
    names: list[str] = []
    token = ""
    while True:
        query = urllib.parse.urlencode({"prefix": prefix, **({"pageToken": token} if token else {})})
        with urllib.request.urlopen(f"{server}/storage/v1/b/{BUCKET}/o?{query}", timeout=30) as resp:
            page = json.load(resp)
        names += [item["name"] for item in page.get("items", [])]
        token = page.get("nextPageToken", "")
        if not token:
            return sorted(names)


@pytest.fixture
async def gcs(gcs_uri: str):
    """(store, parsed URI) on a fresh prefix."""
    uri = parse_uri(gcs_uri)
    store = open_store(uri, config=small_config(), retry=False)  # the backend itself, without the retry layer
    assert isinstance(store, GCSStore)
    try:
        yield store, uri
    finally:
        await store.close()


async def test_multi_level_compose_70_parts(gcs, gcs_server: str, tmp_path) -> None:
    store, uri = gcs
    config = small_config(part_size=1024, multipart_threshold=1024, max_in_flight=8)
    data = os.urandom(70 * 1024 - 300)  # 70 parts, the last one short
    src = tmp_path / "big.bin"
    src.write_bytes(data)
    transfer = Transfer(store, config)
    try:
        up = await transfer.upload_file(str(src), uri.join("big.bin"))
        down = await transfer.download_file(uri.join("big.bin"), str(tmp_path / "back.bin"))
    finally:
        transfer.close()
    assert (tmp_path / "back.bin").read_bytes() == data
    assert up.digest == down.digest
    meta = await store.head(uri.join("big.bin"))
    assert meta.size == len(data)
    assert FileDigest.from_metadata(len(data), meta.metadata) == up.digest
    assert server_names(gcs_server, uri.key + "/") == [uri.join("big.bin")]  # parts and intermediates gone
    assert await store.list_pending_uploads(uri.key) == []


async def test_three_compose_levels(gcs, gcs_server: str) -> None:
    store, uri = gcs
    count = COMPOSE_LIMIT * COMPOSE_LIMIT + 3  # 1027 parts: 33 composites, then 2, then the object
    chunks = [i.to_bytes(2, "big") * 4 for i in range(count)]
    mpu = await store.create_multipart(uri.join("deep"), 8, {"k": "v"})
    infos = await asyncio.gather(*(mpu.put_part(i, c) for i, c in enumerate(chunks)))
    await mpu.complete(list(infos))
    meta = await store.head(uri.join("deep"))
    assert (meta.size, meta.metadata.get("k")) == (8 * count, "v")
    assert await store.get_range(uri.join("deep"), 0, meta.size) == b"".join(chunks)
    assert server_names(gcs_server, uri.key + "/") == [uri.join("deep")]


async def test_emulator_refuses_33_sources_like_gcs(gcs) -> None:
    store, uri = gcs
    names = [uri.join(f"src/{i}") for i in range(COMPOSE_LIMIT + 1)]
    await asyncio.gather(*(store.put(n, b"x") for n in names))
    composed = await store.client.compose(uri.join("ok"), names[:COMPOSE_LIMIT])
    assert composed["size"] in (COMPOSE_LIMIT, str(COMPOSE_LIMIT))
    with pytest.raises(StoreError, match="32") as info:
        await store.client.compose(uri.join("too-many"), names)
    assert not isinstance(info.value, TransientStoreError)


@pytest.mark.parametrize("op, fail_after", [("put_part", 5), ("complete", 0)])
async def test_failed_upload_leaves_no_parts(gcs, gcs_server: str, tmp_path, op: str, fail_after: int) -> None:
    store, uri = gcs
    src = tmp_path / "f.bin"
    src.write_bytes(os.urandom(40 * 1024))
    faulty = FaultInjectingStore(store, ops={op}, fail_after=fail_after)
    transfer = Transfer(faulty, small_config(part_size=1024, multipart_threshold=1024))
    try:
        with pytest.raises(StoreError, match="injected"):
            await transfer.upload_file(str(src), uri.join("f.bin"))
    finally:
        transfer.close()
    assert faulty.injected >= 1
    with pytest.raises(ObjectNotFoundError):
        await store.head(uri.join("f.bin"))
    assert server_names(gcs_server, uri.key + "/") == []
    assert await store.list_pending_uploads(uri.key) == []


async def test_pending_parts_hidden_listed_and_aborted(gcs, gcs_server: str) -> None:
    store, uri = gcs
    await store.put(uri.join("d/visible"), b"v")
    mpu = await store.create_multipart(uri.join("d/obj.tar"), 4)
    await asyncio.gather(*(mpu.put_part(i, b"abcd") for i in range(3)))
    hidden = server_names(gcs_server, uri.key + "/")
    parts = [n for n in hidden if n.startswith(parts_prefix(uri.join("d/obj.tar"), mpu.upload_id))]
    assert [n.rsplit("/", 1)[1].split(".")[0] for n in parts] == ["0", "1", "2"]  # <index>.<nonce>
    assert [m.key async for m in store.list(uri.key)] == [uri.join("d/visible")]
    objects, dirs = await store.list_dir(uri.join("d"))
    assert ([o.key for o in objects], dirs) == ([uri.join("d/visible")], [])
    assert PARTS_DIR not in str(await store.list_dir(uri.key))
    for prefix in (uri.key, uri.join("d"), uri.join("d/obj.tar")):
        pending = await store.list_pending_uploads(prefix)
        assert [(p.key, p.upload_id) for p in pending] == [(uri.join("d/obj.tar"), mpu.upload_id)], prefix
    assert await store.list_pending_uploads(uri.join("d/obj")) == []  # a sibling name, not a parent
    await store.abort_pending_upload(pending[0])
    assert server_names(gcs_server, uri.key + "/") == [uri.join("d/visible")]
    await mpu.abort()  # safe after the gc removed it
    with pytest.raises(StoreError, match="no longer active"):
        await mpu.put_part(3, b"late")


async def test_missing_bucket_is_named(gcs_server: str) -> None:
    store = open_store(f"gs://no-such-bucket-4711/p?endpoint_override={gcs_server}")
    try:
        for call in (store.head("p/x"), store.put("p/x", b"1"), store.get_range("p/x", 0, 1),
                     store.delete("p/x"), store.list_dir("p")):
            with pytest.raises(ObjectNotFoundError) as info:
                await call
            message = str(info.value)
            assert "no-such-bucket-4711" in message and gcs_server in message and "\n" not in message
    finally:
        await store.close()


async def test_missing_object_is_not_a_missing_bucket(gcs) -> None:
    store, uri = gcs
    with pytest.raises(ObjectNotFoundError) as info:
        await store.head(uri.join("nothing"))
    assert uri.join("nothing") in str(info.value) and "bucket" not in str(info.value)


async def test_storage_emulator_host(gcs_server: str, tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    src = tmp_path / "ckpt"
    src.mkdir()
    (src / "a.bin").write_bytes(os.urandom(3000))
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(tmp_path / "absent.json"))  # not read: anonymous
    for host in (gcs_server, gcs_server.removeprefix("http://")):  # with and without the scheme
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", host)
        dst = f"gs://{BUCKET}/env-{uuid.uuid4().hex[:8]}"
        await fastckpt.upload_async(src, dst, config=small_config())
        out = tmp_path / f"out-{len(host)}"
        await fastckpt.download_async(dst, out, config=small_config())
        assert (out / "a.bin").read_bytes() == (src / "a.bin").read_bytes()


async def test_endpoint_override_wins_over_emulator_host(gcs_uri: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", f"http://127.0.0.1:{free_port()}")  # nothing listens there
    uri = parse_uri(gcs_uri)
    async with open_store(uri) as store:
        await store.put(uri.join("x"), b"via override")
        assert await store.get_range(uri.join("x"), 0, 100) == b"via override"


async def test_crc32c_mismatch_rejected(gcs) -> None:
    store, uri = gcs
    with pytest.raises(TransientStoreError, match="CRC32C"):
        await store.client.upload_object(uri.join("bad"), memoryview(b"payload"), crc="AAAAAA==")
    with pytest.raises(ObjectNotFoundError):
        await store.head(uri.join("bad"))
    await store.client.upload_object(uri.join("good"), memoryview(b"payload"))  # the computed CRC32C is accepted


async def test_bad_credentials_one_line(gcs_server: str, tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    creds = tmp_path / "adc.json"  # refresh goes to the emulator, which has no token endpoint (404)
    creds.write_text(json.dumps({"type": "authorized_user", "client_id": "id", "client_secret": "secret",
                                 "refresh_token": "bogus", "token_uri": f"{gcs_server}/token"}))
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(creds))
    async with open_store(f"gs://{BUCKET}/p?endpoint_override={gcs_server}&anonymous=false") as store:
        with pytest.raises(AccessDeniedError) as info:
            await store.head("p/x")
    message = str(info.value)
    assert BUCKET in message and gcs_server in message and "GOOGLE_APPLICATION_CREDENTIALS" in message
    assert "\n" not in message
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(tmp_path / "missing.json"))
    async with open_store(f"gs://{BUCKET}/p?endpoint_override={gcs_server}&anonymous=false") as store:
        with pytest.raises(AccessDeniedError, match=r"missing\.json"):
            await store.head("p/x")


async def test_folder_placeholders_are_not_files(gcs, gcs_server: str) -> None:
    store, uri = gcs
    await store.put(uri.join("dir") + "/", b"")  # what consoles create for "folders"
    await store.put(uri.join("dir/file"), b"f")
    assert [m.key async for m in store.list(uri.join("dir"))] == [uri.join("dir/file")]
    assert [o.key for o in (await store.list_dir(uri.join("dir")))[0]] == [uri.join("dir/file")]



async def test_compose_that_ignores_preconditions_is_refused_by_default(gcs_server: str) -> None:
    """fake-gcs-server ignores ifGenerationMatch=0 on compose: detected, and a create-if-absent refused."""
    async with GCSStore(BUCKET, GCSOptions(gcs_server, anonymous=True, if_absent_mode="auto")) as store:
        key = f"cond-{uuid.uuid4().hex[:8]}/obj"
        await store.put(key, b"first")
        mpu = await store.create_multipart(key, 4, if_absent=True)
        infos = [await mpu.put_part(0, b"abcd"), await mpu.put_part(1, b"e")]
        with pytest.raises(StoreError, match=r"ignores ifGenerationMatch=0 on compose.*FASTCKPT_GCS_IF_ABSENT"):
            await mpu.complete(infos)
        await mpu.abort()
        assert await store.get_range(key, 0, 100) == b"first"
