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

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import polars as pl
from warninglight.forensics.judging.baseline import z_numpy
from warninglight.forensics.judging.conditions import Config
from warninglight.forensics.judging.hits import signal_of
from warninglight.tracer.schema import COUNT_METRICS, FORWARD, GRADIENT, WEIGHTS

UPDATE_METRICS = frozenset({"update_norm_l2", "update_ratio", "update_cos", "lr_surge"})
OPTIMIZER_WIDE_SHARE = 0.5  # of parameter-owning components whose updates departed together
DRIFT_REACH = 2  # steps: a drift run this close to the metric's onset explains it
ROOT_WINDOW = 2  # steps: the root's condition is chosen among its alarms this close to its onset


@dataclass(frozen=True)
class Located:
    """One alarm with where its excursion began and the component it is attributed to."""

    rank: int
    observed_on: str  # the component whose metric alarmed
    condition: str
    step: int  # alarm step
    last_step: int
    metric: str
    value: float | None
    median: float | None  # None for a non-finite rule
    magnitude: float | None
    onset_step: int
    attributed_to: str
    nonfinite: bool  # a non-finite rule fired: a NaN/Inf value, or a count of them above 0
    drift: bool  # direct evidence: a run of weight drift reached the onset
    signal: str  # forward | gradient | weights (hits.SIGNALS)
    forward_index: int | None  # of `attributed_to`; None if it was never called in a forward pass


@dataclass(frozen=True)
class RootCause:
    """The root alarm (onset, attribution and drift those of the fault), and why it was chosen."""

    alarm: Located
    evidence: str
    scope: str  # "component" | "optimizer" (attributed_to is then "", the whole model)


@dataclass(frozen=True)
class Series:
    """One component's steps with a metric's values (sorted by step)."""

    steps: np.ndarray
    values: np.ndarray


class History:
    """The scored rows of the components alarms need, grouped once by (rank, component)."""

    def __init__(self, scored: pl.DataFrame, components: Iterable[str]) -> None:
        rows = scored.filter(pl.col("component").is_in(list(set(components)))).sort("step")
        self._groups = rows.partition_by(["rank", "component"], as_dict=True)

    def rows(self, rank: int, component: str) -> pl.DataFrame:
        return self._groups.get((rank, component), pl.DataFrame())

    def series(self, rank: int, component: str, column: str) -> Series:
        """`column` over the component's steps; NaN where null or where the column is absent."""
        rows = self.rows(rank, component)
        if rows.is_empty():
            return Series(np.array([], dtype=np.int64), np.array([], dtype=np.float64))
        values = (rows[column].cast(pl.Float64).fill_null(np.nan).to_numpy() if column in rows.columns
                  else np.full(len(rows), np.nan))
        return Series(rows["step"].to_numpy(), values)


def is_nonfinite_alarm(metric: str, value: float | None) -> bool:
    """True when the alarm came from a non-finite rule: threshold rules fire on finite values only."""
    return metric in COUNT_METRICS or value is None or not np.isfinite(value)


def metric_onset(history: History, alarm: dict, onset_z: float) -> int:
    """First step of the run of departing values that ends at the alarm step."""
    rank, comp, metric = alarm["rank"], alarm["component"], alarm["metric"]
    s = history.series(rank, comp, metric)
    upto = s.steps <= alarm["step"]
    steps, values = s.steps[upto], s.values[upto]
    if is_nonfinite_alarm(metric, alarm["value"]):
        departing = ~np.isfinite(values) | ((np.nan_to_num(values) > 0) & (metric in COUNT_METRICS))
    else:
        scale = float(history.series(rank, comp, f"{metric}__scale").values[upto][-1])  # at the alarm
        direction = np.sign(alarm["value"] - alarm["median"]) or 1.0
        z = direction * z_numpy(metric, values, alarm["median"], scale)
        # ...and against its own baseline at the time, as a live monitor saw it: one noisy step
        # just before an abrupt fault must not pass for its start.
        # no baseline yet (null z) counts as departing, in either direction
        own = np.nan_to_num(direction * history.series(rank, comp, f"{metric}__z").values[upto], nan=np.inf)
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


