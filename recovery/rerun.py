"""`rerun`: re-execute an incident from its clean checkpoint and say why — hardware, data or recipe.

The user's entry function, called as `FUNC(checkpoint_path)`, returns an object (or a dict) with
`model` and `optimizer` (that checkpoint's state loaded), an optional `scheduler`, `batch(ids)`
(the batch made of those recorded sample ids) and `step(model, optimizer, batch) -> loss` (one
training step as in training); docs/rerun.md has complete examples. The recorded steps from the
rollback's clean checkpoint through the alarm plus `margin` are run again under the recorder into
a second trace beside the original (`<trace>.rerun/recorded`), never touching the original's files.

Each component's magnitudes (gradient, weight and update norms, output rms and largest value)
are judged on log values as robust z against the recorded run's steps before the onset, and the
root component's series that departed most at the onset is the evidence:

- the re-run must agree with the recorded run before the onset: the tolerance is the 95th
  percentile of the relative differences over every compared series and step there (a GPU re-run
  is not bit-identical), at least `TOLERANCE_FLOOR`; above `AGREE_MAX` the runs are `not
  comparable`, with the reason;
- the evidence does not depart again at the onset (its z stays under `Z_MIN` or half the
  recorded z) → `transient`: nothing in the data or the recipe reproduces it (rank and host named);
- it departs again → the onset window is run once more with the batches of clean steps
  (`<trace>.rerun/swapped`): it departs whatever the batches → `recipe`; it does not → `data`,
  and the Proofreader (proofreader.py) names the samples to skip (`skip_ids.json`).

torch is imported inside the functions that run the entry: the engine loads without it.
"""

from __future__ import annotations

import importlib.util
import json
import math
import shutil
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import polars as pl
from warninglight.forensics.explaining import rollback as rb
from warninglight.forensics.explaining.analysis import Analysis, analyze
from warninglight.forensics.explaining.saved_rerun import (
    RESULT_FILE,
    SKIP_FILE,
    default_out,
)
from warninglight.forensics.trace import store
from warninglight.forensics.trace.store import Trace
from warninglight.recovery import proofreader

TRANSIENT, DATA, RECIPE, NOT_COMPARABLE = "transient", "data", "recipe", "not comparable"
MARGIN = 10  # steps re-run past the alarm
BAND = 64  # recorded steps before the onset that each series' band is taken over
PEAK_AFTER = 3  # steps past the alarm a departure is looked for
Z_MIN = 6.0  # robust z a departure must reach
DEPART_FRACTION = 0.5  # ... and this share of the recorded departure's z
TOLERANCE_FLOOR, AGREE_MAX = 0.01, 0.05  # relative differences before the onset
MIN_PRE_ONSET = 3  # re-run steps before the onset the agreement is measured on
MAGNITUDES = ("grad_norm_l2", "weight_norm_l2", "update_norm_l2", "out_rms", "out_absmax")
COUNTS = ("out_nonfinite_count", "grad_nonfinite_count")
RECORDED, SWAPPED = "recorded", "swapped"
_MAD_TO_SIGMA, _SCALE_FLOOR = 1.4826, 2e-3
FIELDS_HELP = ("return an object with model, optimizer, batch(ids) and step(model, optimizer, batch) "
               "(scheduler optional); see docs/rerun.md")


class RerunError(ValueError):
    """An entry, checkpoint or trace a re-run cannot use (one line: what, the value, the fix)."""


@dataclass(frozen=True)
class Entry:
    """What the user's entry function returned, checked."""

    model: Any
    optimizer: Any
    scheduler: Any
    batch: Callable[[Sequence[int]], Any]
    step: Callable[[Any, Any, Any], Any]


@dataclass(frozen=True)
class Evidence:
    """The series the verdict rests on: its recorded departure and the re-runs'."""

    component: str
    metric: str
    recorded_z: float
    rerun_z: float
    swapped_z: float | None  # None: the swapped re-run was not needed


