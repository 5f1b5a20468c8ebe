"""`WarningLightCallback(path, **watch_options)` for Lightning: one line.

    trainer = L.Trainer(..., callbacks=[WarningLightCallback("runs/exp1")])

What it records:
- Steps: the hooks go on the torch optimizer Lightning holds (`trainer.optimizers[0]`; the
  `LightningOptimizer` a module sees wraps it), so `accumulate_grad_batches` gives one health
  step per optimizer step. With several optimizers the first is watched, with a warning.
- Loss: the `loss` a `training_step` returns, every micro-batch (the mean lands on its step).
- Checkpoints: every file a `ModelCheckpoint` callback saves (its path), at the step it holds.
- Sample ids: when a batch is a dict with an `ids_key` ("sample_id") entry.
- Nothing here raises into training: a failure warns once and recording stops.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import lightning.pytorch as pl
from warninglight.tracer import watch

from ._recording import Recording


class WarningLightCallback(Recording, pl.Callback):
    """Record a Warning Light trace of a Lightning run into `path`."""

    framework = "Lightning"

    def __init__(self, path: str | os.PathLike[str], *, ids_key: str = "sample_id",
                 stop_on_alarm: bool = False, **watch_options: Any) -> None:
        super().__init__(path, ids_key, stop_on_alarm, watch_options)
        self._saved: set[str] = set()

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        try:
            options = self._options(start_step=trainer.global_step)
            optimizers = list(trainer.optimizers)
            if len(optimizers) > 1:
                warnings.warn(f"warninglight: {len(optimizers)} optimizers; steps follow the first",
                              RuntimeWarning, stacklevel=2)
            self.rec = watch(pl_module, optimizers[0] if optimizers else None, self.path, **options)
        except Exception as exc:
            self._give_up(exc)

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        self._record_checkpoints(trainer)  # saved after the previous step: step_count is its step

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any,
                           batch: Any, batch_idx: int) -> None:
        if self.rec is None:
            return
        # after this micro-batch's forward: the step in progress, or the one just completed
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if loss is not None:
            self._guard(self.rec.log, loss=loss)
        if isinstance(batch, dict) and self.ids_key in batch:
            self._guard(self.rec.batch, batch[self.ids_key])
        if self._alarmed and self.stop_on_alarm:
            trainer.should_stop = True

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._record_checkpoints(trainer)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._record_checkpoints(trainer)
        if self.rec is not None:
            self._guard(self.rec.close)

    def _record_checkpoints(self, trainer: pl.Trainer) -> None:
        if self.rec is None:
            return
        for cb in trainer.checkpoint_callbacks:
            # without a monitored metric only best_model_path names the file just saved
            paths = [*getattr(cb, "best_k_models", {}), getattr(cb, "best_model_path", ""),
                     getattr(cb, "last_model_path", "")]
            for path in sorted(set(paths) - self._saved - {""}):
                if os.path.exists(path):
                    self._saved.add(path)
                    self._guard(self.rec.checkpoint, path)



__all__ = ["WarningLightCallback"]
