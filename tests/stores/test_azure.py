"""Azure Blob backend: limits, uncommitted blocks, URI forms and credentials, errors, metadata names."""

from __future__ import annotations

import base64
import hashlib
import os
import uuid
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

import fastckpt
from fastckpt import AccessDeniedError, ObjectNotFoundError, StoreError, open_store, parse_uri
from fastckpt.engine.plan import plan_upload
from fastckpt.engine.transfer import Transfer
from fastckpt.stores.azure import (
    EMULATOR_ACCOUNT,
    EMULATOR_KEY,
    AzureOptions,
    AzureStore,
    decode_metadata_key,
    encode_metadata_key,
    resolve_endpoint,
    shared_key_signer,
)
from fastckpt.stores.azure.client import AzureClient
from fastckpt.transport import Buffer, BufferReceiver
from harness.faults import FaultInjectingStore

from ..conftest import small_config
from ..servers.azure import CONTAINER, Azurite

MiB = 1 << 20
_ENV = ("AZURE_STORAGE_CONNECTION_STRING", "AZURE_STORAGE_ACCOUNT_NAME", "AZURE_STORAGE_ACCOUNT",
        "AZURE_STORAGE_ACCOUNT_KEY", "AZURE_STORAGE_KEY", "AZURE_STORAGE_SAS_TOKEN")


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No Azure credentials from the developer's environment."""
    for name in _ENV:
        monkeypatch.delenv(name, raising=False)


def offline_store() -> AzureStore:
    return open_store("az://c0ntainer/x?account=acct&anonymous=true", retry=False)  # type: ignore[return-value]


# ----------------------------------------------------------------------------- limits


@pytest.mark.parametrize(("size", "part"), [
    (50_000 * 32 * MiB, 32 * MiB),                  # exactly fits at the configured 32 MiB
    (50_000 * 32 * MiB + 1, 33 * MiB),              # one byte more: next whole MiB
    (5 << 40, 105 * MiB),                           # 5 TiB
    (50_000 * 4000 * MiB, 4000 * MiB),              # Azure's largest block blob
])
def test_block_size_scales_to_50000_blocks(size: int, part: int) -> None:
    store = offline_store()
    plan = plan_upload(size, fastckpt.TransferConfig(part_size=32 * MiB), store)
    assert plan.part_size == part
    assert plan.count <= 50_000
    assert plan.part_size <= 4000 * MiB
    assert (plan.count - 1) * plan.part_size < size <= plan.count * plan.part_size


def test_too_large_for_azure_is_refused() -> None:
    with pytest.raises(ValueError, match="50000 parts"):
        plan_upload(50_000 * 4000 * MiB + 1, fastckpt.TransferConfig(), offline_store())


async def test_block_ids_have_a_fixed_length() -> None:
    store = offline_store()
    mpu = await store.create_multipart("k", 8 * MiB)
    ids = [mpu.block_id(i) for i in (0, 7, 9_999, 49_999)]  # type: ignore[attr-defined]
    assert len({len(i) for i in ids}) == 1 and len(set(ids)) == 4
    assert all(len(base64.b64encode(i.encode())) == 32 for i in ids)  # no padding once encoded
    with pytest.raises(ValueError):
        mpu.block_id(50_000)  # type: ignore[attr-defined]
    other = await store.create_multipart("k", 8 * MiB)
    assert other.block_id(0) != ids[0]  # type: ignore[attr-defined]


# ----------------------------------------------------------------------------- uncommitted blocks


async def blob_exists_with_blocks(azurite: Azurite, key: str) -> bool:
    """Whether the emulator still holds a blob or staged blocks for ``key`` (asked through the SDK)."""
    from azure.core.exceptions import ResourceNotFoundError
    from azure.storage.blob.aio import BlobServiceClient

    async with BlobServiceClient.from_connection_string(azurite.connection_string, retry_total=0) as client:
        blob = client.get_blob_client(CONTAINER, key)
        try:
            committed, uncommitted = await blob.get_block_list("all")
        except ResourceNotFoundError:
            return False
        return bool(committed or uncommitted)


async def test_failed_upload_leaves_no_visible_blob(azure_uri: str, azurite: Azurite, tmp_path: Path) -> None:
    uri = parse_uri(azure_uri)
    inner = open_store(uri, config=small_config())
    store = FaultInjectingStore(inner, fail_after=3, ops={"put_part"})
    src = tmp_path / "big.bin"
    src.write_bytes(os.urandom(6 * (256 << 10) + 5))
    key = uri.join("big.bin")
    try:
        transfer = Transfer(store, small_config(max_in_flight=1))
        with pytest.raises(StoreError, match="injected permanent failure"):
            await transfer.upload_file(str(src), key)
        transfer.close()
        assert store.injected >= 1
        with pytest.raises(ObjectNotFoundError):
            await inner.head(key)
        assert [m async for m in inner.list(uri.key)] == []
        assert await inner.list_pending_uploads(uri.key) == []
        assert not await blob_exists_with_blocks(azurite, key)  # the staged blocks are gone too
    finally:
        await inner.close()


