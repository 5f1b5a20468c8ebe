"""`analyze(trace_dir)`: classify, localise, recommend a rollback and run the comparators, in one call.

`Analysis` is typed (`Root`, `Alarm`, `Detectors`, `rollback.Rollback`); `Analysis.to_dict()` is
exactly the object `warninglight analyze --json` prints (documented in docs/analysis-json.md);
`alarms` is a Polars frame; `baseline_frame(component, metric)` gives a metric with its baseline
band, for plots. How a verdict is worded for a person lives in `wording`.

Memory is bounded whatever the trace's length: the health rows are read and classified one step
window at a time (`stream.Classifier` carries the trailing baseline across windows; the static
rules scan the same windows), and localisation reads back only the alarmed components' series.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
from warninglight.forensics.comparators import detectors
from warninglight.forensics.comparators.static_rules import StaticAlarm, StaticScan
from warninglight.forensics.explaining import ranks as rank_analysis
from warninglight.forensics.explaining import rollback as rb
from warninglight.forensics.explaining import saved_rerun
from warninglight.forensics.explaining.dataroot import (
    SUSTAIN,
    data_root,
    gradient_felt,
    gradients_wide,
    loss_spike_root,
)
from warninglight.forensics.explaining.findings import (
    KINDS,
    Finding,
    faults,
    findings,
    trains_where_frozen,
)
from warninglight.forensics.explaining.localise import (
    DRIFT_REACH,
    Located,
    RootCause,
    locate,
    located_frame,
    onsets_held,
    root_cause,
)
from warninglight.forensics.explaining.reference import (
    check_components,
    frozen_in,
    reference_baseline,
)
from warninglight.forensics.explaining.repairable import Soundness, judge
from warninglight.forensics.judging.baseline import band, with_baseline
from warninglight.forensics.judging.classifier import Classifier
from warninglight.forensics.judging.conditions import Config, load_config
from warninglight.forensics.trace import checks
from warninglight.forensics.trace.schedule import component_lr, join_lr
from warninglight.forensics.trace.store import (
    CHUNK_ROWS,
    COMPONENT_KEYS,
    Trace,
    health_window,
    info,
    open_trace,
    require_health,
    window_starts,
)
from warninglight.tracer import schema

# the heatmap keeps at most this many step columns (one bin = several steps): about the pixels its
# figure has across (~850), so no column is dropped when the image is drawn
HEAT_BINS = 800
# steps before the first alarm that localisation reads first: the alarmed components' rows from
# the run's first step are in nearly every file of a long run, these steps in a few of them
LOCATE_REACH = 1024

HEALTHY, FAULT = "healthy", "fault"  # the two verdicts


@dataclass(frozen=True)
class Root:
    """The root cause: which component the fault is attributed to, since when, and why."""

    attributed_to: str  # module path; "" = no single component (scope "optimizer" or "data")
    observed_on: str  # the component whose metric alarmed
    condition: str
    onset_step: int
    alarm_step: int
    magnitude: float | None  # robust z (a count for non-finite counts; None for a NaN/Inf value)
    metric: str
    rank: int | None  # None: a multi-rank run shows it on every rank
    ranks: list[int]  # every rank on which the attributed component alarmed
    ranks_disagree: bool  # it alarmed on some ranks only
    evidence: str
    scope: str  # "component" | "optimizer" | "data" | "replicas" | "setup"
    finding: str | None = None  # scope "setup": the finding's kind (findings.KINDS)

    @property
    def name(self) -> str:
        """How the root is named to a person: its module path, or what "" (the whole model) means."""
        if self.scope == "setup" and self.finding in KINDS:
            what = KINDS[self.finding][1]
            return f"{what} ({self.attributed_to})" if self.attributed_to else what
        if self.scope == "optimizer":
            return "optimizer-wide (every component's update)"
        if self.scope == "data":
            return "the data (bad batches)"
        return self.attributed_to or "(whole model)"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Alarm:
    """One alarm: where it was observed, what it is attributed to, when it began and fired."""

    observed_on: str
    attributed_to: str
    condition: str
    step: int  # when the light lit
    onset_step: int
    magnitude: float | None
    metric: str
    rank: int | None  # None: a replica divergence with no single odd rank
    last_step: int  # last step of the episode
    value: float | None
    median: float | None  # None for non-finite rules

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# Every alarm and the root say where the metric was measured (`observed_on`) and which component
# the fault is attributed to (`attributed_to`); they differ when an activation's alarm is
# attributed to the layer feeding it. No key is called plain `component`.
ALARM_KEYS = tuple(f.name for f in fields(Alarm))


@dataclass(frozen=True)
class Detectors:
    """When the comparator rules fired on the same trace, and the light's lead over them."""

    loss_spike_step: int | None  # first firing at or after the onset (at all when healthy)
    grad_norm_spike_step: int | None
    loss_spike_first_step: int | None  # first firing anywhere
    grad_norm_spike_first_step: int | None
    loss_spike_count: int
    grad_norm_spike_count: int
    light_lead_over_loss_spike: int | None  # positive: the light lit first
    light_lead_over_grad_norm_spike: int | None
    first_alarm_step: int | None  # the earliest alarm of any condition
    loss_points: int | None = None  # steps with a logged loss (Trainer logs one every logging_steps)
    loss_steps_judged: int | None = None  # of those, how many the loss rule had enough past losses to judge

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Analysis:
    """The forensic verdict on one trace, and the frames it was reached from."""

    trace_dir: Path
    verdict: str  # HEALTHY | FAULT
    root: Root | None
    affected: list[str]
    alarms: pl.DataFrame  # one row per alarm, columns ALARM_KEYS
    rollback: rb.Rollback
    detectors: Detectors
    heat: pl.DataFrame = field(repr=False)  # component, step (bin start), score: worst |robust z| in the bin
    summary: dict[str, Any] = field(default_factory=dict)  # store.info(): what `info` prints
    components: pl.DataFrame = field(default_factory=pl.DataFrame, repr=False)  # the components table
    steps: pl.DataFrame = field(default_factory=pl.DataFrame, repr=False)  # the steps table, by step
    warmup_steps: int = 0  # recorded steps before a component is first judged (baseline min_samples + lag)
    warnings: list[str] = field(default_factory=list)  # problems of the trace the analysis went past
    ranks_panel: pl.DataFrame = field(default_factory=pl.DataFrame, repr=False)  # ranks.panel(): rank x step
    static: list[StaticAlarm] = field(default_factory=list)  # what fixed-threshold rules saw
    config: Config = field(default_factory=Config, repr=False)
    heat_width: int = 1  # steps per heat bin (1 up to HEAT_BINS steps)
    # health rows in the segments, from their footers (None: a restarted run, whose effective
    # timeline leaves some out, or an incident window): what `eval` divides false alarms by
    health_rows: int | None = None
    # the root metric against its baseline over the run (`baseline_frame`'s columns, the band held
    # at the onset's through the root's episode: `root_episode`), read beside the analysis' tail
    # when asked (`analyze(band=True)`, the report's figure); None: not asked, no root, or a
    # metric with no band (a rank finding's)
    root_band: pl.DataFrame | None = field(default=None, repr=False)
    # whether the root component alone can be repaired in the latest checkpoint (`repairable`);
    # None: healthy
    repair: Soundness | None = None
    # the verdict of a re-run saved beside the trace (`warninglight rerun`), None where there is none
    rerun: dict[str, Any] | None = None
    # facts of the training set-up the recorder saw (findings.py), faults first
    findings: list[Finding] = field(default_factory=list)

    def alarm_list(self) -> list[Alarm]:
        """The alarms as records, in step order (non-finite floats as None)."""
        return [Alarm(**{k: _plain(a[k]) for k in ALARM_KEYS}) for a in self.alarms.iter_rows(named=True)]

    def to_dict(self) -> dict[str, Any]:
        """The `--json` object (docs/analysis-json.md)."""
        return {
            "trace": str(self.trace_dir), "verdict": self.verdict,
            "root": None if self.root is None else self.root.to_dict(),
            "affected": self.affected, "alarms": [a.to_dict() for a in self.alarm_list()],
            "rollback": self.rollback.to_dict(), "detectors": self.detectors.to_dict(), "trace_info": self.summary,
            "warnings": self.warnings,
            "repair": None if self.repair is None else self.repair.to_dict(),
            "rerun": self.rerun,
            "findings": [f.to_dict() for f in self.findings],
        }

    def baseline_frame(self, component: str, metric: str, rank: int = 0,
                       width_z: float = 3.0, hold: tuple[int, int] | None = None) -> pl.DataFrame:
        """step, value, median, lower, upper (median ± width_z robust scales), held of one metric;
        `hold` = (first, last): the band as it stood at step first, held to step last
        (`baseline.band`; `root_episode` gives the root's)."""
        trace = open_trace(self.trace_dir)  # one component is read back: the analysis keeps none
        try:
            return _baseline_frame(trace, self.config, component, metric, rank, width_z, hold)
        finally:
            trace.close()