@dataclass(frozen=True)
class Rerun:
    """A re-run's verdict and its evidence (`to_dict()` is `rerun --json`)."""

    verdict: str  # TRANSIENT | DATA | RECIPE | NOT_COMPARABLE
    reason: str
    trace: str
    out: str
    steps: list[int]  # [first, last] re-run step
    checkpoint_step: int
    checkpoint_path: str
    onset_step: int
    alarm_step: int
    root: str  # the root component ("" = none: scope optimizer or data)
    scope: str
    evidence: Evidence | None
    tolerance: float | None
    pre_onset_divergence: float | None  # 95th percentile of relative differences before the onset
    diverged_at: int | None  # first step the evidence left the recorded run by more than the tolerance
    rank: int
    host: str | None  # None: the trace predates host names in the manifest
    swapped_steps: list[int] | None = None  # [first, last] step re-run with clean steps' batches
    proofreader: proofreader.Proofread | None = None
    skip_ids_file: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def load_entry(spec: str) -> Callable[[str], Any]:
    """`FILE.py:FUNC` → the function; a `RerunError` naming what is wrong."""
    file, sep, name = spec.rpartition(":")
    if not sep or not file.endswith(".py") or not name.isidentifier():
        raise RerunError(f"--entry {spec!r}: expected FILE.py:FUNC, e.g. --entry train.py:rerun_entry")
    path = Path(file)
    if not path.is_file():
        raise RerunError(f"--entry {spec}: no file {path}; pass the path of the Python file that defines {name}")
    module_name = f"warninglight_rerun_entry_{abs(hash(str(path.resolve())))}"
    try:
        loader = importlib.util.spec_from_file_location(module_name, path)
        assert loader is not None and loader.loader is not None
        module = importlib.util.module_from_spec(loader)
        sys.modules[module_name] = module  # dataclasses and pickling look their module up
        loader.loader.exec_module(module)
    except Exception as exc:  # noqa: BLE001 - whatever the user's file raises is the same error here
        raise RerunError(f"--entry {spec}: importing {path} raised {type(exc).__name__}: {exc} — "
                         "fix the file so `python FILE.py` imports cleanly") from None
    fn = getattr(module, name, None)
    if not callable(fn):
        raise RerunError(f"--entry {spec}: {path} defines no function {name}; "
                         f"define def {name}(checkpoint_path): ... ({FIELDS_HELP})")
    return fn  # type: ignore[no-any-return]


def open_entry(fn: Callable[[str], Any], checkpoint: str, components: Sequence[str]) -> Entry:
    """Call the entry on `checkpoint` and check what it returned against the trace's components."""
    import torch

    name = getattr(fn, "__name__", "entry")
    try:
        got = fn(checkpoint)
    except Exception as exc:  # noqa: BLE001
        raise RerunError(f"the entry {name}({checkpoint!r}) raised {type(exc).__name__}: {exc} — "
                         "it must load that checkpoint's weights and optimizer state") from None

    def field_of(key: str) -> Any:
        return got.get(key) if isinstance(got, dict) else getattr(got, key, None)

    entry = Entry(*(field_of(k) for k in ("model", "optimizer", "scheduler", "batch", "step")))
    wrong = [k for k, ok in (("model", isinstance(entry.model, torch.nn.Module)),
                             ("optimizer", hasattr(entry.optimizer, "param_groups")),
                             ("batch", callable(entry.batch)), ("step", callable(entry.step)),
                             ("scheduler", entry.scheduler is None or hasattr(entry.scheduler, "step")))
             if not ok]
    if wrong:
        raise RerunError(f"the entry {name} returned a {type(got).__name__} whose {', '.join(wrong)} "
                         f"{'is' if len(wrong) == 1 else 'are'} missing or of the wrong type: {FIELDS_HELP}")
    names = {n for n, _ in entry.model.named_modules()}
    missing = [c for c in components if c not in names]
    if missing:
        raise RerunError(f"the entry {name}'s model has no module {missing[0]!r} of the recorded run "
                         f"({len(missing)} of {len(components)} components missing): return the model "
                         "that was recorded, unwrapped as it was given to watch()")
    return entry


