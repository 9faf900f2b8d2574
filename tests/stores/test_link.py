"""Transfers over an emulated cloud link (``harness.link``): the requests in flight size themselves to the link
(``stores.concurrency``) and fall when the service throttles, buffers stay within ``memory_limit`` whatever the
concurrency, and no request waits on an answer another could have carried (round trips counted)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from urllib.parse import urlsplit

import boto3
import pytest

import fastckpt
from fastckpt.engine.transfer import Transfer
from fastckpt.stores.concurrency import MIN_LIMIT, endpoint_limit
from harness.link import LinkEmulator, LinkProcess, LinkProfile
from harness.proxy import FaultProxy
from harness.s3 import CREDENTIALS
from harness.uris import emulator_uri

from ..conftest import small_config

pytestmark = pytest.mark.timeout(240)
MiB = 1 << 20
MB = 1_000_000
SLOW = LinkProfile("slow", rtt=0.04, per_connection=2 * MB, total=32 * MB)
"""A link one connection fills a sixteenth of: 16 requests in flight are what it needs."""


def _port(endpoint: str) -> int:
    return urlsplit(endpoint).port or 80


# ----------------------------------------------------------------------------- the emulator itself


def test_the_emulator_delays_paces_and_counts(moto_server) -> None:
    """A request through the link waits its round trips (the handshake's and its own); a body is paced at the
    connection's rate; request heads are counted, bodies skipped."""
    body = os.urandom(2 * MiB)
    _client(moto_server.endpoint).put_object(Bucket="fastckpt-test", Key="link-obj", Body=body)
    profile = LinkProfile("t", rtt=0.1, per_connection=4 * MB, total=0)
    with LinkEmulator(_port(moto_server.endpoint), profile) as link:
        client = _client(link.url)
        started = time.monotonic()
        assert client.get_object(Bucket="fastckpt-test", Key="link-obj")["Body"].read() == body
        took = time.monotonic() - started
        client.head_object(Bucket="fastckpt-test", Key="link-obj")
    assert took >= 2 * 0.1 + len(body) / (4 * MB) * 0.9  # handshake + request round trips, then 2 MiB at 4 MB/s
    assert link.stats.requests == ["GET /fastckpt-test/link-obj", "HEAD /fastckpt-test/link-obj"]
    assert link.stats.moved["down"] > len(body)


def _client(endpoint: str):
    return boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1",
                        aws_access_key_id=CREDENTIALS["AWS_ACCESS_KEY_ID"],
                        aws_secret_access_key=CREDENTIALS["AWS_SECRET_ACCESS_KEY"])


# ----------------------------------------------------------------------------- concurrency sized to the link


@pytest.mark.parametrize("backend", ["azure", "gcs"])
async def test_requests_in_flight_grow_to_what_the_link_needs_and_stop(backend: str, request: pytest.FixtureRequest,
                                                                       tmp_path: Path) -> None:
    """Starting at 8 requests in flight on a link that needs 16 (each connection carries a sixteenth of it), the
    limit grows past 16 on an upload and on a download, and stops well short of the 48 parts on offer: Azure's and
    GCS's data paths through the emulated link."""
    endpoint = request.getfixturevalue("azurite").endpoint if backend == "azure" else request.getfixturevalue(
        "gcs_server")
    data = os.urandom(24 * MiB)
    (tmp_path / "f").write_bytes(data)
    config = small_config(part_size=512 << 10, max_in_flight=256, target_throughput=1, range_size=512 << 10,
                          retries=6)
    with LinkEmulator(_port(endpoint), SLOW) as link:
        store = fastckpt.open_store(emulator_uri(backend, link.url, f"grow-{os.urandom(4).hex()}"))
        limit = endpoint_limit(store.location, config.max_in_flight, MIN_LIMIT)
        transfer = Transfer(store, config)
        try:
            assert limit.limit == MIN_LIMIT
            await transfer.upload_file(str(tmp_path / "f"), "f")
            grown_up, peak_up = limit.limit, limit.peak
            limit.limit, limit.peak, limit.slow_start = float(MIN_LIMIT), 0, True  # the download starts over
            await transfer.download_file("f", str(tmp_path / "g"))
            grown_down, peak_down = limit.limit, limit.peak
        finally:
            transfer.close()
            await store.close()
    assert (tmp_path / "g").read_bytes() == data
    assert peak_up >= 16 and peak_down >= 16, (peak_up, peak_down)
    assert 16 <= grown_up < 40 and 16 <= grown_down < 40, (grown_up, grown_down)


