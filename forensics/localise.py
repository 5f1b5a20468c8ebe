"""Onset and root: where each excursion began, and which component it began in.

Onset: from the alarm step, walk back while the metric still departs (|z| > `onset_z`, in the
alarm's direction) both from the baseline *as it stood at the alarm* and from its own baseline
at that step — so a gradual excursion is traced to where it started, not where it crossed the
threshold, and one noisy step before an abrupt fault is not taken for its start. Weight drift (the weights
changed between one optimizer step and the next forward: something outside the optimizer wrote
them) is direct evidence: a run of drift steps reaching the onset moves the onset to its start.

Attribution: an activation's alarm is reported on its `parent_param` (the layer feeding it) when
that layer's weights drifted at the onset — the layer is the real source. Otherwise the
activation itself is reported. Each alarm says where it was observed (`observed_on`).

Root: an alarm is *explained* when its cause is visible elsewhere: a forward-signal or weight
alarm whose inputs had already departed (an upstream component, by `forward_index`, with a
forward alarm at or before its onset); a gradient alarm with any alarm downstream at or before
its onset (gradients flow backwards). The root is the unexplained alarm with the earliest onset;
ties go to a non-finite value, then to direct evidence (drift), then upstream-most. The root is
named by the most specific condition (registry precedence) its component showed within
`ROOT_WINDOW` steps of the onset. Every other component that alarmed is *affected*.

Optimizer-wide faults: when the updates of at least half the parameter-owning components (and
at least three) depart at the earliest onset while their gradients and inputs have not, and no
weights drifted, no single component is the source: the optimizer changed how it steps (a
learning-rate spike, corrupted optimizer state). The root is then reported on the whole model
(component `""`, scope `optimizer`), observed on the component that led.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import polars as pl
from warninglight.tracer.schema import COUNT_METRICS, FORWARD, GRADIENT, WEIGHTS

from .baseline import z_numpy
from .classify import signal_of
from .conditions import Config

UPDATE_METRICS = frozenset({"update_norm_l2", "update_ratio", "update_cos"})
OPTIMIZER_WIDE_SHARE = 0.5  # of parameter-owning components whose updates departed together
DRIFT_REACH = 2  # steps: a drift run this close to the metric's onset explains it
ROOT_WINDOW = 2  # steps: the root's condition is chosen among its alarms this close to its onset


@dataclass(frozen=True)
class Series:
    """One component's steps with a metric's values (sorted by step)."""

    steps: np.ndarray
    values: np.ndarray


def _series(scored: pl.DataFrame, rank: int, component: str, metric: str) -> Series:
    rows = scored.filter((pl.col("rank") == rank) & (pl.col("component") == component)).sort("step")
    values = rows[metric].cast(pl.Float64).fill_null(np.nan).to_numpy() if metric in rows.columns else np.full(len(rows), np.nan)
    return Series(rows["step"].to_numpy(), values)


def metric_onset(scored: pl.DataFrame, alarm: dict[str, Any], onset_z: float) -> int:
    """First step of the run of departing values that ends at the alarm step."""
    s = _series(scored, alarm["rank"], alarm["component"], alarm["metric"])
    upto = s.steps <= alarm["step"]
    steps, values = s.steps[upto], s.values[upto]
    if alarm["median"] is None or not np.isfinite(alarm["median"]):  # non-finite rule
        count = alarm["metric"] in COUNT_METRICS
        departing = ~np.isfinite(values) | ((np.nan_to_num(values) > 0) & count)
    else:
        row = scored.filter((pl.col("rank") == alarm["rank"]) & (pl.col("component") == alarm["component"])
                            & (pl.col("step") == alarm["step"]))
        scale = float(row[f"{alarm['metric']}__scale"][0])
        direction = np.sign(alarm["value"] - alarm["median"]) or 1.0
        z = direction * z_numpy(alarm["metric"], values, alarm["median"], scale)
        # ...and against its own baseline at the time, as a live monitor saw it: one noisy step
        # just before an abrupt fault must not pass for its start.
        own = direction * np.nan_to_num(_series(scored, alarm["rank"], alarm["component"],
                                                f"{alarm['metric']}__z").values[upto], nan=np.inf)
        departing = ~np.isfinite(values) | ((z > onset_z) & (own > onset_z))
    i = len(steps) - 1
    while i > 0 and departing[i - 1] and steps[i - 1] == steps[i] - 1:
        i -= 1
    return int(steps[i])


def drift_run_start(drift: Series, onset: int) -> int | None:
    """Start of the run of consecutive drift steps within `DRIFT_REACH` of `onset`, or None."""
    hit = drift.steps[np.nan_to_num(drift.values) > 0]
    near = hit[(hit <= onset + DRIFT_REACH) & (hit >= onset - DRIFT_REACH)]
    if len(near) == 0:
        return None
    start = int(near.max())
    marked = set(hit.tolist())
    while start - 1 in marked:
        start -= 1
    return start


def _attribute(alarm: dict[str, Any], comps: dict[str, dict[str, Any]], scored: pl.DataFrame,
               onset: int) -> tuple[str, int, bool]:
    """(reported component, onset, drift evidence) for one alarm."""
    own = drift_run_start(_series(scored, alarm["rank"], alarm["component"], "weight_drift_l2"), onset)
    if own is not None:  # the write outside the optimizer is when it began
        return alarm["component"], own, True
    info = comps.get(alarm["component"], {})
    parent = info.get("parent_param")
    if info.get("role") == "activation" and parent:
        start = drift_run_start(_series(scored, alarm["rank"], parent, "weight_drift_l2"), onset)
        if start is not None:
            return parent, start, True
    return alarm["component"], onset, False


def locate(alarms: pl.DataFrame, scored: pl.DataFrame, components: pl.DataFrame,
           config: Config) -> pl.DataFrame:
    """The alarms with onset_step, the component they are attributed to, signal and evidence."""
    comps = {r["component"]: r for r in components.iter_rows(named=True)}
    rows = []
    for alarm in alarms.iter_rows(named=True):
        onset = metric_onset(scored, alarm, config.baseline.onset_z)
        reported, onset, drift = _attribute(alarm, comps, scored, onset)
        fi = comps.get(reported, {}).get("forward_index")
        rows.append({**alarm, "onset_step": onset, "attributed_to": reported, "drift": drift,
                     "signal": signal_of(alarm["metric"]),
                     "forward_index": fi if fi is not None else 1 << 30})
    schema = {**dict(alarms.schema), "onset_step": pl.Int64, "attributed_to": pl.String,
              "drift": pl.Boolean, "signal": pl.String, "forward_index": pl.Int64}
    return pl.DataFrame(rows, schema=schema).rename({"component": "observed_on"})


def _explained(a: dict[str, Any], others: list[dict[str, Any]]) -> bool:
    """True when another component's earlier-or-equal alarm accounts for this one."""
    for b in others:
        if b["rank"] != a["rank"] or b["attributed_to"] == a["attributed_to"] or b["onset_step"] > a["onset_step"]:
            continue
        upstream = b["forward_index"] < a["forward_index"]
        if upstream and b["signal"] == FORWARD:
            return True  # its inputs had departed
        # Gradients come from downstream, and without drift so do the optimizer's weight changes.
        driven = a["signal"] == GRADIENT or (a["signal"] == WEIGHTS and not a["drift"])
        if driven and not upstream:
            return True
    return False


