"""URI parsing: every scheme users write, and clear errors for bad ones."""

from __future__ import annotations

import os

import pytest

from fastckpt import TransferConfig, open_store, parse_uri
from fastckpt.config import env_seconds, parse_size


@pytest.mark.parametrize(
    ("uri", "backend", "bucket", "key"),
    [
        ("s3://bucket/a/b", "s3", "bucket", "a/b"),
        ("s3://bucket", "s3", "bucket", ""),
        ("gs://b/x/", "gcs", "b", "x"),
        ("abfss://ckpts@acct.dfs.core.windows.net/run/1", "azure", "ckpts", "run/1"),
        ("az://ckpts/run", "azure", "ckpts", "run"),
        ("file:///tmp/x/y", "local", "", "tmp/x/y"),
        ("/tmp/x", "local", "", "tmp/x"),
        ("memory://mem/p", "memory", "mem", "p"),
        ("hdfs://namenode:8020/user/x", "delegate", "namenode:8020", "user/x"),
    ],
)
def test_parse(uri: str, backend: str, bucket: str, key: str) -> None:
    parsed = parse_uri(uri)
    assert (parsed.backend, parsed.bucket, parsed.key) == (backend, bucket, key)


def test_options_and_account() -> None:
    parsed = parse_uri("s3://b/p?endpoint_override=http://127.0.0.1:9000&region=us-east-2")
    assert parsed.options == {"endpoint_override": "http://127.0.0.1:9000", "region": "us-east-2"}
    assert parse_uri("abfss://c@myacct.dfs.core.windows.net/p").options["account"] == "myacct"


def test_relative_local_path() -> None:
    assert parse_uri("rel/dir").key == os.path.abspath("rel/dir").strip("/")


@pytest.mark.parametrize(
    ("uri", "problem"),
    [
        ("", "empty"),
        ("s3://", "missing bucket"),
        ("s3:/bucket", "expected scheme"),
        ("s3://bad_bucket!/x", "not a valid bucket"),
        ("file://host/x", "take no host"),
        ("az://Upper/x", "not a valid Azure container"),
        ("s3://bkt/k#1?endpoint_override=http://127.0.0.1:5555", "'#' starts a URL fragment"),
        ("gs://bkt/a#b", "'#' starts a URL fragment"),
        ("s3://b/k?region=a&region=b", r"\['region'\] given more than once"),
    ],
)
def test_bad_uris(uri: str, problem: str) -> None:
    with pytest.raises(ValueError, match=problem) as info:
        parse_uri(uri)
    assert repr(uri) in str(info.value)


@pytest.mark.parametrize("uri", ["s3://b/p?endpoint=x", "gs://b/p?region=x", "az://c0ntainer/p?account=a&bucket=x",
                                 "file:///tmp/x?fsync=0", "memory://b/p?x=1"])
def test_each_backend_refuses_options_it_does_not_take(uri: str) -> None:
    """The backend's typed options decide which query options are valid (at open, not at parse)."""
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['(endpoint|region|bucket|fsync|x)'\]") as info:
        open_store(uri, retry=False)
    assert repr(uri) in str(info.value)


def test_config_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FASTCKPT_PART_SIZE", "8MiB")
    monkeypatch.setenv("FASTCKPT_VERIFY", "0")
    config = TransferConfig.from_env(max_in_flight=3)
    assert (config.part_size, config.verify, config.max_in_flight) == (8 << 20, False, 3)
    monkeypatch.setenv("FASTCKPT_MAX_IN_FLIGHT", "lots")
    with pytest.raises(ValueError, match="FASTCKPT_MAX_IN_FLIGHT"):
        TransferConfig.from_env()
    assert parse_size("1.5GiB") == 3 << 29
    with pytest.raises(ValueError, match="invalid size"):
        parse_size("12 parsecs")


@pytest.mark.parametrize("key", ["k#1", "50%/x?y", "a%23b"])
def test_keys_with_url_characters_round_trip(key: str) -> None:
    """A key holding '#', '?' or '%' is written percent-encoded, and str() of the URI parses back to it."""
    encoded = key.replace("%", "%25").replace("#", "%23").replace("?", "%3F")
    parsed = parse_uri(f"s3://bkt/{encoded}?endpoint_override=http://127.0.0.1:5555")
    assert parsed.key == key
    assert parsed.options == {"endpoint_override": "http://127.0.0.1:5555"}
    assert parse_uri(str(parsed)).key == key


@pytest.mark.parametrize("uri", ["s3://b/p?anonymous=", "gs://b/p?anonymous=", "az://c/p?account=acct&anonymous=",
                                 "s3://b/p?anonymous=maybe"])
def test_blank_or_odd_boolean_is_an_error_on_every_backend(uri: str) -> None:
    from fastckpt import open_store

    with pytest.raises(ValueError, match=r"option anonymous='(maybe)?' is not a boolean"):
        open_store(uri)


@pytest.mark.parametrize("uri", ["abfss://ckpts@acct.dfs.core.chinacloudapi.cn/run1/step-1",
                                 "https://acct.blob.core.usgovcloudapi.net/ckpts/run1",
                                 "s3://bkt/a%23b?endpoint_override=http://127.0.0.1:9&region=eu-west-1",
                                 "gs://bkt/x?anonymous=true", "memory://m/k", "/tmp/some#dir/x"])
def test_uri_parses_back_to_the_same_location(uri: str) -> None:
    """``StorageURI.uri()`` (what latest() / list_checkpoints() hand back) parses to the same location."""
    parsed = parse_uri(uri)
    again = parse_uri(parsed.uri())
    where = (parsed.backend, parsed.bucket, parsed.key, parsed.options)
    assert (again.backend, again.bucket, again.key, again.options) == where


def test_sovereign_azure_uri_reaches_its_cloud() -> None:
    from fastckpt.stores.azure import resolve_endpoint

    uri = parse_uri("abfss://ckpts/run1/step-1?account=acct&endpoint_suffix=core.chinacloudapi.cn")
    assert resolve_endpoint(uri.options, {"AZURE_STORAGE_KEY": "a2V5"}).url == "https://acct.blob.core.chinacloudapi.cn"


def test_env_seconds_reads_when_asked() -> None:
    """The agent's and the replicas' waits are read from the environment when used, a bad value named."""
    assert env_seconds("FASTCKPT_X", 60.0, {}) == 60.0
    assert env_seconds("FASTCKPT_X", 60.0, {"FASTCKPT_X": " 2.5 "}) == 2.5
    assert env_seconds("FASTCKPT_X", 60.0, {"FASTCKPT_X": "inf"}) == float("inf")
    for bad in ("soon", "-1", "nan"):
        with pytest.raises(ValueError, match="FASTCKPT_X"):
            env_seconds("FASTCKPT_X", 60.0, {"FASTCKPT_X": bad})
