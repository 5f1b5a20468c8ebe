"""Alarm sinks for experiment trackers: MLflow, TensorBoard, Weights & Biases (offline).

Each tracker is an optional extra (`pip install 'warninglight[mlflow]'`, `[tensorboard]`,
`[wandb]`), imported only when its sink is named. Every sink writes the alarm's one-line text and
its numbers at the alarm's step, under the `warninglight/` prefix so they sit beside the run's
own metrics without colliding.
"""

from __future__ import annotations

import importlib
from typing import Any

from .base import SinkError

PREFIX = "warninglight"


def _need(module: str, extra: str, spec: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise SinkError(f"alarm sink {spec!r} needs {module.split('.')[0]} ({exc}); install it "
                        f"with pip install 'warninglight[{extra}]'") from None


def _numbers(alarm: dict[str, Any]) -> dict[str, float]:
    root = alarm.get("root") or {}
    out = {"alarm_magnitude": alarm.get("magnitude"), "alarm_onset_step": alarm.get("onset_step"),
           "root_onset_step": root.get("onset_step"),
           "rollback_step": (alarm.get("rollback") or {}).get("checkpoint_step")}
    return {f"{PREFIX}/{k}": float(v) for k, v in out.items() if v is not None}


class MLflowSink:
    """Tags and metrics on a run: the one active when `watch` started, `run_id`, or a new run."""

    retries = 3
    every_alarm = False  # an incident's news, as a webhook gets it

    def __init__(self, tracking_uri: str, run_id: str | None = None, spec: str = "mlflow") -> None:
        mlflow = _need("mlflow", "mlflow", spec)
        self.client = mlflow.tracking.MlflowClient(tracking_uri=tracking_uri)
        active = mlflow.active_run()  # thread-local: read now, on the training thread
        self.run_id = run_id or (active.info.run_id if active is not None else None)
        if self.run_id is None:  # no run to join: the alarms get their own, made now (a new
            # sqlite store creates its tables here, before training, not while alarms wait)
            exp = self.client.get_experiment_by_name(PREFIX)
            exp_id = exp.experiment_id if exp else self.client.create_experiment(PREFIX)
            self.run_id = self.client.create_run(exp_id, run_name=f"{PREFIX}-alarms").info.run_id
        self.count = 0

    def send(self, alarm: dict[str, Any]) -> None:
        self.count += 1
        step = int(alarm["step"])
        for key, value in _numbers(alarm).items():
            self.client.log_metric(self.run_id, key, value, step=step)
        self.client.log_metric(self.run_id, f"{PREFIX}/alarms", float(self.count), step=step)
        root = alarm.get("root") or {}
        tags = {"verdict": "fault", "last_alarm": alarm.get("text", ""),
                "root": root.get("attributed_to"), "root_condition": root.get("condition"),
                "root_onset_step": root.get("onset_step")}
        for key, value in tags.items():
            if value is not None:
                self.client.set_tag(self.run_id, f"{PREFIX}.{key}", str(value)[:5000])


class TensorBoardSink:
    """A text summary (the alarm's line) and scalars at the alarm's step, in `logdir`."""

    retries = 2
    every_alarm = False  # an incident's news, as a webhook gets it

    def __init__(self, logdir: str, spec: str = "tensorboard") -> None:
        _need("tensorboard", "tensorboard", spec)
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=logdir)

    def send(self, alarm: dict[str, Any]) -> None:
        step = int(alarm["step"])
        self.writer.add_text(f"{PREFIX}/alarm", alarm.get("text", ""), global_step=step)
        for key, value in _numbers(alarm).items():
            self.writer.add_scalar(key, value, global_step=step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    """Logs to the active W&B run, or to a run of its own (`wandb:offline`: offline mode, no network)."""

    retries = 2
    every_alarm = False  # an incident's news, as a webhook gets it

    def __init__(self, mode: str, spec: str = "wandb") -> None:
        if mode not in ("offline", "online", "active"):
            raise SinkError(f"alarm sink {spec!r}: expected wandb:offline, wandb:online, or "
                            "wandb:active (the run already started with wandb.init)")
        self.wandb = _need("wandb", "wandb", spec)
        self.run, self._own = self.wandb.run, False
        if self.run is None and mode == "active":
            raise SinkError(f"alarm sink {spec!r}: no active W&B run; call wandb.init() before watch()")
        if self.run is None:  # started now, on the training thread, not while alarms wait
            self.run = self.wandb.init(project=PREFIX, mode="offline" if mode == "offline" else "online",
                                       job_type="alarms")
            self._own = True

    def send(self, alarm: dict[str, Any]) -> None:
        root = alarm.get("root") or {}
        self.run.log({**_numbers(alarm), f"{PREFIX}/alarm_step": float(alarm["step"]),
                      f"{PREFIX}/alarm": alarm.get("text", "")})
        self.run.summary[f"{PREFIX}/root"] = root.get("attributed_to")
        self.run.summary[f"{PREFIX}/last_alarm"] = alarm.get("text", "")

    def close(self) -> None:
        if self._own and self.run is not None:
            self.run.finish()


def from_spec(kind: str, arg: str, spec: str) -> Any:
    """The tracker sink a `kind:arg` string names."""
    if kind == "mlflow":
        return MLflowSink(arg, spec=spec)
    if kind == "tensorboard":
        return TensorBoardSink(arg, spec=spec)
    return WandbSink(arg, spec=spec)


__all__ = ["MLflowSink", "TensorBoardSink", "WandbSink", "from_spec"]