def _baseline_frame(trace: Trace, config: Config, component: str, metric: str, rank: int = 0,
                    width_z: float = 3.0, hold: tuple[int, int] | None = None) -> pl.DataFrame:
    """`Analysis.baseline_frame` from an open trace."""
    if metric not in trace.sql("SELECT * FROM health WHERE false").columns:
        raise KeyError(f"no metric {metric!r} in {trace.root}; try out_rms, grad_norm_l2, update_ratio")
    first, last = require_health(trace)
    rows = health_window(trace, first, last, columns=[metric], names=[component], rank=rank)
    if rows.is_empty():
        raise KeyError(f"no component {component!r} on rank {rank} in {trace.root}")
    return band(with_baseline(rows.lazy(), config.baseline, [metric]).collect(), metric, width_z, hold)


def band_of(root: Root | None) -> tuple[str, str, int] | None:
    """(component, metric, rank) of the root metric's band: the metric as measured on
    `observed_on` (e.g. the ReLU after the root Linear). None: no root, a rank finding's
    metric (the replicas table's) or a set-up finding, which have no baseline band."""
    if root is None or root.scope == "setup" or root.metric not in schema.HEALTH_METRICS:
        return None
    return root.observed_on, root.metric, root.rank if root.rank is not None else (root.ranks or [0])[0]


