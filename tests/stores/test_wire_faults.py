"""Faults on the wire (``harness.proxy``) between the client and each emulator: resets mid-body both ways,
short answers, stalls past the timeouts, 503 / SlowDown bursts, an outage while the server "restarts".

Each transfer completes and verifies, or fails within a bounded time with a clear error; none leaves a
short file under its final name or a visible partial object.
"""

from __future__ import annotations

import asyncio
import os
import random
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest

import fastckpt
from fastckpt import StoreError, open_store, parse_uri
from fastckpt.engine.plan import plan_upload
from harness.procs import free_port
from harness.proxy import Fault, FaultProxy
from harness.uris import emulator_uri

from ..conftest import small_config

pytestmark = pytest.mark.timeout(240)

WIRED = ["s3", "gcs", "azure"]


def fault_config(**overrides: object) -> fastckpt.TransferConfig:
    """Small parts, a short stall deadline, a few quick retries."""
    base: dict[str, object] = {"retries": 4, "retry_for": 0, "stall_timeout": 2.0, "min_rate": 1 << 30}
    return small_config(**{**base, **overrides})


def base_uri(backend: str, endpoint: str) -> str:
    """A fresh prefix on ``backend``'s emulator, reached at ``endpoint``."""
    return emulator_uri(backend, endpoint, f"wire-{os.urandom(4).hex()}")


def below(uri: str, name: str) -> str:
    path, _, query = uri.partition("?")
    return f"{path}/{name}?{query}"


@pytest.fixture(params=WIRED)
def wire(request: pytest.FixtureRequest) -> Iterator[tuple[FaultProxy, str, str]]:
    """(proxy in front of the backend's emulator, base URI through the proxy, the same URI direct)."""
    backend = request.param
    upstream = {"s3": lambda: request.getfixturevalue("moto_server").endpoint,
                "gcs": lambda: request.getfixturevalue("gcs_server"),
                "azure": lambda: request.getfixturevalue("azurite").endpoint}[backend]()
    with FaultProxy(urlsplit(upstream).port) as proxy:
        through = base_uri(backend, proxy.url)
        yield proxy, through, through.replace(proxy.url, upstream)


def sample(tmp_path: Path, uri: str) -> tuple[Path, bytes]:
    """A file of three parts and a bit at the part size this backend uses."""
    part = plan_upload(1, fault_config(), open_store(uri, retry=False)).part_size
    data = os.urandom(3 * part + 4321)
    src = tmp_path / "model.bin"
    src.write_bytes(data)
    return src, data


UPLOAD_FAULTS = {
    "reset mid-body": Fault("reset_request", after=200 << 10),
    "reset in headers": Fault("reset_request", after=100),
    "stall past the deadline": Fault("stall", after=200 << 10, seconds=6),
    "503 SlowDown": Fault("status", status=503, code="SlowDown"),
    "429": Fault("status", status=429, code="TooManyRequests"),
    "refused": Fault("refuse"),
}
DOWNLOAD_FAULTS = {
    "reset mid-body": Fault("reset_response", after=150 << 10),
    "short body": Fault("truncate_response", after=150 << 10),
    "stall past the deadline": Fault("stall_response", after=150 << 10, seconds=6),
    "503 SlowDown": Fault("status", status=503, code="SlowDown"),
}


@pytest.mark.parametrize("name", list(UPLOAD_FAULTS))
async def test_upload_survives(wire, tmp_path: Path, name: str) -> None:
    proxy, uri, direct = wire
    src, data = sample(tmp_path, direct)
    # a refused first contact is a wrong endpoint (fails at once): refuse connections once one was answered
    proxy.arm(UPLOAD_FAULTS[name], times=2, skip=1 if name == "refused" else 0)
    await fastckpt.upload_async(src, below(uri, "model.bin"), config=fault_config())
    assert proxy.triggered, "the fault never took effect"
    await fastckpt.download_async(below(direct, "model.bin"), tmp_path / "back.bin", config=fault_config())
    assert (tmp_path / "back.bin").read_bytes() == data