def rerun(trace: str | Path, entry: str | Callable[[str], Any], *, steps: tuple[int, int] | None = None,
          out: str | Path | None = None, force: bool = False, margin: int = MARGIN,
          max_samples: int = proofreader.MAX_SAMPLES, analysis: Analysis | None = None) -> Rerun:
    """Re-run the incident of `trace` through `entry` (a callable or `FILE.py:FUNC`), judge it,
    write the re-run traces and `rerun.json` under `out` (default `default_out(trace)`)."""
    fn = load_entry(entry) if isinstance(entry, str) else entry
    found = analysis if analysis is not None else analyze(trace)
    if found.root is None:
        raise RerunError(f"{trace}: the run is healthy: there is no incident to re-run")
    root = found.root
    original = store.open_trace(trace)
    try:
        first, last, ckpt = _plan(original, found, steps, margin)
        rank = root.rank if root.rank is not None else 0
        ids = _recorded_ids(original, first, last, rank)
        out_dir = _claim(Path(out) if out is not None else default_out(trace), Path(trace), force)
        try:
            return _judge(original, found, fn, ckpt, (first, last), ids, out_dir, rank, max_samples)
        except BaseException:
            shutil.rmtree(out_dir, ignore_errors=True)  # never leave half a re-run behind
            raise
    finally:
        original.close()


def _plan(trace: Trace, found: Analysis, steps: tuple[int, int] | None, margin: int) -> tuple[int, int, str]:
    """The steps to re-run and the checkpoint they start from."""
    root = found.root
    assert root is not None
    last_recorded = int(trace.one("SELECT max(step) FROM steps")[0])
    saved = {c.step: c.path for c in rb.from_trace(trace) if c.path}
    if steps is None:
        start = found.rollback.checkpoint_step
        if not start or start not in saved:
            raise RerunError(f"{trace.root}: no checkpoint file recorded before the onset (step "
                             f"{root.onset_step}); a re-run starts from one: record them with "
                             "rec.checkpoint(path), or pass --steps A:B after a recorded checkpoint")
        first, last = start + 1, min(last_recorded, root.alarm_step + margin)
    else:
        first, last = steps
        if first - 1 not in saved:
            raise RerunError(f"--steps {first}:{last}: no checkpoint recorded at step {first - 1}; "
                             f"a re-run starts after one (recorded: {', '.join(map(str, sorted(saved))) or 'none'})")
        if not first <= root.onset_step <= last:
            raise RerunError(f"--steps {first}:{last} does not hold the onset (step {root.onset_step}); "
                             f"choose a window that does, e.g. --steps {first}:{root.alarm_step + margin}")
    path = saved[first - 1]
    if not Path(path).exists():
        raise RerunError(f"the checkpoint of step {first - 1} ({path}) is missing: restore the file, or "
                         "pass --steps A:B starting after another recorded checkpoint")
    return first, last, path


def _recorded_ids(trace: Trace, first: int, last: int, rank: int) -> dict[int, list[int]]:
    """Each step's recorded sample ids (`rec.batch`), steps 1..last (the clean steps' too)."""
    rows = trace.con.execute("SELECT step, batch_ids FROM steps WHERE step <= ? AND rank = ? ORDER BY step",
                             [last, rank]).fetchall()
    ids = {int(s): [int(i) for i in b] for s, b in rows if b is not None}
    missing = [s for s in range(first, last + 1) if s not in ids]
    if missing:
        raise RerunError(f"{trace.root}: no sample ids recorded for step {missing[0]} (and "
                         f"{len(missing) - 1} more of {first}-{last}); a re-run needs them: call "
                         "rec.batch(ids) at every step")
    return ids


