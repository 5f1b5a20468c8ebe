"""Bad batches are a root of their own, and the skip list covers the whole bad window."""

from __future__ import annotations

from rehearsed import analysed, truth
from warninglight.forensics.explaining.dataroot import block_of


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
