"""Bad batches are a root of their own, and the skip list covers the whole bad window."""

from __future__ import annotations

import tempfile
from dataclasses import replace

import numpy as np
from rehearsed import analysed, truth
from warninglight.forensics import analyze
from warninglight.forensics.explaining.analysis import felt_alarms
from warninglight.forensics.explaining.dataroot import block_of
from warninglight.forensics.explaining.localise import Located
from warninglight.forensics.judging.conditions import Config
from warninglight.lab.drills import CorruptBatches
from warninglight.lab.rehearsal import SCENARIOS, rehearse


def test_corrupted_batches_are_rooted_on_the_data_with_the_whole_window_skipped() -> None:
    a = analysed("mlp_corrupt_batches", steps=200).to_dict()
    t = truth(analysed("mlp_corrupt_batches", steps=200).trace_dir)
    root, rb = a["root"], a["rollback"]
    assert (root["scope"], root["attributed_to"], root["onset_step"]) == ("data", "", t["step"])
    assert root["evidence"].startswith("data: ")
    first, last = rb["skip_step_range"]
    assert first == t["step"] and last >= t["last_step"]  # every bad batch, not only up to the alarm
    assert last < t["last_step"] + 10  # and the window ends when the signal is back
    assert len(rb["skip_batches"]) == 32 * (last - first + 1)  # 32 sample ids a step


def test_a_fault_inside_the_model_is_not_taken_for_bad_data() -> None:
    root = analysed("mlp_weight_corruption", steps=170).to_dict()["root"]
    assert (root["scope"], root["attributed_to"]) == ("component", "2")


def test_blocks_are_paths_up_to_their_index() -> None:
    assert [block_of(c) for c in ("h.1.mlp.c_fc", "wte", "3", "layers.10.attn")] == ["h.1", "wte", "3", "layers.10"]


def _skipped(name: str, steps: int) -> tuple[dict, dict, float, float]:
    """(root, truth, share of the bad steps skipped, share of their sample ids skipped)."""
    found = analysed(name, steps=steps)
    a, t = found.to_dict(), truth(found.trace_dir)
    rb = a["rollback"]
    bad = found.steps.filter(found.steps["step"].is_between(t["step"], t["last_step"]))
    first, last = rb["skip_step_range"] or (0, -1)
    ids = {i for row in bad["batch_ids"].to_list() for i in row}
    inside = max(0, min(last, t["last_step"]) - max(first, t["step"]) + 1)
    return a["root"], t, inside / (t["last_step"] - t["step"] + 1), len(ids & set(rb["skip_batches"] or ())) / len(ids)


def test_random_tokens_in_a_llama_are_rooted_on_the_data_and_skipped_whole() -> None:
    # RMSNorm, SwiGLU, rotary positions: garbage of the data's own range, which moves no single
    # component far — the loss, rising and staying high, says it
    root, t, steps, ids = _skipped("llama_corrupt_batches", 200)
    assert (root["scope"], root["attributed_to"], root["onset_step"]) == ("data", "", t["step"])
    assert steps >= 0.9 and ids >= 0.9
    assert analysed("llama_clean", steps=200).root is None  # its clean twin stays healthy


def test_noise_images_in_a_cnn_are_rooted_on_the_data_and_skipped_whole() -> None:
    root, t, steps, ids = _skipped("cnn_noise_batches", 200)
    assert (root["scope"], root["onset_step"]) == ("data", t["step"])
    assert steps >= 0.9 and ids >= 0.9


def test_a_few_poisoned_samples_in_sound_batches_are_no_healthy_run() -> None:
    root, t, steps, _ = _skipped("gpt_poisoned_samples", 200)
    assert root is not None and root["scope"] == "data"
    assert abs(root["onset_step"] - t["step"]) <= 2 and steps >= 0.8
    assert "rose and stayed high" in root["evidence"]


def test_one_bad_batch_where_the_loss_spike_rule_fires_is_a_data_fault() -> None:
    """Never darker than the loss-spike rule: one garbage batch, which no component alarms on."""
    sc = replace(SCENARIOS["gpt_clean"], name="gpt_one_bad_batch",
                 drills=lambda: [CorruptBatches("wte", 150, duration=1, mode="random", vocab_size=96)])
    with tempfile.TemporaryDirectory() as tmp:
        rehearse(sc, tmp, steps=170, checkpoint_every=0)
        a = analyze(tmp, heat=False)
    assert a.detectors.loss_spike_step == 150
    assert a.root is not None and (a.root.scope, a.root.onset_step) == ("data", 150)
    assert a.rollback.skip_step_range is not None and a.rollback.skip_step_range[0] == 150
    assert "loss-spike rule" in a.root.evidence


def _surge(metric: str = "grad_norm_l2", nonfinite: bool = False) -> Located:
    """An exploding alarm on one component, onset at step 150."""
    return Located(rank=0, observed_on="k_proj", condition="exploding", step=152, last_step=158, metric=metric,
                   value=1.0, median=0.1, magnitude=7.0, onset_step=150, attributed_to="k_proj",
                   nonfinite=nonfinite, drift=False, signal="gradient", forward_index=3)


def test_one_component_s_gradient_surge_the_model_never_felt_is_no_explosion() -> None:
    rng = np.random.default_rng(0)
    steps = np.arange(300)
    calm = np.exp(rng.normal(np.log(0.4), 0.1, 300))  # the model's total gradient norm, in its range
    cfg = Config()
    alarms = [_surge(), _surge("out_rms"), _surge(nonfinite=True)]
    kept = felt_alarms(alarms, (steps, calm), cfg)
    assert [a.metric for a in kept] == ["out_rms", "grad_norm_l2"] and kept[1].nonfinite
    felt = calm.copy()
    felt[151:156] *= 5  # the whole model's gradient rises with it: an explosion
    assert felt_alarms(alarms, (steps, felt), cfg) == alarms
    # no total gradient norm recorded: nothing to tell a shift from an explosion, the alarm stands
    assert felt_alarms(alarms, (np.arange(0), np.arange(0.0)), cfg) == alarms
