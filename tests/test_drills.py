"""Drills do exactly the harm they claim, at the step they claim, and nothing before."""

from __future__ import annotations

import pytest
import torch
from rehearsed import trace, truth
from warninglight.forensics import open_trace
from warninglight.lab import zoo
from warninglight.lab.drills import (
    BiasDrift,
    CorruptBatches,
    DrillError,
    FreezeModule,
    GradientAttenuation,
    GradientSignFlip,
    LRSpike,
    NaNInjection,
    PoisonedSamples,
    PreActivationScale,
    WeightCorruption,
    WeightShrink,
)
from warninglight.lab.rehearsal import SCENARIOS, ScenarioError, rehearse


def model_and_opt(lr: float = 0.1):
    torch.manual_seed(0)
    model = zoo.mlp(d_in=4, hidden=8, depth=2, n_classes=3, activation="tanh")
    return model, torch.optim.SGD(model.parameters(), lr=lr)


def test_weight_corruption_modes() -> None:
    model, opt = model_and_opt()
    w0 = model[2].weight.detach().clone()
    d = WeightCorruption("2", 3, mode="scale", factor=10.0)
    d.attach(model, opt)
    d.before_step(2, model, opt)
    assert torch.equal(model[2].weight, w0)               # not before its step
    d.before_step(3, model, opt)
    assert torch.allclose(model[2].weight, 10 * w0)
    flip = WeightCorruption("0", 1, mode="bitflip", fraction=0.05)
    flip.attach(model, opt)
    flip.before_step(1, model, opt)
    assert model[0].weight.abs().max() > 1e30              # an exponent bit flipped
    with pytest.raises(DrillError, match="mode must be scale, bitflip or noise"):
        WeightCorruption("0", 1, mode="zap")


def test_bias_drift_and_shrink_act_gradually() -> None:
    model, opt = model_and_opt()
    b0, w0 = model[0].bias.detach().clone(), model[4].weight.detach().clone()
    drift, shrink = BiasDrift("0", 2, rate=0.5, duration=3), WeightShrink("4", 2, rate=0.5, duration=2)
    for d in (drift, shrink):
        d.attach(model, opt)
    for step in range(1, 8):
        drift.before_step(step, model, opt)
        shrink.before_step(step, model, opt)
    assert torch.allclose(model[0].bias, b0 - 1.5)        # steps 2, 3, 4
    assert torch.allclose(model[4].weight, w0 * 0.25)     # steps 2, 3
    assert drift.truth()["kind"] == "gradual" and drift.truth()["condition"] == "dead"


def test_lr_spike_and_freeze_isolate_one_module() -> None:
    model, opt = model_and_opt(lr=0.1)
    spike, freeze = LRSpike("2", 3, factor=20.0, duration=2), FreezeModule("0", 2)
    spike.attach(model, opt)
    freeze.attach(model, opt)
    assert len(opt.param_groups) == 3 and sum(len(g["params"]) for g in opt.param_groups) == 6
    lrs = []
    for step in range(1, 6):
        spike.before_step(step, model, opt)
        freeze.before_step(step, model, opt)
        lrs.append([g["lr"] for g in opt.param_groups])
    assert [row[1] for row in lrs] == [0.1, 0.1, 2.0, 2.0, 0.1]  # module 2's group
    assert [row[2] for row in lrs] == [0.1, 0.0, 0.0, 0.0, 0.0]  # module 0's group
    assert all(row[0] == 0.1 for row in lrs)                     # the rest


def test_output_hooks_nan_and_gradient_drills() -> None:
    model, opt = model_and_opt()
    x = torch.randn(16, 4)
    clean_out = model(x).detach()
    clean_grad = torch.autograd.grad(model(x).sum(), model[0].weight)[0]
    nan, atten, flip = NaNInjection("2", 2, fraction=0.5), GradientAttenuation("2", 3, factor=1e-3), GradientSignFlip("2", 4)
    for d in (nan, atten, flip):
        d.attach(model, opt)

    def at(step: int):
        for d in (nan, atten, flip):
            d.before_step(step, model, opt)
        out = model(x)
        return out, torch.autograd.grad(out.sum(), model[0].weight, allow_unused=True)[0]

    out, _ = at(1)
    assert torch.allclose(out, clean_out)
    out, _ = at(2)
    assert out.isnan().any()
    nan.detach()
    out, g = at(3)
    assert torch.allclose(out, clean_out) and torch.allclose(g, clean_grad * 1e-3, atol=1e-9)
    atten.detach()
    out, g = at(4)
    assert torch.allclose(out, clean_out) and torch.allclose(g, -clean_grad, atol=1e-6)
    _, g = at(5)
    assert torch.allclose(g, clean_grad, atol=1e-6)                # flips every other step