@pytest.mark.parametrize("name", list(DOWNLOAD_FAULTS))
async def test_download_survives(wire, tmp_path: Path, name: str) -> None:
    proxy, uri, direct = wire
    src, data = sample(tmp_path, direct)
    await fastckpt.upload_async(src, below(direct, "model.bin"), config=fault_config())
    proxy.arm(DOWNLOAD_FAULTS[name], times=2)
    await fastckpt.download_async(below(uri, "model.bin"), tmp_path / "back.bin", config=fault_config())
    assert proxy.triggered, "the fault never took effect"
    assert (tmp_path / "back.bin").read_bytes() == data


async def test_outage_shorter_than_the_retry_budget_is_ridden_out(wire, tmp_path: Path) -> None:
    """Every connection dropped and refused for 3 s mid-upload: with a 10 s budget the upload completes."""
    proxy, uri, direct = wire
    src, data = sample(tmp_path, direct)
    config = fault_config(retries=2, retry_for=10, backoff_max=0.5)

    def progress(done: int, total: int) -> None:
        if done and not proxy.triggered:  # the first part is in: the server "restarts"
            proxy.outage(3)

    await fastckpt.upload_async(src, below(uri, "model.bin"), config=config, progress=progress)
    assert "refuse" in proxy.triggered
    await fastckpt.download_async(below(direct, "model.bin"), tmp_path / "back.bin", config=config)
    assert (tmp_path / "back.bin").read_bytes() == data


@pytest.mark.parametrize("direction", ["upload", "download"])
async def test_persistent_fault_fails_in_bounded_time(wire, tmp_path: Path, direction: str) -> None:
    proxy, uri, direct = wire
    src, _ = sample(tmp_path, direct)
    if direction == "download":
        await fastckpt.upload_async(src, below(direct, "model.bin"), config=fault_config())
    proxy.rule = lambda n: Fault("reset_request" if direction == "upload" else "reset_response", after=0)
    config = fault_config(retries=2, backoff_max=0.2)
    bound = 3 * (config.stall_timeout + 1) + 10
    started = time.monotonic()
    with pytest.raises(StoreError, match="failed after 3 attempts") as info:
        if direction == "upload":
            await fastckpt.upload_async(src, below(uri, "other.bin"), config=config)
        else:
            await fastckpt.download_async(below(uri, "model.bin"), tmp_path / "out" / "model.bin", config=config)
    took = time.monotonic() - started
    print(f"{direction} under a persistent reset failed in {took:.1f} s (bound {bound:.0f} s): {info.value}")
    assert took < bound and "\n" not in str(info.value)
    if direction == "upload":
        async with open_store(direct, config=small_config()) as store:
            assert [m.key async for m in store.list(parse_uri(direct).join("other.bin"))] == []
    else:
        assert not (tmp_path / "out").exists() or list((tmp_path / "out").iterdir()) == []


@pytest.mark.parametrize("backend", ["s3", "azure"])
async def test_four_rank_checkpoint_under_random_faults(backend: str, request: pytest.FixtureRequest,
                                                        tmp_path: Path) -> None:
    """Two runs of a 4-rank checkpoint with 20% of connections faulted at random: each commits and
    verifies, or fails cleanly (never a committed partial checkpoint). The soak version is bench/faults_bench.py."""
    upstream = (request.getfixturevalue("moto_server").endpoint if backend == "s3"
                else request.getfixturevalue("azurite").endpoint)
    rng = random.Random(7)
    kinds = [Fault("reset_request", after=64 << 10), Fault("reset_response", after=32 << 10),
             Fault("truncate_response", after=16 << 10), Fault("status"), Fault("refuse")]
    with FaultProxy(urlsplit(upstream).port, lambda n: rng.choice(kinds) if rng.random() < 0.2 else None) as proxy:
        for run in range(2):
            base = base_uri(backend, proxy.url)
            outcome = await write_checkpoint(below(base, "step-1"), tmp_path / f"run{run}")
            direct = base.replace(proxy.url, upstream)
            states = [i.state for i in await fastckpt.list_checkpoints_async(direct, config=fault_config())]
            print(f"run {run}: {'committed' if outcome is None else f'failed cleanly: {outcome!r}'}")
            if outcome is None:
                assert states == ["committed"]
                report = await fastckpt.verify_async(below(direct, "step-1"), config=fault_config())
                assert report.ok and report.files == 8, report
            else:
                assert "committed" not in states, outcome
        assert proxy.triggered


