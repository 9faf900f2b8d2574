"""Conformance of the command verbs on every store: the path conventions of ``aws s3 cp`` and s5cmd, wildcards and
filters, ``rm``, ``mv``, ``sync``, ``cat``, ``du`` and ``ls`` (the API under ``fastckpt`` and ``fastckpt.mirror``)."""

from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import urlsplit

import pytest

import fastckpt
from fastckpt import folder_sync, mirror, objects, removal
from fastckpt.checkpoint import CheckpointWriter
from fastckpt.engine.layout import Layout
from fastckpt.errors import IntegrityError, ObjectNotFoundError
from fastckpt.integrity import FileDigest
from fastckpt.stores import open_store
from fastckpt.uri import parse_uri
from harness.proxy import FaultProxy

from ..conftest import small_config


def at(base: str, rel: str) -> str:
    """``rel`` below the base URI ``base``, its options kept after it (a trailing '/' stays before them)."""
    head, sep, query = base.partition("?")
    return f"{head.rstrip('/')}/{rel}{sep}{query}"


async def keys(base: str) -> list[str]:
    """The relative keys of every object below ``base``."""
    uri = parse_uri(base)
    async with open_store(uri, config=small_config()) as s:
        return sorted([m.key[len(uri.key):].lstrip("/") async for m in s.list(uri.key)])


def tree(root: Path, files: dict[str, bytes]) -> Path:
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    return root


def flip(path: Path, offset: int) -> None:
    """Flip one byte in place (the recorded digest stays)."""
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 1]))


async def commit(uri: str, files: dict[str, bytes]) -> None:
    async with CheckpointWriter(uri, config=small_config()) as writer:
        for name, data in files.items():
            await writer.put_layout(name, Layout([data]))


async def test_paths_as_aws_s3_cp_takes_them(store_uri: str, tmp_path: Path) -> None:
    cfg = small_config()
    src = tree(tmp_path / "ckpt", {"a.bin": b"a" * 10, "sub/b.bin": b"b" * 20})
    model = tree(tmp_path, {"model.bin": os.urandom(3000)}) / "model.bin"
    await fastckpt.upload_async(model, at(store_uri, "run/"), config=cfg)
    await fastckpt.upload_async(model, at(store_uri, "single"), config=cfg)
    await fastckpt.upload_async(model, at(store_uri, "run"), config=cfg)  # an existing folder: inside it, again
    await fastckpt.upload_async(src, at(store_uri, "dir/"), config=cfg)  # a folder: its contents
    await fastckpt.upload_async(src, at(store_uri, "dir2"), config=cfg)
    assert await keys(store_uri) == ["dir/a.bin", "dir/sub/b.bin", "dir2/a.bin", "dir2/sub/b.bin", "run/model.bin",
                                     "single"]
    out = tmp_path / "out"
    await fastckpt.download_async(at(store_uri, "run/model.bin"), f"{out}/", config=cfg)
    await fastckpt.download_async(at(store_uri, "single"), out / "renamed.bin", config=cfg)
    await fastckpt.download_async(at(store_uri, "single"), out, config=cfg)  # an existing folder: inside it
    await fastckpt.download_async(at(store_uri, "dir"), out / "tree", config=cfg)
    assert sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file()) == [
        "model.bin", "renamed.bin", "single", "tree/a.bin", "tree/sub/b.bin"]
    assert (out / "model.bin").read_bytes() == model.read_bytes() == (out / "single").read_bytes()


async def test_wildcards_and_filters(store_uri: str, tmp_path: Path) -> None:
    cfg = small_config()
    src = tree(tmp_path / "src", {"m-1.safetensors": b"1", "m-2.safetensors": b"22", "m-10.safetensors": b"10",
                                  "config.json": b"{}", "deep/x/opt.pt": b"o", "deep/y.json": b"[]", "tmp.tmp": b"t"})
    await fastckpt.upload_async(src, at(store_uri, "ck/"), config=cfg, filters=[("exclude", "*.tmp")])
    assert "ck/tmp.tmp" not in await keys(store_uri)

    async def got(pattern: str, **kw: object) -> list[str]:
        out = tmp_path / f"out-{os.urandom(4).hex()}"
        await fastckpt.download_async(at(store_uri, pattern), f"{out}/", config=cfg, **kw)
        return sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())

    assert await got("ck/*.safetensors") == ["m-1.safetensors", "m-10.safetensors", "m-2.safetensors"]
    assert await got("ck/m-?.safetensors") == ["m-1.safetensors", "m-2.safetensors"]
    assert await got("ck/**/*.json") == ["config.json", "deep/y.json"]  # '**/' also matches no folder
    assert await got("ck/*.json") == ["config.json"]  # '*' stays within one path part
    assert await got("ck/de*") == ["deep/x/opt.pt", "deep/y.json"]  # a matching folder brings all below it
    assert await got("ck", filters=[("exclude", "*"), ("include", "*.json")]) == ["config.json", "deep/y.json"]
    assert await got("ck", filters=[("exclude", "deep"), ("include", "opt.pt")]) == [
        "config.json", "deep/x/opt.pt", "m-1.safetensors", "m-10.safetensors", "m-2.safetensors"]
    with pytest.raises(ObjectNotFoundError, match=r"matches \*\.nothing"):
        await got("ck/*.nothing")
    await fastckpt.upload_async(f"{src}/deep/**/*.pt", at(store_uri, "pts/"), config=cfg)  # local wildcards too
    assert [k for k in await keys(store_uri) if k.startswith("pts/")] == ["pts/x/opt.pt"]