def onsets_held(located: list[Located], scored: pl.DataFrame, whole: int) -> bool:
    """Whether `locate` on `scored` rows read from a later step than the run's first gave what
    the whole run gives: each onset's walk back (`metric_onset`) stopped at a row whose own
    baseline read a trailing window (`whole` rows: window and lag) read whole, and a drift run
    reaching it (`drift_run_start`) starts after the first row read. The metric's onset lies at
    most `DRIFT_REACH` steps after the onset reported (drift moves it back to where its run
    began, or forward within that reach), so the alarm's series must hold `whole` rows before
    the first step `DRIFT_REACH` before it."""
    exact_from = scored.group_by("rank", "component").agg(
        pl.col("step").sort().slice(whole, 1).first().alias("from"))  # null: fewer rows
    held = {(r, c): f for r, c, f in exact_from.iter_rows()}
    return all((f := held.get((a.rank, a.observed_on))) is not None and a.onset_step - DRIFT_REACH >= f
               for a in located)


@dataclass(frozen=True)
class _Component:
    role: str | None
    parent_param: str | None
    forward_index: int | None


def _attribute(alarm: dict, comps: dict[str, _Component], history: History, onset: int) -> tuple[str, int, bool]:
    """(attributed component, onset, drift evidence) for one alarm."""
    rank, comp = alarm["rank"], alarm["component"]
    own = drift_run_start(history.series(rank, comp, "weight_drift_l2"), onset)
    if own is not None:  # the write outside the optimizer is when it began
        return comp, own, True
    info = comps.get(comp)
    if info is not None and info.role == "activation" and info.parent_param:
        start = drift_run_start(history.series(rank, info.parent_param, "weight_drift_l2"), onset)
        if start is not None:
            return info.parent_param, start, True
    return comp, onset, False


def locate(alarms: pl.DataFrame, scored: pl.DataFrame, components: pl.DataFrame,
           config: Config) -> list[Located]:
    """The classifier's alarms with their onset, attribution, signal and evidence, in alarm order."""
    comps = {r["component"]: _Component(r.get("role"), r.get("parent_param"), r.get("forward_index"))
             for r in components.iter_rows(named=True)}
    rows = list(alarms.iter_rows(named=True))
    parents = [comps[a["component"]].parent_param for a in rows if a["component"] in comps]
    history = History(scored, [a["component"] for a in rows] + [p for p in parents if p])
    located = []
    for alarm in rows:
        onset = metric_onset(history, alarm, config.baseline.onset_z)
        attributed, onset, drift = _attribute(alarm, comps, history, onset)
        info = comps.get(attributed)
        located.append(Located(
            rank=alarm["rank"], observed_on=alarm["component"], condition=alarm["condition"], step=alarm["step"],
            last_step=alarm["last_step"], metric=alarm["metric"], value=alarm["value"], median=alarm["median"],
            magnitude=alarm["magnitude"], onset_step=onset, attributed_to=attributed,
            nonfinite=is_nonfinite_alarm(alarm["metric"], alarm["value"]), drift=drift,
            signal=signal_of(alarm["metric"]), forward_index=info.forward_index if info else None))
    return located


LOCATED_SCHEMA = {f.name: t for f, t in zip(dataclasses.fields(Located), (
    pl.Int64, pl.String, pl.String, pl.Int64, pl.Int64, pl.String, pl.Float64, pl.Float64, pl.Float64,
    pl.Int64, pl.String, pl.Boolean, pl.Boolean, pl.String, pl.Int64), strict=True)}


def located_frame(located: list[Located]) -> pl.DataFrame:
    """The located alarms as a Polars frame, one column per `Located` field."""
    return pl.DataFrame([dataclasses.asdict(a) for a in located], schema=LOCATED_SCHEMA)


def _upstream(b: Located, a: Located) -> bool:
    """True when b's component runs before a's in the forward pass (never-called ones run last)."""
    if b.forward_index is None:
        return False
    return a.forward_index is None or b.forward_index < a.forward_index