def optimizer_wide(rows: list[dict[str, Any]], first: int, param_components: int) -> set[str]:
    """Components whose updates departed at `first` ahead of their gradients and inputs, if they
    are enough (and nothing drifted) to say the optimizer, not one component, changed; else empty."""
    near = [a for a in rows if first <= a["onset_step"] <= first + ROOT_WINDOW]
    if any(a["drift"] or a["median"] is None for a in near):
        return set()  # a write outside the optimizer, or a non-finite value, has a place
    led = {a["attributed_to"]: a["onset_step"] for a in near if a["metric"] in UPDATE_METRICS}
    for a in rows:  # a gradient or input that moved no later than the update drove it
        if a["signal"] != WEIGHTS and a["onset_step"] <= led.get(a["attributed_to"], -1):
            led.pop(a["attributed_to"])
    enough = len(led) >= max(3, OPTIMIZER_WIDE_SHARE * param_components)
    return set(led) if param_components and enough else set()


def root_cause(located: pl.DataFrame, config: Config,
               param_components: int = 0) -> tuple[dict[str, Any] | None, list[str]]:
    """The root alarm (or None) and the other components that alarmed, earliest first.

    `param_components`: how many components own parameters (0: never call a fault optimizer-wide).
    """
    if located.is_empty():
        return None, []
    precedence = {c.name: c.precedence for c in config.conditions}
    rows = list(located.iter_rows(named=True))
    for a in rows:
        a["explained"] = _explained(a, rows)
    candidates = [a for a in rows if not a["explained"]] or rows
    first = min(a["onset_step"] for a in candidates)
    tied = [a for a in candidates if a["onset_step"] == first]
    # A non-finite value outranks everything (the value itself is broken), then drift.
    lead = min(tied, key=lambda a: (a["median"] is not None, not a["drift"], a["forward_index"]))
    # One fault shows as several conditions on its component (an LR spike: big updates, then
    # flipping ones): name it by the most specific one that began with it.
    same = [a for a in rows if a["attributed_to"] == lead["attributed_to"] and a["rank"] == lead["rank"]
            and first <= a["onset_step"] <= first + ROOT_WINDOW]
    root = min(same, key=lambda a: (a["median"] is not None, precedence.get(a["condition"], 99),
                                    a["onset_step"], -(abs(a["magnitude"] or 0.0))))
    root = {**root, "onset_step": first, "drift": lead["drift"], "evidence": _evidence(lead, tied),
            "scope": "component"}
    wide = optimizer_wide(rows, first, param_components)
    if wide:
        root.update(attributed_to="", scope="optimizer", evidence=(
            f"optimizer-wide: the updates of {len(wide)} of {param_components} parameter-owning "
            "components departed together while their gradients had not, and no weights drifted: "
            "the optimizer's step changed (learning rate, optimizer state), not one component"))
    affected: list[str] = []
    for a in sorted(rows, key=lambda a: (a["onset_step"], a["forward_index"])):
        if a["attributed_to"] != root["attributed_to"] and a["attributed_to"] not in affected:
            affected.append(a["attributed_to"])
    return root, affected


def _evidence(root: dict[str, Any], tied: list[dict[str, Any]]) -> str:
    if root["drift"]:
        return "weight drift: its weights changed outside the optimizer at the onset"
    if len({a["attributed_to"] for a in tied}) > 1:
        return "earliest onset, tie broken by causal order (its inputs had not departed)"
    return "earliest onset among components whose inputs had not departed"