def root_episode(root: Root | None, alarms: pl.DataFrame) -> tuple[int, int] | None:
    """(onset, last step) of the root's episode: its alarm's last alarming step among `alarms`
    (columns observed_on, condition, metric, step, last_step), else its alarm step. The root's
    band is held at the onset's through it: the fault is shown against the baseline before it."""
    if root is None:
        return None
    own = alarms.filter(pl.col("observed_on") == root.observed_on, pl.col("condition") == root.condition,
                        pl.col("metric") == root.metric, pl.col("step") == root.alarm_step)
    last = own["last_step"].max() if len(own) else None
    return root.onset_step, max(root.alarm_step, int(last) if isinstance(last, int) else root.alarm_step)


def _root_band(trace: Trace, config: Config, root: Root | None, pool: ThreadPoolExecutor,
               hold: tuple[int, int] | None = None) -> Future[pl.DataFrame | None]:
    """The root metric's band (`Analysis.root_band`), held through `hold` (`root_episode`), read
    on `pool` through a connection of its own to the open trace's database (its views are the
    trace's), beside what the caller does next."""
    which = band_of(root)
    if which is None:
        done: Future[pl.DataFrame | None] = Future()
        done.set_result(None)
        return done
    beside = replace(trace, con=trace.con.cursor(), _read={})

    def read() -> pl.DataFrame:
        try:
            return _baseline_frame(beside, config, *which, hold=hold)
        finally:
            beside.con.close()
    return pool.submit(read)


def _plain(v: Any) -> Any:
    if isinstance(v, float) and not np.isfinite(v):
        return None
    return v


def typed_root(cause: RootCause | None, located: list[Located], ranks: int) -> Root | None:
    if cause is None:
        return None
    root = cause.alarm
    # an optimizer-wide root ("" = the whole model) is located where it was observed
    where = root.attributed_to or root.observed_on
    # no alarm located there: a data root read from the steps table, which holds every rank's
    on = sorted({a.rank for a in located if a.attributed_to == where}) or list(range(ranks))
    return Root(attributed_to=root.attributed_to, observed_on=root.observed_on,
                condition=root.condition, onset_step=root.onset_step, alarm_step=root.step,
                magnitude=_plain(root.magnitude), metric=root.metric, ranks=on,
                # None when every rank of a multi-rank run shows it: the model's fault, not one GPU's
                rank=root.rank if ranks == 1 or len(on) < ranks else None,
                ranks_disagree=len(on) < ranks, evidence=cause.evidence, scope=cause.scope)