async def test_staged_blocks_are_invisible_until_committed(azure_uri: str, azurite: Azurite) -> None:
    uri = parse_uri(azure_uri)
    async with open_store(uri, config=small_config()) as store:
        mpu = await store.create_multipart(uri.join("staged"), 1024)
        parts = [await mpu.put_part(i, bytes([i]) * 1024) for i in range(3)]
        assert await blob_exists_with_blocks(azurite, uri.join("staged"))
        with pytest.raises(ObjectNotFoundError):
            await store.head(uri.join("staged"))
        assert [m async for m in store.list(uri.key)] == []
        assert [u.key for u in await store.list_pending_uploads(uri.key)] == [uri.join("staged")]
        await mpu.complete(parts, {"fastckpt-chunk": "1024"})
        meta = await store.head(uri.join("staged"))
        assert meta.size == 3 * 1024 and meta.metadata == {"fastckpt-chunk": "1024"}
        assert await store.list_pending_uploads(uri.key) == []


async def test_abort_keeps_the_committed_blob(azure_uri: str) -> None:
    uri = parse_uri(azure_uri)
    key = uri.join("keep")
    async with open_store(uri, config=small_config()) as store:
        await store.put(key, b"committed version")
        mpu = await store.create_multipart(key, 1024)
        await mpu.put_part(0, os.urandom(1024))
        await mpu.abort()
        await mpu.abort()  # twice is fine
        assert await store.get_range(key, 0, 100) == b"committed version"
        with pytest.raises(StoreError, match="no longer active"):
            await mpu.put_part(1, b"x")


class WrongMd5Client(AzureClient):
    """Sends the Content-MD5 of other bytes, as if the payload had been corrupted after hashing."""

    async def md5(self, data: Buffer) -> bytes | None:
        return hashlib.md5(b"other bytes").digest()


class WrongMd5Store(AzureStore):
    def __init__(self, container: str, options: AzureOptions) -> None:
        super().__init__(container, options)
        self.client = WrongMd5Client(container, options, max_connections=16)


async def test_service_checks_the_content_md5(azure_uri: str) -> None:
    uri = parse_uri(azure_uri)
    async with WrongMd5Store(uri.bucket, resolve_endpoint(uri.options)) as store:
        with pytest.raises(StoreError, match="400"):
            await store.put(uri.join("single"), b"payload")
        mpu = await store.create_multipart(uri.join("multi"), 1024)
        with pytest.raises(StoreError, match="400"):
            await mpu.put_part(0, b"x" * 1024)
        await mpu.abort()
        with pytest.raises(ObjectNotFoundError):
            await store.head(uri.join("single"))


def test_content_md5_can_be_turned_off(monkeypatch: pytest.MonkeyPatch) -> None:
    assert offline_store().options.content_md5
    monkeypatch.setenv("FASTCKPT_AZURE_CONTENT_MD5", "0")
    assert not offline_store().options.content_md5


# ----------------------------------------------------------------------------- URI forms and credentials


def emulator_options(azurite: Azurite) -> str:
    return f"endpoint_override={azurite.endpoint}"


@pytest.mark.parametrize("form", ["abfss", "az", "https"])
async def test_uri_forms_reach_azurite(form: str, azurite: Azurite, monkeypatch: pytest.MonkeyPatch,
                                       tmp_path: Path) -> None:
    prefix = f"forms-{uuid.uuid4().hex[:8]}"
    if form == "abfss":
        uri = f"abfss://{CONTAINER}@{EMULATOR_ACCOUNT}.dfs.core.windows.net/{prefix}?{emulator_options(azurite)}"
    elif form == "https":
        uri = f"https://{EMULATOR_ACCOUNT}.blob.core.windows.net/{CONTAINER}/{prefix}?{emulator_options(azurite)}"
    else:
        monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", azurite.connection_string)
        uri = f"az://{CONTAINER}/{prefix}"
    parsed = parse_uri(uri)
    assert (parsed.backend, parsed.bucket, parsed.key) == ("azure", CONTAINER, prefix)
    (tmp_path / "f.bin").write_bytes(b"payload " + form.encode())
    base, _, query = uri.partition("?")
    await fastckpt.upload_async(tmp_path / "f.bin", f"{base}/f.bin" + (f"?{query}" if query else ""),
                                config=small_config())
    async with open_store(parsed, config=small_config()) as store:
        assert await store.get_range(parsed.join("f.bin"), 0, 100) == b"payload " + form.encode()


