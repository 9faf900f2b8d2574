"""URI parsing: every scheme users write, and clear errors for bad ones."""

from __future__ import annotations

import os

import pytest

from fastckpt import TransferConfig, parse_uri
from fastckpt.config import parse_size


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
        ("s3://b/p?endpoint=x", "unknown option"),
        ("file://host/x", "take no host"),
        ("az://Upper/x", "not a valid Azure container"),
    ],
)
def test_bad_uris(uri: str, problem: str) -> None:
    with pytest.raises(ValueError, match=problem) as info:
        parse_uri(uri)
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
