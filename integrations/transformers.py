"""`WarningLightCallback(path, **watch_options)` for Hugging Face `transformers.Trainer`: one line.

    trainer = Trainer(..., callbacks=[WarningLightCallback("runs/exp1")])

What it records, and how it meets Trainer's habits:
- Steps: the hooks go on the torch optimizer inside accelerate's `AcceleratedOptimizer`, which
  steps it once per optimizer step, so gradient accumulation gives one health step per optimizer
  step (every micro-batch's forward is counted in `micro_batches`).
- Loss: Trainer reports it only every `logging_steps`, as the mean since the last report; it is
  recorded at the step it was reported (the loss-spike comparator works on those points). With
  `logging_nan_inf_filter` (Trainer's default) a NaN loss is reported as the running mean: the
  health trace's non-finite counts still see it.
- Checkpoints: each `checkpoint-N` directory Trainer saves, at the step it holds.
- Sample ids: a dataset item field named `ids_key` ("sample_id") is taken out of the batch before
  the model's forward (so the model never sees it) and recorded for the step. Trainer's default
  `remove_unused_columns` drops fields the model does not accept before collation; for a torch
  Dataset the callback keeps `ids_key` through that filter; a `datasets.Dataset` loses it before
  any callback runs (pass `remove_unused_columns=False` there, or ids are simply not recorded).
- Nothing here raises into training: a failure warns once and recording stops.
"""

from __future__ import annotations

import os
from typing import Any

from transformers import TrainerCallback
from warninglight.tracer import watch

from ._recording import Recording

PREFIX = "checkpoint"  # transformers.trainer_utils.PREFIX_CHECKPOINT_DIR


class WarningLightCallback(Recording, TrainerCallback):
    """Record a Warning Light trace of a `transformers.Trainer` run into `path`."""

    framework = "Trainer"

    def __init__(self, path: str | os.PathLike[str], *, ids_key: str = "sample_id",
                 stop_on_alarm: bool = False, **watch_options: Any) -> None:
        super().__init__(path, ids_key, stop_on_alarm, watch_options)
        self._ids: list[Any] = []
        self._ids_hook: Any = None

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None,
                       optimizer: Any = None, train_dataloader: Any = None, **kwargs: Any) -> None:
        try:
            options = self._options(start_step=state.global_step,
                                    loss_logged_every=args.logging_steps)
            self._ids_hook = model.register_forward_pre_hook(self._take_ids, with_kwargs=True)
            _keep_ids_column(train_dataloader, self.ids_key)
            self.rec = watch(model, optimizer, self.path, **options)
        except Exception as exc:
            self._give_up(exc)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        if self.rec is not None and self._ids:
            self._guard(self.rec.batch, [i for chunk in self._ids for i in chunk])
        self._ids = []
        if self._alarmed and self.stop_on_alarm:
            control.should_save = control.should_training_stop = True
        return control

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None,
               **kwargs: Any) -> None:
        if self.rec is not None and logs and "loss" in logs:
            self._guard(self.rec.log, loss=logs["loss"])

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        folder = os.path.join(args.output_dir, f"{PREFIX}-{state.global_step}")
        if self.rec is not None and os.path.isdir(folder):
            self._guard(self.rec.checkpoint, folder)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._ids_hook is not None:
            self._ids_hook.remove()
        if self.rec is not None:
            self._guard(self.rec.close)

    def _take_ids(self, module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if self.ids_key not in kwargs:
            return None
        kwargs = dict(kwargs)
        ids = kwargs.pop(self.ids_key)  # the model never sees it, in training or evaluation
        if module.training:
            try:
                self._ids.append(ids.reshape(-1).tolist() if hasattr(ids, "reshape") else list(ids))
            except Exception as exc:
                self._give_up(exc)
        return args, kwargs



def _keep_ids_column(loader: Any, key: str) -> None:
    """Let `key` through Trainer's RemoveColumnsCollator (a torch Dataset's unused-column filter)."""
    collate = getattr(loader, "collate_fn", None)
    columns = getattr(collate, "signature_columns", None)
    if isinstance(columns, list) and key not in columns:
        columns.append(key)


__all__ = ["WarningLightCallback"]