def _claim(out: Path, trace: Path, force: bool) -> Path:
    """Make the output folder: beside the trace, never inside it, never over another's files."""
    out, trace = out.resolve(), trace.resolve()
    if out == trace or trace in out.parents or out in trace.parents:
        raise RerunError(f"--out {out}: a re-run is written beside the trace, not in or around it; "
                         f"e.g. --out {default_out(trace)}")
    if out.exists():
        ours = out.is_dir() and all(p.name in (RESULT_FILE, SKIP_FILE, RECORDED, SWAPPED) for p in out.iterdir())
        if not force:
            raise RerunError(f"{out} already exists — pass --force to replace the re-run there, or --out DIR")
        if not ours:
            raise RerunError(f"{out} holds files that are not a re-run's; not removed — choose another --out")
        shutil.rmtree(out)
    out.mkdir(parents=True)
    return out


def _judge(original: Trace, found: Analysis, fn: Callable[[str], Any], ckpt: str, window: tuple[int, int],
           ids: dict[int, list[int]], out: Path, rank: int, max_samples: int) -> Rerun:
    """Re-run on the recorded batches, then (where it departs again) on clean ones; the verdict."""
    root = found.root
    assert root is not None
    first, last = window
    onset, alarm = root.onset_step, root.alarm_step
    comps = [str(c) for (c,) in original.con.execute(
        "SELECT DISTINCT component FROM components WHERE component <> ''").fetchall()]
    recorded_plan = [(s, ids[s]) for s in range(first, last + 1)]
    entry = open_entry(fn, ckpt, comps)
    stateless = not entry.optimizer.state  # a checkpoint without optimizer state, most likely
    _execute(entry, recorded_plan, out / RECORDED, first - 1, original, rank)
    base = dict(trace=str(original.root), out=str(out), steps=[first, last], checkpoint_step=first - 1,
                checkpoint_path=ckpt, onset_step=onset, alarm_step=alarm, root=root.attributed_to,
                scope=root.scope, rank=rank, host=_host(original, rank))
    recorded = store.health_window(original, max(1, onset - BAND), last, columns=[*MAGNITUDES, *COUNTS], rank=rank)
    again = _health(out / RECORDED, first, last)
    band = _bands(recorded, onset)
    peak_window = (onset, min(last, alarm + PEAK_AFTER))
    suspects = _root_set(found, comps)
    peaks = _peaks(recorded.filter(pl.col("component").is_in(suspects)), band, peak_window)
    if not peaks or max(peaks.values()) < Z_MIN:
        return _saved(Rerun(NOT_COMPARABLE, f"the recorded run's root ({', '.join(suspects[:3])}) does not depart in "
                     f"the magnitudes a re-run compares ({', '.join(MAGNITUDES)}) at steps {peak_window[0]}-"
                     f"{peak_window[1]}: a re-run cannot tell hardware, data and recipe apart here",
                     evidence=None, tolerance=None, pre_onset_divergence=None, diverged_at=None, **base))
    component, metric = max(peaks, key=lambda k: peaks[k])
    divergence, why = _agreement(recorded, again, (first, onset), stateless, (original, out / RECORDED))
    if why:
        return _saved(Rerun(NOT_COMPARABLE, why, evidence=None, tolerance=None, pre_onset_divergence=divergence,
                            diverged_at=None, **base))
    tolerance = max(TOLERANCE_FLOOR, 4 * (divergence or 0.0))
    diverged = _diverged_at(recorded, again, component, metric, first, tolerance)
    rerun_z = _peaks(again.filter(pl.col("component") == component), band, peak_window).get((component, metric), 0.0)
    recorded_z = peaks[(component, metric)]
    common = dict(tolerance=tolerance, pre_onset_divergence=divergence, diverged_at=diverged, **base)
    if not _departs(rerun_z, recorded_z):
        ev = Evidence(component, metric, _round(recorded_z), _round(rerun_z), None)
        host = base["host"] or "a host the trace did not record"
        return _saved(Rerun(TRANSIENT, f"re-run from step {first - 1} on the recorded batches, {component}'s "
                            f"{metric} stays within the band (z {ev.rerun_z} against {ev.recorded_z} recorded) "
                            f"through the onset at step {onset}: nothing in the data or the recipe reproduces it; "
                            f"it happened on rank {rank}, {host} — resume as is, and look at that machine",
                            evidence=ev, **common))
    swapped_plan, swapped_steps = _swap(ids, first, onset, last)
    _execute(open_entry(fn, ckpt, comps), swapped_plan, out / SWAPPED, first - 1, original, rank)
    swapped_z = _peaks(_health(out / SWAPPED, first, last).filter(pl.col("component") == component), band,
                       peak_window).get((component, metric), 0.0)
    ev = Evidence(component, metric, _round(recorded_z), _round(rerun_z), _round(swapped_z))
    if _departs(swapped_z, recorded_z):
        return _saved(Rerun(RECIPE, f"{component}'s {metric} departs again at step {onset} on the recorded "
                            f"batches (z {ev.rerun_z}) and on clean steps' batches (z {ev.swapped_z}): the recipe "
                            "(optimizer, schedule, code) does it, whatever the data", evidence=ev,
                            swapped_steps=swapped_steps, **common))
    skip = found.rollback.skip_step_range or [onset, alarm]
    window = [(s, ids[s]) for s in range(onset, last + 1)]  # the whole re-run from the onset: a bad
    # sample can sit in a step past the alarm that the skip range, ending there, leaves out
    reference = [i for s in sorted(ids) if s < onset for i in ids[s]][::-1]  # the nearest clean steps first
    proof = proofreader.proofread(lambda: open_entry(fn, ckpt, comps), recorded_plan[:onset - first], window,
                                  reference, component, max_samples=max_samples)
    (out / SKIP_FILE).write_text(json.dumps(proof.skip_ids))
    return _saved(Rerun(DATA, f"{component}'s {metric} departs again at step {onset} on the recorded batches "
                        f"(z {ev.rerun_z}) but not on clean steps' batches (z {ev.swapped_z}): the data of steps "
                        f"{skip[0]}-{skip[1]} does it; the Proofreader lists {len(proof.skip_ids)} of "
                        f"{proof.samples_judged} samples to skip", evidence=ev, swapped_steps=swapped_steps,
                        proofreader=proof, skip_ids_file=str(out / SKIP_FILE), **common))


