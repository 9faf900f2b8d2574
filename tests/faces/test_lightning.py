"""fastckpt's Lightning ``CheckpointIO`` as a drop-in for ``TorchCheckpointIO``, with real Trainers on CPU, on a
local directory and on every emulator through ``fastckpt://``: ``ModelCheckpoint``'s ``save_last`` (rewritten every
save) and ``save_top_k`` removals leave what they leave with Lightning's default, each checkpoint is a file that
``torch.load`` and ``load_from_checkpoint`` read, resume from ``"last"`` works; a save killed midway leaves the old
checkpoint; a fit killed and resumed ends with the same weights as an uninterrupted one."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import fsspec
import pytest

pytest.importorskip("lightning")

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.plugins.io import TorchCheckpointIO

import fastckpt.lightning as fl
from fastckpt import CheckpointError, IntegrityError, ObjectNotFoundError, TransferConfig, open_store, parse_uri
from fastckpt.checkpoint import SyncCheckpointWriter
from fastckpt.lightning_io import FOLDER_FILE
from harness.link import LinkEmulator, LinkProfile
from harness.uris import emulator_uri

from ..servers.s3 import BUCKET

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
MB = 1 << 20


@pytest.fixture(params=["local", "s3", "gcs", "azure"])
def dirpath(request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A fresh ModelCheckpoint ``dirpath``: a plain local path, or a ``fastckpt://`` URL on an emulator reached
    through the environment (Lightning joins names onto it, so it carries no query)."""
    where = request.param
    if where == "local":
        return str(tmp_path / "ckpts")
    run = f"lightning-{uuid.uuid4().hex[:8]}/ckpts"
    if where == "s3":
        monkeypatch.setenv("AWS_ENDPOINT_URL", request.getfixturevalue("moto_server").endpoint)
        return f"fastckpt://s3://{BUCKET}/{run}"
    if where == "gcs":
        from ..servers.gcs import BUCKET as GCS_BUCKET
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", request.getfixturevalue("gcs_server"))
        return f"fastckpt://gs://{GCS_BUCKET}/{run}"
    from ..servers.azure import CONTAINER
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", request.getfixturevalue("azurite").connection_string)
    return f"fastckpt://az://{CONTAINER}/{run}"


def fit(dirpath: str, io: Any, epochs: int = 3, ckpt_path: str | None = None, **checkpointing: Any
        ) -> tuple[pl.Trainer, ModelCheckpoint]:
    """A fit of ``BoringModel`` (4 batches an epoch) with ``ModelCheckpoint(dirpath, **checkpointing)``."""
    callback = ModelCheckpoint(dirpath=dirpath, **checkpointing)
    trainer = pl.Trainer(max_epochs=epochs, limit_train_batches=4, limit_val_batches=0, logger=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[callback],
                         plugins=[io] if io is not None else [])
    trainer.fit(BoringModel(), ckpt_path=ckpt_path)
    return trainer, callback


def entries(dirpath: str) -> tuple[list[str], list[str]]:
    """(the names of the checkpoints in ``dirpath``, the names of the hidden sidecars there)."""
    fs, path = fsspec.core.url_to_fs(dirpath)
    names = sorted(os.path.basename(p.rstrip("/")) for p in fs.ls(path, detail=False))
    return [n for n in names if not n.startswith(".")], [n for n in names if n.startswith(".")]


def read_file(path: str) -> dict:
    """The checkpoint at ``path`` as plain ``torch.load`` reads it (through fsspec for ``fastckpt://``)."""
    with fsspec.open(path, "rb") as f:
        return torch.load(f, weights_only=False)


TOP_1 = {"save_last": True, "save_top_k": 1, "monitor": "step", "mode": "max", "every_n_train_steps": 2}


