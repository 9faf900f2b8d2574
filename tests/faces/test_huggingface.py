"""fastckpt's ``transformers.Trainer`` callback with a real tiny GPT-2 built from a config on CPU, checkpoints on moto:
every saved folder is committed in the background, the Trainer's ``save_total_limit`` deleting local folders does not
disturb an upload, and the restored latest checkpoint is the folder the Trainer wrote, byte for byte."""

from __future__ import annotations

import shutil
import uuid
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")
import torch  # noqa: E402

import fastckpt  # noqa: E402
from fastckpt.huggingface import UploadCheckpoints, restore_latest  # noqa: E402

from ..servers.s3 import BUCKET  # noqa: E402

pytestmark = pytest.mark.slow


class Tokens(torch.utils.data.Dataset):
    def __init__(self) -> None:
        self.ids = torch.randint(0, 64, (32, 16), generator=torch.Generator().manual_seed(1))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def train(output_dir: Path, steps: int, callbacks: list, resume: str | None = None) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=1, n_head=2, n_embd=32, vocab_size=64, n_positions=16, bos_token_id=0,
                                     eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = transformers.GPT2LMHeadModel(config)
    args = transformers.TrainingArguments(output_dir=str(output_dir), max_steps=steps, save_steps=2,
                                          save_total_limit=1, per_device_train_batch_size=4, report_to=[],
                                          use_cpu=True, seed=0, logging_strategy="no", disable_tqdm=True)
    transformers.Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=callbacks).train(
        resume_from_checkpoint=resume)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_background_uploads_and_resume_from_the_latest(tmp_path: Path, moto_server,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Each folder is committed; the restored latest is byte-identical to the folder the Trainer wrote, and a run
    resumed from it ends exactly as one resumed from the original (``transformers`` itself does not resume bit-exact
    to an uninterrupted run: a few 1e-5 apart here, so that is not the comparison)."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", moto_server.endpoint)
    uri = f"s3://{BUCKET}/hf-{uuid.uuid4().hex[:8]}"
    uploads = UploadCheckpoints(uri, retention=fastckpt.Retention(keep_last=2, grace=0))
    train(tmp_path / "first", 6, [uploads])
    assert uploads.uploaded == [f"{uri}/checkpoint-{s}" for s in (2, 4, 6)]
    kept = fastckpt.list_checkpoints(uri)  # the retention after each upload, as save_total_limit locally
    assert [c.name for c in kept] == ["checkpoint-4", "checkpoint-6"] and kept[-1].metrics["epoch"] > 0
    assert sorted(p.name for p in (tmp_path / "first").iterdir()) == ["checkpoint-6"]  # save_total_limit=1
    for done in uploads.uploaded[1:]:
        assert fastckpt.verify(done).ok
    original = files(tmp_path / "first" / "checkpoint-6")
    local = train(tmp_path / "first", 8, [], resume=str(tmp_path / "first" / "checkpoint-6"))
    shutil.rmtree(tmp_path / "first")  # the node is gone; only the bucket has the run

    restored = restore_latest(uri, str(tmp_path / "second"))
    assert restored is not None and restored.endswith("checkpoint-6")
    assert files(Path(restored)) == original
    resumed = train(tmp_path / "second", 8, [], resume=restored)
    assert all(torch.equal(local[k], resumed[k]) for k in local)


def files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_nothing_to_restore(tmp_path: Path, moto_server, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL", moto_server.endpoint)
    assert restore_latest(f"s3://{BUCKET}/hf-empty-{uuid.uuid4().hex[:8]}", str(tmp_path)) is None
