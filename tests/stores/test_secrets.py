"""Planted secrets (an AWS secret key and session token, an Azure account key and SAS signature, a GCS
private key) never appear in messages, tracebacks, fastckpt's debug log, ``repr()`` of stores and
filesystems, progress or CLI output, or the URIs the library hands back."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import traceback
from pathlib import Path

import pytest

import fastckpt
import fastckpt.fs as ffs
from fastckpt import open_store
from fastckpt.stores.azure import EMULATOR_ACCOUNT, EMULATOR_KEY

from ..conftest import small_config
from ..servers.azure import CONTAINER
from ..servers.s3 import BUCKET

AWS_SECRET = "PLANTEDawsSECRETkey0123456789abcdefABCDEF"
AWS_TOKEN = "PLANTEDsessionTOKEN0123456789"
SAS_SIG = "PLANTEDsasSIGNATURE0123456789abcdef"
GCS_KEY = "PLANTEDprivateKEYmaterial0123456789"


def texts_of(exc: BaseException) -> list[str]:
    return [str(exc), repr(exc), "".join(traceback.format_exception(exc))]


async def exercise(uri: str, tmp_path: Path, seen: list[str]) -> None:
    """Upload, download, a checkpoint, listings and failures against ``uri``; what they show goes to ``seen``."""
    src = tmp_path / "f.bin"
    src.write_bytes(os.urandom(300 << 10))
    path, _, query = uri.partition("?")
    below = lambda name: f"{path}/{name}?{query}"  # noqa: E731
    progress: list[str] = []
    results = await fastckpt.upload_async(src, below("f.bin"), config=small_config(),
                                          progress=lambda d, t: progress.append(f"{d}/{t}"))
    results += await fastckpt.download_async(below("f.bin"), tmp_path / "back.bin", config=small_config())
    async with fastckpt.CheckpointWriter(below("ckpt/step-1"), config=small_config()) as writer:
        await writer.put_file(src, "model.bin")
    seen += [repr(writer.result), str(await fastckpt.latest_async(below("ckpt"), config=small_config()))]
    seen += [repr(i) for i in await fastckpt.list_checkpoints_async(below("ckpt"), config=small_config())]
    seen += [repr(r) for r in results] + progress
    async with open_store(uri, config=small_config()) as store:
        seen += [repr(store), store.uri("x"), repr(store.location)]
        for op in (store.head(below("missing")), store.get_range("nope/x", 0, 10)):
            try:
                await op
            except Exception as exc:
                seen += texts_of(exc)
    fs, base = ffs.from_uri(uri)
    seen += [repr(fs), repr(getattr(fs, "handler", None)), base]
    for bad in (below("ckpt/step-9"), f"{path.split('/')[0]}//no-such-bucket-x/p?{query}"):
        try:
            await fastckpt.download_checkpoint_async(bad, tmp_path / "never", config=small_config())
        except Exception as exc:
            seen += texts_of(exc)


def check(seen: list[str], caplog: pytest.LogCaptureFixture, *secrets: str) -> None:
    blob = "\n".join(seen) + caplog.text
    assert "upload " in caplog.text or "gcs secrets test ran" in caplog.text, "the debug log is not captured"
    for secret in secrets:
        assert secret not in blob and secret[:12] not in blob


async def test_aws_secret_key_and_session_token(moto_server, tmp_path: Path, monkeypatch, caplog) -> None:
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", AWS_SECRET)
    monkeypatch.setenv("AWS_SESSION_TOKEN", AWS_TOKEN)
    caplog.set_level(logging.DEBUG, logger="fastckpt")
    seen: list[str] = []
    await exercise(moto_server.uri(BUCKET, f"secrets-{os.urandom(3).hex()}"), tmp_path, seen)
    check(seen, caplog, AWS_SECRET, AWS_TOKEN)


async def test_azure_account_key_and_sas(azurite, tmp_path: Path, monkeypatch, caplog) -> None:
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", azurite.connection_string)  # holds the account key
    caplog.set_level(logging.DEBUG, logger="fastckpt")
    seen: list[str] = []
    await exercise(f"az://{CONTAINER}/secrets-{os.urandom(3).hex()}?account={EMULATOR_ACCOUNT}"
                   f"&endpoint_override={azurite.endpoint}", tmp_path, seen)
    sas_uri = f"https://{EMULATOR_ACCOUNT}.blob.core.windows.net/{CONTAINER}/p?sv=2024-01-01&sig={SAS_SIG}"
    for attempt in (lambda: fastckpt.open_store(sas_uri), lambda: repr(ffs.handler(sas_uri))):
        try:
            seen.append(str(attempt()))
        except Exception as exc:
            seen += texts_of(exc)
    monkeypatch.delenv("AZURE_STORAGE_CONNECTION_STRING")
    monkeypatch.setenv("AZURE_STORAGE_SAS_TOKEN", f"sv=2024-01-01&sig={SAS_SIG}")
    try:
        await fastckpt.download_async(f"az://{CONTAINER}/p/x?account={EMULATOR_ACCOUNT}&endpoint_override="
                                      f"{azurite.endpoint}", tmp_path / "x", config=small_config())
    except Exception as exc:
        seen += texts_of(exc)
    check(seen, caplog, EMULATOR_KEY, SAS_SIG)


async def test_gcs_private_key(gcs_server: str, tmp_path: Path, monkeypatch, caplog) -> None:
    creds = tmp_path / "sa.json"
    creds.write_text(json.dumps({"type": "service_account", "client_email": "x@y.iam.gserviceaccount.com",
                                 "private_key": f"-----BEGIN PRIVATE KEY-----\n{GCS_KEY}\n-----END PRIVATE KEY-----\n",
                                 "token_uri": f"{gcs_server}/token"}))
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(creds))
    monkeypatch.delenv("STORAGE_EMULATOR_HOST", raising=False)
    caplog.set_level(logging.DEBUG, logger="fastckpt")
    seen: list[str] = []
    async with open_store(f"gs://b/p?endpoint_override={gcs_server.replace('http://', 'https://')}") as store:
        seen.append(repr(store))
        try:
            await store.head("p/x")
        except Exception as exc:
            seen += texts_of(exc)
    logging.getLogger("fastckpt").debug("gcs secrets test ran")  # the log is on: a leak would show
    check(seen, caplog, GCS_KEY)


def test_cli_at_debug_level_shows_no_secret(moto_server, tmp_path: Path) -> None:
    src = tmp_path / "f.bin"
    src.write_bytes(os.urandom(1 << 20))
    env = {**os.environ, "AWS_SECRET_ACCESS_KEY": AWS_SECRET, "AWS_SESSION_TOKEN": AWS_TOKEN}
    uri = moto_server.uri(BUCKET, f"cli-{os.urandom(3).hex()}/f.bin")
    bad = moto_server.uri("no-such-bucket-cli", "f.bin")
    out = []
    for args in (["cp", str(src), uri, "-vv", "--progress"], ["cp", uri, str(tmp_path / "b"), "-vv"],
                 ["cp", str(src), bad, "--log-level", "debug"], ["ls", uri.rsplit("/", 1)[0] + "?" + uri.split("?")[1],
                                                                  "-vv", "--json"]):
        res = subprocess.run([sys.executable, "-m", "fastckpt.cli", *args], env=env, capture_output=True,
                             text=True, timeout=120)
        out += [res.stdout, res.stderr]
    blob = "\n".join(out)
    assert "no-such-bucket-cli" in blob  # the failure was reported
    assert AWS_SECRET[:12] not in blob and AWS_TOKEN[:12] not in blob