def test_modelcheckpoint_behaves_as_with_torch_checkpoint_io(dirpath: str, tmp_path: Path) -> None:
    stock_dir = str(tmp_path / "stock")
    _, stock = fit(stock_dir, None, **TOP_1)
    _, callback = fit(dirpath, fl.CheckpointIO(), **TOP_1)  # 6 saves, each rewriting last.ckpt

    names, hidden = entries(dirpath)
    assert names == entries(stock_dir)[0] == ["epoch=2-step=12.ckpt", "last.ckpt"]
    assert hidden == [f".{n}.fastckpt" for n in names]  # the removed checkpoints left nothing behind
    assert os.path.basename(callback.best_model_path) == os.path.basename(stock.best_model_path)

    plain = read_file(callback.best_model_path)  # a normal checkpoint file
    assert plain["global_step"] == 12 and read_file(callback.last_model_path)["global_step"] == 12
    through = fl.CheckpointIO().load_checkpoint(callback.best_model_path)
    assert all(torch.equal(v, through["state_dict"][k]) for k, v in plain["state_dict"].items())
    model = BoringModel.load_from_checkpoint(callback.best_model_path)
    assert torch.equal(model.layer.weight, plain["state_dict"]["layer.weight"])

    # Lightning finds "last" through os.path.normpath of the listing, which breaks URLs (with s3fs as with fastckpt):
    # on a store, a fit resumes from the path its callback recorded
    last = "last" if not dirpath.startswith(fl.PREFIX) else callback.last_model_path
    resumed, _ = fit(dirpath, fl.CheckpointIO(), epochs=4, ckpt_path=last, **TOP_1)
    assert resumed.global_step == 16 and read_file(f"{dirpath}/last.ckpt")["global_step"] == 16
    assert entries(dirpath)[0] == ["epoch=3-step=16.ckpt", "last.ckpt"]


def test_save_last_link_and_async_saves(tmp_path: Path) -> None:
    """``save_last="link"`` (local: a symbolic link to the newest checkpoint) with ``AsyncCheckpointIO``: removals
    wait for the saves before them, the link resolves to a verified checkpoint, and removing it keeps its target."""
    dirpath = str(tmp_path / "ckpts")
    spec = {**TOP_1, "save_last": "link"}
    fit(dirpath, fl.AsyncCheckpointIO(), **spec)
    names, hidden = entries(dirpath)
    assert names == ["epoch=2-step=12.ckpt", "last.ckpt"] and hidden == [".epoch=2-step=12.ckpt.fastckpt"]
    link = os.path.join(dirpath, "last.ckpt")
    assert os.readlink(link) == "epoch=2-step=12.ckpt"
    resumed, _ = fit(dirpath, fl.AsyncCheckpointIO(checkpoint_io=fl.CheckpointIO()), epochs=4, ckpt_path="last",
                     **spec)
    assert resumed.global_step == 16 and os.readlink(link) == "epoch=3-step=16.ckpt"
    fl.CheckpointIO().remove_checkpoint(link)
    assert entries(dirpath) == (["epoch=3-step=16.ckpt"], [".epoch=3-step=16.ckpt.fastckpt"])


def test_async_checkpoint_io_takes_lightnings_signature(tmp_path: Path) -> None:
    stock = TorchCheckpointIO()
    assert fl.AsyncCheckpointIO(checkpoint_io=stock).checkpoint_io is stock
    assert isinstance(fl.AsyncCheckpointIO().checkpoint_io, fl.CheckpointIO)
    config = TransferConfig(max_in_flight=4)
    assert fl.AsyncCheckpointIO(config=config).checkpoint_io.config is config  # type: ignore[union-attr]
    with pytest.raises(TypeError, match="config="):
        fl.AsyncCheckpointIO(config)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="config"):
        fl.AsyncCheckpointIO(stock, config=config)
    with pytest.raises(TypeError, match="storage_options"):
        fl.CheckpointIO().save_checkpoint({}, str(tmp_path / "x.ckpt"), storage_options={"a": 1})


