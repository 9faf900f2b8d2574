"""Transfers an operator can watch: the summary of a call against what a recording proxy saw on the wire, the
retries and throttling it reports, its stages and its log line."""

from __future__ import annotations

import collections
import logging
import os
from pathlib import Path
from urllib.parse import urlsplit

import pytest

import fastckpt
from fastckpt import stats
from harness.proxy import FaultProxy

from .conftest import small_config


def tree(root: Path, sizes: dict[str, int]) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for name, size in sizes.items():
        (root / name).write_bytes(os.urandom(size))
    return root


@pytest.mark.parametrize("backend", ["s3", "gcs", "azure"])
async def test_the_summary_counts_what_the_wire_carried(backend: str, request: pytest.FixtureRequest,
                                                         tmp_path: Path) -> None:
    """Requests by method and the body bytes sent, as a recording proxy counted them; bytes received, files and
    stages as the transfer moved them: the data path's requests and the SDK's alike."""
    uri = request.getfixturevalue(f"{backend}_uri")
    endpoint = {"s3": lambda: request.getfixturevalue("moto_server").endpoint,
                "gcs": lambda: request.getfixturevalue("gcs_server"),
                "azure": lambda: request.getfixturevalue("azurite").endpoint}[backend]()
    src = tree(tmp_path / "src", {"a.bin": 1000, "b.bin": 700 << 10, "c.bin": 0})
    with FaultProxy(urlsplit(endpoint).port) as proxy:
        proxy.throttle(1000)  # records each request; throttles none
        through = uri.replace(str(urlsplit(endpoint).port), str(proxy.port))
        with stats.observe("round trip") as summary:
            await fastckpt.upload_async(src, through, config=small_config())
            await fastckpt.download_async(through, tmp_path / "out", config=small_config())
    assert dict(summary.requests) == dict(collections.Counter(line.split(" ")[0] for line in proxy.requests))
    assert summary.bytes_up == proxy.sent
    assert summary.bytes_down >= (700 << 10) + 1000
    assert summary.files == 6
    assert {"listing", "sending", "receiving", "hashing"} <= set(summary.stages)
    assert summary.elapsed > 0 and summary.throughput > 0 and summary.peak_in_flight >= 1


async def test_retries_and_throttling_are_reported(moto_server, s3_uri: str, tmp_path: Path) -> None:
    """Throttled answers count as such, with each fall of the request limit, and their retries by cause."""
    src = tree(tmp_path / "src", {f"f{i}.bin": 300 << 10 for i in range(6)})
    with FaultProxy(urlsplit(moto_server.endpoint).port) as proxy:
        proxy.throttle(2)  # a third request at once is answered 503 SlowDown
        through = s3_uri.replace(moto_server.endpoint, proxy.url)
        with stats.observe() as summary:
            await fastckpt.upload_async(src, through, config=small_config(max_in_flight=8, retries=20))
    refused = sum(proxy.answers)
    assert refused and summary.throttled == refused
    assert summary.retries["ThrottledError 503"] == refused
    assert summary.limit_changes and all(after < before for before, after in summary.limit_changes)
    assert "throttled" in str(summary) and summary.as_dict()["throttled"] == refused


def test_each_public_call_logs_its_summary(tmp_path: Path, caplog) -> None:
    """At INFO (``fastckpt -v``), a call's summary; the process totals grow with it."""
    caplog.set_level(logging.INFO, logger="fastckpt.stats")
    before = stats.TOTALS.files
    src = tree(tmp_path / "src", {"a.bin": 5000})
    fastckpt.upload(src, f"file://{tmp_path}/store", config=small_config())
    fastckpt.download(f"file://{tmp_path}/store", tmp_path / "out", config=small_config())
    lines = [r.getMessage() for r in caplog.records if r.name == "fastckpt.stats"]
    assert [line.split(":")[0] for line in lines] == ["upload", "download"], lines
    assert "1 file(s), 0.0 MiB" in lines[0] and stats.TOTALS.files == before + 2


OTEL_SAVE = """
import json, sys
import torch
from opentelemetry import metrics, trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

spans, reader = InMemorySpanExporter(), InMemoryMetricReader()
provider = TracerProvider()
provider.add_span_processor(SimpleSpanProcessor(spans))
trace.set_tracer_provider(provider)
metrics.set_meter_provider(MeterProvider(metric_readers=[reader]))

import fastckpt.torch as ft
ft.save({"w": torch.arange(300000, dtype=torch.float32), "b": torch.ones(10)}, sys.argv[1])
found = [m.name for rm in reader.get_metrics_data().resource_metrics for sm in rm.scope_metrics for m in sm.metrics]
print(json.dumps({"spans": [(s.name, s.parent.span_id if s.parent else None, s.context.span_id,
                             dict(s.attributes)) for s in spans.get_finished_spans()], "metrics": found}))
"""


