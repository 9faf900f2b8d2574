"""The public API speaks one vocabulary: ``docs/api.md``'s table against the signatures themselves (every callable
listed takes the parameter; every public callable that takes one of the table's parameters is listed), ``config``
keyword-only, durations without a unit in their names, one ``latest``; and each old spelling still works, with a
``DeprecationWarning`` naming the new one."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import re
import socket
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

import fastckpt

API = Path(__file__).resolve().parents[1] / "docs" / "api.md"
MODULES = ["fastckpt", "fastckpt.torch", "fastckpt.torch.dcp", "fastckpt.huggingface", "fastckpt.huggingface_models",
           "fastckpt.fs", "fastckpt.lightning", "fastckpt.pytorch_lightning", "fastckpt.tier", "fastckpt.checkpoint",
           "fastckpt.monitoring", "fastckpt.fsspec"]
MADE_BY_FASTCKPT = {"SaveHandle", "FastckptHandler", "LocalHandler", "ObjectStoreHandler", "InputFile", "OutputStream",
                    "Rendezvous", "FastckptFileSystem"}
"""Exported classes that fastckpt constructs and hands out (their constructors are not the vocabulary's)."""


def table() -> dict[str, set[str]]:
    """{parameter: the callables its row lists}, from ``docs/api.md``."""
    rows: dict[str, set[str]] = {}
    for line in API.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")] if line.startswith("| `") else []
        if len(cells) >= 3:
            for name in re.findall(r"`(\w+)`", cells[0]):
                rows[name] = set(re.findall(r"`([\w.]+)`", cells[-1]))
    return rows


def public() -> dict[str, inspect.Signature]:
    """Every public callable by its documented dotted name, with its signature."""
    found = {}
    for name in MODULES:
        module = importlib.import_module(name)
        for attr in module.__all__:
            obj = getattr(module, attr)
            if not callable(obj) or attr in MADE_BY_FASTCKPT or (inspect.isclass(obj) and (
                    issubclass(obj, BaseException) or (dataclasses.is_dataclass(obj) and attr != "Retention"))):
                continue
            try:
                found[f"{name}.{attr}"] = inspect.signature(obj)
            except (TypeError, ValueError):
                continue
    return found


def test_the_table_matches_the_signatures() -> None:
    rows, signatures = table(), public()
    assert {"config", "group", "barrier", "tier", "base", "retention", "metrics"} <= set(rows)
    for param, where in rows.items():
        for name in where:
            assert name in signatures, f"docs/api.md lists {name} for {param}: not a public callable"
            assert param in signatures[name].parameters, f"{name} does not take {param}= (docs/api.md says it does)"
    for name, sig in signatures.items():
        for param in set(sig.parameters) & set(rows):
            if name.startswith("fastckpt.checkpoint.") and f"fastckpt.{name.rsplit('.', 1)[1]}" in rows[param]:
                continue  # the same object, re-exported at the top
            assert name in rows[param], f"{name} takes {param}=, which docs/api.md's row for {param} does not list"


def test_the_rules_that_hold_everywhere() -> None:
    for name, sig in public().items():
        for param in sig.parameters.values():
            if param.name == "config" and not name.startswith("fastckpt.huggingface_models"):
                assert param.kind is param.KEYWORD_ONLY, f"{name}: config is not keyword-only"
            assert not re.search(r"_(s|secs|seconds|ms)$", param.name), f"{name}({param.name}=): a unit in a name"
    exported = {n for m in MODULES for n in importlib.import_module(m).__all__}
    assert "latest" in fastckpt.__all__ and "latest" not in importlib.import_module("fastckpt.checkpoint").__all__
    assert [m for m in MODULES if "latest" in importlib.import_module(m).__all__] == ["fastckpt"], exported


def deprecated(call: Any, new: str) -> Any:
    """``call()``'s result; it warned once, naming ``new``."""
    with pytest.warns(DeprecationWarning, match=new) as seen:
        out = call()
    assert len(seen) == 1
    return out


def test_the_old_spellings_work_and_warn(tmp_path: Path) -> None:
    base = f"file://{tmp_path}/run"
    (tmp_path / "a").write_bytes(b"1")
    with fastckpt.SyncCheckpointWriter(f"{base}/step-1") as w:
        w.put_file(tmp_path / "a", "a")
    report = deprecated(lambda: fastckpt.gc(base, older_than_s=0, dry_run=True), "older_than=")
    assert report.dry_run
    assert deprecated(lambda: fastckpt.gc(base, 0, True), "by keyword").dry_run
    with pytest.raises(TypeError, match="twice"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fastckpt.gc(base, 0, older_than=0)
    store = deprecated(lambda: fastckpt.open_store(base, fastckpt.TransferConfig()), "config= by keyword")
    assert store.config == fastckpt.TransferConfig()
    import fastckpt.checkpoint as checkpoint

    old = deprecated(lambda: checkpoint.latest, "fastckpt.latest")
    assert old(base) == fastckpt.latest(base) and old(base).endswith("run/step-1")
    fs = deprecated(lambda: fastckpt.fs.filesystem(base, fastckpt.TransferConfig()), "config= by keyword")
    assert fs.get_file_info(str(tmp_path / "run")).type.name == "Directory"


def test_a_save_takes_its_process_group_as_group(tmp_path: Path) -> None:
    """One gloo rank: ``save(group=)`` commits with the group's rank and size; a ``TorchBarrier`` passed as
    ``barrier=`` still works and warns; ``group=`` with ``barrier=`` is refused."""
    torch = pytest.importorskip("torch")
    import torch.distributed as dist

    import fastckpt.torch as ft
    from fastckpt.checkpoint.barrier_torch import TorchBarrier

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                            timeout=timedelta(seconds=30))
    try:
        state = {"w": torch.arange(4.0)}
        group = dist.new_group([0], backend="gloo")
        assert ft.save(state, f"file://{tmp_path}/a", group=group).world_size == 1
        assert deprecated(lambda: ft.save(state, f"file://{tmp_path}/b", barrier=TorchBarrier()),
                          "group=").world_size == 1
        with pytest.raises(ValueError, match=r"group= .* or barrier="):
            ft.save(state, f"file://{tmp_path}/c", group=group, barrier=TorchBarrier())
        with fastckpt.SyncCheckpointWriter(f"file://{tmp_path}/d", group=group) as writer:
            writer.put_file(__file__, "f.py")
        assert writer.result is not None and writer.result.world_size == 1
        assert torch.equal(ft.load(f"file://{tmp_path}/a", group=group)["w"], state["w"])
        with pytest.raises(ValueError, match="tier= or group="):
            ft.load(f"file://{tmp_path}/a", group=group, tier=tmp_path / "tier")
    finally:
        dist.destroy_process_group()


def test_every_public_module_says_what_it_exports() -> None:
    """Every module below ``fastckpt`` but the private ones has an ``__all__``, and each name in it exists."""
    import pkgutil

    for info in pkgutil.walk_packages(fastckpt.__path__, "fastckpt."):
        if any(part.startswith("_") for part in info.name.split(".")):
            continue
        try:
            module = importlib.import_module(info.name)
        except ImportError as exc:  # an optional dependency missing here (ray, lightning ...)
            assert exc.name and not exc.name.startswith("fastckpt"), exc
            continue
        assert isinstance(getattr(module, "__all__", None), list), f"{info.name} has no __all__"
        missing = [n for n in module.__all__ if not hasattr(module, n)]
        assert not missing, f"{info.name}.__all__ names {missing}, which it does not define"


def test_the_environment_is_read_in_one_place() -> None:
    """No ``os.environ`` / ``os.getenv`` outside ``config.py``, the command line and the clouds' option modules (their
    SDKs' own variables): everything else reads it through ``config``, when asked."""
    root = Path(fastckpt.__file__).parent
    allowed = re.compile(r"^(config\.py|cli/.*|stores/\w+/(options|controls)\.py)$")
    readers = [str(p.relative_to(root)) for p in root.rglob("*.py")
               if re.search(r"os\.environ|os\.getenv|getenv\(", p.read_text())
               and not allowed.match(str(p.relative_to(root)))]
    assert readers == []
