"""Roots that are no single component: bad batches (the data), and the gradients the optimizer is fed.

A corrupted batch (a bad shard, a broken tokenizer, shuffled labels, garbage samples mixed into
sound batches) shows first in what the step measures of the batch as a whole: its loss, and the
total gradient norm (in log units; before any clipping where recorded, since clipping hides a
jump). Both are judged against their own trailing baseline (the components' baseline settings);
the loss's robust scale is never below `LOSS_FLOOR` of the loss as training began: a loss near
zero moving by a thousandth is no jump. The root is the data when:

- the batch signals leave their baseline: a jump (robust z at least `JUMP_Z`) within
  `ROOT_WINDOW` steps of the earliest onset, with several components departing together (at
  least `MIN_COMPONENTS`, in at least two blocks); or a sustained excursion of the loss, which
  needs no component to alarm at all (garbage of the data's own range moves no single
  component far, and a few garbage samples in each batch move none): from a step at least
  `onset_z` above its baseline, the median z over the next `SUSTAIN` steps is at least
  `HELD_Z` — a run of bad batches, not one odd batch — and `RECORD` times any such median the
  run held before (a loss that wanders sets its own bar);
- nothing inside the model explains it: no weight drift (nothing wrote the weights), no
  non-finite value, no learning rate that rose (an alarm on it, or the recorded rate itself), no
  component fault that began earlier, and no output departing, by the step the batch signals
  left their baseline, that begins mid-model — an output departing first at the component that
  reads the batch is the batch itself. Outputs that depart after that step, and a head's
  predictions, are what the model makes of the bad batches, not their cause.

`loss_spike_root` keeps the light never darker than the loss-spike rule: where that rule fires,
the loss jumped against its own baseline and nothing else explains it, the root is the data.

When instead the gradients of most components — the head's among them (a tied head's is its owner's) — grow far past their
baseline, alarming before anything else and with no weight drift or non-finite value, what the optimizer steps on changed for the whole model: gradients not zeroed between
steps, a wrong loss scale (`gradients_wide`). Against a reference run this finds a forgotten
`optimizer.zero_grad()` present from the first step.

The bad window runs from its first bad step to its last: a step is bad while its signal stays
nearer the level of the window's first `SUSTAIN` steps than the baseline before it, and
`CALM_STEPS` steps in a row nearer the baseline end it (a model that half adapts to garbage
keeps its loss far above the clean level; the clean batches after the window drop it back at
once). The rollback skips all of it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import polars as pl
from warninglight.forensics.explaining.localise import ROOT_WINDOW
from warninglight.forensics.judging.conditions import BaselineConfig
from warninglight.tracer.schema import FORWARD, metrics_of

JUMP_Z = 6.0  # the |z| the registry's exploding rules ask of a norm far above its baseline
HELD_Z = 2.0  # median z over SUSTAIN steps that makes an excursion a run of bad batches (a
# healthy run is back at its baseline right after an odd step: a hard batch, a plateau's bump)
RECORD = 1.5  # an excursion stands this many times above the run's own largest before it
SUSTAIN = 8  # steps: a run of bad batches is told from one odd batch by its length
MIN_COMPONENTS = 3  # departing together: more than a component and its neighbour
CALM_STEPS = 3  # steps back at baseline that end a bad window: a few ordinary batches inside a
# bad shard (or a model half-adapted to the garbage) do not end it
LOSS_FLOOR = 0.02  # the loss's robust scale is at least this share of its level as training began
LR_RISE = 2.0  # a learning rate this many times its value a few steps before: the optimizer moved
MIN_POINTS = 8  # however sparse the logging (a loss every N steps), never a baseline of fewer


def _gap(steps: np.ndarray) -> int:
    """The usual number of steps between two points of a series (a loss logged every N steps: N)."""
    return max(1, int(np.median(np.diff(steps)))) if len(steps) > 1 else 1


OUTPUTS = frozenset(metrics_of(FORWARD))  # a component's own output (not a head's predictions)
Series = tuple[np.ndarray, np.ndarray]  # (steps, values)


def block_of(component: str) -> str:
    """The model block a component belongs to: its path up to the first numeric part (`h.1`)."""
    parts = component.split(".")
    for i, p in enumerate(parts):
        if p.isdigit():
            return ".".join(parts[: i + 1])
    return parts[0]


@dataclass(frozen=True)
class Signal:
    """One measure of the batch as a whole: its series and the floor of its robust scale."""

    name: str  # how the evidence names it
    series: Series
    floor: float = 0.0
    _bands: dict[BaselineConfig, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict, repr=False,
                                                                         compare=False)

    def needed(self, cfg: BaselineConfig) -> int:
        """Past points a baseline needs: the baseline's, or fewer for a series logged every few steps."""
        gap = _gap(self.series[0])
        return cfg.min_samples if gap == 1 else max(MIN_POINTS, cfg.min_samples // gap)

    def bands(self, cfg: BaselineConfig) -> tuple[np.ndarray, np.ndarray]:
        """(median, robust scale) of the baseline judging each point (NaN: too few past values),
        for every point at once."""
        if cfg not in self._bands:
            self._bands[cfg] = self._compute(cfg)
        return self._bands[cfg]

    def _compute(self, cfg: BaselineConfig) -> tuple[np.ndarray, np.ndarray]:
        steps, values = self.series
        n = len(steps)
        med, scale = np.full(n, np.nan), np.full(n, np.nan)
        if n == 0:
            return med, scale
        if _gap(steps) == 1:  # a value every step (a dropped one aside): windows of points, one pass
            past = pl.Series(np.where(np.isfinite(values), values, np.nan)).fill_nan(None)
            roll = {"window_size": cfg.window, "min_samples": self.needed(cfg)}
            m = past.rolling_median(**roll).to_numpy()
            iqr = (past.rolling_quantile(0.75, "linear", **roll) - past.rolling_quantile(0.25, "linear", **roll)).to_numpy()
            shift = cfg.lag  # the window ends `lag` steps before the step judged
            med[shift:], iqr_at = m[: n - shift], np.full(n, np.nan)
            iqr_at[shift:] = iqr[: n - shift]
            scale = np.maximum.reduce([iqr_at / 1.349, 0.02 * np.abs(med), np.full(n, max(self.floor, 1e-8))])
            return med, np.where(np.isfinite(med), scale, np.nan)
        lo = np.searchsorted(steps, steps - cfg.lag + 1 - cfg.window)
        hi = np.searchsorted(steps, steps - cfg.lag + 1)
        for i in range(n):  # logged every few steps: a few points each
            past = values[lo[i]:hi[i]]
            past = past[np.isfinite(past)]
            if len(past) >= self.needed(cfg):
                med[i] = float(np.median(past))
                q75, q25 = np.percentile(past, [75, 25])
                scale[i] = max(float(q75 - q25) / 1.349, 0.02 * abs(med[i]), self.floor, 1e-8)
        return med, scale

    def baseline(self, at: int, cfg: BaselineConfig) -> tuple[float, float] | None:
        """(median, robust scale) of the baseline judging step `at`, or None."""
        i = int(np.searchsorted(self.series[0], at))
        if i >= len(self.series[0]) or self.series[0][i] != at:
            return None
        med, scale = self.bands(cfg)
        return None if not np.isfinite(med[i]) else (float(med[i]), float(scale[i]))

    def zs(self, cfg: BaselineConfig) -> np.ndarray:
        """Every point's z against its baseline (NaN where there is none or the value is not finite)."""
        med, scale = self.bands(cfg)
        with np.errstate(invalid="ignore"):
            return (self.series[1] - med) / scale

    def z(self, at: int, base: tuple[float, float]) -> float | None:
        value = self.series[1][self.series[0] == at]
        if len(value) == 0 or not np.isfinite(value[0]):
            return None
        return (float(value[0]) - base[0]) / base[1]


def signals(loss: Series, grad: Series, cfg: BaselineConfig) -> list[Signal]:
    """The loss, and the log of the total gradient norm, as batch signals."""
    finite = loss[1][np.isfinite(loss[1])][:MIN_POINTS]
    early = float(np.median(np.abs(finite))) if len(finite) else 0.0  # as training began
    return [Signal("the loss", loss, LOSS_FLOOR * early),
            Signal("the total gradient norm", (grad[0], np.log(np.maximum(grad[1], 1e-12))))]


def jump(found: list[Signal], first: int, cfg: BaselineConfig) -> tuple[int, float, list[int]] | None:
    """(step, z, signals that jumped) at the first step in [first, first + ROOT_WINDOW] where a
    signal is `JUMP_Z` above its baseline, or None."""
    for step in range(first, first + ROOT_WINDOW + 1):
        zs: dict[int, float] = {}
        for i, sig in enumerate(found):
            base = sig.baseline(step, cfg)
            z = None if base is None else sig.z(step, base)
            if z is not None and z >= JUMP_Z:
                zs[i] = z
        if zs:
            return step, max(zs.values()), sorted(zs)
    return None


def held(sig: Signal, at: int, cfg: BaselineConfig, from_onset: bool = True) -> float | None:
    """The median z over the `SUSTAIN` steps from `at` (at least three points) against the
    baseline at `at`; None where there is none, or (`from_onset`) where `at` itself is not
    `onset_z` above it."""
    base = sig.baseline(at, cfg)
    first = None if base is None else sig.z(at, base)
    if base is None or (from_onset and (first is None or first < cfg.onset_z)):
        return None
    steps, values = sig.series
    span = (steps >= at) & (steps < at + SUSTAIN)
    if span.sum() < 3:  # a loss logged every few steps: its next three points
        span = np.flatnonzero(steps >= at)[:3]
    ahead = values[span]
    ahead = ahead[np.isfinite(ahead)]
    return float(np.median((ahead - base[0]) / base[1])) if len(ahead) >= 3 else None


def gradient_felt(grad: Series, first: int, last: int, cfg: BaselineConfig) -> bool:
    """Whether the model's total gradient norm (`grad`) rose `onset_z` above its own baseline at
    some step from `first` to `last`; True too where it cannot tell (no total gradient norm, or
    no baseline for it there). One component's gradient norm surging while the whole model's
    stays in its usual range is a shift of the gradient between components (attention sharpening
    once warmup ends moves it onto its projections), which neither the loss nor the updates of
    an adaptive optimizer feel: no explosion of the gradient."""
    sig = Signal("the total gradient norm", (grad[0], np.log(np.maximum(grad[1], 1e-12))))
    steps = sig.series[0]
    span = (steps >= first) & (steps <= last)
    if not span.any():
        return True
    med, scale = sig.bands(cfg)
    if not np.isfinite(med[span]).any():
        return True
    with np.errstate(invalid="ignore"):
        z = (sig.series[1][span] - med[span]) / scale[span]
    return bool(np.any(~np.isfinite(sig.series[1][span])) or np.nanmax(np.where(np.isfinite(z), z, -np.inf)) >= cfg.onset_z)


def excursion(found: list[Signal], cfg: BaselineConfig,
              within: tuple[int, int] | None = None) -> tuple[int, float, list[int]] | None:
    """(step, median z, [0]) of the run's first sustained excursion of the loss (the first
    signal): `HELD_Z` held, and `RECORD` times the largest median z any step `onset_z` above the
    baseline held before it (a loss that wanders has had such excursions all along: its own
    record is its bar). The gradient norm alone is no evidence of one: it drifts and swings for
    long stretches in healthy runs. `within` = (first, last): only excursions beginning there
    (the record counts from the run's start)."""
    loss = found[0]
    record = 0.0
    for step in loss.series[0][np.nan_to_num(loss.zs(cfg), nan=-np.inf) >= cfg.onset_z]:
        if within is not None and step > within[1]:
            break
        z = held(loss, int(step), cfg)
        if z is None:
            continue
        if z >= max(HELD_Z, RECORD * record) and (within is None or step >= within[0]):
            return int(step), z, [0]
        record = max(record, z)
    return None


def bad_window(sig: Signal, start: int, cfg: BaselineConfig) -> tuple[int, int]:
    """(first, last) bad step of the excursion found at `start`: on from it while steps stay
    nearer the level of its first `SUSTAIN` steps than the baseline before it, until
    `CALM_STEPS` steps in a row are nearer the baseline; back from it over steps nearer the level
    of the clearly bad ones among them (a short burst: its own bad steps, not its calm
    neighbours), likewise."""
    base = sig.baseline(start, cfg)
    steps, values = sig.series
    if base is None:
        return start, start
    ahead = values[(steps >= start) & (steps < start + SUSTAIN) & np.isfinite(values)]
    clear = ahead[ahead >= base[0] + cfg.onset_z * base[1]]

    def midway(level: np.ndarray) -> float:
        bad = float(np.median(level)) if len(level) else base[0]
        return max((base[0] + bad) / 2, base[0] + cfg.onset_z * base[1] / 2)
    at = int(np.searchsorted(steps, start))
    first = _reach(steps, values, at, -1, midway(clear if len(clear) else ahead))
    last = _reach(steps, values, at, 1, midway(ahead))
    if _gap(steps) == 1:
        return int(steps[first]), int(steps[last])
    # a value logged every few steps is the mean of the steps since the one before (Trainer's
    # loss): the window holds all of those, and those of a next value still above the baseline
    after = last + 1 < len(steps) and np.isfinite(values[last + 1]) and \
        values[last + 1] >= base[0] + cfg.onset_z * base[1] / 2
    return (int(steps[first - 1]) + 1 if first > 0 else int(steps[first]),
            int(steps[last + 1]) if after else int(steps[last]))


def _reach(steps: np.ndarray, values: np.ndarray, at: int, way: int, above: float) -> int:
    """The furthest index from `at` in direction `way` (1 on, -1 back) whose value is above
    `above`, crossing fewer than `CALM_STEPS` steps in a row that are not."""
    far, i = at, at + way
    while 0 <= i < len(steps) and abs(int(steps[i]) - int(steps[far])) <= CALM_STEPS * _gap(steps):
        if np.isfinite(values[i]) and values[i] > above:
            far = i
        i += way
    return far


def _inside_model(near: list[dict[str, Any]], first_readers: set[str], start: int) -> bool:
    """True when the departure has a cause inside the model (not the batch): a weight written
    outside the optimizer, a non-finite value, a learning-rate alarm, or an output departing by
    `start` that begins mid-model."""
    if any(a["drift"] or a["median"] is None or a["metric"] in ("lr", "lr_surge") for a in near):
        return True
    outputs = [a for a in near if a["metric"] in OUTPUTS and a["onset_step"] <= start]
    if not outputs:
        return False
    lead = min(a["forward_index"] for a in outputs)
    return not any(a["forward_index"] == lead and a["attributed_to"] in first_readers for a in outputs)


def _lr_rose(lr: Series | None, start: int) -> bool:
    """The recorded learning rate rose `LR_RISE`-fold in the few steps up to `start` (a restart,
    a spike): the optimizer's doing, not the batch's."""
    if lr is None or not len(lr[0]):
        return False
    steps, values = lr
    now = values[(steps <= start) & (steps >= start - ROOT_WINDOW)]
    before = values[(steps < start - ROOT_WINDOW) & (steps >= start - ROOT_WINDOW - SUSTAIN)]
    now, before = now[np.isfinite(now)], before[np.isfinite(before)]
    return bool(len(now) and len(before) and now.max() >= LR_RISE * max(before.min(), 1e-30))


def _window(found: list[Signal], which: list[int], start: int, cfg: BaselineConfig) -> tuple[int, int]:
    """The bad window of the signals that left their baseline at `start` (`which`): from their
    earliest first bad step to the latest last one of them and of any other signal that stayed
    above its baseline from there (a loss that rose less than the gradients jumped)."""
    along = [i for i, sig in enumerate(found) if (h := held(sig, start, cfg, from_onset=False)) is not None
             and h >= cfg.onset_z / 2]
    spans = {i: bad_window(found[i], start, cfg) for i in sorted({*which, *along})}
    lo = min(min(spans[i][0] for i in which), start)
    if any(_gap(found[i].series[0]) > 1 for i in which):
        # a sparse signal's first interval: from where a signal of every step left its baseline
        dense = [sig for sig in found if _gap(sig.series[0]) == 1]
        left = [int(st) for sig in dense for st, z in zip(sig.series[0], sig.zs(cfg), strict=True)
                if lo <= st <= start and z >= cfg.onset_z]
        lo = min(left, default=lo)
    return lo, max(s[1] for s in spans.values())


def _evidence(found: list[Signal], which: list[int], how: str, at: int, first: int, last: int,
              tail: str) -> str:
    what = " and ".join(found[i].name for i in which)
    return (f"data: {what} {how} at step {at}{tail}, with no weight drift and no departure "
            f"beginning inside the model: the batches of steps {first}-{last} (until it returned "
            "to its baseline)")


def data_root(root: dict[str, Any] | None, rows: list[dict[str, Any]], first_readers: set[str],
              loss: Series, grad: Series, cfg: BaselineConfig,
              lr: Series | None = None, within: tuple[int, int] | None = None) -> tuple[int, int, str, float] | None:
    """(onset, end of the bad window, evidence, z of the signal that found it) when the root is
    the data, else None.

    `root`: the classifier's root (None: no component alarmed); `rows`: the located alarms;
    `first_readers`: the components that read the batch first; `loss`, `grad`: (steps, values)
    of the loss and of the total gradient norm; `lr`: of the learning rate; `within` = (first,
    last): the steps judged (an incident window), where an excursion no component alarmed on
    must begin.
    """
    if root is not None and root.get("scope") != "component":
        return None
    found = signals(loss, grad, cfg)
    if root is not None:
        first = root["onset_step"]
        near = [a for a in rows if first <= a["onset_step"] <= first + ROOT_WINDOW]
        comps = {a["attributed_to"] for a in near}
        hit = jump(found, first, cfg)
        if (hit is not None and len(comps) >= MIN_COMPONENTS and len({block_of(c) for c in comps}) >= 2
                and not _inside_model(near, first_readers, hit[0]) and not _lr_rose(lr, hit[0])):
            start, z, which = hit
            lo, hi = _window(found, which, start, cfg)
            tail = (f" (z={z:.1f} against its baseline) while {len(comps)} components in "
                    f"{len({block_of(c) for c in comps})} blocks departed together")
            return lo, hi, _evidence(found, which, "jumped", start, lo, hi, tail), z
    held_at = excursion(found, cfg, within)
    if held_at is None:
        return None
    start, z, which = held_at
    lo, hi = _window(found, which, start, cfg)
    if root is not None and root["onset_step"] < lo - ROOT_WINDOW:
        return None  # a fault inside the model began first
    near = [a for a in rows if lo - ROOT_WINDOW <= a["onset_step"] <= start + ROOT_WINDOW]
    if _inside_model(near, first_readers, start) or _lr_rose(lr, start):
        return None
    comps = {a["attributed_to"] for a in near}
    tail = (f" (median z={z:.1f} against its baseline over the next {SUSTAIN} steps: a run of bad "
            "batches, not one)" + (f" while {len(comps)} components departed" if comps else
                                   " while no component departed on its own"))
    return lo, hi, _evidence(found, which, "rose and stayed high", start, lo, hi, tail), z


def loss_spike_root(fired: list[int], rows: list[dict[str, Any]], first_readers: set[str],
                    loss: Series, grad: Series, cfg: BaselineConfig,
                    lr: Series | None = None) -> tuple[int, int, str, float] | None:
    """(onset, end of the bad window, evidence, z of the loss) where the loss-spike rule fired (`fired`: its
    steps), the loss jumped `JUMP_Z` against its own baseline there and nothing inside the model
    explains it; else None. Where no component alarmed, the light is never darker than that rule."""
    found = signals(loss, grad, cfg)
    for step in fired:
        base = found[0].baseline(step, cfg)
        z = None if base is None else found[0].z(step, base)
        if z is None or z < JUMP_Z:
            continue
        lo, hi = _window(found, [0], step, cfg)
        near = [a for a in rows if lo - ROOT_WINDOW <= a["onset_step"] <= step + ROOT_WINDOW]
        if _inside_model(near, first_readers, step) or _lr_rose(lr, step):
            continue
        tail = f" (z={z:.1f} against its baseline, where the loss-spike rule fired)"
        return lo, hi, _evidence(found, [0], "jumped", step, lo, hi, tail), z
    return None


def gradients_wide(root: dict[str, Any], rows: list[dict[str, Any]], heads: set[str],
                   param_components: int) -> tuple[dict[str, Any], int, str] | None:
    """(the leading gradient alarm, onset, evidence) when the gradients of most components grew
    together, else None."""
    if root.get("scope") != "component":
        return None
    grew = [a for a in rows if a["metric"] == "grad_norm_l2" and a["median"] is not None
            and a["value"] > a["median"]]
    if any(a["drift"] for a in grew):
        return None
    comps = {a["attributed_to"] for a in grew}
    if len(comps) < max(MIN_COMPONENTS, 0.5 * param_components) or not comps & heads:
        return None
    if min(a["step"] for a in grew) > min(a["step"] for a in rows):
        return None  # something else alarmed first
    onset = min(a["onset_step"] for a in grew)
    lead = min(grew, key=lambda a: (a["onset_step"], a["step"]))
    return lead, onset, (f"gradients model-wide: the gradient norms of {len(comps)} of {param_components} "
                   "parameter-owning components, the head's among them, grew far past their "
                   "baseline together with no weight drift: what the optimizer steps on changed "
                   "for the whole model (gradients not zeroed between steps, a loss scale), not one component")
