"""A small Lightning fit on CPU with checkpoints through fastckpt: ``python -m tests.ranks.lightning_job SPEC_JSON``.

Spec keys: dirpath (ModelCheckpoint's, a ``fastckpt://`` URL), epochs, ckpt_path (resume from it, or null), die_at
(SIGKILL this process when that epoch starts, once the previous epoch's checkpoint loads; or null), asynchronous
(``AsyncCheckpointIO``), out (a JSON file: the final weights).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

import fastckpt
import fastckpt.lightning as fl


class Regression(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(8, 1)

    def training_step(self, batch: list[torch.Tensor], _: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.layer(x), y)
        self.log("ep", float(self.current_epoch), on_epoch=True, on_step=False)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


class DieAt(Callback):
    """SIGKILL when epoch ``epoch`` starts, once the previous epoch's checkpoint loads (an asynchronous save
    may still be uploading: a process killed before that loses it, as any in-process save)."""

    def __init__(self, epoch: int, dirpath: str) -> None:
        self.epoch, self.dirpath = epoch, fl.checkpoint_uri(dirpath)

    def on_train_epoch_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        if trainer.current_epoch != self.epoch:
            return
        want = f"{self.dirpath}/epoch={self.epoch - 1}.ckpt"
        for _ in range(600):
            try:
                fl.CheckpointIO().load_checkpoint(want)
                break
            except (fastckpt.CheckpointError, fastckpt.ObjectNotFoundError):
                time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGKILL)


def main() -> int:
    spec = json.loads(sys.argv[1])
    torch.manual_seed(0)
    x = torch.randn(64, 8)
    data = DataLoader(TensorDataset(x, x @ torch.arange(8.0).unsqueeze(1)), batch_size=16, shuffle=False)
    callbacks: list[Callback] = [ModelCheckpoint(dirpath=spec["dirpath"], filename="{epoch}", monitor="ep", mode="max",
                                                 save_top_k=2, every_n_epochs=1)]
    if spec.get("die_at") is not None:
        callbacks.append(DieAt(spec["die_at"], spec["dirpath"]))
    io = fl.AsyncCheckpointIO() if spec.get("asynchronous") else fl.CheckpointIO()
    trainer = pl.Trainer(max_epochs=spec["epochs"], accelerator="cpu", devices=1, logger=False,
                         enable_progress_bar=False, enable_model_summary=False, plugins=[io], callbacks=callbacks)
    model = Regression()
    trainer.fit(model, data, ckpt_path=spec.get("ckpt_path"))
    with open(spec["out"], "w") as f:
        json.dump({k: v.tolist() for k, v in model.state_dict().items()}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