def _execute(entry: Entry, plan: Sequence[tuple[int, list[int]]], path: Path, start_step: int,
             original: Trace, rank: int) -> None:
    """Run `plan`'s (step, ids) through the entry under the recorder, into the trace `path`."""
    from warninglight.tracer import watch

    manifest = next((m for m in original.manifests if m.get("rank") == rank), {})
    config = manifest.get("config") or {}
    options = {k: config[k] for k in ("heads", "sample_size", "sketch_size") if config.get(k) is not None}
    with watch(entry.model, entry.optimizer, str(path), start_step=start_step, **options) as rec:
        for step, ids in plan:
            loss = _one_step(entry, step, ids)
            if step == start_step + 1 and not math.isfinite(loss):
                raise RerunError(f"the re-run's first step (step {step}) gave a loss of {loss}: the entry or "
                                 f"the checkpoint is broken, not the incident — check that the entry loads "
                                 "the checkpoint's weights and that step() returns the batch's loss")
            if entry.scheduler is not None:
                entry.scheduler.step()
            rec.log(loss=loss)
            rec.batch(ids)


def _one_step(entry: Entry, step: int, ids: list[int]) -> float:
    """One recorded step through the entry: the batch of `ids`, the user's step, its loss."""
    shown = ", ".join(map(str, ids[:3])) + (", ..." if len(ids) > 3 else "")
    try:
        batch = entry.batch(ids)
    except Exception as exc:  # noqa: BLE001 - the user's code: any failure is the same one-line error
        raise RerunError(f"the entry's batch(ids) failed for step {step} (ids {shown}): "
                         f"{type(exc).__name__}: {exc} — batch(ids) must build the batch of those "
                         "recorded sample ids (the ids given to rec.batch)") from None
    try:
        loss = entry.step(entry.model, entry.optimizer, batch)
        return float(loss.item() if hasattr(loss, "item") else loss)
    except Exception as exc:  # noqa: BLE001
        raise RerunError(f"the entry's step(model, optimizer, batch) raised at step {step}: "
                         f"{type(exc).__name__}: {exc} — it must run one training step as in training "
                         "and return the loss") from None


