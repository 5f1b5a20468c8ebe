"""The detection benchmark: rehearse scenarios over seeds, score the engine against the answer key.

One run = one rehearsal (`tracer.rehearsal.rehearse`: a real small training run with a fault drill
and its truth.json), then `analyze` and the static rules on the trace it left. `score` turns the
three into a `RunScore` (pure arithmetic, tested on its own); `summarise` aggregates per scenario
and overall; `format_tables` prints what docs/results.md shows. Nothing here knows any scenario by
name: every scenario is scored by the same rules.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from warninglight.forensics.comparators.static_rules import StaticAlarm

if TYPE_CHECKING:
    from warninglight.forensics import Analysis

ONSET_TOLERANCE = {"abrupt": 2, "gradual": 10}  # steps; the targets
GRADUAL_LEAD_TARGET = 100  # steps the alarm must precede the loss-spike rule on gradual faults
ROOT_ACCURACY_TARGET = 0.97
ONSET_ACCURACY_TARGET = 0.97
CLEAN = "clean"
REFERENCE_SUFFIX = "+ref"  # a step-one scenario analysed with `--reference` (its twin without is blind)
REFERENCE_SEED = 1000  # the reference run of seed s trains with seed REFERENCE_SEED + s


class EvaluationError(ValueError):
    """The benchmark was asked for something it cannot run."""


@dataclass(frozen=True)
class RunScore:
    """One rehearsal scored against its answer key. Steps are optimizer steps; None = not applicable."""

    scenario: str
    seed: int
    fault: str  # "clean" for a run without a drill
    kind: str  # abrupt | gradual | clean
    truth_component: str | None
    injected: int | None  # first step the fault acted
    fault_verdict: bool  # the engine named a root component
    root_component: str | None
    root_condition: str | None
    root_correct: bool | None  # None on clean runs
    onset_error: int | None  # |onset - injected|
    onset_ok: bool | None  # within ONSET_TOLERANCE[kind]
    latency: int | None  # first light - injected: when a live monitor would have lit
    root_latency: int | None  # the root alarm's step - injected (the root can be confirmed later)
    early_alarm: bool | None  # the light lit before the fault existed: a false alarm
    loss_rule_step: int | None
    grad_rule_step: int | None
    lead_loss: int | None  # loss rule step - our alarm step; None if either never fired
    lead_grad: int | None
    alarms: int
    component_steps: int
    discarded_ours: int | None
    discarded_loss_only: int | None
    loss_only_contaminated: bool | None
    static_step: int | None  # first static-rule firing at or after the injection (any step if clean)
    static_rule: str | None
    static_correct: bool | None  # the truth component, and it alone, fired first
    seconds: float = 0.0
    truth_scope: str | None = None  # "data" / "optimizer": the root is no single component
    root_scope: str | None = None
    skip_cover: float | None = None  # share of the truth's bad-batch window the skip list covers
    reference: bool | None = None  # True: analysed against a reference run; False: its blind twin
    truth_rank: int | None = None  # data-parallel runs: the faulty rank (None: every rank or single-rank)
    root_rank: int | None = None
    rank_correct: bool | None = None  # None for single-rank runs and clean runs

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready dict."""
        return asdict(self)


def _diff(a: int | None, b: int | None) -> int | None:
    return None if a is None or b is None else int(a) - int(b)


@dataclass(frozen=True)
class Comparators:
    """Every step at which the loss-spike and gradient-norm rules fired on a run."""

    loss: tuple[int, ...] = ()
    grad: tuple[int, ...] = ()

    def first(self, rule: str, at_or_after: int | None) -> int | None:
        """First firing of `rule` ("loss" or "grad") at or after a step (at all if None)."""
        return next((s for s in getattr(self, rule) if at_or_after is None or s >= at_or_after), None)


def _static(static: Sequence[StaticAlarm], injected: int | None,
            truth_component: str | None) -> tuple[int | None, str | None, bool | None]:
    """First static firing at/after the injection: (step, rule, named the root alone)."""
    firing = next((a for a in static if a.step >= (injected or 0)), None)
    if firing is None:
        return None, None, None
    # a fixed rule names the root only if the truth component is the one component firing first
    first = {a.component for a in static if a.step == firing.step}
    return firing.step, firing.rule, (None if truth_component is None else first == {truth_component})