def with_ranks(root: Root | None, found: list[rank_analysis.RankFinding]) -> Root | None:
    """The root once the ranks are compared (forensics/ranks.py): the earliest of the two.

    A finding on the classifier root's own component at or before its onset confirms it and
    names its rank; a finding earlier than the root's onset (or at it, elsewhere) replaces it.
    """
    if not found:
        return root
    lead = found[0]
    if root is None or lead.step < root.onset_step:
        return Root(**rank_analysis.root_fields(lead))
    same = [f for f in found if f.component == root.attributed_to and f.step <= root.onset_step]
    if same:
        f = same[0]
        return replace(root, onset_step=f.step, rank=f.rank, ranks=f.ranks, ranks_disagree=f.some_ranks,
                       scope="replicas" if f.kind == rank_analysis.REPLICAS else root.scope,
                       evidence=f"{root.evidence}; {f.evidence}")
    return Root(**rank_analysis.root_fields(lead)) if lead.step == root.onset_step else root


def with_findings(root: Root | None, found: list[Finding], ranks: int) -> Root | None:
    """The root once the set-up's findings are known: the earliest fault finding when it held at
    or before the root's onset, or from the first step it could be seen at all (a bug present
    from step one, whose symptom the classifier saw later, or, against a reference, sooner than
    the fact itself can show), else the root as it was."""
    setup = faults(found)
    if not setup or (root is not None and setup[0].step > root.onset_step and not setup[0].from_start):
        return root
    f = setup[0]
    if root is not None and root.scope == "replicas" and f.step >= root.onset_step:
        # the replicas diverged at that step: the ranks' comparison names the odd one and how; the
        # fact on that rank (e.g. it stepped on zero gradients) says what it did
        who = f"rank {', '.join(map(str, f.ranks))}" if f.ranks else "every rank"
        return replace(root, evidence=f"{root.evidence}; on {who}: {f.evidence}")
    on = f.ranks or list(range(ranks))
    where = f.component
    if root is not None and where and root.attributed_to == where:  # the classifier saw it too
        return replace(root, onset_step=f.step, alarm_step=min(f.step, root.alarm_step),
                       evidence=f"{f.evidence}; {root.evidence}", scope="setup", finding=f.kind)
    return Root(attributed_to=where, observed_on=where, condition="unclassified", onset_step=f.step,
                alarm_step=f.step, magnitude=None, metric=f.column,
                rank=on[0] if len(on) == 1 else None, ranks=on, ranks_disagree=len(on) < ranks,
                evidence=f.evidence, scope="setup", finding=f.kind)


def param_components(components: pl.DataFrame) -> int:
    """How many components own parameters (counted once across ranks)."""
    return components.filter(pl.col("param_count") > 0)["component"].n_unique()


def _step_series(trace: Trace, column: str) -> tuple[np.ndarray, np.ndarray]:
    """(steps, the column's mean over the ranks at each), read once while the trace is open (the
    comparators and the whole-model root both read the loss and the gradient norm). Steps where
    nothing was logged are left out: a missing loss is not a NaN loss."""
    def read() -> tuple[np.ndarray, np.ndarray]:
        got = trace.con.execute(f"SELECT step, avg({column}) AS v FROM steps GROUP BY step HAVING v IS NOT NULL "
                                "ORDER BY step").fetchnumpy()
        steps, values = np.asarray(got["step"], dtype=np.int64), np.asarray(got["v"], dtype=np.float64)
        steps.flags.writeable = values.flags.writeable = False  # shared by every reader
        return steps, values

    return trace.once(("step_series", column), read)


def _whole_model_root(cause: RootCause | None, located: list[Located], components: pl.DataFrame,
                      trace: Trace, cfg: Config, within: tuple[int, int]) -> tuple[RootCause | None, int | None]:
    """Re-root on the data (or on the gradients fed to the optimizer) when they, not one component,
    explain the departure — or find the data where no component alarmed, in the steps judged
    (`within`); with the bad window's last step for data."""
    far = 1 << 30  # never called in a forward pass: downstream of everything
    rows = [{**asdict(a), "forward_index": far if a.forward_index is None else a.forward_index} for a in located]
    root = None if cause is None else {**asdict(cause.alarm), "scope": cause.scope}
    owners = components.filter(pl.col("param_count") > 0).drop_nulls("forward_index")
    readers = set(owners.filter(pl.col("forward_index") == pl.col("forward_index").min())["component"].to_list())
    batch = (_step_series(trace, "loss"), _batch_grad(trace), cfg.baseline)
    found = data_root(root, rows, readers, *batch, lr=_step_series(trace, "lr"), within=within)
    if found is None and cause is None:  # never darker than the loss-spike rule
        fired = [s for s in detectors.loss_spikes(*_step_series(trace, "loss")) if within[0] <= s <= within[1]]
        found = loss_spike_root(fired, rows, readers, *batch, lr=_step_series(trace, "lr")) if fired else None
    if found is not None:
        onset, end, evidence, z = found
        alarm = cause.alarm if cause is not None and cause.alarm.onset_step <= end else _batch_alarm(
            onset, end, sorted(readers)[0] if readers else "", batch[0], z)
        return RootCause(replace(alarm, attributed_to="", onset_step=onset), evidence, "data"), end
    if cause is None:
        return None, None
    heads = set(components.filter(pl.col("role") == "head")["component"].to_list())
    if "tied_to" in components.columns:  # a tied head's gradient is its owner's (the embedding's)
        heads |= set(components.filter(pl.col("role") == "head")["tied_to"].drop_nulls().to_list())
    wide = gradients_wide(root, rows, heads, param_components(components))
    if wide is not None:
        lead, onset, evidence = wide
        alarm = next(a for a in located if (a.rank, a.observed_on, a.condition, a.step, a.metric)
                     == (lead["rank"], lead["observed_on"], lead["condition"], lead["step"], lead["metric"]))
        return RootCause(replace(alarm, attributed_to="", onset_step=onset), evidence, "optimizer"), None
    return _lr_evidence(cause), None


