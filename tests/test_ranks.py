"""Rank faults in real data-parallel runs (gloo DDP on CPU, spawned processes), named by `analyze`.

Two spawned groups for the whole module: the 2-rank DDP faults, a clean 2-rank twin, a clean FSDP2
run and a with/without-recorder training (one group), and a clean 4-rank run (the other). The
local-gradient naming is also held to hand-built tables (which rank among two, or equal groups).
"""

from __future__ import annotations

import json
from pathlib import Path

import duckdb
import numpy as np
import polars as pl
import pytest
from typer.testing import CliRunner
from warninglight.cli.main import app
from warninglight.forensics import analyze, open_trace
from warninglight.forensics.explaining.ranks import local_finding
from warninglight.forensics.trace import checks
from warninglight.lab.distributed import CHECKPOINT_EVERY, SCENARIOS, run_group
from warninglight.tracer import schema

TWO_RANKS = ["ddp_weight_scale", "ddp_grad_corrupt", "ddp_grad_corrupt_inner", "ddp_grad_corrupt_views",
             "ddp_unwrapped_steps",
             "ddp_unwrapped_rank", "ddp_zeroed_grads", "ddp_zeroed_local", "ddp_layernorm_clip", "ddp_clean",
             "ddp_accumulated", "ddp_accumulated_views", "fsdp_clean"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("ranks")
    run_group(TWO_RANKS, root, identity=True)
    run_group(["ddp_clean_4ranks"], root)
    return root


@pytest.mark.parametrize(("scenario", "component", "rank", "scope"), [
    ("ddp_weight_scale", "h.0.mlp.c_fc", 1, "replicas"),
    ("ddp_grad_corrupt", "h.0.attn.c_attn", 1, "component"),
    ("ddp_grad_corrupt_inner", "h.0.attn.c_attn", 1, "component"),  # watch() given the module in the DDP
    ("ddp_grad_corrupt_views", "h.0.attn.c_attn", 1, "component"),  # gradients as bucket views: a hook
    ("ddp_unwrapped_steps", "", None, "replicas"),  # every rank, the whole model
    # no majority among two: each rank's own evidence names it
    ("ddp_unwrapped_rank", "", 1, "replicas"),  # it alone ran no all-reduce
    ("ddp_zeroed_grads", "", 1, "replicas"),  # its gradients zeroed after the all-reduce
    ("ddp_zeroed_local", "", 1, "component"),  # ... before it: the replicas stay equal
    ("ddp_layernorm_clip", "h.0.ln_1", 1, "replicas"),  # LayerNorm left out of its clipping
])
def test_a_rank_fault_is_named_by_rank_component_onset_and_checkpoint(
        runs: Path, scenario: str, component: str, rank: int | None, scope: str) -> None:
    truth = json.loads((runs / scenario / "truth.json").read_text())
    d = analyze(runs / scenario).to_dict()
    root = d["root"]
    assert d["verdict"] == "fault"
    assert (root["attributed_to"], root["rank"], root["onset_step"], root["scope"]) == (
        component, rank, truth["step"], scope), root
    assert (truth["component"], truth["rank"]) == (component, rank)
    ckpt = (truth["step"] - 1) // CHECKPOINT_EVERY * CHECKPOINT_EVERY  # latest strictly before
    assert d["rollback"]["checkpoint_step"] == ckpt
    assert any(a["rank"] == rank and a["attributed_to"] == component for a in d["alarms"])
    by_rank = d["rollback"]["skip_batches_by_rank"]  # every rank read its own batches
    assert sorted(by_rank) == ["0", "1"] and by_rank["0"] != by_rank["1"]


def test_the_corrupted_rank_is_named_though_every_rank_applied_the_same_bad_average(runs: Path) -> None:
    trace = open_trace(runs / "ddp_grad_corrupt")
    try:
        # after the all-reduce every rank holds the same gradient: the health table cannot tell
        post = trace.con.execute("""SELECT count(DISTINCT grad_norm_l2) FROM health
            WHERE step = 25 AND component = 'h.0.attn.c_attn'""").fetchone()
        row = trace.con.execute("""SELECT max_rank, local_grad_norm_max / local_grad_norm_min, fingerprints
            FROM ranks WHERE step = 25 AND component = 'h.0.attn.c_attn'""").fetchone()
    finally:
        trace.close()
    assert post == (1,)
    assert row[0] == 1 and row[1] > 10 and row[2] == 1  # rank 1's local norm, replicas still equal
    assert analyze(runs / "ddp_grad_corrupt").to_dict()["root"]["condition"] == "exploding"


@pytest.mark.parametrize("scenario", ["ddp_grad_corrupt", "ddp_grad_corrupt_inner", "ddp_grad_corrupt_views"])
def test_the_wrapper_or_its_module_give_the_same_names_and_local_norms(runs: Path, scenario: str) -> None:
    trace = open_trace(runs / scenario)
    try:
        names = [n for (n,) in trace.con.execute("SELECT DISTINCT component FROM components").fetchall()]
        local = trace.con.execute("""SELECT count(local_grad_norm_l2), bool_and(grad_allreduced)
            FROM replicas WHERE component = 'h.0.attn.c_attn'""").fetchone()
        warned = trace.con.execute("SELECT count(*) FROM events WHERE kind = 'warning'").fetchone()
    finally:
        trace.close()
    assert "lm_head" in names and not [n for n in names if n.startswith("module")]
    assert local == (2 * 40, True)  # every step of both ranks, read before the all-reduce
    assert warned == (0,)


def _local_norms(trace: Path) -> list[tuple[int, int, str, float]]:
    return duckdb.sql(f"SELECT rank, step, component, local_grad_norm_l2 FROM read_parquet("
                      f"'{schema.segment_glob(trace, 'replicas')}', hive_partitioning = true) "
                      "ORDER BY rank, step, component").fetchall()


def test_local_norms_read_in_grad_equal_those_read_in_the_communication_hook(runs: Path) -> None:
    """DDP's default copies the gradients into its buckets, and the recorder reads the local ones
    in `.grad` before DDP copies the all-reduced ones back; with the gradients as views of the
    buckets it reads them in a communication hook. The same run gives the same norms both ways."""
    copied, views = _local_norms(runs / "ddp_grad_corrupt"), _local_norms(runs / "ddp_grad_corrupt_views")
    assert len(copied) == len(views) > 0
    assert [r[:3] for r in copied] == [r[:3] for r in views]
    assert [r[3] for r in copied] == pytest.approx([r[3] for r in views], rel=1e-5)


def test_with_micro_batches_the_local_norms_are_those_of_the_all_reduced_step(runs: Path) -> None:
    """Three micro-batches a step, DDP all-reducing after the last only: the local gradient read
    is that step's accumulated one, once a step, the same read in `.grad` as in the hook."""
    copied, views = _local_norms(runs / "ddp_accumulated"), _local_norms(runs / "ddp_accumulated_views")
    steps = SCENARIOS["ddp_accumulated"].steps
    assert {(r, s) for r, s, _, _ in copied} == {(r, s) for r in (0, 1) for s in range(1, steps + 1)}
    assert all(v is not None for *_, v in copied)
    assert [r[:3] for r in copied] == [r[:3] for r in views]
    assert [r[3] for r in copied] == pytest.approx([r[3] for r in views], rel=1e-5)


def test_steps_outside_ddp_are_visible_as_not_all_reduced(runs: Path) -> None:
    trace = open_trace(runs / "ddp_unwrapped_steps")
    try:
        rows = trace.con.execute("""SELECT step, bool_or(all_reduced) FROM ranks
            WHERE step BETWEEN 23 AND 28 GROUP BY step ORDER BY step""").fetchall()
    finally:
        trace.close()
    assert rows == [(23, True), (24, True), (25, False), (26, True), (27, False), (28, True)]
    root = analyze(runs / "ddp_unwrapped_steps").to_dict()["root"]
    assert "trained outside DDP" in root["evidence"] and root["ranks"] == [0, 1]


def test_the_clean_two_rank_twin_that_clips_is_healthy_with_no_alarm(runs: Path) -> None:
    d = analyze(runs / "ddp_clean").to_dict()
    assert (d["verdict"], d["root"], d["alarms"]) == ("healthy", None, [])


def _preclip_by_rank(trace: Path) -> dict[int, list[tuple[int, float, float | None]]]:
    rows = duckdb.sql(f"SELECT rank, step, grad_norm_total_l2, grad_norm_preclip_l2 FROM read_parquet("
                      f"'{schema.segment_glob(trace, 'steps')}', hive_partitioning = true) "
                      "ORDER BY rank, step").fetchall()
    out: dict[int, list[tuple[int, float, float | None]]] = {}
    for rank, step, total, pre in rows:
        out.setdefault(int(rank), []).append((step, total, pre))
    return out


def test_the_pre_clip_norm_is_that_of_the_all_reduced_gradients(runs: Path) -> None:
    """DDP copies the all-reduced gradients into `.grad` in a callback of its own at the end of
    the backward pass; the pre-clip norm is read after it, so where nothing clips it is the total
    norm on every rank, and where the loop clips it is the same on every rank."""
    for unclipped in ("ddp_clean_4ranks", "fsdp_clean"):
        ranks = _preclip_by_rank(runs / unclipped)
        assert len(ranks) == (4 if unclipped == "ddp_clean_4ranks" else 2)
        assert all(pre == total for steps in ranks.values() for _, total, pre in steps), unclipped
    ranks = _preclip_by_rank(runs / "ddp_clean")  # clipped to CLIP from its step 25 on
    start = SCENARIOS["ddp_clean"].step
    for steps in ranks.values():
        assert all(pre == total for step, total, pre in steps if step < start)
        assert [pre for step, _, pre in steps if step == start] == [None]  # the loop is seen to clip
        assert all(pre > total for step, total, pre in steps if step > start)
    later = [[pre for step, _, pre in steps if step > start] for steps in ranks.values()]
    assert len(later[0]) > 5 and later[0] == later[1]  # the all-reduced gradients are the same


def test_a_clean_four_rank_run_is_healthy_with_no_alarm(runs: Path) -> None:
    d = analyze(runs / "ddp_clean_4ranks").to_dict()
    assert d["trace_info"]["ranks"] == 4
    assert (d["verdict"], d["root"], d["alarms"]) == ("healthy", None, [])
    trace = open_trace(runs / "ddp_clean_4ranks")
    try:
        fingerprints, local = trace.one("SELECT max(fingerprints), count(local_grad_norm_median) FROM ranks")
        scanned = [r for (r,) in trace.con.execute(
            "SELECT DISTINCT rank FROM (SELECT rank FROM health_all UNION ALL SELECT rank FROM steps_all) "
            "ORDER BY rank").fetchall()]
        assert checks.data_ranks(trace) == scanned == [0, 1, 2, 3]  # from the footers, no scan
    finally:
        trace.close()
    assert fingerprints == 1 and local > 0  # replicas equal at every step; local norms recorded


def test_training_is_bit_identical_with_and_without_the_recorder(runs: Path) -> None:
    for rank in (0, 1):
        assert json.loads((runs / f"identity-rank{rank}.json").read_text())["bit_identical"] is True


def test_analyze_json_carries_the_rank(runs: Path) -> None:
    result = CliRunner().invoke(app, ["analyze", str(runs / "ddp_grad_corrupt"), "--json"])
    assert result.exit_code == 0, result.output
    d = json.loads(result.stdout)
    assert d["root"]["rank"] == 1
    text = CliRunner().invoke(app, ["analyze", str(runs / "ddp_unwrapped_steps")]).stdout
    assert "on every rank" in text and "(whole model)" in text


def test_fsdp2_shards_are_recorded_per_rank_and_combine_to_the_full_norm(runs: Path) -> None:
    truth = json.loads((runs / "fsdp_clean" / "truth.json").read_text())
    d = analyze(runs / "fsdp_clean").to_dict()
    assert (d["verdict"], d["alarms"]) == ("healthy", [])
    trace = open_trace(runs / "fsdp_clean")
    try:
        sharded = trace.one("SELECT bool_and(sharded), count(*) FROM replicas")
        rows = trace.con.execute("""SELECT component, sqrt(sum(weight_norm_l2 * weight_norm_l2)), count(*)
            FROM health WHERE step = 40 AND weight_norm_l2 IS NOT NULL GROUP BY component""").fetchall()
    finally:
        trace.close()
    assert sharded[0] is True and sharded[1] > 0  # shards are never compared as replicas
    assert {c for c, _, _ in rows} == set(truth["full_weight_norms"])
    for component, combined, ranks in rows:  # each rank's shard norm: together, the full norm
        assert ranks == 2
        assert abs(combined - truth["full_weight_norms"][component]) <= 1e-4 * truth["full_weight_norms"][component]


def test_the_report_shows_a_rank_by_step_panel(runs: Path, tmp_path: Path) -> None:
    from warninglight.forensics.presenting.report import write_html

    a = analyze(runs / "ddp_grad_corrupt")
    at = {r: dev for r, step, dev, _ in a.ranks_panel.iter_rows() if step == 25}
    assert at[1] > 1.0 and at[0] < -1.0  # rank 1 far above the ranks' median, rank 0 mirrored below
    html = write_html(runs / "ddp_grad_corrupt", tmp_path / "r.html", a).read_text()
    assert "Which rank: every rank at every step" in html
    diverged = analyze(runs / "ddp_unwrapped_steps").ranks_panel
    assert diverged.filter(pl.col("step") < 25)["diverged"].any() is False
    assert diverged.filter(pl.col("step") == 25)["diverged"].to_list() == [True, True]


def test_eval_counts_every_ranks_rows_and_fires_the_comparators_on_every_ranks_steps(runs: Path) -> None:
    # eval's denominator and comparator firings, taken from the analysis, are what reading the
    # multi-rank trace apart gives: every rank's health rows, the steps of every rank in order
    from test_evaluation import _read_run
    from warninglight.lab.evaluation import run_of

    fired = 0
    for path in sorted(p for p in runs.iterdir() if (p / "health").is_dir()):
        rows, comps = run_of(analyze(path, heat=False))
        assert (rows, comps) == _read_run(path) and rows > 0, path.name
        fired += len(comps.loss) + len(comps.grad)
    assert fired > 0


# --- the local-gradient finding on hand-built tables ------------------------------------------

def _local(world: int, steps: int = 40, seed: int = 0) -> pl.DataFrame:
    """Local gradient norms of a healthy run: per rank its own noise around a per-component scale."""
    rng = np.random.default_rng(seed)
    comps = [f"c{i}" for i in range(6)]
    scale = {c: 10 ** rng.uniform(-2, 0) for c in comps}
    return pl.DataFrame([{"rank": r, "component": c, "step": s, "g": scale[c] * float(np.exp(rng.normal(0, 0.15)))}
                         for s in range(1, steps + 1) for c in comps for r in range(world)])


def _scaled(rows: pl.DataFrame, ranks: list[int], components: list[str], factor: float, step: int = 30) -> pl.DataFrame:
    where = pl.col("rank").is_in(ranks) & pl.col("component").is_in(components) & (pl.col("step") >= step)
    return rows.with_columns(pl.when(where).then(pl.col("g") * factor).otherwise(pl.col("g")).alias("g"))


@pytest.mark.parametrize(("world", "odd"), [(2, [1]), (2, [0]), (4, [2, 3])])
def test_the_ranks_whose_own_local_norm_left_its_own_history_are_named(world: int, odd: list[int]) -> None:
    f = local_finding(_scaled(_local(world), odd, ["c2"], 30.0), world)
    assert f is not None and (f.component, f.step, f.ranks) == ("c2", 30, odd)
    assert f.rank == (odd[0] if len(odd) == 1 else None) and f.some_ranks


def test_two_ranks_whose_local_norms_both_left_their_own_history_are_not_told_apart() -> None:
    rows = _scaled(_scaled(_local(2), [0], ["c2"], 30.0), [1], ["c2"], 1 / 30)
    f = local_finding(rows, 2)
    assert f is not None and (f.step, f.rank, f.ranks) == (30, None, [0, 1]) and not f.some_ranks


def test_a_rank_whose_local_gradient_is_all_zero_is_named_at_the_first_step_on_the_whole_model() -> None:
    comps = sorted(_local(2)["component"].unique())
    f = local_finding(_scaled(_local(2), [1], comps, 0.0, step=1), 2)
    assert f is not None and (f.component, f.step, f.rank, f.condition) == ("", 1, 1, "losing_gradient")
