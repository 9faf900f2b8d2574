"""The fastckpt command, run as a real subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys

CLI = [sys.executable, "-m", "fastckpt.cli"]


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=120)


def test_cp_ls_verify_roundtrip(tmp_path) -> None:
    src = tmp_path / "ckpt"
    (src / "sub").mkdir(parents=True)
    (src / "a.bin").write_bytes(os.urandom(3000))
    (src / "sub" / "b.bin").write_bytes(os.urandom(5))
    store = f"file://{tmp_path}/store/ckpt"
    up = run("cp", str(src), store, "--json")
    assert up.returncode == 0, up.stderr
    assert json.loads(up.stdout)["files"] == 2
    ls = json.loads(run("ls", store, "--json").stdout)
    assert [o["size"] for o in ls["objects"]] == [3000] and ls["folders"] == [f"{tmp_path}/store/ckpt/sub/"]
    ls = run("ls", "-r", store, "--json")
    assert sorted(o["size"] for o in json.loads(ls.stdout)["objects"]) == [5, 3000]
    (tmp_path / "empty").mkdir()
    assert (run("ls", str(tmp_path / "empty")).returncode, run("ls", str(tmp_path / "empty")).stdout) == (0, "")
    ver = run("verify", store)
    assert ver.returncode == 0 and "verified" in ver.stdout
    down = run("cp", "--durable", store, str(tmp_path / "back"))
    assert down.returncode == 0, down.stderr
    assert (tmp_path / "back" / "sub" / "b.bin").read_bytes() == (src / "sub" / "b.bin").read_bytes()
    target = tmp_path / "store" / "ckpt" / "a.bin"
    data = bytearray(target.read_bytes())
    data[0] ^= 0xFF
    with open(target, "r+b") as f:  # flip a byte in place: the xattr digest stays
        f.write(bytes(data[:1]))
    bad = run("verify", store)
    assert bad.returncode == 1 and "FAIL" in bad.stdout and "a.bin" in bad.stdout


def test_errors_are_one_line(tmp_path) -> None:
    res = run("cp", str(tmp_path / "missing"), f"file://{tmp_path}/x")
    assert res.returncode == 1
    assert res.stderr.strip().count("\n") == 0 and "does not exist" in res.stderr
    res = run("ls", "s3:/nope")
    assert res.returncode == 1 and "invalid storage URI" in res.stderr


def test_demo_and_doctor(tmp_path) -> None:
    res = run("demo", "--size", "8MiB", "--dir", str(tmp_path), "--json")
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["verified"] is True and out["files"] == 7
    assert os.listdir(tmp_path) == []  # scratch space cleaned up
    doc = json.loads(run("doctor", "--json").stdout)
    assert "native_accelerator" in doc and doc["version"]
    assert doc["backends"] == {name: "available" for name in ("local", "memory", "s3", "gcs", "azure")}


def test_checkpoint_ls_verify_gc(tmp_path) -> None:
    import fastckpt

    src = tmp_path / "src"
    src.mkdir()
    (src / "model.safetensors").write_bytes(os.urandom(4096))
    run_dir = tmp_path / "store" / "run"
    with fastckpt.SyncCheckpointWriter(str(run_dir / "step-1"), attempt="a1") as ckpt:
        ckpt.put_dir(str(src))
    crashed = run_dir / "step-2" / ".fastckpt" / "dead-attempt"
    crashed.mkdir(parents=True)
    (crashed / "rank-00000.json").write_text("{}")
    (run_dir / "step-2" / "partial.bin").write_bytes(b"partial")

    listing = json.loads(run("ls", "--checkpoints", str(run_dir), "--json").stdout)["checkpoints"]
    assert {c["name"]: c["state"] for c in listing} == {"step-1": "committed", "step-2": "uncommitted"}
    assert run("verify", str(run_dir / "step-1")).returncode == 0

    dry = json.loads(run("gc", str(run_dir), "--older-than", "0", "--dry-run", "--json").stdout)
    assert dry["dry_run"] and any(k.endswith("partial.bin") for k in dry["removed"])
    assert (run_dir / "step-2" / "partial.bin").exists()
    done = run("gc", str(run_dir), "--older-than", "0")
    assert done.returncode == 0, done.stderr
    assert not (run_dir / "step-2" / "partial.bin").exists()
    assert fastckpt.latest(str(run_dir)).endswith("step-1")

    model = run_dir / "step-1" / "model.safetensors"
    with open(model, "r+b") as f:
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 1]))
    bad = run("verify", str(run_dir / "step-1"))
    assert bad.returncode == 1 and "model.safetensors" in bad.stdout


def test_cp_with_a_base_copies_what_did_not_change(tmp_path) -> None:
    """``cp --base`` against an earlier upload: its objects carry their digests (not their chunks'), so unchanged
    files are copied whole by the store and changed ones sent; the summary says which was which."""
    src = tmp_path / "ckpt"
    (src / "shards").mkdir(parents=True)
    frozen, trained = os.urandom(3 << 20), os.urandom(4 << 20)
    (src / "shards" / "frozen.bin").write_bytes(frozen)
    (src / "trained.bin").write_bytes(trained)
    store = f"file://{tmp_path}/store/run"
    assert run("cp", str(src), f"{store}/1", "--part-size", "1MiB", "--json").returncode == 0
    (src / "trained.bin").write_bytes(trained[:1 << 20] + os.urandom(3 << 20))
    up = run("cp", str(src), f"{store}/2", "--base", f"{store}/1", "--part-size", "1MiB", "--json")
    assert up.returncode == 0, up.stderr
    out = json.loads(up.stdout)
    assert (out["copied"], out["sent"]) == (len(frozen), 4 << 20)
    assert {os.path.basename(r["key"]): r["copied"] for r in out["results"]} == {"frozen.bin": len(frozen),
                                                                               "trained.bin": 0}
    human = run("cp", str(src), f"{store}/3", "--base", f"{store}/2", "--part-size", "1MiB")
    assert human.returncode == 0 and "copied in the store from the base" in human.stdout, human.stdout + human.stderr
    assert run("verify", f"{store}/3").returncode == 0
    back = tmp_path / "back"
    assert run("cp", f"{store}/3", str(back)).returncode == 0
    assert (back / "shards" / "frozen.bin").read_bytes() == frozen
    missing = run("cp", str(src), f"{store}/4", "--base", "s3://elsewhere/run/3")
    assert missing.returncode != 0 and "not in the bucket" in missing.stderr


def test_the_verbs_as_an_s5cmd_user_types_them(s3_uri: str, tmp_path) -> None:
    """The issue's table on moto (the endpoint rides in the URI's options, after the trailing '/'), then each verb
    once through the real command line; exit status 2 for a usage error."""
    base, _, query = s3_uri.partition("?")
    at = lambda rel: f"{base}/{rel}?{query}"  # noqa: E731
    model = tmp_path / "model.bin"
    model.write_bytes(os.urandom(5000))
    assert run("cp", str(model), at("run/")).returncode == 0
    for i in range(3):
        (tmp_path / "ck").mkdir(exist_ok=True)
        (tmp_path / "ck" / f"m-{i}.safetensors").write_bytes(bytes([i]) * (i + 1))
    (tmp_path / "ck" / "config.json").write_bytes(b"{}")
    assert run("cp", str(tmp_path / "ck"), at("ckpt/")).returncode == 0
    listing = json.loads(run("ls", "-r", at(""), "--json").stdout)["objects"]
    assert sorted(o["key"][len(base.split("/", 3)[3]) + 1:] for o in listing) == [
        "ckpt/config.json", "ckpt/m-0.safetensors", "ckpt/m-1.safetensors", "ckpt/m-2.safetensors", "run/model.bin"]
    got = run("cp", at("ckpt/*.safetensors"), f"{tmp_path}/out/")
    assert got.returncode == 0, got.stderr
    assert sorted(os.listdir(tmp_path / "out")) == ["m-0.safetensors", "m-1.safetensors", "m-2.safetensors"]

    cat = subprocess.run([*CLI, "cat", at("run/model.bin")], capture_output=True, timeout=120)
    assert cat.returncode == 0 and cat.stdout == model.read_bytes()
    du = json.loads(run("du", at(""), "--json").stdout)
    assert (du["objects"], du["bytes"]) == (5, 5000 + 6 + 2)
    human = run("ls", "-l", "-H", at("run"))
    assert "4.9K" in human.stdout and "model.bin" in human.stdout
    dry = run("rm", "-r", "-n", at("ckpt"))
    assert dry.stdout.count("would remove") == 4 and run("ls", "-r", at("ckpt"), "--json").stdout.count("key") == 4
    assert run("mv", at("ckpt/config.json"), at("moved/")).returncode == 0
    (tmp_path / "ck" / "m-0.safetensors").write_bytes(b"\xff")
    synced = json.loads(run("sync", str(tmp_path / "ck"), at("ckpt"), "--delete", "--json").stdout)
    assert (synced["files"], synced["unchanged"], synced["deleted"]) == (2, 2, [])  # m-0 changed, config.json gone
    assert run("rm", "-r", at("")).returncode == 0
    assert json.loads(run("ls", "-r", at(""), "--json").stdout)["objects"] == []

    misused = run("cp", at("run/model.bin"), str(tmp_path / "m.bin"), "--base", at("run"))
    assert misused.returncode == 1 and "--base applies to uploads" in misused.stderr
    usage = run("cp", "only-one-argument")
    assert usage.returncode == 2 and "usage:" in usage.stderr
    helped = run("--help").stdout
    assert all(f"    {verb} " in helped for verb in ("cp", "mv", "sync", "rm", "cat", "ls", "du"))
    assert "exit status" in helped
    assert "e.g. s3://b/run/" in run("cp", "--help").stdout
