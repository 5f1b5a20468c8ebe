"""The live classifier: the engine's own `stream.Classifier`, then `locate → root_cause`, fed
segment by segment.

This is the code path of `warninglight analyze` and `replay`: each closed segment's health rows,
with the learning rate each component saw joined on (`schedule.join_lr`), are fed to one
`Classifier`, which carries the trailing history and the open episodes, so an alarm is raised at
exactly the step the offline analysis raises it. Localisation walks back over the rows kept in
memory, with the alarmed components' baselines taken when an alarm comes (as `analyze` reads
them back): at most `reach` steps, so an excursion that began further back than that is dated to
the edge of what is kept (the offline analysis has no such limit). Imported only when
`watch(..., alarms=...)` is used.
"""

from __future__ import annotations

import os
from dataclasses import replace
from typing import Any

import numpy as np
import polars as pl
from warninglight.forensics.comparators import detectors
from warninglight.forensics.explaining import rollback as rb
from warninglight.forensics.explaining.analysis import (
    ALARM_KEYS,
    Alarm,
    Detectors,
    felt_alarms,
    param_components,
    typed_root,
)
from warninglight.forensics.explaining.localise import Located, RootCause, locate, root_cause
from warninglight.forensics.judging.baseline import with_baseline
from warninglight.forensics.judging.classifier import Classifier
from warninglight.forensics.judging.conditions import Config, load_config
from warninglight.forensics.presenting.wording import alarm_line, summary_line
from warninglight.forensics.trace.schedule import join_lr, lr_of_components

from ..writer import Segment, health_table

DEFAULT_REACH = 1024  # steps of rows kept for walking an onset back (memory: reach × components rows)
_COMPONENT_COLUMNS = ("component", "kind", "role", "bound", "parent_param", "forward_index")


