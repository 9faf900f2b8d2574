"""The S3 backend's set-up against real moto servers: endpoints, credentials, regions, client settings, signing
as botocore does, buckets in other regions, authentication and errors that name the problem."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import uuid
from urllib.parse import urlsplit

import boto3
import pytest
from botocore.credentials import EnvProvider

import fastckpt
from fastckpt import (
    ObjectNotFoundError,
    StoreError,
    TransferConfig,
    open_store,
    parse_uri,
)
from fastckpt.engine.plan import plan_upload
from fastckpt.engine.select import keys_below
from fastckpt.engine.transfer import Transfer
from fastckpt.stores.s3 import S3Store, resolve_endpoint
from fastckpt.stores.s3.options import env_credentials
from fastckpt.stores.s3.sigv4 import StaticCredentials
from harness.procs import free_port
from harness.s3 import BUCKET, MotoServer

from ..conftest import small_config
from .conftest import PART, make_file, one_line, raw_client, record_data_path


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
