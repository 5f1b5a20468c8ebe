"""The comparators as published: ZClip's z-score test on the total gradient norm."""

from __future__ import annotations

import numpy as np
from warninglight.forensics.detectors import ZClipRule, grad_norm_spikes


def test_zclip_waits_for_its_warmup_then_fires_on_a_spike() -> None:
    norms = np.array([1.0, 1.2] * 15 + [1.1, 5.0, 1.1, 1.1])
    steps = np.arange(1, len(norms) + 1)
    assert grad_norm_spikes(steps, norms) == [32]  # the first 25 steps only initialise the EMA
    assert grad_norm_spikes(steps[:25], norms[:25]) == []


def test_zclip_adds_its_epsilon_to_sigma_so_a_flat_run_is_not_a_string_of_spikes() -> None:
    """A perfectly flat norm has σ = 0: z = (g − μ) / (σ + 1e-6), not a division by ~0."""
    norms = np.full(40, 2.0)
    norms[30] += 1e-7
    assert grad_norm_spikes(np.arange(40), norms) == []
    norms[35] += 1e-4  # 100 ε above a flat mean: z = 100
    assert grad_norm_spikes(np.arange(40), norms) == [35]


def test_zclip_feeds_its_adaptive_clip_back_so_one_spike_does_not_hide_the_next() -> None:
    rule = ZClipRule()
    base = [1.0, 1.2] * 15
    norms = np.array(base + [50.0, 1.6])
    fired = grad_norm_spikes(np.arange(len(norms)), norms, rule)
    assert fired == [30, 31]  # the EMA took mean + z_thr²·σ/z for the spike, not 50