def felt_alarms(located: list[Located], grad: tuple[np.ndarray, np.ndarray], cfg: Config) -> list[Located]:
    """The alarms less those of a gradient norm surging on one component while the model's total
    gradient norm never left its own range (`dataroot.gradient_felt`): a finite excursion of
    `grad_norm_l2` alone is an explosion only where the whole model's gradient feels it. Every
    other alarm (a non-finite value, outputs, weights, updates, the lr) stands as it is. Judged
    from the onset to the alarm's step, as a live alarm must be."""
    return [a for a in located if a.condition != "exploding" or a.metric != "grad_norm_l2" or a.nonfinite
            or gradient_felt(grad, a.onset_step, a.step, cfg.baseline)]


def _batch_grad(trace: Trace) -> tuple[np.ndarray, np.ndarray]:
    """The total gradient norm as each step's backward left it: before any clipping where the
    trace records it (clipping caps the norm a bad batch makes), else as the optimizer got it."""
    if "grad_norm_preclip_l2" not in trace.columns("steps"):
        return _step_series(trace, "grad_norm_total_l2")
    return _step_series(trace, "coalesce(grad_norm_preclip_l2, grad_norm_total_l2)")


def _batch_alarm(onset: int, end: int, reader: str, loss: tuple[np.ndarray, np.ndarray], z: float) -> Located:
    """The alarm of a data root no component alarmed for: on the loss, observed where the batch
    is read, lit once the excursion's steps are in."""
    at = min(end, onset + SUSTAIN - 1)
    steps, values = loss
    here = values[steps == onset]
    return Located(rank=0, observed_on=reader, condition="unclassified", step=at, last_step=end, metric="loss",
                   value=float(here[0]) if len(here) else None, median=None, magnitude=z,
                   onset_step=onset, attributed_to="", nonfinite=False, drift=False, signal="forward",
                   forward_index=None)


def _lr_evidence(cause: RootCause) -> RootCause:
    """Say what the learning rate did when it, not the updates, is the evidence."""
    a = cause.alarm
    if a.metric == "lr_surge" and cause.scope == "optimizer":
        return replace(cause, evidence=(
            f"optimizer-wide: the learning rate rose {a.value:.3g}x in one step to above any the "
            "run's schedule had set, on the components it feeds: a spike, not a schedule"))
    if a.metric == "lr" and a.median is None:
        return replace(cause, evidence=("no optimizer param group holds its parameters: its "
                                        "gradients are computed every step and never applied"))
    return cause


def comparators(trace: Trace, onset: int | None) -> dict[str, Any]:
    """When the loss-spike and ZClip-style rules fire on this trace."""
    loss_series = _step_series(trace, "loss")
    loss, judged = detectors.judge_losses(*loss_series)
    grad = detectors.grad_norm_spikes(*_step_series(trace, "grad_norm_total_l2"))
    return {
        "loss_spike_step": detectors.first_at_or_after(loss, onset),
        "grad_norm_spike_step": detectors.first_at_or_after(grad, onset),
        "loss_spike_first_step": detectors.first_at_or_after(loss, None),
        "grad_norm_spike_first_step": detectors.first_at_or_after(grad, None),
        "loss_spike_count": len(loss), "grad_norm_spike_count": len(grad),
        "loss_points": len(loss_series[0]), "loss_steps_judged": judged,
    }