def _health(path: Path, first: int, last: int) -> pl.DataFrame:
    trace = store.open_trace(path)
    try:
        return store.health_window(trace, first, last, columns=[*MAGNITUDES, *COUNTS])
    finally:
        trace.close()


def _long(df: pl.DataFrame) -> pl.DataFrame:
    """step, component, metric, value: the magnitudes, one row each, nulls dropped."""
    return (df.select("step", "component", *MAGNITUDES)
            .unpivot(index=["step", "component"], on=list(MAGNITUDES), variable_name="metric")
            .drop_nulls("value"))


def _bands(recorded: pl.DataFrame, onset: int) -> pl.DataFrame:
    """Each series' median and robust scale of log values over the recorded steps before the onset."""
    logs = (_long(recorded.filter(pl.col("step") < onset))
            .filter(pl.col("value").is_finite() & (pl.col("value") > 0))
            .with_columns(pl.col("value").log().alias("log")))
    med = logs.group_by("component", "metric").agg(pl.col("log").median().alias("median"))
    return (logs.join(med, on=["component", "metric"])
            .group_by("component", "metric")
            .agg(pl.col("median").first(), (pl.col("log") - pl.col("median")).abs().median().alias("mad"))
            .with_columns(pl.max_horizontal(pl.col("mad") * _MAD_TO_SIGMA, pl.lit(_SCALE_FLOOR)).alias("scale")))


Z_NONFINITE = 1e6  # the z given to a non-finite value, a zero norm or a non-zero non-finite count


def _peaks(df: pl.DataFrame, band: pl.DataFrame, window: tuple[int, int]) -> dict[tuple[str, str], float]:
    """(component, metric) → the largest |z| over the window's steps."""
    rows = df.filter(pl.col("step").is_between(*window))
    v = pl.col("value")
    z = (_long(rows).join(band, on=["component", "metric"])
         .with_columns(pl.when(v.is_finite() & (v > 0))
                       .then((v.log() - pl.col("median")).abs() / pl.col("scale"))
                       .otherwise(Z_NONFINITE).alias("z")))
    peaks = {(c, m): float(x) for c, m, x in z.group_by("component", "metric").agg(pl.col("z").max()).iter_rows()}
    for metric in COUNTS:
        for c, n in rows.group_by("component").agg(pl.col(metric).max()).iter_rows():
            if n:
                peaks[(c, metric)] = Z_NONFINITE
    return peaks


def _departs(z: float, recorded_z: float) -> bool:
    return z >= max(Z_MIN, DEPART_FRACTION * recorded_z)


def _root_set(found: Analysis, components: list[str]) -> list[str]:
    """The components the verdict looks at: the root; for bad data the one that read it; else all."""
    root = found.root
    assert root is not None
    if root.attributed_to in components:
        return [root.attributed_to]
    if root.scope == "data" and root.observed_on in components:
        return [root.observed_on]
    return components


def _paired(recorded: pl.DataFrame, again: pl.DataFrame, first: int, last: int) -> pl.DataFrame:
    """The recorded and re-run value of each series at each step first..last, and their relative difference."""
    o = _long(recorded.filter(pl.col("step").is_between(first, last)))
    r = _long(again.filter(pl.col("step").is_between(first, last))).rename({"value": "rerun"})
    rel = (pl.col("rerun") - pl.col("value")).abs() / pl.max_horizontal(
        pl.col("value").abs(), pl.col("rerun").abs(), pl.lit(1e-12))
    return o.join(r, on=["step", "component", "metric"]).with_columns(rel.fill_nan(1.0).alias("rel"))