def _rule_steps(result: Mapping[str, Any], comparators: Comparators | None,
                injected: int | None) -> tuple[int | None, int | None]:
    """(loss rule step, grad-norm rule step) for this run."""
    if comparators is not None:
        return comparators.first("loss", injected), comparators.first("grad", injected)
    det = result.get("detectors") or {}
    return det.get("loss_spike_step"), det.get("grad_norm_spike_step")


def score(scenario: str, seed: int, truth: Mapping[str, Any], result: Mapping[str, Any],
          static: Sequence[StaticAlarm], component_steps: int, seconds: float = 0.0,
          comparators: Comparators | None = None) -> RunScore:
    """Score one run: the truth.json dict, the `analyze --json` dict and the static-rule firings.

    The comparators' steps are their first firing at or after the injection (on a clean run: at
    all, which is a false alarm). Without `comparators`, the engine's own `detectors` are used
    (first firing at or after *its* onset).
    """
    fault = str(truth.get("fault") or CLEAN)
    clean = fault in (CLEAN, "none")
    kind = CLEAN if clean else str(truth.get("kind", "abrupt"))
    injected = None if clean else int(truth["step"])
    want = None if clean else truth.get("component")  # "" = a drill on the whole model (e.g. every LR)
    scope = None if clean else truth.get("scope")
    root = result.get("root") or {}
    named = root.get("attributed_to") is not None
    rb = result.get("rollback") or {}
    loss_only = (rb.get("loss_only") or {}) if named else {}
    # the light lights at its first alarm of any kind; older engines only give the root's step
    alarm = ((result.get("detectors") or {}).get("first_alarm_step") or root.get("alarm_step")) if named else None
    onset_error = abs(_diff(root.get("onset_step"), injected)) if named and not clean and root.get("onset_step") is not None else None
    loss_step, grad_step = _rule_steps(result, comparators, injected)
    static_step, static_rule, static_correct = _static(static, injected, want)
    # a data-parallel drill also says which rank (null: every rank); the root must name it too
    ranked = "rank" in truth and not clean
    rank_ok = (named and root.get("rank") == truth["rank"]) if ranked else None
    return RunScore(
        scenario=scenario, seed=seed, fault=CLEAN if clean else fault, kind=kind,
        truth_component=want, injected=injected,
        fault_verdict=named, root_component=root.get("attributed_to"), root_condition=root.get("condition"),
        root_correct=None if want is None else (_root_right(root, named, want, scope, truth.get("finding"))
                                                 and rank_ok is not False),
        onset_error=onset_error,
        onset_ok=None if clean else (onset_error is not None and onset_error <= ONSET_TOLERANCE.get(kind, 2)),
        latency=None if clean else _diff(alarm, injected),
        root_latency=None if clean or not named else _diff(root.get("alarm_step"), injected),
        early_alarm=None if clean else (alarm is not None and alarm < injected),
        loss_rule_step=loss_step, grad_rule_step=grad_step,
        lead_loss=_diff(loss_step, alarm), lead_grad=_diff(grad_step, alarm),
        alarms=len(result.get("alarms") or []), component_steps=component_steps,
        discarded_ours=rb.get("steps_discarded") if named else None,
        discarded_loss_only=loss_only.get("steps_discarded"), loss_only_contaminated=loss_only.get("contaminated"),
        static_step=static_step, static_rule=static_rule,
        static_correct=None if clean else static_correct,
        seconds=seconds, truth_scope=scope, root_scope=root.get("scope") if named else None,
        skip_cover=_skip_cover(truth, rb) if named and not clean else None,
        truth_rank=truth.get("rank"), root_rank=root.get("rank") if named else None,
        rank_correct=rank_ok,
    )


def _root_right(root: Mapping[str, Any], named: bool, want: str, scope: str | None,
                finding: str | None = None) -> bool:
    """The drilled component; for a data or optimizer fault, a root of that scope; for a bug of
    the set-up, the finding the drill causes."""
    if not named:
        return False
    if scope in ("data", "optimizer"):
        return root.get("scope") == scope
    if scope == "setup":  # a finding of the set-up: its kind, and its component where it names one
        return root.get("scope") == scope and root.get("finding") == finding and (
            not want or root.get("attributed_to") == want)
    return root.get("attributed_to") == want and root.get("scope") not in ("data", "optimizer")