def _checkpoints(trace: Trace, checkpoints_glob: str | None, checkpoint_every: int | None,
                 last_step: int, before: list[int | None]) -> tuple[list[rb.Checkpoint], str, str | None]:
    """(checkpoints, where they came from, a warning to show): the options', else the trace's,
    else files found in the conventional places beside the trace (said in the warning)."""
    if checkpoints_glob and checkpoint_every:
        raise rb.CheckpointError(f"--checkpoints {checkpoints_glob!r} and --checkpoint-every {checkpoint_every} "
                                 "both say where the checkpoints are; pass one of them")
    if checkpoints_glob:
        return rb.from_glob(checkpoints_glob), "glob", None
    if checkpoint_every:
        return rb.every(checkpoint_every, last_step, before), "every", None
    recorded = rb.from_trace(trace)
    found = rb.beside(trace.root) if not recorded else None
    if found is None:
        return recorded, "trace", None
    steps = [c.step for c in found.checkpoints]
    return found.checkpoints, "found", (
        f"no checkpoint recorded in the trace: using the {len(steps)} found in {found.pattern} (steps "
        f"{steps[0]}-{steps[-1]}, read from the file names); record them with rec.checkpoint(path) "
        f"or pass --checkpoints '{found.pattern}' to say so")


class StepWindowError(ValueError):
    """A step window that holds none of the trace's steps."""



def judged_steps(trace: Trace, config: Config, steps: tuple[int, int] | None = None) -> tuple[int, int, int]:
    """(first step read, first step judged, last step) of the health timeline, or of the window
    `steps` = (A, B): judged from A, read from A minus the history a rule reads."""
    first, last = require_health(trace)
    if steps is None:
        return first, first, last
    a, b = steps
    if a > b or b < first or a > last:
        raise StepWindowError(f"--steps {a}:{b} holds none of the recorded steps {first}-{last}; "
                              f"pass a window A:B with A <= B inside {first}:{last}")
    a, b = max(a, first), min(b, last)
    return max(first, a - config.baseline.history(config.conditions)), a, b


