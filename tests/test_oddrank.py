"""Which rank is the odd one without a majority, decided on hand-built per-rank evidence.

Each table is what `oddrank.judge` reads: per rank, parameter-owning component and step, the
gradient norm at optimizer.step (g), the update norm (u), the local gradient norm before the
all-reduce (local) and whether it was all-reduced (synced). Up to the step the replicas part,
every rank holds the same all-reduced gradient and update (a shared past, noisy); local norms
differ by rank (each rank reads its own data). The real spawned runs are in test_ranks.py.
"""

from __future__ import annotations

import numpy as np
import polars as pl
import pytest
from warninglight.forensics.explaining import oddrank
from warninglight.forensics.explaining.oddrank import split

COMPONENTS = ["wte", "h.0.ln_1", "h.0.attn", "h.0.ln_2", "h.0.mlp", "ln_f", "lm_head"]
LAYERNORMS = ["h.0.ln_1", "h.0.ln_2", "ln_f"]
STEP = 30  # the step the replicas part


def _rows(world: int = 2, seed: int = 0, first: int = 1) -> pl.DataFrame:
    """Steps `first`..STEP of a healthy run: g and u shared by every rank, local norms per rank."""
    rng = np.random.default_rng(seed)
    out = []
    scale = {c: 10 ** rng.uniform(-2, 0) for c in COMPONENTS}
    for step in range(first, STEP + 1):
        for c in COMPONENTS:
            g = scale[c] * np.exp(rng.normal(0, 0.1))
            u = 1e-3 * np.exp(rng.normal(0, 0.05))
            # local norms around the average's norm / coherence: the average is at most their mean
            local = g / 0.8 * np.exp(rng.normal(0, 0.15, world))
            for r in range(world):
                out.append({"rank": r, "component": c, "step": step, "g": g, "u": u,
                            "local": float(local[r]), "synced": True, "seen": True})
    return pl.DataFrame(out)


def _at_step(rows: pl.DataFrame, ranks: list[int], components: list[str], **set_to: pl.Expr) -> pl.DataFrame:
    """`rows` with columns replaced by `set_to` on `ranks` x `components` at `STEP`."""
    where = (pl.col("step") == STEP) & pl.col("rank").is_in(ranks) & pl.col("component").is_in(components)
    return rows.with_columns(**{k: pl.when(where).then(v).otherwise(pl.col(k)) for k, v in set_to.items()})


def _clipped(rows: pl.DataFrame, skip: list[int], factor: float = 0.1) -> pl.DataFrame:
    """Every rank clips its gradient by `factor` at STEP, except LayerNorm's on the `skip` ranks."""
    world = rows["rank"].n_unique()
    others = [r for r in range(world) if r not in skip]
    rows = _at_step(rows, others, COMPONENTS, g=pl.col("g") * factor)
    return _at_step(rows, skip, [c for c in COMPONENTS if c not in LAYERNORMS], g=pl.col("g") * factor)


@pytest.mark.parametrize(("z", "move", "odd"), [
    ({0: 0.5, 1: 30.0}, {0: 0.01, 1: 2.0}, [1]),              # one left its own past, one stayed
    ({0: 30.0, 1: 25.0}, {0: 2.0, 1: 1.8}, []),               # both left it alike: symmetric
    ({0: 0.5, 1: 1.0}, {0: 0.01, 1: 0.02}, []),               # neither did
    ({0: 0.5, 1: 30.0}, {0: 0.01, 1: 0.1}, []),               # far in z but a tiny change
    ({0: 6.0, 1: 30.0}, {0: 0.3, 1: 2.0}, []),                # the other neither stayed nor left
    ({0: None, 1: 30.0}, {0: None, 1: 2.0}, []),              # the other has no past to judge by
    ({0: 0.1, 1: 0.2, 2: -20.0, 3: -40.0}, {0: 0.0, 1: 0.0, 2: -1.5, 3: -3.0}, [2, 3]),  # a node of two
    ({0: 0.1, 1: float("inf")}, {0: 0.0, 1: float("inf")}, [1]),  # a non-finite value left it
])
def test_split_names_the_ranks_that_left_their_own_past_while_the_others_stayed(
        z: dict[int, float | None], move: dict[int, float | None], odd: list[int]) -> None:
    assert split(z, move) == odd