async def test_throttling_lowers_the_limit_the_link_raised(azurite, tmp_path: Path) -> None:
    """Behind the same link, a service that throttles above 6 requests at once: the limit falls from where it
    started (32) to around 6, short of the 16 the link alone would take, and the transfer completes with most of
    its later requests served."""
    data = os.urandom(48 * MiB)
    (tmp_path / "f").write_bytes(data)
    config = small_config(part_size=512 << 10, max_in_flight=256, retries=20, retry_for=60)
    with FaultProxy(_port(azurite.endpoint)) as proxy, LinkEmulator(proxy.port, SLOW) as link:
        proxy.throttle(6, 503, "ServerBusy")
        store = fastckpt.open_store(emulator_uri("azure", link.url, f"throttle-{os.urandom(4).hex()}"))
        limit = endpoint_limit(store.location, config.max_in_flight, 32)
        transfer = Transfer(store, config)
        try:
            await transfer.upload_file(str(tmp_path / "f"), "f")
        finally:
            transfer.close()
            await store.close()
    assert limit.throttled_at is not None and limit.limit < 10, limit.limit
    later = proxy.answers[len(proxy.answers) // 2:]
    assert sum(later) <= 0.2 * len(later), f"{sum(later)} of the last {len(later)} requests throttled"


# ----------------------------------------------------------------------------- memory apart from concurrency


MEMORY_SCRIPT = """
import asyncio, json, os, sys
import fastckpt
from fastckpt.config import TransferConfig
from fastckpt.engine.transfer import Transfer
from fastckpt.stores.concurrency import endpoint_limit

def rss(field):
    for line in open("/proc/self/status"):
        if line.startswith(field):
            return int(line.split()[1]) * 1024

async def main(uri, src, dst, limit):
    config = TransferConfig(part_size=1 << 20, multipart_threshold=1 << 20, max_in_flight=256,
                            target_throughput=10**12, memory_limit=limit, range_size=1 << 20)
    store = fastckpt.open_store(uri)
    transfer = Transfer(store, config)
    before = rss("VmHWM")
    await transfer.upload_file(src, "f")
    await transfer.download_file("f", dst)
    peak = endpoint_limit(store.location, 256, 256).peak
    print(json.dumps({"growth": rss("VmHWM") - before, "pool_peak": transfer.pool.peak, "limit_peak": peak}))
    transfer.close()
    await store.close()

asyncio.run(main(*sys.argv[1:4], int(sys.argv[4])))
"""


@pytest.mark.parametrize("limit_mib", [16, 64])
def test_memory_stays_within_its_limit_at_256_requests_in_flight(azurite, tmp_path: Path, limit_mib: int) -> None:
    """A 96 MiB file up and down in 1 MiB parts and ranges over a slow link, 256 requests allowed in flight from the
    start: the pool never maps more than ``memory_limit``, and the process's peak RSS grows by no more than it plus
    a constant, while requests pile up to what that memory carries."""
    data = os.urandom(96 * MiB)
    (tmp_path / "f").write_bytes(data)
    with LinkEmulator(_port(azurite.endpoint), LinkProfile("m", rtt=0.05, per_connection=4 * MB, total=160 * MB)
                      ) as link:
        uri = emulator_uri("azure", link.url, f"memory-{os.urandom(4).hex()}")
        out = subprocess.run([sys.executable, "-c", MEMORY_SCRIPT, uri, str(tmp_path / "f"), str(tmp_path / "g"),
                              str(limit_mib * MiB)], capture_output=True, text=True, timeout=200, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    facts = json.loads(out.stdout.strip().splitlines()[-1])
    assert (tmp_path / "g").read_bytes() == data
    assert facts["pool_peak"] <= limit_mib * MiB
    assert facts["growth"] <= limit_mib * MiB + 40 * MiB, facts
    assert facts["limit_peak"] >= min(limit_mib, 32), facts  # requests in flight as the memory allows


# ----------------------------------------------------------------------------- round trips


def test_round_trips_of_a_directory_up_and_down(moto_server, tmp_path: Path) -> None:
    """An upload of three small files and one of three parts asks nothing but the writes (after the store's one
    probe of its bucket): the multipart upload is created while the small files go, and its parts are hashed while
    they are sent; its digest record follows its completion. The download lists while it asks whether the source
    is an object, reads each small file with its metadata in one GET, and the large one after its HEAD (and its
    record's), range by range."""
    src = tmp_path / "src"
    src.mkdir()
    for i in range(3):
        (src / f"small{i}.json").write_bytes(os.urandom(1000))
    (src / "big.bin").write_bytes(os.urandom(12 * MiB))
    config = small_config(part_size=5 * MiB, multipart_threshold=5 * MiB)
    with LinkEmulator(_port(moto_server.endpoint), LinkProfile("rt", rtt=0.01)) as link:
        uri = emulator_uri("s3", link.url, f"rt-{os.urandom(4).hex()}")
        fastckpt.upload(str(src), uri, config=config)
        up = _counted(link.stats.requests)
        link.reset_stats()
        fastckpt.download(uri, str(tmp_path / "dst"), config=config)
        down = _counted(link.stats.requests)
    assert up == {"HEAD": 1, "PUT object": 4, "POST create": 1, "PUT part": 3, "POST complete": 1}, up
    assert down == {"HEAD": 3, "GET list": 1, "GET": 6}, down


def _counted(requests: list[str]) -> Counter[str]:
    """Requests by kind; a HEAD sent again at once (on a fresh connection, after the server closed the idle one it
    went out on) counts once."""
    kept = [r for i, r in enumerate(requests) if not (r.startswith("HEAD ") and i and requests[i - 1] == r)]
    return Counter(_kind(r) for r in kept)


def _kind(request: str) -> str:
    method, target = request.split(" ", 1)
    if method == "PUT":
        return "PUT part" if "partNumber=" in target else "PUT object"
    if method == "POST":
        return "POST create" if "uploads" in target.split("?", 1)[-1].split("&") else "POST complete"
    if method == "GET" and ("list-type=" in target or "prefix=" in target):
        return "GET list"
    return method


def test_emulated_requests_keep_their_order_under_jitter(moto_server) -> None:
    """Jitter delays chunks by different amounts but never reorders a connection's bytes, in the emulator's own
    process (uvloop, as the benchmarks run it): a 4 MiB object signed for its payload goes up through a jittery link
    (the server checks the payload's SHA-256) and comes back intact."""
    body = os.urandom(4 * MiB)
    with LinkProcess(_port(moto_server.endpoint), LinkProfile("j", rtt=0.02, jitter=0.02)) as link:
        client = _client(link.url)
        for i in range(3):
            client.put_object(Bucket="fastckpt-test", Key=f"jitter{i}", Body=body)
            assert client.get_object(Bucket="fastckpt-test", Key=f"jitter{i}")["Body"].read() == body
    assert link.stats["requests"] == 6


async def test_a_reset_link_is_retried_through(azurite, tmp_path: Path) -> None:
    """Connections reset mid-body and loss-like stalls on the link: the transfer retries through them and what
    arrives is intact."""
    data = os.urandom(8 * MiB)
    (tmp_path / "f").write_bytes(data)
    profile = LinkProfile("lossy", rtt=0.01, per_connection=16 * MB, reset_p=0.2, stall_p=0.01, stall=0.1)
    config = small_config(max_in_flight=16, retries=20, retry_for=60)
    with LinkEmulator(_port(azurite.endpoint), profile, seed=1) as link:
        store = fastckpt.open_store(emulator_uri("azure", link.url, f"lossy-{os.urandom(4).hex()}"))
        transfer = Transfer(store, config)
        try:
            await transfer.upload_file(str(tmp_path / "f"), "f")
            await transfer.download_file("f", str(tmp_path / "g"))
        finally:
            transfer.close()
            await store.close()
    assert (tmp_path / "g").read_bytes() == data
    assert link.stats.resets > 0 and link.stats.stalls > 0