async def test_rm_takes_the_marker_first(store_uri: str, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(removal, "BATCH", 2)  # a streamed removal ships batches while it still lists
    cfg = small_config()
    for step in (1, 2):
        await commit(at(store_uri, f"run/step-{step}"), {"w.bin": b"w" * 100, "opt.bin": b"o" * 50,
                                                         "-early.bin": b"e"})  # listed before the marker
    await fastckpt.upload_async(tree(tmp_path, {"x.txt": b"x"}) / "x.txt", at(store_uri, "run/x.txt"), config=cfg)
    with pytest.raises(IsADirectoryError, match="--recursive"):
        await removal.remove_async(at(store_uri, "run/step-1"), config=cfg)
    with pytest.raises(ObjectNotFoundError, match="no such object"):
        await removal.remove_async(at(store_uri, "run/nothing"), config=cfg)
    dry = await removal.remove_async(at(store_uri, "run/step-1"), recursive=True, dry_run=True, config=cfg)
    assert dry[0].endswith("step-1/.fastckpt/COMMITTED") and len(dry) == len(await keys(at(store_uri, "run/step-1")))
    assert len(await keys(store_uri)) == 1 + 2 * len(dry)  # nothing removed

    # one file of a committed checkpoint, by a wildcard: its marker goes too (it would be committed and broken)
    gone = await removal.remove_async(at(store_uri, "run/step-2/opt.*"), config=cfg)
    assert gone[0].endswith("step-2/.fastckpt/COMMITTED") and gone[1].endswith("step-2/opt.bin")
    assert [c.state for c in await fastckpt.list_checkpoints_async(at(store_uri, "run"), config=cfg)] == [
        "committed", "uncommitted"]
    await removal.remove_async(at(store_uri, "run/x.txt"), config=cfg)
    await removal.remove_async(at(store_uri, "run"), recursive=True, config=cfg)
    assert await keys(store_uri) == []
    if parse_uri(store_uri).backend == "local":
        assert not os.path.exists("/" + parse_uri(at(store_uri, "run")).key)  # no empty folders left behind


async def test_mv_within_a_store_to_and_from_local_and_cp_across_stores(store_uri: str, tmp_path: Path) -> None:
    cfg = small_config()
    data = {"w.bin": os.urandom(3 * (256 << 10) + 7), "empty": b""}
    await commit(at(store_uri, "run/step-1"), data)
    done = await mirror.move_async(at(store_uri, "run/step-1"), at(store_uri, "kept/step-1"), config=cfg)
    assert len(done.sent) == len(await keys(at(store_uri, "kept/step-1")))
    assert [k for k in await keys(store_uri) if k.startswith("run/")] == []
    restored = await fastckpt.download_checkpoint_async(at(store_uri, "kept/step-1"), tmp_path / "r", config=cfg)
    assert {Path(r.path).name: Path(r.path).read_bytes() for r in restored} == data  # committed and verified there

    other = f"file://{tmp_path}/other"  # another store: streamed, verified, digests recorded anew
    await mirror.copy_async(at(store_uri, "kept/step-1/w.bin"), f"{other}/", config=cfg)
    assert (tmp_path / "other" / "w.bin").read_bytes() == data["w.bin"]
    async with open_store(parse_uri(other), config=cfg) as s:
        moved = await s.head(parse_uri(other).join("w.bin"))
    assert FileDigest.from_metadata(moved.size, moved.metadata) is not None

    down = tmp_path / "down"
    await mirror.move_async(at(store_uri, "kept"), str(down), config=cfg)
    assert await keys(store_uri) == [] and (down / "step-1" / "empty").read_bytes() == b""
    await mirror.move_async(str(down), at(store_uri, "back/"), config=cfg)
    assert not down.exists()
    assert [c.name for c in await fastckpt.list_checkpoints_async(at(store_uri, "back"), config=cfg)
            if c.state == "committed"] == ["step-1"]


async def test_sync_sends_what_differs_by_digest(store_uri: str, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(folder_sync, "STEP", 2)  # compare and send every two objects listed, while listing goes on
    cfg = small_config()
    src = tree(tmp_path / "src", {f"f{i}.bin": os.urandom(1000 + i) for i in range(6)})
    first = await folder_sync.sync_async(str(src), at(store_uri, "m"), config=cfg)
    assert (len(first.sent), first.unchanged) == (6, 0)

    (src / "f0.bin").write_bytes((src / "f0.bin").read_bytes())  # rewritten, same bytes: newer, not sent
    changed = bytearray((src / "f1.bin").read_bytes())
    changed[5] ^= 1
    (src / "f1.bin").write_bytes(changed)
    os.utime(src / "f1.bin", (1, 1))  # same size, older than the copy: size and time would miss it
    (src / "f2.bin").unlink()
    (src / "new.bin").write_bytes(b"n")
    dry = await folder_sync.sync_async(str(src), at(store_uri, "m"), delete=True, dry_run=True, config=cfg)
    again = await folder_sync.sync_async(str(src), at(store_uri, "m"), delete=True, config=cfg)
    assert sorted(os.path.basename(p) for p, _ in again.sent) == ["f1.bin", "new.bin"] == \
        sorted(os.path.basename(p) for p, _ in dry.sent)
    assert again.unchanged == 4 and [d.rsplit("/", 1)[-1] for d in again.deleted] == ["f2.bin"]
    assert await keys(at(store_uri, "m")) == sorted(p.name for p in src.iterdir())

    out = tmp_path / "out"
    assert len((await folder_sync.sync_async(at(store_uri, "m"), str(out), config=cfg)).sent) == 6
    (out / "f3.bin").write_bytes(b"\0" * (out / "f3.bin").stat().st_size)  # changed here, newer: sent back
    (out / "extra").write_bytes(b"e")
    back = await folder_sync.sync_async(at(store_uri, "m"), str(out), delete=True, config=cfg)
    assert [os.path.basename(p) for _, p in back.sent] == ["f3.bin"] and back.unchanged == 5
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in src.iterdir())
    assert all((out / p.name).read_bytes() == p.read_bytes() for p in src.iterdir())


async def test_sync_without_digests_goes_by_size_and_time(store_uri: str, tmp_path: Path) -> None:
    uri = parse_uri(at(store_uri, "plain"))
    async with open_store(uri, config=small_config()) as s:
        await s.put(uri.join("a"), b"12345")  # written by another tool: no digest
        await s.put(uri.join("b"), b"12345")
    out = tree(tmp_path / "out", {"a": b"abcde", "b": b"abcde"})
    os.utime(out / "a", (1, 1))  # older than the object: taken as stale
    done = await folder_sync.sync_async(at(store_uri, "plain"), str(out), config=small_config())
    assert [os.path.basename(p) for _, p in done.sent] == ["a"] and (out / "a").read_bytes() == b"12345"


async def test_cat_du_and_ls(store_uri: str, tmp_path: Path) -> None:
    cfg = small_config()
    big = os.urandom(5 * (256 << 10) + 3)
    await fastckpt.upload_async(tree(tmp_path / "t", {"big.bin": big, "a/x": b"x" * 10, "a/b/y": b"y" * 5,
                                                      "c/z": b"z"}), at(store_uri, "t/"), config=cfg)
    pieces: list[bytes] = []
    size = await objects.cat_async(at(store_uri, "t/big.bin"), lambda v: pieces.append(bytes(v)), config=cfg)
    assert size == len(big)
    assert b"".join(pieces) == big
    usage = await objects.disk_usage_async(at(store_uri, "t"), config=cfg)
    assert [(u.name, u.objects, u.bytes) for u in usage] == [(".", 1, len(big)), ("a", 2, 15), ("c", 1, 1),
                                                             ("", 4, len(big) + 16)]
    found, folders = await objects.list_async(at(store_uri, "t"), config=cfg)
    assert [m.key.rsplit("/", 1)[-1] for m in found] == ["big.bin"]
    assert [f.rsplit("/", 1)[-1] for f in folders] == ["a", "c"]
    found, folders = await objects.list_async(at(store_uri, "t"), recursive=True, config=cfg)
    assert len(found) == 4 and folders == []
    found, _ = await objects.list_async(at(store_uri, "t/**/?"), config=cfg)
    assert sorted(m.size for m in found) == [1, 5, 10]


async def test_cat_of_a_changed_object_fails(tmp_path: Path) -> None:
    base = f"file://{tmp_path}/s"
    data = os.urandom(3 * (256 << 10))
    await fastckpt.upload_async(tree(tmp_path, {"o": data}) / "o", f"{base}/o", config=small_config())
    flip(tmp_path / "s" / "o", 100)
    with pytest.raises(IntegrityError):
        await objects.cat_async(f"{base}/o", lambda v: None, config=small_config())


async def test_a_later_sync_asks_nothing_of_what_did_not_change(moto_server, s3_uri: str, tmp_path: Path) -> None:
    """What a sync learnt spares the next one its HEADs: unchanged files cost no request, a file rewritten with the
    same bytes only a local read, a file just sent none (S3 names it by its MD5); an object replaced behind its back
    (another ETag) is asked about and sent again."""
    cfg = small_config()
    src = tree(tmp_path / "src", {f"f{i}": os.urandom(500) for i in range(8)})
    with FaultProxy(urlsplit(moto_server.endpoint).port) as proxy:
        proxy.throttle(1000)  # records each request's first line; throttles none
        uri = at(s3_uri.replace(moto_server.endpoint, proxy.url), "s")
        assert len((await folder_sync.sync_async(str(src), uri, config=cfg)).sent) == 8

        def heads_during(seen: int) -> int:
            """HEADs of the objects below the prefix (not the bucket's or the prefix's own, which opening asks)."""
            return sum(line.startswith("HEAD ") and "/s/" in line for line in proxy.requests[seen:])

        seen = len(proxy.requests)
        again = await folder_sync.sync_async(str(src), uri, config=cfg)
        assert (again.sent, again.unchanged, heads_during(seen)) == ([], 8, 0), proxy.requests[seen:]

        (src / "f0").write_bytes((src / "f0").read_bytes())  # a new local version, the same bytes
        other = tree(tmp_path / "other", {"f1": os.urandom(500)})
        await fastckpt.upload_async(other / "f1", at(uri, "f1"), config=cfg)  # the object replaced elsewhere
        seen = len(proxy.requests)
        third = await folder_sync.sync_async(str(src), uri, config=cfg)
        assert [os.path.basename(p) for p, _ in third.sent] == ["f1"] and third.unchanged == 7
        assert heads_during(seen) == 1  # the replaced object's
        seen = len(proxy.requests)
        fourth = await folder_sync.sync_async(str(src), uri, config=cfg)  # f1, just sent, is known by its MD5 ETag
        assert (fourth.sent, fourth.unchanged, heads_during(seen)) == ([], 8, 0)
    out = tmp_path / "back"
    await fastckpt.download_async(at(s3_uri, "s"), out, config=cfg)
    assert all((out / p.name).read_bytes() == p.read_bytes() for p in src.iterdir())


def test_a_streamed_removal_waits_for_the_place_of_every_marker() -> None:
    """An object listed before the place where a commit marker of one of its folders would be listed waits for it."""
    src = parse_uri("s3://b/run")
    assert removal.gate(src, "run/ck/-early.bin") == "run/ck/.fastckpt/COMMITTED" > "run/ck/-early.bin"
    assert removal.gate(src, "run/ck/a.bin") == "run/ck/.fastckpt/COMMITTED" < "run/ck/a.bin"
    assert removal.gate(src, "run/-x/a") == "run/.fastckpt/COMMITTED"  # the outer folder's marker comes later
    assert removal.gate(src, "run/top.bin") == "run/.fastckpt/COMMITTED"


def test_wildcards_split_from_options_and_the_folder_to_list() -> None:
    from fastckpt.engine.select import Selection, split_wildcard

    assert split_wildcard("s3://b/ck/*.bin?endpoint_override=http://h:1") == ("s3://b/ck?endpoint_override=http://h:1",
                                                                              "*.bin")
    assert split_wildcard("s3://b/ck/shard-?.bin") == ("s3://b/ck", "shard-?.bin")  # not options: a wildcard
    assert split_wildcard("s3://b/k?region=x") == ("s3://b/k?region=x", None)
    assert split_wildcard("*.pt") == (".", "*.pt") and split_wildcard("/d/**/x") == ("/d", "**/x")
    with pytest.raises(ValueError, match="bucket"):
        split_wildcard("s3://buck*/k")
    with pytest.raises(ValueError, match="unknown filter"):
        Selection.of(None, [("drop", "*")])
    later_wins = Selection.of(None, [("exclude", "*"), ("include", "*.json"), ("exclude", "secret.json")])
    assert [later_wins.takes(p) for p in ("a/b.json", "a/secret.json", "c.bin")] == [True, False, False]
