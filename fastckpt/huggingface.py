"""Hugging Face ``transformers.Trainer`` checkpoints to any backend, uploaded in the background.

    from fastckpt.huggingface import UploadCheckpoints, restore_latest

    trainer = Trainer(model, args, train_dataset=data, callbacks=[UploadCheckpoints("s3://bucket/run")])
    trainer.train(resume_from_checkpoint=restore_latest("s3://bucket/run", args.output_dir))

``UploadCheckpoints`` uploads each checkpoint folder the Trainer saves (``checkpoint-<step>``) as a committed fastckpt
checkpoint below its URI, on a thread of its own: training goes on while it uploads, and the callback waits for the last
upload when training ends. The folder is first linked into a staging folder beside it (hard links: no bytes copied), so
the Trainer's ``save_total_limit`` may delete it meanwhile. Each commit records the step, the epoch and the newest value
of every number the Trainer logged (``eval_loss``, ``loss`` ...) as its metrics; ``retention=`` (a
``fastckpt.Retention``, such as ``Retention(keep_last=3, best=1, metric="eval_loss")``) then removes the uploads it does
not keep, as ``save_total_limit`` does locally. ``restore_latest`` downloads the newest committed one (verified) for
``resume_from_checkpoint``.
"""

from __future__ import annotations

import logging
import math
import os
import shutil
import tempfile
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from transformers import TrainerCallback

from ._loop import run_sync
from .checkpoint import Retention, SyncCheckpointWriter, apply_retention, download_checkpoint
from .checkpoint.catalog import newest_committed
from .config import TransferConfig
from .deprecation import keywords_only
from .uri import join_key, parse_uri

log = logging.getLogger("fastckpt")

__all__ = ["UploadCheckpoints", "restore_latest"]


class UploadCheckpoints(TrainerCallback):
    """A ``TrainerCallback`` that commits every checkpoint folder the Trainer saves to ``uri``/``checkpoint-<step>``
    (the main process of the job uploads; the others do nothing)."""

    @keywords_only(2, "config")
    def __init__(self, uri: str, *, config: TransferConfig | None = None, retention: Retention | None = None) -> None:
        self.uri = uri
        self.config = config
        self.retention = retention
        self._executor: ThreadPoolExecutor | None = None
        self._pending: list[Future[str]] = []
        self.uploaded: list[str] = []
        """URIs of the checkpoints committed so far."""

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Stage the folder just saved and queue its upload; a failed earlier upload is raised here."""
        self._collect(block=False)
        if not state.is_world_process_zero:
            return
        name = f"checkpoint-{state.global_step}"
        folder = os.path.join(args.output_dir, name)
        staged = _link_tree(folder)
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fastckpt-hf-upload")
        self._pending.append(self._executor.submit(self._upload, staged, self._target(name), _logged(state)))

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Wait for every upload queued (and raise the first that failed)."""
        self.wait()

    def wait(self) -> list[str]:
        """Block until the uploads queued so far are committed; their URIs."""
        self._collect(block=True)
        return list(self.uploaded)

    def _target(self, name: str) -> str:
        uri = parse_uri(self.uri)
        return uri.with_key(join_key(uri.key, name)).uri()

    def _upload(self, staged: str, target: str, metrics: dict[str, float]) -> str:
        try:
            with SyncCheckpointWriter(target, config=self.config, metrics=metrics) as writer:
                writer.put_dir(staged)
        finally:
            shutil.rmtree(os.path.dirname(staged), ignore_errors=True)
        if self.retention is not None:
            try:
                apply_retention(self.uri, self.retention, config=self.config)
            except Exception as exc:  # the upload is committed: the next one tries again
                log.warning("retention below %s failed after committing %s: %s", self.uri, target, exc)
        return target

    def _collect(self, block: bool) -> None:
        done = [f for f in self._pending if block or f.done()]
        self._pending = [f for f in self._pending if f not in done]
        for future in done:
            self.uploaded.append(future.result())


def _logged(state: Any) -> dict[str, float]:
    """The step and epoch, and the newest value of every finite number in the Trainer's log history (``eval_loss``,
    ``loss`` ...)."""
    found: dict[str, float] = {"step": float(state.global_step), "epoch": float(state.epoch or 0.0)}
    for entry in state.log_history:
        found.update((k, float(v)) for k, v in entry.items()
                     if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v))
    return found


def _link_tree(folder: str) -> str:
    """A copy of ``folder`` made of hard links, in a new staging folder beside it (a plain copy where links fail)."""
    staging = tempfile.mkdtemp(prefix=".fastckpt-upload-", dir=os.path.dirname(os.path.abspath(folder)))
    target = os.path.join(staging, os.path.basename(folder))
    shutil.copytree(folder, target, copy_function=_link)
    return target


def _link(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


@keywords_only(2, "config")
def restore_latest(uri: str, output_dir: str, *, config: TransferConfig | None = None) -> str | None:
    """Download the newest committed checkpoint below ``uri`` into ``output_dir``/``<its name>``; the local folder
    (for ``Trainer.train(resume_from_checkpoint=...)``), or None when there is none."""
    newest = run_sync(newest_committed(uri, config=config))
    if newest is None:
        return None
    folder = os.path.join(output_dir, parse_uri(newest).key.rstrip("/").rsplit("/", 1)[-1])
    download_checkpoint(newest, folder, config=config)
    return folder