def _skip_cover(truth: Mapping[str, Any], rollback: Mapping[str, Any]) -> float | None:
    """Share of the steps the drill corrupted ([step, last_step]) inside the skip list's range."""
    if truth.get("last_step") is None:
        return None
    first, last = int(truth["step"]), int(truth["last_step"])
    skip = rollback.get("skip_step_range") or None
    if not skip:
        return 0.0
    inside = max(0, min(last, int(skip[1])) - max(first, int(skip[0])) + 1)
    return inside / (last - first + 1)


def run_one(scenario: Any, seed: int, workdir: Path, steps: int | None = None) -> list[RunScore]:
    """Rehearse one scenario (a name or a `Scenario`) with one seed into `workdir`, analyse, score.

    A scenario marked `reference` is scored twice: blind, and against a clean run of the same
    set-up trained with seed `REFERENCE_SEED + seed` (named with `REFERENCE_SUFFIX`).
    """
    from dataclasses import replace

    from warninglight.lab import distributed
    from warninglight.lab.rehearsal import SCENARIOS, rehearse

    t0 = time.perf_counter()
    if isinstance(scenario, str) and scenario in distributed.SCENARIOS:  # spawned gloo ranks
        trace = workdir / f"{scenario}-seed{seed}"
        return [judge_trace(scenario, seed, trace, distributed.rehearse(scenario, trace, seed), started=t0)]
    sc = SCENARIOS[scenario] if isinstance(scenario, str) else scenario
    trace = workdir / f"{sc.name}-seed{seed}"
    kwargs: dict[str, Any] = {"checkpoint_dir": workdir / f"{sc.name}-seed{seed}-ckpt"}
    if steps is not None:
        kwargs["steps"] = steps
    truth = rehearse(sc, trace, seed=seed, **kwargs)
    trained = time.perf_counter() - t0
    out = [judge_trace(sc.name, seed, trace, truth, started=t0)]
    if sc.reference:
        ref = workdir / f"{sc.model}-reference-seed{seed}"
        if not ref.exists():  # one reference per set-up and seed, shared by its scenarios
            twin = replace(sc, name=f"{sc.model}-reference", drills=list, reference=False)
            rehearse(twin, ref, seed=REFERENCE_SEED + seed, checkpoint_every=0, **({"steps": steps} if steps else {}))
        out[0] = replace(out[0], reference=False)
        judged = judge_trace(sc.name + REFERENCE_SUFFIX, seed, trace, truth, reference=ref)
        out.append(replace(judged, seconds=trained + judged.seconds, reference=True))
    return out


def judge_trace(scenario: str, seed: int, trace: Path, truth: Mapping[str, Any], reference: Path | None = None,
                started: float | None = None) -> RunScore:
    """One recorded trace scored against its answer key, in one pass over it: `analyze` without
    the report's heatmap, whose static rules ran beside the classifier (the same alarms as
    `static_rules.static_alarms`, which read the trace again), and the denominator and the
    comparators' firings from what it read (`run_of`). `started`: when the run began (its
    seconds count from there; else from here)."""
    from warninglight.forensics import analyze

    t0 = time.perf_counter() if started is None else started
    result = analyze(trace, reference=reference, heat=False)
    rows, comps = run_of(result)
    return score(scenario, seed, truth, result.to_dict(), result.static, rows, time.perf_counter() - t0, comps)


def read_truth(trace: Path) -> dict[str, Any]:
    """The answer key (truth.json) a rehearsal or drill left in `trace`; an `EvaluationError`
    naming the fix where there is none."""
    import json

    path = Path(trace) / "truth.json"
    if not Path(trace).is_dir():
        raise EvaluationError(f"--trace {trace}: not a directory — pass a trace directory that holds a truth.json")
    if not path.is_file():
        raise EvaluationError(f"--trace {trace}: no truth.json there — eval scores a trace against its answer key "
                              "(a rehearsal's); analyse a trace without one with `warninglight analyze`")
    try:
        truth = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise EvaluationError(f"--trace {trace}: truth.json is not readable JSON ({e}) — rewrite it or drop the trace") from None
    if not isinstance(truth, dict) or (truth.get("fault") not in (None, CLEAN, "none") and "step" not in truth):
        raise EvaluationError(f"--trace {trace}: truth.json names a fault without its step — add \"step\" "
                              "(the first step the fault acted) or drop the trace")
    return truth