def test_opentelemetry_receives_the_spans_and_metrics_of_a_checkpoint_save(moto_server, s3_uri: str) -> None:
    """A save is a span; each file and each request a span below it; requests, bytes and durations are metrics."""
    import json
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", OTEL_SAVE, s3_uri],
                          capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    spans = {span_id: (name, parent, attrs) for name, parent, span_id, attrs in seen["spans"]}
    (save_id,) = [i for i, (name, _, _) in spans.items() if name == "fastckpt.save"]

    def below_save(span_id: int | None) -> bool:
        while span_id is not None and span_id != save_id:
            span_id = spans[span_id][1] if span_id in spans else None
        return span_id == save_id

    files = [i for i, (name, _, _) in spans.items() if name == "fastckpt.upload_file"]
    requests = [i for i, (name, _, attrs) in spans.items() if "http.request.method" in attrs]
    assert files and requests and all(below_save(i) for i in files + requests)
    assert {"PUT", "HEAD"} <= {spans[i][2]["http.request.method"] for i in requests}
    assert {"fastckpt.requests", "fastckpt.io", "http.client.request.duration",
            "fastckpt.requests.in_flight"} <= set(seen["metrics"])


def scrape(port: int) -> dict[str, list[tuple[dict[str, str], float]]]:
    """The metric families at ``http://127.0.0.1:port/metrics``, as prometheus_client's own parser reads them."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as answer:
        text = answer.read().decode()
    return {f.name: [(s.labels, s.value) for s in f.samples] for f in text_string_to_metric_families(text)}


def test_a_training_process_serves_its_metrics(tmp_path: Path) -> None:
    from fastckpt.monitoring import serve

    server, _ = serve(0)
    try:
        before = dict(scrape(server.server_port))
        fastckpt.upload(tree(tmp_path / "src", {"a.bin": 4096}), f"file://{tmp_path}/store", config=small_config())
        after = scrape(server.server_port)
    finally:
        server.shutdown()
    assert after["fastckpt_files"][0][1] == before["fastckpt_files"][0][1] + 1
    assert after["fastckpt_file_bytes"][0][1] == before["fastckpt_file_bytes"][0][1] + 4096
    assert {"fastckpt_requests", "fastckpt_retries", "fastckpt_throttles", "fastckpt_requests_in_flight"} <= set(after)


def test_a_running_agent_serves_its_queue_to_prometheus(tmp_path: Path) -> None:
    """``fastckpt agent --metrics-port``: queue depth, the oldest entry's age, drains and failures, scraped while the
    agent runs and parsed by prometheus_client."""
    import socket
    import subprocess
    import sys
    import time

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    agent = subprocess.Popen([sys.executable, "-m", "fastckpt.cli", "agent", str(tmp_path / "tier"), "--idle", "60",
                              "--metrics-port", str(port)], env={**os.environ, "PYTHONPATH": os.getcwd()},
                             stderr=subprocess.PIPE, text=True)
    try:
        deadline, families = time.monotonic() + 30, None
        while families is None:
            try:
                families = scrape(port)
            except OSError:
                assert agent.poll() is None, agent.stderr.read() if agent.stderr else ""
                assert time.monotonic() < deadline, "the agent's metrics never answered"
                time.sleep(0.1)
    finally:
        agent.terminate()
        agent.wait(30)
    assert families["fastckpt_agent_queue_depth"] == [({}, 0.0)]
    assert families["fastckpt_agent_oldest_entry_age_seconds"] == [({}, 0.0)]
    assert {"fastckpt_agent_drained_bytes", "fastckpt_agent_failures", "fastckpt_agent_handoffs",
            "fastckpt_requests"} <= set(families)


def test_cli_stats(tmp_path: Path, capsys) -> None:
    """``--stats`` prints the summary after the command's own output; with ``--json`` it is the "stats" object."""
    import json

    from fastckpt.cli import main

    src = tree(tmp_path / "src", {"a.bin": 3000, "b.bin": 5000})
    assert main(["cp", "-q", "--stats", str(src), f"file://{tmp_path}/store"]) == 0
    assert "cp: 2 file(s), 0.0 MiB" in capsys.readouterr().err
    assert main(["cp", "-q", "--json", "--stats", f"file://{tmp_path}/store", str(tmp_path / "out")]) == 0
    shown = json.loads(capsys.readouterr().out)["stats"]
    assert (shown["files"], shown["file_bytes"], shown["name"]) == (2, 8000, "cp")
    assert "receiving" in shown["stages_s"]