class LiveClassifier:
    """Feed it each closed segment; it returns the alarms those steps raised, located and rooted."""

    def __init__(self, rank: int, config: Config | None = None, reach: int = DEFAULT_REACH) -> None:
        self.rank = rank
        self.config = config or load_config(None)
        self.history = self.config.baseline.history(self.config.conditions)
        self.reach = max(reach, self.history)
        self.components: pl.DataFrame | None = None
        self._classifier: Classifier | None = None  # made when the components are known
        self._rows: pl.DataFrame | None = None  # health rows of the last `reach` steps and their history
        self._located: list[Located] = []
        self.incident = 0  # the open incident's number; 0 before the first alarm
        self._incident: list[Located] = []  # the open incident's alarms
        self._announced: tuple[Any, ...] | None = None  # its root and rollback as last announced
        self._checkpoints: list[rb.Checkpoint] = []
        self._batches: dict[int, list[int] | None] = {}
        self._wall: dict[int, float] = {}
        self._losses: dict[int, float | None] = {}  # every logged loss (one float a step)
        self._grads: dict[int, float] = {}  # every recorded total gradient norm (one float a step)
        self.last_step = 0

    def feed(self, seg: Segment) -> list[dict[str, Any]]:
        """The new alarms raised by the steps of `seg`, as `analyze --json` alarms plus root and rollback."""
        self._take_tables(seg)
        if not len(seg.steps) or self.components is None:
            return []
        self.last_step = int(seg.steps[-1])
        if self._classifier is None:
            self._classifier = Classifier(self.config, self.components)
        rows = self._health_rows(seg)
        new = self._classifier.feed(rows)
        kept_from = self.last_step - self.reach - self.history  # every kept step's baseline is whole
        self._rows = rows if self._rows is None else pl.concat(
            [self._rows.filter(pl.col("step") > kept_from), rows], how="diagonal_relaxed")
        if new.is_empty():
            return []
        fresh = felt_alarms(locate(new, self._scored(new), self.components, self.config), self._grad_series(),
                            self.config)
        self._located += fresh
        out = []
        for a in fresh:
            self._join_incident(a)
            # the root as it stands with the incident's alarms so far (it can move as more come in)
            root, _ = root_cause(self._incident, self.config, param_components(self.components))
            out.append(self._alarm(a, root))
        return out

    def _join_incident(self, a: Located) -> None:
        """`a` joins the open incident, or opens the next one after a quiet stretch as long as the
        baseline's history (by then the last incident's rows have left every baseline)."""
        if self._incident and a.onset_step <= max(r.step for r in self._incident) + self.history:
            self._incident.append(a)
            return
        self.incident += 1
        self._incident, self._announced = [a], None

    def _scored(self, alarms: pl.DataFrame) -> pl.DataFrame:
        """The kept rows of the alarmed components (and the layers feeding alarmed activations)
        of the last `reach` steps, with the baselines of the alarms' metrics."""
        assert self._rows is not None and self.components is not None
        parents = self.components.filter(pl.col("component").is_in(alarms["component"].implode()))
        names = {*alarms["component"].to_list(), *parents["parent_param"].drop_nulls().to_list()} \
            if "parent_param" in parents.columns else set(alarms["component"].to_list())
        rows = self._rows.filter(pl.col("component").is_in(sorted(names)))
        have = {*rows.columns, *(["lr_surge"] if "lr" in rows.columns else [])}  # the surge: from the lr
        metrics = [m for m in sorted(set(alarms["metric"].to_list())) if m in have]
        scored = with_baseline(rows.lazy(), self.config.baseline, metrics).collect()
        return scored.filter(pl.col("step") > self.last_step - self.reach)

    def _alarm(self, a: Located, root: RootCause | None) -> dict[str, Any]:
        """The JSON of one alarm: `analyze --json`'s alarm fields, the root and rollback as they
        stand now, `incident` (its number), `update` ("new" for the incident's first alarm,
        "update" when its root or rollback changed, else None), `text` (one line: the incident's
        verdict, worded by the engine) and `detail` (this alarm's own line)."""
        alarm = Alarm(**{k: _plain(getattr(a, k)) for k in ALARM_KEYS})
        alarm = replace(alarm, last_step=alarm.step)  # the episode is still open
        top = typed_root(root, self._incident, 1)
        loss_steps, losses = self._loss_series()
        fired, judged = detectors.judge_losses(loss_steps, losses)  # on the losses logged so far
        loss_spike = detectors.first_at_or_after(fired, root.alarm.onset_step if root else None)
        rollback = self._rollback(root, loss_spike) if root else None
        out: dict[str, Any] = {"text": "", "incident": self.incident, "update": None,
                               "detail": alarm_line(alarm), **alarm.to_dict(),
                               "step_wall_time_s": self._wall.get(alarm.step),
                               "root": top.to_dict() if top else None,
                               "rollback": rollback.to_dict() if rollback else None}
        # what a person is told again: the root, and where to roll back to and which steps to skip
        said = (top and (top.name, top.condition, top.onset_step),
                rollback and (rollback.checkpoint_step, rollback.checkpoint_path,
                              rollback.skip_step_range))
        if said != self._announced:
            out["update"] = "new" if self._announced is None else "update"
            self._announced = said
        if top is not None and rollback is not None:
            first = min(r.step for r in self._incident)
            found = Detectors(  # as far as the run has gone; the gradient-norm rule is judged offline
                loss_spike_step=loss_spike, grad_norm_spike_step=None, loss_spike_first_step=loss_spike,
                grad_norm_spike_first_step=None, loss_spike_count=int(loss_spike is not None),
                grad_norm_spike_count=0, first_alarm_step=first, light_lead_over_grad_norm_spike=None,
                loss_points=len(loss_steps),
                loss_steps_judged=judged,
                light_lead_over_loss_spike=None if loss_spike is None else loss_spike - first)
            # the headline names the checkpoint by its file; its full path is rollback.checkpoint_path
            short = replace(rollback, checkpoint_path=rollback.checkpoint_path and
                            os.path.basename(rollback.checkpoint_path))
            out["text"] = summary_line(top, short, found, "fault")
        else:
            out["text"] = alarm_line(alarm)
        return out

    def _grad_series(self) -> tuple[np.ndarray, np.ndarray]:
        steps = sorted(self._grads)
        return (np.array(steps, dtype=np.int64),
                np.array([self._grads[s] for s in steps], dtype=np.float64))

    def _loss_series(self) -> tuple[np.ndarray, np.ndarray]:
        steps = sorted(self._losses)
        return (np.array(steps, dtype=np.int64),
                np.array([self._losses[s] for s in steps], dtype=np.float64))

    def _rollback(self, root: RootCause, loss_spike: int | None) -> rb.Rollback:
        onset, step = root.alarm.onset_step, root.alarm.step
        rec = rb.recommend(None, self._checkpoints, "trace", onset, step, loss_spike, self.last_step)
        ids = [self._batches.get(s) for s in range(onset, step + 1)]
        skip = list(dict.fromkeys(i for b in ids if b for i in b))  # each id once, as analyze lists them
        return replace(rec, skip_batches=skip if any(b is not None for b in ids) else None)

    def _take_tables(self, seg: Segment) -> None:
        if "components" in seg.tables:
            comps = pl.DataFrame(seg.tables["components"], strict=False)
            self.components = comps.with_columns(pl.lit(self.rank, pl.Int64).alias("rank"))
        events = seg.tables.get("events", {})
        for kind, step, path in zip(events.get("kind", []), events.get("step", []), events.get("path", []),
                                    strict=False):
            if kind == "checkpoint" and step is not None:
                self._checkpoints.append(rb.Checkpoint(int(step), path))
        steps = seg.tables.get("steps", {})
        for s, ids, t, loss in zip(steps.get("step", []), steps.get("batch_ids", []),
                                   steps.get("wall_time_s", []), steps.get("loss", []), strict=False):
            self._batches[int(s)], self._wall[int(s)] = ids, t
            if loss is not None:
                self._losses[int(s)] = loss
        # the gradient as the backward left it (before clipping, where recorded), as `analyze` reads it
        pre, total = steps.get("grad_norm_preclip_l2", []), steps.get("grad_norm_total_l2", [])
        for i, s in enumerate(steps.get("step", [])):
            g = pre[i] if i < len(pre) and pre[i] is not None else total[i] if i < len(total) else None
            if g is not None:
                self._grads[int(s)] = float(g)
        for s in [s for s in self._batches if s <= self.last_step - self.reach]:
            del self._batches[s], self._wall[s]
        # a felt surge is judged from its onset (at most `reach` back) against the baseline before it
        for s in [s for s in self._grads if s <= self.last_step - self.reach - self.history]:
            del self._grads[s]

    def _health_rows(self, seg: Segment) -> pl.DataFrame:
        rows = pl.from_arrow(health_table(seg))
        assert isinstance(rows, pl.DataFrame)
        rows = rows.with_columns(pl.lit(self.rank, pl.Int64).alias("rank"))
        comps = self.components.select([c for c in _COMPONENT_COLUMNS if c in self.components.columns])
        rows = rows.join(comps.with_columns(pl.lit(self.rank, pl.Int64).alias("rank")),
                         on=["rank", "component"], how="left")
        # update sizes are judged per unit of the lr each component saw, as analyze judges them
        steps = {k: v for k, v in seg.tables.get("steps", {}).items() if k in ("step", "lr", "lr_groups")}
        if "step" not in steps:
            return rows
        lr = lr_of_components(pl.DataFrame(steps, strict=False).with_columns(
            pl.lit(self.rank, pl.Int64).alias("rank")), self.components)
        return join_lr(rows.lazy(), lr).collect()


def _plain(v: Any) -> Any:
    if isinstance(v, float) and not np.isfinite(v):
        return None
    return v


__all__ = ["DEFAULT_REACH", "LiveClassifier"]
