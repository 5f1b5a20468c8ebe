"""The comparators: the loss-spike rule on dense and sparse losses (a loss logged every N steps,
as Trainer does), and ZClip's z-score test on the total gradient norm as published."""

from __future__ import annotations

import numpy as np
import pytest
from warninglight.forensics.comparators import detectors
from warninglight.forensics.comparators.detectors import ZClipRule, grad_norm_spikes
from warninglight.forensics.explaining.analysis import Detectors
from warninglight.forensics.presenting.wording import comparator_lines


def _losses(steps: np.ndarray, spike_at: int | None, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    loss = 2.0 - 0.002 * steps + rng.normal(0, 0.01, len(steps))
    if spike_at is not None:
        loss[steps == spike_at] += 1.0
    return loss


@pytest.mark.parametrize(("every", "last", "spike", "judged_from"), [
    (1, 300, 200, 33),   # dense: 32 past losses needed, as before
    (5, 60, 55, 45),     # Trainer's logging_steps=5 on a 60-step run: 8 past points
    (10, 400, 300, 90),  # 32 // 10 = 3 < 8: still 8 past points
])
def test_loss_rule_fires_on_the_points_that_exist(every: int, last: int, spike: int,
                                                   judged_from: int) -> None:
    steps = np.arange(every, last + 1, every)
    loss = _losses(steps, spike)
    assert detectors.loss_spikes(steps, loss) == [spike]
    assert detectors.loss_steps_judged(steps, loss) == int((steps >= judged_from).sum())


def test_dense_window_is_the_previous_128_steps() -> None:
    steps = np.arange(1, 401)
    loss = _losses(steps, None)
    loss[:200] += 5.0  # far higher values more than 128 steps back do not count
    loss[330] += 1.0  # above mean + 6σ of steps 203-330 (trend and noise), not of the old values
    assert detectors.loss_spikes(steps, loss) == [331]


def test_too_few_points_is_said_not_silent() -> None:
    steps = np.arange(10, 71, 10)  # 7 logged losses
    loss = _losses(steps, 50)
    assert detectors.loss_spikes(steps, loss) == []
    assert detectors.loss_steps_judged(steps, loss) == 0
    found = Detectors(loss_spike_step=None, grad_norm_spike_step=None, loss_spike_first_step=None,
                      grad_norm_spike_first_step=None, loss_spike_count=0, grad_norm_spike_count=0,
                      loss_points=7, loss_steps_judged=0, light_lead_over_loss_spike=None,
                      light_lead_over_grad_norm_spike=None, first_alarm_step=None)
    assert comparator_lines(found)[0] == (
        "comparators: loss-spike rule had too few logged losses to judge any step (7 points), "
        "gradient-norm (ZClip) rule never fired")


def test_a_nonfinite_loss_fires_at_once() -> None:
    steps = np.arange(5, 51, 5)
    loss = _losses(steps, None)
    loss[2] = np.nan
    assert detectors.loss_spikes(steps, loss) == [15]


def _judge_one_step_at_a_time(steps: np.ndarray, loss: np.ndarray,
                              rule: detectors.LossSpikeRule) -> tuple[list[int], int]:
    """The loss rule as its definition reads: each step against numpy's mean and std of the
    finite losses logged in the `window` steps before it."""
    fired, judged = [], 0
    for i in range(len(loss)):
        if not np.isfinite(loss[i]):
            fired.append(int(steps[i]))
            continue
        past = loss[(steps >= steps[i] - rule.window) & (np.arange(len(loss)) < i)]
        past = past[np.isfinite(past)]
        if len(past) < rule.points_needed(steps):
            continue
        judged += 1
        if loss[i] > past.mean() + rule.sigmas * past.std():
            fired.append(int(steps[i]))
    return fired, judged


@pytest.mark.parametrize("every", [1, 7])
def test_the_vectorised_loss_rule_gives_the_step_by_step_verdicts(every: int) -> None:
    # a curve with spikes of every size, non-finite losses, a flat stretch whose threshold is the
    # constant itself (a loss equal to it is not a spike, one ulp above is), and logging gaps
    rule = detectors.LossSpikeRule()
    rng = np.random.default_rng(7)
    steps = np.arange(1, 3001, every)
    steps = np.sort(rng.choice(steps, len(steps) * 9 // 10, replace=False))
    loss = _losses(steps, None, seed=every)
    spikes = rng.choice(len(steps) - 1, len(steps) // 20, replace=False)
    loss[spikes] += rng.exponential(0.08, len(spikes))
    loss[rng.choice(len(steps), 5, replace=False)] = [np.nan, np.inf, -np.inf, np.nan, np.nan]
    flat = np.flatnonzero((steps > 1500) & (steps <= 1700))
    loss[flat] = 1.25
    at, above = flat[-1] + 1, flat[-1] + 2
    loss[at], loss[above] = 1.25, np.nextafter(1.25, 2.0)
    fired, judged = detectors.judge_losses(steps, loss, rule)
    assert (fired, judged) == _judge_one_step_at_a_time(steps, loss, rule)
    assert steps[at] not in fired and steps[above] in fired
    assert len(fired) >= 5 and judged > len(steps) // 2


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