def _forward_order(a: Located) -> tuple[bool, int]:
    return a.forward_index is None, a.forward_index or 0


def _explained(a: Located, others: list[Located]) -> bool:
    """True when another component's earlier-or-equal alarm accounts for this one."""
    for b in others:
        if b.rank != a.rank or b.attributed_to == a.attributed_to or b.onset_step > a.onset_step:
            continue
        upstream = _upstream(b, a)
        if upstream and b.signal == FORWARD:
            return True  # its inputs had departed
        # Gradients come from downstream, and without drift so do the optimizer's weight changes.
        driven = a.signal == GRADIENT or (a.signal == WEIGHTS and not a.drift)
        if driven and not upstream:
            return True
    return False


def optimizer_wide(rows: list[Located], first: int, param_components: int) -> set[str]:
    """Components whose updates departed at `first` ahead of their gradients and inputs, if they
    are enough (and nothing drifted) to say the optimizer, not one component, changed; else empty."""
    near = [a for a in rows if first <= a.onset_step <= first + ROOT_WINDOW]
    if any(a.drift or a.nonfinite for a in near):
        return set()  # a write outside the optimizer, or a non-finite value, has a place
    led = {a.attributed_to: a.onset_step for a in near if a.metric in UPDATE_METRICS}
    for a in rows:  # a gradient or input that moved no later than the update drove it
        if a.signal != WEIGHTS and a.onset_step <= led.get(a.attributed_to, -1):
            led.pop(a.attributed_to)
    enough = len(led) >= max(3, OPTIMIZER_WIDE_SHARE * param_components)
    return set(led) if param_components and enough else set()


def root_cause(located: list[Located], config: Config,
               param_components: int = 0) -> tuple[RootCause | None, list[str]]:
    """The root (or None) and the other components that alarmed, earliest first.

    `param_components`: how many components own parameters (0: never call a fault optimizer-wide).
    """
    if not located:
        return None, []
    precedence = {c.name: c.precedence for c in config.conditions}
    candidates = [a for a in located if not _explained(a, located)] or located
    first = min(a.onset_step for a in candidates)
    tied = [a for a in candidates if a.onset_step == first]
    # A non-finite value outranks everything (the value itself is broken), then drift.
    lead = min(tied, key=lambda a: (not a.nonfinite, not a.drift, *_forward_order(a)))
    # One fault shows as several conditions on its component (an LR spike: big updates, then
    # flipping ones): name it by the most specific one that began with it.
    same = [a for a in located if a.attributed_to == lead.attributed_to and a.rank == lead.rank
            and first <= a.onset_step <= first + ROOT_WINDOW]
    named = min(same, key=lambda a: (not a.nonfinite, precedence.get(a.condition, 99),
                                     a.onset_step, -(abs(a.magnitude or 0.0))))
    root = RootCause(dataclasses.replace(named, onset_step=first, drift=lead.drift), _evidence(lead, tied), "component")
    wide = optimizer_wide(located, first, param_components)
    if wide:
        root = RootCause(dataclasses.replace(root.alarm, attributed_to=""), scope="optimizer", evidence=(
            f"optimizer-wide: the updates of {len(wide)} of {param_components} parameter-owning "
            "components departed together while their gradients had not, and no weights drifted: "
            "the optimizer's step changed (learning rate, optimizer state), not one component"))
    affected: list[str] = []
    for a in sorted(located, key=lambda a: (a.onset_step, *_forward_order(a))):
        if a.attributed_to != root.alarm.attributed_to and a.attributed_to not in affected:
            affected.append(a.attributed_to)
    return root, affected


def _evidence(lead: Located, tied: list[Located]) -> str:
    if lead.drift:
        return "weight drift: its weights changed outside the optimizer at the onset"
    if len({a.attributed_to for a in tied}) > 1:
        return "earliest onset, tie broken by causal order (its inputs had not departed)"
    return "earliest onset among components whose inputs had not departed"