def classify_trace(trace: Trace, config: Config, components: pl.DataFrame, heat_width: int | None = None,
                   chunk_steps: int | None = None, static: StaticScan | None = None,
                   steps: tuple[int, int] | None = None,
                   reference: pl.DataFrame | None = None) -> Classifier:
    """Feed the health timeline (or the window `steps`, with the history before it) to one
    `Classifier`, and to `static`, one step window at a time."""
    read_from, judge_from, last = judged_steps(trace, config, steps)
    history = config.baseline.history(config.conditions)
    chunk = chunk_steps or max(history, CHUNK_ROWS // max(1, len(components)))
    clf = Classifier(config, components, heat_width, since=judge_from, reference=reference)
    lr = component_lr(trace)  # the lr each component saw: update metrics are judged relative to it
    # the metrics the rules read, no more (not the incarnation, which the read itself resolves)
    metrics = [c for c in trace.columns("health") if c in schema.HEALTH_METRICS]

    # windows of `chunk` steps, or (unless asked for that many) ending where the segments do,
    # the first an eighth as long: the pipeline below waits on the first read alone, and Arrow's
    # first read of a window is slower than the reads after it
    starts = (list(range(read_from, last + 1, chunk)) if chunk_steps else
              window_starts(trace, "health", read_from, last, chunk, max(history, chunk // 2),
                            opening=max(history, chunk // 8)))
    ends = dict(zip(starts, [s - 1 for s in starts[1:]] + [last], strict=True))

    def read(start: int) -> pl.DataFrame:
        return join_lr(health_window(trace, start, ends[start], columns=metrics, categorical=True), lr)
    # the reads DuckDB still makes (a restarted run's, files that differ in columns: most are
    # Arrow's, `store._arrow_window`) on one thread: they run beside the classifier's threads,
    # which keep the cores busy (DuckDB's own threads would add CPU and save no time)
    threads = trace.one("SELECT current_setting('threads')")[0]
    trace.con.execute("SET threads = 1")
    try:
        for rows in _read_ahead(read, starts):
            clf.submit(rows)  # judged on a thread of its own while the next window is sorted
            if static is not None:
                static.feed(rows, since=judge_from)
    finally:
        trace.con.execute(f"SET threads = {int(threads)}")
    clf.drain()
    return clf


def _read_ahead(read: Callable[[int], pl.DataFrame], starts: list[int]) -> Iterator[pl.DataFrame]:
    """`read(start)` for each start, in order, the next one read on a thread of its own while the
    caller works on this one (the reads wait on DuckDB and Polars, which hold no GIL: a core the
    classifier leaves idle does them). Only that thread touches the trace's connection until the
    last window is handed over; one window is read ahead, no more."""
    if not starts:
        return
    with ThreadPoolExecutor(1, thread_name_prefix="warninglight-read") as pool:
        ahead = pool.submit(read, starts[0])
        for start in starts[1:]:
            rows = ahead.result()
            ahead = pool.submit(read, start)
            yield rows
        yield ahead.result()


def locate_alarms(trace: Trace, alarms: pl.DataFrame, components: pl.DataFrame, config: Config,
                  since: int = 0, reference: pl.DataFrame | None = None) -> list[Located]:
    """`localise.locate` on the alarms, reading back only the alarmed components (and the layers
    feeding alarmed activations): first from `LOCATE_REACH` steps before the first alarm, and
    from step `since` on (all that localisation could look at) only where an onset or a drift
    run reaches back to rows whose baseline that first read did not hold whole
    (`localise.onsets_held`)."""
    if alarms.is_empty():
        return []
    parents = components.filter(pl.col("component").is_in(alarms["component"].implode()))
    names = sorted({*alarms["component"].to_list(), *parents["parent_param"].drop_nulls().to_list()})
    metrics = sorted(set(alarms["metric"].to_list()))
    # derived metrics (the lr and its surge) come from the steps table, joined below
    recorded = [m for m in metrics if m in schema.HEALTH_METRICS]
    if "lr" in metrics:  # an unheld component is told from a frozen one by its gradients
        recorded.append("grad_norm_l2")
    keys = [c for c in COMPONENT_KEYS if c in components.columns and c not in ("rank", "component")]
    last = int(alarms["step"].max()) + DRIFT_REACH

    def scored(first: int) -> pl.DataFrame:
        rows = health_window(trace, first, last, columns=sorted({*recorded, "weight_drift_l2"}), names=names)
        rows = rows.join(components.select("rank", "component", *keys), on=["rank", "component"], how="left")
        rows = join_lr(rows.lazy(), component_lr(trace)).collect()
        return with_baseline(rows.lazy(), config.baseline, [m for m in metrics if m in rows.columns],
                             reference=reference).collect()

    first = int(alarms["step"].min()) - LOCATE_REACH
    if first > since and "lr_surge" not in metrics:  # a surge is judged against every lr before it
        near = scored(first)
        located = locate(alarms, near, components, config)
        if onsets_held(located, near, config.baseline.window + config.baseline.lag):
            return located
    return locate(alarms, scored(since), components, config)


def analyze(trace_dir: str | Path, *, config: Config | str | Path | None = None,
            checkpoints_glob: str | None = None, checkpoint_every: int | None = None,
            steps: tuple[int, int] | None = None,
            reference: str | Path | None = None, heat: bool = True, band: bool = False) -> Analysis:
    """Read the trace and answer: failing? where, since when, how badly, and how far to roll back.

    `steps` = (A, B): an incident window. Only alarms raised at steps A..B are reported, each
    judged exactly as on the whole trace, and only the segment files holding steps A minus the
    baseline's history to B are read (an episode under way at A is reported from A).
    `reference`: a known-good trace of the same model; each component is judged against it step
    by step instead of against its own past, so faults present from the first step show.
    `heat`: keep the report's heatmap (`Analysis.heat`; empty without it, and the metrics no
    rule reads get no baseline: a caller that draws no map saves their kernel passes).
    `band`: read the root metric's band too (`Analysis.root_band`, the report's figure of it),
    beside the comparators and the rollback, from the trace as it is open.
    """
    cfg = config if isinstance(config, Config) else load_config(config)
    ref = reference_baseline(reference, cfg.baseline) if reference is not None else None
    trace = open_trace(trace_dir)
    side = ThreadPoolExecutor(1, thread_name_prefix="warninglight-band")
    try:
        summary = info(trace)
        components = trace.frame("components").collect()
        read_from, first, last_health = judged_steps(trace, cfg, steps)
        table = trace.frame("steps").collect().sort("step")
        if steps is not None:
            table = table.filter(pl.col("step").is_between(first, last_health))
        width = max(1, -(-(last_health - first + 1) // HEAT_BINS))  # ceil
        static = StaticScan(components)
        if ref is not None:
            check_components(components, ref, reference)  # type: ignore[arg-type]
        clf = classify_trace(trace, cfg, components, heat_width=width if heat else None, static=static,
                             steps=steps, reference=ref)
        located = locate_alarms(trace, clf.alarms(), components, cfg, since=read_from, reference=ref)
        if ref is None:
            located = felt_alarms(located, _batch_grad(trace), cfg)
        root, affected = root_cause(located, cfg, param_components(components))
        root, skip_until = _whole_model_root(root, located, components, trace, cfg, (first, last_health))
        ranked = rank_analysis.findings(trace)  # empty for a single rank
        panel = rank_analysis.panel(trace)
        found_setup = findings(trace, table, components)
        if ref is not None:
            found_setup = sorted([*found_setup, *trains_where_frozen(trace, frozen_in(ref), components)],
                                 key=lambda f: (f.severity != "fault", f.step, f.kind))
        top = with_findings(with_ranks(typed_root(root, located, summary["ranks"]), ranked), found_setup,
                            summary["ranks"])
        root_band = _root_band(trace, cfg, top, side, root_episode(top, located_frame(located))) if band else None
        onset = top.onset_step if top else None
        found = comparators(trace, onset)
        last = int(summary["last_step"] or 0)
        ckpts, source, found_warning = _checkpoints(trace, checkpoints_glob, checkpoint_every, last,
                                                    [onset, found["loss_spike_step"]])
        rollback = rb.recommend(trace, ckpts, source, onset, top.alarm_step if top else None,
                                found["loss_spike_step"], last, skip_until,
                                skip=top is None or top.scope != "setup")
        warnings = [*trace.warnings, *([found_warning] if found_warning else [])]
        missing = checks.checkpoint_warning(rollback.checkpoint_path, rollback.checkpoint_step,
                                            trace.root)
        warnings += [missing] if missing else []
        health_rows = (None if trace.restarted or steps is not None else
                       sum(s.rows for s in trace.spans if s.table == "health"))
        band_frame = root_band.result() if root_band is not None else None
    finally:
        side.shutdown()  # the band's read done (or failed) before its connection's trace closes
        trace.close()
    alarms = located_frame(located).select(ALARM_KEYS)
    if ranked and top is not None:
        alarms = pl.concat([alarms, rank_analysis.alarm_frame(ranked, dict(alarms.schema))],
                           how="diagonal_relaxed").sort("step", "rank", "observed_on", nulls_last=True)
        replaced = [root.alarm.attributed_to] if root and root.alarm.attributed_to != top.attributed_to else []
        affected = [c for c in dict.fromkeys([*replaced, *affected, *(f.component for f in ranked)])
                    if c != top.attributed_to]
    if top is not None and top.scope == "setup" and root is not None:  # the symptom it explains
        affected = [c for c in dict.fromkeys([root.alarm.attributed_to, *affected]) if c and c != top.attributed_to]
    first_light = alarms.select(pl.col("step").min()).item() if top is not None else None
    if top is not None and top.scope == "setup":
        first_light = min(top.alarm_step, first_light if first_light is not None else top.alarm_step)
    leads = {key: None if first_light is None or step is None else step - first_light
             for key, step in (("light_lead_over_loss_spike", found["loss_spike_step"]),
                               ("light_lead_over_grad_norm_spike", found["grad_norm_spike_step"]))}
    return Analysis(Path(trace_dir), FAULT if top else HEALTHY, top, affected,
                    alarms, rollback, Detectors(**found, **leads, first_alarm_step=first_light),
                    clf.heat(), summary, components, table, cfg.baseline.min_samples + cfg.baseline.lag,
                    warnings, panel, static.alarms(), cfg, width, health_rows, band_frame,
                    _repair(top, alarms, components, rollback), saved_rerun.load(trace_dir), found_setup)


def _repair(root: Root | None, alarms: pl.DataFrame, components: pl.DataFrame, rollback: rb.Rollback) -> Soundness | None:
    """Whether the root alone can be repaired from the rollback's checkpoint into the latest one."""
    if root is None:
        return None
    clean = rollback.checkpoint_step or None  # step 0 is the initialisation: no file to repair from
    latest = max(rollback.checkpoints) if rollback.checkpoints else None
    return judge(root.scope, root.attributed_to, root.condition, root.onset_step, alarms, components, clean, latest)
