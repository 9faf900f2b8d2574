"""The soak's short form (``bench/soak.py``): a two-rank gloo job saving into its nodes' tiers with peer replicas and
``base="latest"``, SIGKILLed three times (seeded kinds: trainers, agents, a replaced node, wire faults); nothing it
was told was safe is lost, every restore is bit-exact, every commit stays and verifies, ``gc`` leaves only commits."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("torch")

from bench.soak import main

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]


def test_a_short_soak_loses_nothing(tmp_path: Path) -> None:
    out = tmp_path / "soak.json"
    code = main(["--kills", "3", "--seed", "1", "--quick", "--frozen-mib", "4", "--trained-kib", "256",
                 "--workdir", str(tmp_path / "work"), "--out", str(out)])
    report = json.loads(out.read_text())
    assert (report["steps_lost"], report["wrong_restores"]) == (0, 0), (report["lost"], report["wrong"])
    assert report["commits_lost"] == [] and report["unverified"] == [] and report["left_after_gc"] == [], report
    assert report["drained"] and report["committed"] >= 3, report
    assert sum(report["kills"].values()) == 3
    assert report["sent_per_committed_state"] <= 0.5, report
    assert code == 0