@pytest.mark.parametrize("world", [2, 4])
def test_gradients_zeroed_after_the_all_reduce_name_that_rank(world: int) -> None:
    odd = [1] if world == 2 else [2, 3]
    found = oddrank.judge(_at_step(_rows(world), odd, COMPONENTS, g=pl.lit(0.0)), STEP, COMPONENTS, world)
    assert found.ranks == odd and "zero" in found.how


def test_a_rank_whose_health_row_is_missing_is_not_taken_for_one_without_a_gradient() -> None:
    rows = _at_step(_rows(), [1], COMPONENTS, g=pl.lit(None, pl.Float64), seen=pl.lit(False))
    assert oddrank.judge(rows, STEP, COMPONENTS, 2).ranks == []  # a dropped row, not a dropped gradient


def test_a_rank_that_ran_no_all_reduce_is_named_and_none_running_one_is_every_rank() -> None:
    rows = _rows()
    one = oddrank.judge(_at_step(rows, [0], COMPONENTS, synced=pl.lit(False)), STEP, COMPONENTS, 2)
    assert one.ranks == [0] and "no all-reduce" in one.how
    none = oddrank.judge(_at_step(rows, [0, 1], COMPONENTS, synced=pl.lit(False)), STEP, COMPONENTS, 2)
    assert none.ranks == [] and "no rank all-reduced" in none.how
    never = rows.with_columns(synced=pl.lit(False), local=pl.lit(None, pl.Float64))  # no hook recorded it
    assert oddrank.judge(never, STEP, COMPONENTS, 2).ranks == []


def test_a_gradient_above_what_the_average_can_be_names_its_rank() -> None:
    rows = _at_step(_rows(), [1], ["h.0.mlp"], g=pl.col("local") * 3)  # scaled up after the all-reduce
    found = oddrank.judge(rows, STEP, COMPONENTS, 2)
    assert (found.ranks, found.components) == ([1], ["h.0.mlp"])


@pytest.mark.parametrize("world", [2, 4])
def test_layernorm_left_out_of_one_ranks_clipping_is_named_by_its_own_past(world: int) -> None:
    skip = [1] if world == 2 else [2, 3]
    rows = _clipped(_rows(world), skip).with_columns(local=pl.lit(None, pl.Float64))  # history alone
    found = oddrank.judge(rows, STEP, COMPONENTS, world)
    assert found.ranks == skip and "own past" in found.how
    assert found.components == LAYERNORMS


def test_layernorm_left_out_of_clipping_from_the_first_step_is_named_by_its_own_components() -> None:
    rows = _clipped(_rows(first=STEP), [1])  # no past at all: the step is the run's first
    found = oddrank.judge(rows, STEP, COMPONENTS, 2)
    assert found.ranks == [1] and "out of line" in found.how
    assert found.components == LAYERNORMS


def test_ranks_that_moved_alike_are_not_told_apart_and_the_reason_says_so() -> None:
    # every rank clipped alike, yet the checksums differ (an update that differs in its last bits)
    found = oddrank.judge(_clipped(_rows(), []), STEP, COMPONENTS, 2)
    assert found.ranks == [] and "alike" in found.how
    # both ranks' LayerNorm gradients scaled down, each by its own factor: each left its own past
    rows = _at_step(_at_step(_rows(), [0], LAYERNORMS, g=pl.col("g") / 10), [1], LAYERNORMS, g=pl.col("g") / 100)
    assert oddrank.judge(rows, STEP, COMPONENTS, 2).ranks == []
    # one scaled up past what an average can be is named all the same: that is exact
    rows = _at_step(_at_step(_rows(), [0], LAYERNORMS, g=pl.col("g") * 10), [1], LAYERNORMS, g=pl.col("g") / 10)
    assert oddrank.judge(rows, STEP, COMPONENTS, 2).ranks == [0]


def test_a_rank_whose_updates_collapsed_is_named_when_its_gradients_look_alike() -> None:
    rows = _at_step(_rows(), [1], COMPONENTS, u=pl.lit(0.0))  # e.g. its optimizer skipped the step
    found = oddrank.judge(rows, STEP, COMPONENTS, 2)
    assert found.ranks == [1] and "update size" in found.how
