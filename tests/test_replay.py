"""Replay streams the trace through the same classifier and agrees with analyze; restarts."""

from __future__ import annotations

import pytest
from rehearsed import ROOT, analysed, trace
from warninglight.forensics import analyze, open_trace, replay
from warninglight.lab.rehearsal import rehearse

KEYS = ["rank", "observed_on", "condition", "step", "onset_step", "attributed_to", "metric"]


@pytest.mark.parametrize("scenario", ["mlp_weight_corruption", "mlp_dying_layer", "mlp_nan", "mlp_bitflip",
                                      "mlp_oscillating"])
def test_replay_agrees_with_analyze(scenario: str) -> None:
    offline = analysed(scenario)
    live = replay(trace(scenario), chunk=7)  # an odd chunk: window edges fall mid-episode
    assert len(offline.alarms) > 0
    assert live.alarms.select(KEYS).equals(offline.alarms.select(KEYS))
    lights = [e for e in live.events if e.source == "light"]
    assert [e.step for e in lights] == sorted(offline.alarms["step"].to_list())
    assert live.root is not None and live.root.alarm.attributed_to == offline.root.attributed_to


def test_replay_timeline_names_the_comparators() -> None:
    live = replay(trace("mlp_weight_corruption"))
    sources = [e.source for e in live.events]
    assert "loss_spike" in sources
    loss = next(e.step for e in live.events if e.source == "loss_spike")
    assert loss == analysed("mlp_weight_corruption").detectors.loss_spike_step


@pytest.fixture(scope="module")
def restarted():
    """A run hit by corruption at step 150, restarted from its step-100 checkpoint without the fault."""
    out, ckpt = ROOT / "restarted", ROOT / "restarted-ckpt"
    rehearse("mlp_weight_corruption", out, steps=200, checkpoint_every=50, checkpoint_dir=ckpt)
    rehearse("mlp_clean", out, steps=260, checkpoint_every=50, checkpoint_dir=ckpt,
             resume_from=ckpt / "step-000100.pt", start_step=100)
    return out


def test_restart_is_analysed_on_its_effective_timeline(restarted) -> None:
    t = open_trace(restarted)
    try:
        raw = t.one("SELECT count(*), count(DISTINCT incarnation) FROM health_all WHERE component = '2'")
        eff = t.one("SELECT count(*), count(DISTINCT step), max(step) FROM health WHERE component = '2'")
        inc = t.one("SELECT max(incarnation) FROM health WHERE step BETWEEN 101 AND 200")
    finally:
        t.close()
    assert raw == (200 + 160, 2)          # steps 101-200 were recorded twice
    assert eff == (260, 260, 260)         # each step once on the effective timeline
    assert inc == (2,)                    # ...from the restarted incarnation
    result = analyze(restarted)           # the corrupted steps were superseded by the restart
    assert result.verdict == "healthy", result.to_dict()["alarms"]
    assert result.summary["incarnations"] == 2
    live = replay(restarted)
    assert live.alarms.is_empty()


def test_comparator_rules_fire_where_they_should() -> None:
    import numpy as np
    from warninglight.forensics.comparators.detectors import grad_norm_spikes, loss_spikes

    steps = np.arange(1, 301)
    rng = np.random.default_rng(0)
    loss = 2.0 - np.linspace(0, 1, 300) + 0.02 * rng.standard_normal(300)
    assert loss_spikes(steps, loss) == []
    loss[199] = 3.0                                   # step 200
    loss[249] = np.nan                                # step 250
    assert loss_spikes(steps, loss) == [200, 250]
    norm = 1.0 + 0.01 * rng.standard_normal(300)
    norm[149] = 5.0                                   # step 150
    fired = grad_norm_spikes(steps, norm)
    assert 150 in fired and all(s > 25 for s in fired)
