"""Comparator detectors, computed on the same trace: what a loss-curve or grad-norm watcher sees.

- Loss spike (OLMo-core style): loss at step t > mean + 6σ of the losses logged in the previous
  128 steps; a non-finite loss counts as a spike. A loss logged every N steps (Trainer's
  `logging_steps`, an average) gives 128/N points per window: the rule judges a step once the
  window holds 32/N of them (at least 8), and says how many steps it could judge at all.
- ZClip's gradient-norm spike test, as published (Kumar et al., 2025, "ZClip: Adaptive Spike
  Mitigation for LLM Pre-Training", and its reference implementation's defaults): the first 25
  total gradient norms initialise the mean and (population) variance; from then on
  z = (g − μ) / (σ + 1e-6) and z > 2.5 is a spike. The EMA (α = 0.97) is updated with the norm
  ZClip lets through: on a spike its default adaptive clip, μ + z_thr²·σ / z (the threshold
  μ + z_thr·σ divided by z / z_thr); the mean is updated first, then the variance around the new mean.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class LossSpikeRule:
    """value > mean + sigmas·std of the losses logged over the last `window` steps."""

    window: int = 128  # steps (with a loss every step, points)
    sigmas: float = 6.0
    min_history: int = 32  # steps of logged history before the rule may fire
    min_points: int = 8  # however sparse the logging, never judge on fewer past losses

    def points_needed(self, steps: np.ndarray) -> int:
        """Past losses the rule needs, given how often they were logged (median gap in steps)."""
        gap = max(1, int(np.median(np.diff(steps)))) if len(steps) > 1 else 1
        return max(self.min_points, self.min_history // gap) if gap > 1 else self.min_history


@dataclass(frozen=True)
class ZClipRule:
    """EMA z-score of the total gradient norm."""

    alpha: float = 0.97
    z: float = 2.5
    warmup: int = 25  # steps used to initialise the mean and variance
    eps: float = 1e-6  # added to σ, in gradient-norm units


def loss_spikes(steps: np.ndarray, loss: np.ndarray, rule: LossSpikeRule = LossSpikeRule()) -> list[int]:
    """Every step at which the loss-spike rule fires."""
    return judge_losses(steps, loss, rule)[0]


def loss_steps_judged(steps: np.ndarray, loss: np.ndarray, rule: LossSpikeRule = LossSpikeRule()) -> int:
    """At how many logged steps the loss rule had enough past losses to judge (0: too few)."""
    return judge_losses(steps, loss, rule)[1]


def judge_losses(steps: np.ndarray, loss: np.ndarray,
                 rule: LossSpikeRule = LossSpikeRule()) -> tuple[list[int], int]:
    """(`loss_spikes`, `loss_steps_judged`) in one pass over the losses.

    Each step's window mean and deviation are computed for all steps at once (blocks of a padded
    window matrix); the few steps whose loss comes within 1e-9 (relative) of their threshold are
    judged again exactly as one step at a time would (numpy's mean and std of the window), so the
    verdicts are those of the step-by-step rule, at the cost of a vector pass."""
    n = len(loss)
    if n == 0:
        return [], 0
    needed = rule.points_needed(steps)
    idx = np.arange(n)
    first = np.searchsorted(steps, steps - rule.window, side="left")  # oldest step inside the window
    finite = np.isfinite(loss)
    counted = np.concatenate([[0], np.cumsum(finite)])
    judged = finite & (counted[idx] - counted[first] >= needed)
    near = np.zeros(n, dtype=bool)
    rows = np.flatnonzero(judged)
    width = int((idx - first).max())
    block = max(1, (1 << 21) // max(width, 1))
    with np.errstate(invalid="ignore"):
        for lo in range(0, len(rows), block):
            r = rows[lo:lo + block]
            pos = first[r, None] + np.arange(width)
            window = np.where(pos < r[:, None], loss[np.minimum(pos, n - 1)], np.nan)
            mean, std = np.nanmean(window, axis=1), np.nanstd(window, axis=1)
            threshold = mean + rule.sigmas * std
            tol = 1e-9 * (np.abs(mean) + rule.sigmas * std + np.abs(loss[r]))
            near[r] = loss[r] > threshold - tol
    fired = ~finite
    for i in np.flatnonzero(near):
        past = loss[first[i]:i]
        past = past[np.isfinite(past)]
        fired[i] = loss[i] > past.mean() + rule.sigmas * past.std()
    return [int(s) for s in steps[fired]], int(judged.sum())


def grad_norm_spikes(steps: np.ndarray, norm: np.ndarray, rule: ZClipRule = ZClipRule()) -> list[int]:
    """Every step at which the ZClip-style rule fires (non-finite norms always fire after warm-up)."""
    fired: list[int] = []
    finite = norm[np.isfinite(norm)][: rule.warmup]
    if len(norm) <= rule.warmup or len(finite) < 2:
        return fired
    mean, var = float(finite.mean()), float(finite.var())
    for i in range(rule.warmup, len(norm)):
        g = float(norm[i])
        if not math.isfinite(g):
            fired.append(int(steps[i]))
            continue
        std = math.sqrt(max(var, 0.0))
        z = (g - mean) / (std + rule.eps)
        if z > rule.z:
            fired.append(int(steps[i]))
            g = mean + rule.z * std / (z / rule.z)  # adaptive scaling: larger outliers clip harder
        mean = rule.alpha * mean + (1 - rule.alpha) * g
        var = rule.alpha * var + (1 - rule.alpha) * (g - mean) ** 2
    return fired


def first_at_or_after(fired: list[int], step: int | None) -> int | None:
    """The first firing at or after `step` (the first firing at all when step is None)."""
    later = [s for s in fired if step is None or s >= step]
    return later[0] if later else None
