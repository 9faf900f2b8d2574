"""Soak: a gloo job that saves every step into its nodes' tiers, killed again and again; nothing it was told was safe
may be lost.

    python -m bench.soak --kills 20 --seed 0              # a few minutes
    python -m bench.soak --kills 3 --seed 1 --quick       # the default suite's short form (tests/tier/test_soak.py)

The bucket is a moto server on 127.0.0.1 behind ``harness/proxy.py``; each rank is a "node" with a tier directory of
its own (``LOCAL_WORLD_SIZE=1``). Each incarnation of the job restores (every rank: ``latest(tier=)``, the newest
step any rank found, ``restore_tier``, ``load(tier=)``, checked bit for bit against the state of that step; when a
rank cannot read that one, its copy lost with its node, every rank falls back to the step before), then
saves step after step with ``async_save(tier=, replicas=1, base="latest")`` (frozen weights that never change and a
trained part that changes every step), noting each step once ``wait()`` returned. Between incarnations the controller
SIGKILLs, at a random moment (seeded): the trainers; the trainers and a node's agent; a node's agent alone (the
trainers go on, then die); a node (its trainer and agent killed and its tier wiped: a replaced node); or the trainers
after throttling (503 SlowDown) and wire faults (connection resets) on the way to the bucket. After the last kill the
job restores once more, the agents drain, ``gc`` runs, and every checkpoint committed in the bucket is verified.

Checked: every step that every rank was told was safe before a kill is restored or a newer one is (steps lost),
every restore bit-exact (wrong restores), every checkpoint once committed in the bucket still committed and
verified at the end, only committed checkpoints left after ``gc``; reported: kills by kind, bytes sent to the
bucket per committed state (incremental saves: well under the state).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from typing import Any
from urllib.parse import urlsplit

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

KILLS = ("trainers", "trainers+agent", "agent", "node", "wire")
MiB = 1 << 20


# ----------------------------------------------------------------------------- the job


def state(step: int, rank: int, frozen_mib: int, trained_kib: int) -> dict[str, Any]:
    """Rank ``rank``'s state at ``step``: frozen bf16 weights (the same every step), a trained fp32 part and its
    moments (new every step), the step."""
    import torch

    g = torch.Generator().manual_seed(rank)
    frozen = {f"layers.{i}.weight": torch.randn(MiB // 2, generator=g).to(torch.bfloat16) for i in range(frozen_mib)}
    g.manual_seed(step * 1000 + rank)
    n = trained_kib * 1024 // 4 // 3
    trained = {name: torch.randn(n, generator=g) for name in ("adapter", "exp_avg", "exp_avg_sq")}
    return {"model": {**frozen, "adapter": trained["adapter"]},
            "optim": {"exp_avg": trained["exp_avg"], "exp_avg_sq": trained["exp_avg_sq"]}, "step": step}


def digest(st: Any) -> str:
    """SHA-256 over a state's keys and values (tensors by their bytes)."""
    import torch

    h = hashlib.sha256()

    def walk(prefix: str, v: Any) -> None:
        if isinstance(v, dict):
            for k in sorted(v):
                walk(f"{prefix}.{k}", v[k])
        elif isinstance(v, torch.Tensor):
            h.update(prefix.encode() + v.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
        else:
            h.update(prefix.encode() + repr(v).encode())

    walk("", st)
    return h.hexdigest()


def step_of(uri: str | None) -> int:
    """The step a checkpoint URI names (``.../step-00012``); 0 for None."""
    if uri is None:
        return 0
    return int(uri.partition("?")[0].rstrip("/").rsplit("-", 1)[1])


def _note(path: str, doc: dict[str, Any]) -> None:
    """Append one JSON line to ``path``, synced: a note survives the SIGKILL that follows it."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (json.dumps(doc) + "\n").encode())
        os.fsync(fd)
    finally:
        os.close(fd)


def rank_main(rank: int, spec: dict[str, Any]) -> None:
    """One rank of one incarnation: restore, check, then save until killed (or, ``final``, stop after the restore)."""
    import torch
    import torch.distributed as dist

    import fastckpt
    import fastckpt.torch as ft
    from fastckpt.tier import Tier
    from fastckpt.torch import restore_tier
    from harness.uris import below

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(spec["port"]), LOCAL_WORLD_SIZE="1")
    dist.init_process_group("gloo", rank=rank, world_size=spec["world"], timeout=timedelta(seconds=60))
    tier, run, notes = Tier(spec["tiers"][rank], keep=2), spec["run"], spec["notes"]
    sizes = (spec["frozen_mib"], spec["trained_kib"])
    found = torch.tensor([step_of(fastckpt.latest(run, tier=tier))])
    dist.all_reduce(found, dist.ReduceOp.MAX)
    step = int(found.item())
    record: dict[str, Any] = {"kind": "restore", "incarnation": spec["incarnation"], "rank": rank, "step": step,
                              "unrestorable": []}
    while step:  # the newest step any rank found, else the next older one every rank can restore
        uri = below(run, f"step-{step:05d}")
        try:
            record["received"] = restore_tier(uri, tier)
            loaded = digest(ft.load(uri, tier=tier, rank=rank))
            record.update(ok=loaded == digest(state(step, rank, *sizes)), error="")
        except Exception as exc:  # this rank cannot restore it (its copy lost with its node): an older step
            record.update(ok=False, error=f"{type(exc).__name__}: {exc}")
        readable = torch.tensor([0 if record["error"] else 1])
        dist.all_reduce(readable, dist.ReduceOp.MIN)
        if readable.item():
            break
        record["unrestorable"].append({"step": step, "error": record["error"]})
        step -= 1
        record["step"] = step
    _note(notes, record)
    if spec["final"]:
        dist.destroy_process_group()
        return
    while True:
        step += 1
        h = ft.async_save(state(step, rank, *sizes), below(run, f"step-{step:05d}"), tier=tier, replicas=1,
                          base="latest")
        h.wait(timeout=120)
        _note(notes, {"kind": "safe", "incarnation": spec["incarnation"], "rank": rank, "step": step})
        time.sleep(spec["pause"])


def job_main(spec: dict[str, Any]) -> int:
    """``python -m bench.soak --job SPEC_JSON``: the ranks as forked processes of this one (one process group)."""
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=rank_main, args=(r, spec)) for r in range(spec["world"])]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    return 0


# ----------------------------------------------------------------------------- the controller


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _notes(path: str) -> list[dict[str, Any]]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _safe_step(notes: list[dict[str, Any]], world: int) -> int:
    """The newest step every rank was told was safe (each rank's steps are told in order)."""
    newest = {r: 0 for r in range(world)}
    for n in notes:
        if n["kind"] == "safe":
            newest[n["rank"]] = max(newest[n["rank"]], n["step"])
    return min(newest.values())


class Soak:
    """One soak: the bucket behind a fault proxy, the nodes' tiers, the incarnations and what they noted."""

    def __init__(self, args: argparse.Namespace) -> None:
        from harness.proxy import FaultProxy
        from harness.s3 import BUCKET, CREDENTIALS, start_moto

        self.args, self.rng = args, random.Random(args.seed)
        self.work = args.workdir or tempfile.mkdtemp(prefix="fastckpt-soak-")
        os.makedirs(self.work, exist_ok=True)
        shm = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else self.work
        self.tier_root = tempfile.mkdtemp(prefix="fastckpt-soak-tiers-", dir=shm)
        self.tiers = [os.path.join(self.tier_root, f"node-{r}") for r in range(args.ranks)]
        self.notes = os.path.join(self.work, "notes.jsonl")
        # a checkpoint whose other rank's data went with a replaced node never commits: its agent gives up after
        # FASTCKPT_AGENT_COMMIT_WAIT (an hour by default; a minute here, so that the soak ends drained)
        self.env = {**os.environ, **CREDENTIALS, "FASTCKPT_AGENT_IDLE": "3", "FASTCKPT_AGENT_COMMIT_WAIT": "60",
                    "PYTHONPATH": REPO}
        os.environ.update(CREDENTIALS)
        self.moto = start_moto()
        self.moto.create_bucket(BUCKET)
        self.proxy = FaultProxy(urlsplit(self.moto.endpoint).port).__enter__()
        prefix = f"soak-{args.seed}-{os.getpid()}/run"
        self.direct = self.moto.uri(BUCKET, prefix)
        self.run = self.direct.replace(self.moto.endpoint, self.proxy.url)
        self.kills: dict[str, int] = {k: 0 for k in KILLS}
        self.ever_committed: set[str] = set()
        self.lost_commits: list[str] = []
        self.expected: list[tuple[int, int]] = []
        """(incarnation, the step every rank was told was safe before it started)."""

    def close(self) -> None:
        from harness.s3 import stop_moto

        for tier in self.tiers:
            self._kill_agent(tier)
        self.proxy.__exit__(None, None, None)
        stop_moto(self.moto)
        shutil.rmtree(self.tier_root, ignore_errors=True)
        if self.args.workdir is None:
            shutil.rmtree(self.work, ignore_errors=True)

    def start(self, incarnation: int, final: bool = False) -> subprocess.Popen[bytes]:
        """Start an incarnation of the job (its own process group)."""
        a = self.args
        spec = {"world": a.ranks, "port": _free_port(), "tiers": self.tiers, "run": self.run, "notes": self.notes,
                "incarnation": incarnation, "final": final, "frozen_mib": a.frozen_mib, "trained_kib": a.trained_kib,
                "pause": a.pause}
        with open(os.path.join(self.work, f"job-{incarnation}.log"), "wb") as log:
            return subprocess.Popen([sys.executable, "-m", "bench.soak", "--job", json.dumps(spec)], cwd=REPO,
                                    env=self.env, stdout=log, stderr=log, start_new_session=True)

    def _kill_agent(self, tier: str) -> None:
        from fastckpt.tier import Tier
        from fastckpt.tier.agent import agent_pid

        if not os.path.isdir(tier):
            return
        pid = agent_pid(Tier(tier))
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def _wait_started(self, job: subprocess.Popen[bytes], incarnation: int, timeout: float = 120) -> None:
        """Until every rank of ``incarnation`` noted its restore (or the job ended)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and job.poll() is None:
            if sum(n["kind"] == "restore" and n["incarnation"] == incarnation for n in _notes(self.notes)) \
                    >= self.args.ranks:
                return
            time.sleep(0.1)

    def incarnation(self, i: int) -> str:
        """Run incarnation ``i`` and kill it as the dice say; the kind of kill."""
        from harness.proxy import Fault

        self.expected.append((i, _safe_step(_notes(self.notes), self.args.ranks)))
        job = self.start(i)
        self._wait_started(job, i)
        kind = self.rng.choice(KILLS)
        time.sleep(self.rng.uniform(*self.args.run_for))
        if kind == "wire":
            self.proxy.throttle(2)
            self.proxy.arm(Fault(self.rng.choice(["reset_request", "reset_response"]), after=256 << 10), times=3)
            time.sleep(self.rng.uniform(*self.args.run_for))
        if kind in ("trainers+agent", "agent"):
            self._kill_agent(self.rng.choice(self.tiers))
            if kind == "agent":
                time.sleep(self.rng.uniform(*self.args.run_for))
        with contextlib.suppress(ProcessLookupError):
            os.killpg(job.pid, signal.SIGKILL)
        job.wait()
        self.proxy.throttle(None)
        self.proxy.arm(None)
        if kind == "node":
            node = self.rng.choice(self.tiers)
            self._kill_agent(node)
            shutil.rmtree(node, ignore_errors=True)
        self.kills[kind] += 1
        self._check_commits()
        return kind

    def _check_commits(self) -> None:
        """Every checkpoint once committed in the bucket is still committed."""
        import fastckpt

        now = {i.name for i in fastckpt.list_checkpoints(self.direct) if i.state == "committed"}
        self.lost_commits += sorted(self.ever_committed - now)
        self.ever_committed |= now

    def drained(self, timeout: float) -> bool:
        """Wait until no tier has a queue entry or a hand-off left."""
        from fastckpt.tier import Tier
        from fastckpt.tier.handoff import handoffs

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            tiers = [Tier(t) for t in self.tiers if os.path.isdir(t)]
            if not any(t.pending() or handoffs(t) for t in tiers):
                return True
            time.sleep(0.2)
        return False

    def finish(self) -> dict[str, Any]:
        """The last restore, the drains, ``gc``, the checks; the report."""
        import fastckpt

        n = len(self.expected)
        self.expected.append((n, _safe_step(_notes(self.notes), self.args.ranks)))
        job = self.start(n, final=True)
        job.wait(timeout=300)
        drained = self.drained(300)
        self._check_commits()
        sent = self.proxy.moved["up"]
        report = fastckpt.gc(self.direct, older_than=0)
        infos = fastckpt.list_checkpoints(self.direct)
        committed = [i for i in infos if i.state == "committed"]
        unverified = [i.name for i in committed if not fastckpt.verify(i.uri).ok]
        notes = _notes(self.notes)
        restores = {(n["incarnation"], n["rank"]): n for n in notes if n["kind"] == "restore"}
        lost: list[dict[str, Any]] = []
        wrong: list[dict[str, Any]] = []
        unrestorable: list[dict[str, Any]] = []
        for inc, safe in self.expected:
            got = [restores.get((inc, r)) for r in range(self.args.ranks)]
            if any(g is None for g in got):
                lost.append({"incarnation": inc, "safe": safe, "restored": None, "why": "no restore noted"})
                continue
            step = got[0]["step"]
            if step < safe:
                lost.append({"incarnation": inc, "safe": safe, "restored": step})
            wrong += [{"incarnation": inc, "rank": g["rank"], "step": step, "error": g.get("error", "")}
                      for g in got if step and not g.get("ok")]
            unrestorable += [{"incarnation": inc, "rank": g["rank"], **u}
                             for g in got for u in g.get("unrestorable", [])]
        state_bytes = self.args.ranks * (self.args.frozen_mib * MiB + self.args.trained_kib * 1024)
        return {"seed": self.args.seed, "ranks": self.args.ranks, "kills": self.kills, "incarnations": n + 1,
                "steps_safe": _safe_step(notes, self.args.ranks), "steps_lost": len(lost), "lost": lost,
                "wrong_restores": len(wrong), "wrong": wrong, "committed": len(committed),
                "unrestorable_newest": unrestorable,
                "commits_lost": self.lost_commits, "unverified": unverified, "drained": drained,
                "left_after_gc": [i.name for i in infos if i.state != "committed"], "gc_removed": len(report.removed),
                "bytes_sent": sent, "state_bytes": state_bytes,
                "sent_per_committed_state": round(sent / max(1, len(committed)) / state_bytes, 3)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kills", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--frozen-mib", type=int, default=16, help="frozen bf16 weights per rank (MiB)")
    ap.add_argument("--trained-kib", type=int, default=768, help="trained part and its moments per rank (KiB)")
    ap.add_argument("--pause", type=float, default=0.2, help="seconds between a save's wait() and the next save")
    ap.add_argument("--quick", action="store_true", help="shorter runs between kills (the default suite's form)")
    ap.add_argument("--workdir", default=None, help="kept: notes, the jobs' logs")
    ap.add_argument("--out", default=None, help="write the report as JSON here")
    ap.add_argument("--job", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.job:
        return job_main(json.loads(args.job))
    args.run_for = (0.5, 1.5) if args.quick else (1.0, 4.0)
    soak = Soak(args)
    try:
        for i in range(args.kills):
            kind = soak.incarnation(i)
            print(f"incarnation {i}: killed ({kind}); safe so far: step {_safe_step(_notes(soak.notes), args.ranks)}",
                  flush=True)
        out = soak.finish()
    finally:
        soak.close()
    print(json.dumps({k: v for k, v in out.items() if k not in ("lost", "wrong")}, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    clean = not (out["steps_lost"] or out["wrong_restores"] or out["commits_lost"] or out["unverified"]
                 or out["left_after_gc"] or not out["drained"])
    return 0 if clean else 1


if __name__ == "__main__":
    sys.exit(main())