def test_preactivation_scale_and_corrupt_batches() -> None:
    model, opt = model_and_opt()
    sat = PreActivationScale("1", 2, factor=100.0)
    sat.attach(model, opt)
    x = torch.randn(64, 4)
    sat.before_step(1, model, opt)
    h1 = model[1](model[0](x))
    sat.before_step(2, model, opt)
    h2 = model[1](model[0](x))
    assert (h2.abs() > 0.99).float().mean() > 0.8 > (h1.abs() > 0.99).float().mean()
    bad = CorruptBatches("0", 5, duration=2, factor=25.0)
    y = torch.zeros(64, dtype=torch.long)
    assert bad.corrupt_batch(4, x, y)[0] is x
    assert bad.corrupt_batch(6, x, y)[0].std() > 20 * x.std()
    assert bad.corrupt_batch(7, x, y)[0] is x
    assert bad.truth()["last_step"] == 6


def test_garbage_of_the_data_own_range_whole_or_in_a_few_samples() -> None:
    g = torch.Generator().manual_seed(0)
    tokens, targets = torch.randint(1, 60, (8, 32), generator=g), torch.randint(1, 60, (8, 32), generator=g)
    bad_x, bad_y = CorruptBatches("wte", 3, duration=1, mode="random", vocab_size=96).corrupt_batch(3, tokens, targets)
    assert bad_x.max() >= 60 and bad_x.max() < 96 and not torch.equal(bad_y, targets)  # the whole vocabulary
    few = PoisonedSamples("wte", 3, duration=2, count=2, vocab_size=96)
    x, y = few.corrupt_batch(4, tokens, targets)
    changed = (x != tokens).any(1)
    assert int(changed.sum()) == 2 and torch.equal(x[~changed], tokens[~changed])  # the rest are sound
    assert few.corrupt_batch(5, tokens, targets)[0] is tokens and few.truth()["last_step"] == 4
    images = torch.randn(16, 1, 8, 8, generator=g) * 0.3 + 0.5
    noise, _ = CorruptBatches("0", 1, duration=1, mode="random").corrupt_batch(1, images, torch.arange(16))
    assert abs(float(noise.mean() - images.mean())) < 0.05 and abs(float(noise.std() / images.std()) - 1) < 0.1
    assert not torch.allclose(noise, images)
    with pytest.raises(DrillError, match="mode must be scale or random"):
        CorruptBatches("0", 1, mode="zeros")


def test_unknown_module_and_scenario_are_named() -> None:
    model, opt = model_and_opt()
    with pytest.raises(DrillError, match="no module named 'fc9'"):
        WeightCorruption("fc9", 1).attach(model, opt)
    with pytest.raises(ScenarioError, match="unknown scenario 'mlp_nope'"):
        rehearse("mlp_nope", "/nonexistent")


def test_scenarios_cover_every_model_and_fault() -> None:
    faults = {(sc.model, d.fault) for sc in SCENARIOS.values() for d in sc.drills()}
    for model in ("mlp", "cnn", "gpt"):
        assert f"{model}_clean" in SCENARIOS
        for fault in ("weight_corruption", "lr_spike", "nan_injection", "corrupt_batches", "frozen_module",
                      "bias_drift"):
            assert (model, fault) in faults
    conditions = {d.condition for sc in SCENARIOS.values() for d in sc.drills()}
    assert conditions == {"exploding", "dead", "saturated", "stagnant", "oscillating",
                          "losing_confidence", "losing_gradient", "unclassified"}


def test_rehearsal_writes_truth_and_records_checkpoints() -> None:
    path = trace("mlp_weight_corruption")
    t = truth(path)
    assert (t["fault"], t["component"], t["step"], t["kind"]) == ("weight_corruption", "2", 150, "abrupt")
    assert t["healthy"] is False and t["steps"] == 300
    assert truth(trace("mlp_clean"))["healthy"] is True
    store = open_trace(path)
    rows = store.sql("select step, detail from checkpoints order by step").fetchall()
    store.close()
    assert [r[0] for r in rows] == [50, 100, 150, 200, 250, 300]
    assert all(r[1] == "rehearsal: no file was written" for r in rows)
