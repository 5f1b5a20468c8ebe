"""Comparator detectors, computed on the same trace: what a loss-curve or grad-norm watcher sees.

- Loss spike (OLMo-core style): loss at step t > mean + 6σ of the previous 128 steps' losses;
  a non-finite loss counts as a spike.
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
    """value > mean + sigmas·std over the last `window` steps."""

    window: int = 128
    sigmas: float = 6.0
    min_history: int = 32  # steps before the rule may fire


@dataclass(frozen=True)
class ZClipRule:
    """EMA z-score of the total gradient norm."""

    alpha: float = 0.97
    z: float = 2.5
    warmup: int = 25  # steps used to initialise the mean and variance
    eps: float = 1e-6  # added to σ, in gradient-norm units


def loss_spikes(steps: np.ndarray, loss: np.ndarray, rule: LossSpikeRule = LossSpikeRule()) -> list[int]:
    """Every step at which the loss-spike rule fires."""
    fired = []
    for i in range(len(loss)):
        if not math.isfinite(loss[i]):
            fired.append(int(steps[i]))
            continue
        past = loss[max(0, i - rule.window):i]
        past = past[np.isfinite(past)]
        if len(past) < rule.min_history:
            continue
        if loss[i] > past.mean() + rule.sigmas * past.std():
            fired.append(int(steps[i]))
    return fired


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