def judge_recorded(traces: Sequence[Path], progress: Callable[[RunScore], None] | None = None) -> list[RunScore]:
    """`judge_trace` of traces already recorded, each with its truth.json (read first, all of them:
    a bad one fails before any is analysed); scenario and seed are the answer key's."""
    truths = [read_truth(t) for t in traces]
    out = []
    for trace, truth in zip(traces, truths, strict=True):
        run = judge_trace(str(truth.get("scenario") or Path(trace).name), int(truth.get("seed") or 0), Path(trace), truth)
        out.append(run)
        if progress:
            progress(run)
    return out


def run_of(result: Analysis) -> tuple[int, Comparators]:
    """Health rows (the false-alarm denominator) and every firing of the two comparator rules on
    the trace an analysis of the whole run was reached from: its rows from the segments' footers
    and the loss and gradient norm of the steps table it read, every row in step order. A
    restarted run's rows are counted on its effective timeline (the trace is opened again for
    that, and only for that: opening a large trace reads every segment's footer)."""
    import numpy as np
    import polars as pl
    from warninglight.forensics import open_trace
    from warninglight.forensics.comparators import detectors

    rows = result.health_rows
    if rows is None:
        opened = open_trace(result.trace_dir)
        try:
            rows = int(opened.one("SELECT count(*) FROM health")[0])
        finally:
            opened.close()
    table = result.steps.sort("step", "rank", maintain_order=True)  # every view has both

    def values(name: str) -> np.ndarray:  # NaN where not logged (a trace may lack the column)
        if name not in table.columns:
            return np.full(table.height, np.nan)
        return table[name].cast(pl.Float64).fill_null(np.nan).to_numpy()

    step = table["step"].cast(pl.Int64).to_numpy()
    loss, grad = values("loss"), values("grad_norm_total_l2")
    return rows, Comparators(tuple(detectors.loss_spikes(step, loss)), tuple(detectors.grad_norm_spikes(step, grad)))


def clean_twins(names: Sequence[str]) -> list[Any]:
    """A drill-free copy of each training set-up among `names` that no clean scenario already covers.

    Without them the false-alarm figure would only speak for the set-ups someone wrote a clean
    scenario for (e.g. Adam, while the learning-rate-spike runs train with SGD + momentum).
    """
    from dataclasses import replace

    from warninglight.lab.rehearsal import SCENARIOS

    def setup(sc: Any) -> tuple[Any, ...]:
        return (sc.model, sc.steps, sc.optimizer, sc.lr, sc.momentum, sc.activation, sc.batch_size,
                sc.schedule, sc.weight_decay, sc.head_group)

    covered = {setup(sc) for sc in SCENARIOS.values() if not sc.drills()}
    twins: dict[tuple[Any, ...], Any] = {}
    for name in names:
        if name not in SCENARIOS:  # a data-parallel scenario: its clean run is its own scenario
            continue
        sc = SCENARIOS[name]
        if setup(sc) not in covered and setup(sc) not in twins:
            twins[setup(sc)] = replace(sc, name=f"{name}~clean", drills=list, reference=False)
    return list(twins.values())


def run_benchmark(scenarios: Iterable[Any], seeds: int, workdir: Path | None = None,
                  steps: int | None = None,
                  progress: Callable[[RunScore], None] | None = None) -> list[RunScore]:
    """Every scenario × seeds 0..seeds-1, in order; traces go to `workdir` (a temporary one if None)."""
    if seeds < 1:
        raise EvaluationError(f"--seeds must be at least 1, got {seeds}")
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)  # fastest for these small models, and the same reduction order everywhere
    try:
        return _run_all(list(scenarios), seeds, workdir, steps, progress)
    finally:
        torch.set_num_threads(previous)


def _run_all(scenarios: list[Any], seeds: int, workdir: Path | None, steps: int | None,
             progress: Callable[[RunScore], None] | None) -> list[RunScore]:
    with tempfile.TemporaryDirectory(prefix="wl-eval-") as tmp:
        root = Path(workdir) if workdir is not None else Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        out = []
        for scenario in scenarios:
            for seed in range(seeds):
                for run in run_one(scenario, seed, root, steps):
                    out.append(run)
                    if progress:
                        progress(run)
        return out