async def test_account_key_and_sas_from_environment(azure_uri: str, azurite: Azurite,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    from azure.storage.blob import ContainerSasPermissions, generate_container_sas

    uri = parse_uri(azure_uri)
    monkeypatch.setenv("AZURE_STORAGE_ACCOUNT_NAME", EMULATOR_ACCOUNT)
    monkeypatch.setenv("AZURE_STORAGE_ACCOUNT_KEY", EMULATOR_KEY)
    async with open_store(uri, config=small_config()) as store:
        assert store.options.source == "the account key from the environment"  # type: ignore[attr-defined]
        await store.put(uri.join("by-key"), b"k")
    monkeypatch.delenv("AZURE_STORAGE_ACCOUNT_KEY")
    sas = generate_container_sas(EMULATOR_ACCOUNT, CONTAINER, account_key=EMULATOR_KEY,
                                 permission=ContainerSasPermissions(read=True, write=True, list=True),
                                 expiry=datetime.now(timezone.utc) + timedelta(hours=1))
    monkeypatch.setenv("AZURE_STORAGE_SAS_TOKEN", "?" + sas)
    async with open_store(uri, config=small_config()) as store:
        assert store.options.source == "AZURE_STORAGE_SAS_TOKEN"  # type: ignore[attr-defined]
        await store.put(uri.join("by-sas"), b"s")
        assert sorted([m.key async for m in store.list(uri.key)]) == [uri.join("by-key"), uri.join("by-sas")]
        with pytest.raises(AccessDeniedError, match="AZURE_STORAGE_SAS_TOKEN"):
            await store.delete(uri.join("by-key"))  # the SAS grants no delete


def test_only_azure_hosts_take_the_https_form() -> None:
    assert parse_uri("https://example.com/c0ntainer/p").backend == "delegate"
    parsed = parse_uri("https://acct.dfs.core.windows.net/c0ntainer/a/b?endpoint_override=http://127.0.0.1:1")
    assert (parsed.backend, parsed.bucket, parsed.key) == ("azure", "c0ntainer", "a/b")
    assert parsed.options["account"] == "acct"
    with pytest.raises(ValueError, match="missing container"):
        parse_uri("https://acct.blob.core.windows.net/")


def test_endpoint_resolution() -> None:
    abfss = parse_uri("abfss://c0ntainer@acct.dfs.core.windows.net/p").options
    assert resolve_endpoint(abfss, {"AZURE_STORAGE_KEY": "a2V5"}).url == "https://acct.blob.core.windows.net"
    china = parse_uri("https://acct.blob.core.chinacloudapi.cn/c0ntainer/p").options
    assert resolve_endpoint(china, {"AZURE_STORAGE_KEY": "a2V5"}).url == "https://acct.blob.core.chinacloudapi.cn"
    override = {"account": "acct", "endpoint_override": "http://127.0.0.1:10000"}
    assert resolve_endpoint(override, {"AZURE_STORAGE_KEY": "a2V5"}).url == "http://127.0.0.1:10000/acct"
    conn = {"AZURE_STORAGE_CONNECTION_STRING": "DefaultEndpointsProtocol=https;AccountName=other;"
                                               "AccountKey=a2V5;EndpointSuffix=core.usgovcloudapi.net"}
    assert resolve_endpoint({}, conn).url == "https://other.blob.core.usgovcloudapi.net"
    # a connection string for another account does not lend its key
    assert resolve_endpoint({"account": "acct"}, {**conn, "AZURE_STORAGE_SAS_TOKEN": "sv=1"}).credential == "sv=1"
    assert resolve_endpoint({"account": "acct", "anonymous": "true"}, conn).credential is None
    dev = resolve_endpoint({}, {"AZURE_STORAGE_CONNECTION_STRING": "UseDevelopmentStorage=true"})
    assert (dev.account, dev.url) == (EMULATOR_ACCOUNT, "http://127.0.0.1:10000/devstoreaccount1")
    assert resolve_endpoint({"account": "acct"}, {}).credential == "default"  # azure-identity is installed
    with pytest.raises(ValueError, match="no Azure storage account"):
        resolve_endpoint({}, {})


# ----------------------------------------------------------------------------- errors


async def test_missing_container_is_named(azurite: Azurite, tmp_path: Path) -> None:
    uri = parse_uri(f"az://no-such-container/p?account={EMULATOR_ACCOUNT}&{emulator_options(azurite)}")
    async with open_store(uri, config=small_config()) as store:
        for op in (store.head("p/x"), store.put("p/x", b"1"), store.delete("p/x"),
                   store.get_range("p/x", 0, 1), anext(store.list("p"))):
            with pytest.raises(ObjectNotFoundError) as info:
                await op
            message = str(info.value)
            assert "'no-such-container'" in message and EMULATOR_ACCOUNT in message
            assert "\n" not in message
    (tmp_path / "f").write_bytes(b"1")
    with pytest.raises(ObjectNotFoundError, match="container 'no-such-container' does not exist"):
        await fastckpt.upload_async(tmp_path / "f", uri.raw.replace("/p?", "/p/f?"), config=small_config())


async def test_bad_key_is_access_denied_without_the_key(azure_uri: str, azurite: Azurite,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    bad_key = base64.b64encode(os.urandom(64)).decode()
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING",
                       azurite.connection_string.replace(EMULATOR_KEY, bad_key))
    uri = parse_uri(azure_uri.split("?")[0])  # credentials from the connection string only
    async with open_store(uri, config=small_config()) as store:
        for op in (store.head(uri.join("x")), store.put(uri.join("x"), b"1"), anext(store.list(uri.key))):
            with pytest.raises(AccessDeniedError) as info:
                await op
            message = str(info.value)
            assert EMULATOR_ACCOUNT in message and CONTAINER in message and "\n" not in message
            assert bad_key not in message and bad_key[:12] not in message
            assert EMULATOR_KEY[:12] not in message


# ----------------------------------------------------------------------------- metadata names


@given(st.text(min_size=1, max_size=40))
def test_metadata_key_encoding_is_reversible(name: str) -> None:
    encoded = encode_metadata_key(name)
    assert encoded.isascii() and (encoded[0].isalpha() or encoded[0] == "_")
    assert all(c.isalnum() or c == "_" for c in encoded)
    assert decode_metadata_key(encoded) == name


def test_metadata_key_encoding_is_readable() -> None:
    assert encode_metadata_key("fastckpt-xxh3") == "fastckpt_xxh3"
    assert encode_metadata_key("k") == "k"
    assert decode_metadata_key("plain_name") == "plain-name"  # foreign names: underscores read as dashes


async def test_metadata_keys_roundtrip_through_azurite(azure_uri: str, azurite: Azurite) -> None:
    from azure.storage.blob.aio import BlobServiceClient

    uri = parse_uri(azure_uri)
    metadata = {"fastckpt-xxh3": "00ff", "fastckpt-chunk": "42", "snake_case": "1", "9lives": "2",
                "dots.and-dashes": "3", "état": "4"}
    async with open_store(uri, config=small_config()) as store:
        await store.put(uri.join("m"), b"abc", metadata=metadata)
        assert (await store.head(uri.join("m"))).metadata == metadata
        mpu = await store.create_multipart(uri.join("mp"), 1024)
        await mpu.complete([await mpu.put_part(0, b"x")], metadata)
        assert (await store.head(uri.join("mp"))).metadata == metadata
        assert [m.metadata async for m in store.list(uri.join("mp"))] == [metadata]
    async with BlobServiceClient.from_connection_string(azurite.connection_string, retry_total=0) as client:
        props = await client.get_blob_client(CONTAINER, uri.join("m")).get_blob_properties()
    assert props.metadata["fastckpt_xxh3"] == "00ff"  # stored under a C# identifier



async def test_sdk_internals_this_backend_reads_keep_their_shape(azure_uri: str) -> None:
    """``shared_key_signer`` is where the private SDK part is used (its shared-key policy signs the data path's
    requests): Azurite accepts what it signs, a wrong key is refused, and its absence is a clear error."""
    uri = parse_uri(azure_uri)
    async with open_store(uri, config=small_config()) as store:
        await store.put(uri.join("shape"), b"0123456789")
        buf = bytearray(4)
        resp = await store.inner.client.send("GET", uri.join("shape"), "", {"x-ms-range": "bytes=2-5"},
                                      into=BufferReceiver(memoryview(buf)))
        assert resp.status == 206 and buf == b"2345"
        sign = shared_key_signer(EMULATOR_ACCOUNT, EMULATOR_KEY)
        headers = sign("GET", "http://h/devstoreaccount1/c/k", {"x-ms-date": "Thu, 03 Dec 2026 10:00:00 GMT"})
        assert headers["Authorization"].startswith(f"SharedKey {EMULATOR_ACCOUNT}:")
        store.inner.client.sign = shared_key_signer(EMULATOR_ACCOUNT, base64.b64encode(b"wrong key").decode())
        with pytest.raises(AccessDeniedError):
            await store.read_into(uri.join("shape"), 0, memoryview(buf))
    import azure.storage.blob._shared.authentication as authentication

    policy = authentication.SharedKeyCredentialPolicy
    try:
        del authentication.SharedKeyCredentialPolicy
        with pytest.raises(StoreError, match=r"azure-storage-blob \S+ changed shape"):
            shared_key_signer(EMULATOR_ACCOUNT, EMULATOR_KEY)
    finally:
        authentication.SharedKeyCredentialPolicy = policy