def _agreement(recorded: pl.DataFrame, again: pl.DataFrame, steps: tuple[int, int], stateless: bool,
               traces: tuple[Trace, Path]) -> tuple[float | None, str]:
    """The 95th percentile of relative differences before the onset; a reason where it is too large."""
    first, onset = steps
    if onset - first < MIN_PRE_ONSET:
        return None, (f"only {onset - first} re-run steps before the onset (checkpoint at step {first - 1}, onset "
                      f"at {onset}): the tolerance is measured on at least {MIN_PRE_ONSET} — pass --steps A:B "
                      "starting after an earlier checkpoint")
    pairs = _paired(recorded, again, first, onset - 1)
    if pairs.is_empty():
        return None, "no component of the re-run matches the recorded run's: the entry must return the recorded model"
    q95 = float(pairs["rel"].quantile(0.95) or 0.0)
    if q95 <= AGREE_MAX:
        return q95, ""
    worst = pairs.sort("rel", descending=True).row(0, named=True)
    return q95, (f"the re-run departs from the recorded run before the onset (95th percentile of relative "
                 f"differences {q95:.3g} > {AGREE_MAX}; first at step {worst['step']}, {worst['component']}'s "
                 f"{worst['metric']}: {worst['value']:.4g} recorded, {worst['rerun']:.4g} re-run): "
                 + _why_apart(traces, first, onset, stateless))


def _why_apart(traces: tuple[Trace, Path], first: int, onset: int, stateless: bool) -> str:
    """The likeliest reason a re-run does not repeat the recorded steps, from what can be checked."""
    if stateless:
        return ("the entry's optimizer holds no state (a checkpoint without optimizer state?): load it "
                "with optimizer.load_state_dict")
    original, path = traces
    again = store.open_trace(path)
    try:
        lr = {int(s): v for s, v in again.con.execute(
            "SELECT step, lr FROM steps WHERE step BETWEEN ? AND ?", [first, onset - 1]).fetchall()}
    finally:
        again.close()
    for step, v in original.con.execute("SELECT step, lr FROM steps WHERE step BETWEEN ? AND ? ORDER BY step",
                                        [first, onset - 1]).fetchall():
        if v is not None and lr.get(int(step)) is not None and not math.isclose(v, lr[int(step)], rel_tol=1e-6):
            return (f"the learning rate differs (step {step}: {v:.4g} recorded, {lr[int(step)]:.4g} re-run): "
                    "return the scheduler with its state loaded")
    return ("a re-run must repeat the recorded steps: the same seed and RNG state (dropout, augmentation), "
            "the checkpoint's optimizer state, the same batch for each id; it is not comparable, not a verdict")


def _diverged_at(recorded: pl.DataFrame, again: pl.DataFrame, component: str, metric: str, first: int,
                 tolerance: float) -> int | None:
    pairs = _paired(recorded, again, first, int(again["step"].max() or first))
    apart = pairs.filter((pl.col("component") == component) & (pl.col("metric") == metric)
                         & (pl.col("rel") > tolerance))
    return int(apart["step"].min()) if apart.height else None  # type: ignore[arg-type]


def _swap(ids: dict[int, list[int]], first: int, onset: int, last: int) -> tuple[list[tuple[int, list[int]]], list[int]]:
    """The recorded steps up to the onset, then clean steps' batches (the nearest before the
    re-run, else any before the onset) in place of the onset window's."""
    n = last - onset + 1
    clean = [s for s in sorted(ids) if s < first][-n:]
    if len(clean) < n:
        before = [s for s in sorted(ids) if s < onset]
        clean = (before * n)[:n]
    plan = [(s, ids[s]) for s in range(first, onset)] + [(s, ids[c]) for s, c in zip(range(onset, last + 1), clean, strict=True)]
    return plan, [onset, last]


def _host(trace: Trace, rank: int) -> str | None:
    return next((m.get("host") for m in trace.manifests if m.get("rank") == rank), None)


def _round(z: float) -> float:
    return round(z, 1)


def _saved(result: Rerun) -> Rerun:
    (Path(result.out) / RESULT_FILE).write_text(json.dumps(result.to_dict(), indent=1))
    return result