def test_a_file_fastckpt_did_not_write_is_refused_unless_allowed(tmp_path: Path) -> None:
    path = str(tmp_path / "stock.ckpt")
    TorchCheckpointIO().save_checkpoint({"w": torch.arange(4)}, path)
    with pytest.raises(CheckpointError, match="allow_unverified=True"):
        fl.CheckpointIO().load_checkpoint(path)
    assert torch.equal(fl.CheckpointIO(allow_unverified=True).load_checkpoint(path)["w"], torch.arange(4))

    ours = str(tmp_path / "ours.ckpt")
    fl.CheckpointIO().save_checkpoint({"w": torch.zeros(1 << 16)}, ours)
    with open(ours, "r+b") as f:  # one byte changed in place
        f.seek(os.path.getsize(ours) // 2)
        f.write(b"\x01")
    with pytest.raises(IntegrityError, match=r"ours\.ckpt"):
        fl.CheckpointIO().load_checkpoint(ours)


def test_checkpoints_saved_as_folders_still_load_and_remove(tmp_path: Path) -> None:
    """fastckpt before the sidecar format committed each Lightning checkpoint as a folder holding checkpoint.pt."""
    folder, state = str(tmp_path / "old.ckpt"), tmp_path / "state.pt"
    torch.save({"w": torch.arange(3)}, state)
    with SyncCheckpointWriter(folder) as writer:
        writer.put_file(state, FOLDER_FILE)
    assert torch.equal(fl.CheckpointIO().load_checkpoint(folder)["w"], torch.arange(3))
    fl.CheckpointIO().save_checkpoint({"w": torch.arange(5)}, folder)  # saved over: now a file
    assert os.path.isfile(folder) and torch.equal(torch.load(folder)["w"], torch.arange(5))
    fl.CheckpointIO().remove_checkpoint(folder)
    assert os.listdir(tmp_path) == ["state.pt"]


def test_a_save_killed_midway_leaves_the_old_checkpoint(moto_server, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A process saving over ``last.ckpt`` through a slow link is killed while its upload runs: the old checkpoint
    still loads, verified, through the plugin and as a plain file; the next save replaces it."""
    path = f"{BUCKET}/killed-{uuid.uuid4().hex[:8]}/last.ckpt"
    slow = LinkProfile("slow", rtt=0.002, per_connection=4 * MB, total=8 * MB)
    with LinkEmulator(int(moto_server.endpoint.rsplit(":", 1)[1]), slow) as link:
        uri = emulator_uri("s3", link.url, path.split("/", 1)[1])
        job = subprocess.Popen([sys.executable, "-c", KILLED_SAVE, uri], cwd=REPO, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
        try:
            assert job.stdout is not None and job.stdout.readline().strip() == "first saved"
            side = _sidecar(uri)
            deadline = time.monotonic() + 60
            while len(_records(side)) < 2:  # the second save has recorded its bytes: its upload runs
                assert time.monotonic() < deadline and job.poll() is None, job.stderr.read() if job.stderr else ""
                time.sleep(0.02)
            time.sleep(0.5)
            job.send_signal(signal.SIGKILL)
        finally:
            job.kill()
            job.wait()
        assert torch.equal(fl.CheckpointIO().load_checkpoint(uri)["w"], torch.arange(8))
        fl.CheckpointIO().save_checkpoint({"w": torch.arange(2)}, uri)
        assert torch.equal(fl.CheckpointIO().load_checkpoint(uri)["w"], torch.arange(2))
        assert len(_records(_sidecar(uri))) == 1
    monkeypatch.setenv("AWS_ENDPOINT_URL", moto_server.endpoint)
    assert torch.equal(read_file(f"fastckpt://s3://{path}?endpoint_override={moto_server.endpoint}")["w"],
                       torch.arange(2))


KILLED_SAVE = """
import sys, torch, fastckpt.lightning as fl
io, uri = fl.CheckpointIO(), sys.argv[1]
io.save_checkpoint({"w": torch.arange(8)}, uri)
print("first saved", flush=True)
io.save_checkpoint({"w": torch.ones(16 << 20, dtype=torch.uint8)}, uri)
print("second saved", flush=True)
"""


def _sidecar(uri: str) -> str:
    path, _, query = uri.partition("?")
    parent, _, name = path.rpartition("/")
    return f"{parent}/.{name}.fastckpt?{query}"


def _records(side: str) -> list[dict]:
    async def read() -> bytes:
        target = parse_uri(side)
        async with open_store(target) as store:
            try:
                return await store.get_range(target.key, 0, 1 << 20)
            except ObjectNotFoundError:
                return b'{"records": []}'

    return json.loads(asyncio.run(read()))["records"]


def fit_job(tmp_path: Path, endpoint: str, dirpath: str, **spec: object) -> tuple[int, dict]:
    out = tmp_path / f"weights-{uuid.uuid4().hex[:6]}.json"
    env = {**os.environ, "AWS_ENDPOINT_URL": endpoint}
    run = subprocess.run([sys.executable, "-m", "tests.ranks.lightning_job",
                          json.dumps({"dirpath": f"fastckpt://{dirpath}", "out": str(out), **spec})],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    if run.returncode not in (0, -signal.SIGKILL):
        raise AssertionError(run.stdout[-3000:] + run.stderr[-3000:])
    return run.returncode, json.loads(out.read_text()) if out.exists() else {}


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_killed_fit_resumes_to_the_same_weights(tmp_path: Path, moto_server, monkeypatch: pytest.MonkeyPatch,
                                                asynchronous: bool) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL", moto_server.endpoint)
    run = f"s3://{BUCKET}/lightning-{uuid.uuid4().hex[:8]}"
    _, straight = fit_job(tmp_path, moto_server.endpoint, f"{run}/straight", epochs=4, asynchronous=asynchronous)
    assert entries(f"fastckpt://{run}/straight")[0] == ["epoch=2.ckpt", "epoch=3.ckpt"]  # save_top_k=2

    code, _ = fit_job(tmp_path, moto_server.endpoint, f"{run}/killed", epochs=4, die_at=2, asynchronous=asynchronous)
    assert code == -signal.SIGKILL
    assert entries(f"fastckpt://{run}/killed")[0] == ["epoch=0.ckpt", "epoch=1.ckpt"]

    _, resumed = fit_job(tmp_path, moto_server.endpoint, f"{run}/killed", epochs=4, asynchronous=asynchronous,
                         ckpt_path=f"fastckpt://{run}/killed/epoch=1.ckpt")
    assert resumed == straight
    assert entries(f"fastckpt://{run}/killed")[0] == ["epoch=2.ckpt", "epoch=3.ckpt"]


def test_pytorch_lightning_projects_use_their_own_package(tmp_path: Path, moto_server, monkeypatch) -> None:
    """``fastckpt.pytorch_lightning``: the same plug-ins on ``pytorch_lightning``'s base classes, whose ``Trainer``
    takes no other; checkpoints saved, listed, kept last and resumed from, as with ``fastckpt.lightning``."""
    ptl = pytest.importorskip("pytorch_lightning")
    from lightning_fabric.utilities.exceptions import MisconfigurationException
    from pytorch_lightning.callbacks import ModelCheckpoint as PtlModelCheckpoint
    from pytorch_lightning.demos.boring_classes import BoringModel as PtlBoringModel

    import fastckpt.pytorch_lightning as fpl

    monkeypatch.setenv("AWS_ENDPOINT_URL", moto_server.endpoint)
    dirpath = f"fastckpt://s3://{BUCKET}/ptl-{uuid.uuid4().hex[:8]}/ckpts"

    def ptl_fit(io: Any, epochs: int, ckpt_path: str | None = None) -> Any:
        trainer = ptl.Trainer(max_epochs=epochs, limit_train_batches=4, limit_val_batches=0, logger=False,
                              enable_progress_bar=False, enable_model_summary=False, plugins=[io],
                              callbacks=[PtlModelCheckpoint(dirpath=dirpath, save_last=True, save_top_k=-1)])
        trainer.fit(PtlBoringModel(), ckpt_path=ckpt_path)
        return trainer

    with pytest.raises(MisconfigurationException, match="invalid type for plugin"):  # `lightning`'s is not theirs
        ptl.Trainer(plugins=[fl.CheckpointIO()], logger=False)
    ptl_fit(fpl.AsyncCheckpointIO(), epochs=2)
    assert entries(dirpath)[0] == ["epoch=0-step=4.ckpt", "epoch=1-step=8.ckpt", "last.ckpt"]
    trainer = ptl_fit(fpl.CheckpointIO(), epochs=3, ckpt_path=f"{dirpath}/last.ckpt")  # "last": normpath breaks URLs
    assert trainer.global_step == 12
    loaded = fpl.CheckpointIO().load_checkpoint(f"{dirpath}/last.ckpt")
    assert loaded["global_step"] == 12