CHECKPOINT_FAULTS = {"reset mid-body (up)": Fault("reset_request", after=256 << 10),
                     "reset mid-body (down)": Fault("reset_response", after=200),
                     "short body": Fault("truncate_response", after=100),
                     "stall past the deadline": Fault("stall", after=256 << 10, seconds=6),
                     "503 SlowDown": Fault("status"), "refused": Fault("refuse")}


@pytest.mark.parametrize("name", list(CHECKPOINT_FAULTS))
@pytest.mark.parametrize("backend", ["s3", "azure"])
async def test_four_rank_checkpoint_under_each_fault(backend: str, name: str, request: pytest.FixtureRequest,
                                                     tmp_path: Path) -> None:
    """Each fault, twice during a 4-rank checkpoint: it commits, and every file verifies."""
    upstream = (request.getfixturevalue("moto_server").endpoint if backend == "s3"
                else request.getfixturevalue("azurite").endpoint)
    with FaultProxy(urlsplit(upstream).port) as proxy:
        base = base_uri(backend, proxy.url)
        proxy.arm(CHECKPOINT_FAULTS[name], times=2, skip=4 if name == "refused" else 0)
        assert await write_checkpoint(below(base, "step-1"), tmp_path / "run") is None
        assert proxy.triggered, "the fault never took effect"
    direct = base.replace(proxy.url, upstream)
    report = await fastckpt.verify_async(below(direct, "step-1"), config=fault_config())
    assert report.ok and report.files == 8, report


async def write_checkpoint(uri: str, work: Path) -> BaseException | None:
    """4 ranks, each writing a multi-part file and a small one; None when it committed."""
    barrier = fastckpt.InProcessBarrier(timeout=60)
    work.mkdir()

    async def rank(r: int) -> None:
        async with fastckpt.CheckpointWriter(uri, rank=r, world_size=4, barrier=barrier, attempt="a1",
                                             config=fault_config()) as writer:
            big, small = work / f"big-{r}", work / f"small-{r}"
            big.write_bytes(os.urandom((5 << 20) + 1000 * r))
            small.write_bytes(os.urandom(1000 + r))
            await writer.put_file(big, f"model-{r}.bin")
            await writer.put_file(small, f"rng-{r}.json")

    results = await asyncio.gather(*(rank(r) for r in range(4)), return_exceptions=True)
    failed = [res for res in results if isinstance(res, BaseException)]
    for res in failed:
        print(f"  rank failed: {res!r}")
    return failed[0] if failed else None


@pytest.mark.parametrize("backend", WIRED)
async def test_endpoint_never_reached_fails_after_the_counted_retries(backend: str, tmp_path: Path) -> None:
    """A refused first contact is most likely a wrong endpoint: it fails after ``retries`` attempts, not
    after the whole ``retry_for`` budget (here ten minutes)."""
    endpoint = f"http://127.0.0.1:{free_port()}"
    (tmp_path / "f").write_bytes(b"payload")
    config = fault_config(retries=2, retry_for=600, backoff_max=0.05)
    service = {"s3": "S3", "gcs": "GCS", "azure": "Azure"}[backend]
    started = time.monotonic()
    with pytest.raises(StoreError, match=f"failed after 3 attempts .*cannot reach {service} endpoint {endpoint}"):
        await fastckpt.upload_async(tmp_path / "f", below(base_uri(backend, endpoint), "f"), config=config)
    assert time.monotonic() - started < 30