def _median(values: Iterable[int | None]) -> float | None:
    v = [x for x in values if x is not None]
    return statistics.median(v) if v else None


def _count(values: Iterable[bool | None]) -> tuple[int, int]:
    v = [x for x in values if x is not None]
    return sum(v), len(v)


def _lead(runs: Sequence[RunScore], rule_step: str, lead: str) -> str:
    """Median lead over a rule where both fired, and how often the rule never fired."""
    fired = [getattr(r, lead) for r in runs if getattr(r, lead) is not None]
    never = sum(1 for r in runs if getattr(r, rule_step) is None)
    if not fired:
        return "never fired" if never == len(runs) else "—"
    text = f"{_num(statistics.median(fired))}"
    return text + (f" (never fired {never}/{len(runs)})" if never else "")


def _num(x: float | None) -> str:
    if x is None:
        return "—"
    return f"{x:+.0f}"


def _ratio(pair: tuple[int, int]) -> str:
    k, n = pair
    return f"{k}/{n}" if n else "—"


def summarise_faults(runs: Sequence[RunScore]) -> dict[str, Any]:
    """Detection row of the fault table for a group of fault runs (one scenario, or all)."""
    onset = [r.onset_error for r in runs if r.onset_error is not None]
    return {
        "runs": len(runs),
        "root right": _ratio(_count(r.root_correct for r in runs)),
        "rank right": _ratio(_count(r.rank_correct for r in runs)),
        "onset err med/max": f"{_plain(_median(onset))}/{max(onset)}" if onset else "—",
        "onset in tol": _ratio(_count(r.onset_ok for r in runs)),
        "latency med": _plain(_median(r.latency for r in runs)),
        "root alarm latency med": _plain(_median(r.root_latency for r in runs)),
        "alarm before fault": _ratio(_count(r.early_alarm for r in runs)),
        "lead vs loss rule": _lead(runs, "loss_rule_step", "lead_loss"),
        "lead vs grad rule": _lead(runs, "grad_rule_step", "lead_grad"),
    }


def summarise_recovery(runs: Sequence[RunScore]) -> dict[str, Any]:
    """Rollback and fixed-rule row of the fault table."""
    rb_ours, rb_loss_only = _median(r.discarded_ours for r in runs), _median(r.discarded_loss_only for r in runs)
    hits = [r for r in runs if r.static_step is not None]
    rules = ", ".join(sorted({r.static_rule for r in hits if r.static_rule}))
    return {
        "runs": len(runs),
        "discarded ours/loss-only (med)": f"{_plain(rb_ours)}/{_plain(rb_loss_only)}",
        "loss-only rolled back": f"{sum(r.discarded_loss_only is not None for r in runs)}/{len(runs)}",
        "loss-only ckpt damaged": _ratio(_count(r.loss_only_contaminated for r in runs)),
        "static rules fired": f"{len(hits)}/{len(runs)}" + (f" ({rules})" if rules else ""),
        "static named root alone": _ratio(_count(r.static_correct for r in hits)),
        "static latency med": _plain(_median(_diff(r.static_step, r.injected) for r in hits)),
    }


def _plain(x: float | None) -> str:
    return "—" if x is None else (str(int(x)) if float(x).is_integer() else f"{x:.1f}")


def summarise_clean(runs: Sequence[RunScore]) -> dict[str, Any]:
    """One row of the clean-run table: fault verdicts, alarm rate, static firings."""
    steps = sum(r.component_steps for r in runs)
    alarms = sum(r.alarms for r in runs)
    return {
        "runs": len(runs),
        "fault verdicts": f"{sum(r.fault_verdict for r in runs)}/{len(runs)}",
        "alarms": alarms,
        "component-steps": steps,
        "alarms per 10k comp-steps": f"{1e4 * alarms / steps:.2f}" if steps else "—",
        "static rules fired": f"{sum(r.static_step is not None for r in runs)}/{len(runs)}",
        "loss rule fired": f"{sum(r.loss_rule_step is not None for r in runs)}/{len(runs)}",
        "grad rule fired": f"{sum(r.grad_rule_step is not None for r in runs)}/{len(runs)}",
    }
