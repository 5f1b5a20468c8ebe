"""The learning rate each component's parameters saw at each step: what the optimizer intended.

SGD (with or without momentum), Adam and AdamW all step by the learning rate times a direction
that does not depend on it, so a scheduled change of the learning rate (warmup, step decay,
cosine, one-cycle, a manual `param_group["lr"]` change, a different lr per param group) moves a
component's update norm by exactly the same factor. The baseline judges update metrics relative
to the lr in effect (`baseline.LR_SCALED`), so a schedule is not a fault; a rise of the lr
itself far beyond the run's own history is (`lr_surge`, classified in the registry).

Where the recorder wrote every param group's lr (`steps.lr_groups`) and which group holds each
component (`components.param_group`), a component sees its own group's lr; older traces only
have the first group's `steps.lr`, which every parameter-owning component is then given.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TypeVar

import numba
import numpy as np
import polars as pl
from warninglight.forensics.trace.store import Trace

F = TypeVar("F", pl.DataFrame, pl.LazyFrame)


@dataclass(frozen=True)
class Schedule:
    """The lr of every step (and param group) and which group holds each parameter-owning
    component: two small tables, which `join_lr` expands only for the health rows at hand (a
    component × step table of a long run would hold as many rows as the health table)."""

    steps: pl.DataFrame   # rank, step, lr[, lr_groups]
    owners: pl.DataFrame  # rank, component[, param_group]: the components that own parameters

    def lr_expr(self) -> pl.Expr:
        """The lr a row's component saw, over the columns `join_lr` joins in."""
        lr = pl.col("__step_lr").cast(pl.Float64)
        if "__lr_groups" in self.steps.columns and "__group" in self.owners.columns:
            # lr_groups is null where the run had no optimizer; param_group null: no group holds
            # the component, so no learning rate applies to it (NaN, see `join_lr`)
            lr = (pl.when(pl.col("__lr_groups").is_null()).then(lr)
                  .when(pl.col("__group").is_null()).then(pl.lit(float("nan")))
                  .otherwise(pl.col("__lr_groups").list.get(pl.col("__group"), null_on_oob=True))
                  .cast(pl.Float64))
        return pl.when(pl.col("__owner")).then(lr)

    def table(self) -> pl.DataFrame:
        """rank, step, component, lr of every owner at every step (for a small run: it is as long
        as the health table)."""
        rows = self.steps.join(self.owners, on="rank")
        return rows.select(pl.col("rank").cast(pl.Int64), pl.col("step").cast(pl.Int64), "component",
                           self.lr_expr().alias("lr"))


def component_lr(trace: Trace) -> Schedule | None:
    """The lr schedule of every parameter-owning component; None if no lr was recorded (read once
    while the trace is open: the classifier and localisation both join it)."""
    return trace.once(("component_lr",), lambda: _read_component_lr(trace))


def _read_component_lr(trace: Trace) -> Schedule | None:
    steps, comps = trace.columns("steps"), trace.columns("components")
    if "lr" not in steps:
        return None
    step_cols = ", ".join(c for c in ("rank", "step", "lr", "lr_groups") if c in steps)
    comp_cols = ", ".join(c for c in ("rank", "component", "param_count", "param_group") if c in comps)
    return lr_of_components(trace.con.sql(f"SELECT {step_cols} FROM steps").pl(),
                            trace.con.sql(f"SELECT {comp_cols} FROM components").pl())


def lr_of_components(steps: pl.DataFrame, components: pl.DataFrame) -> Schedule | None:
    """The schedule from a `steps` and a `components` table (as frames; the live monitor has them
    in memory); None if no lr was recorded for any parameter-owning component."""
    if "lr" not in steps.columns:
        return None
    step_cols = {"lr": "__step_lr", "lr_groups": "__lr_groups"}
    # one row per (rank, step) and per (rank, component), the last recorded: `join_lr` adds one
    # lr to each health row
    kept = steps.select(pl.col("rank").cast(pl.Int64), pl.col("step").cast(pl.Int64),
                        *(pl.col(c).alias(a) for c, a in step_cols.items() if c in steps.columns)
                        ).unique(["rank", "step"], keep="last", maintain_order=True)
    owners = components.filter(pl.col("param_count") > 0).select(
        pl.col("rank").cast(pl.Int64), "component", pl.lit(True).alias("__owner"),
        *([pl.col("param_group").alias("__group")] if "param_group" in components.columns else [])
    ).unique(["rank", "component"], keep="last", maintain_order=True)
    schedule = Schedule(kept, owners)
    # all null: no lr applies anywhere (the groups are few: check them, not every component)
    groups = owners.drop("component").unique()
    if kept.is_empty() or groups.is_empty() or kept.join(groups, on="rank").select(
            schedule.lr_expr().is_null().all()).item():
        return None
    return schedule


def not_held(trace: Trace) -> list[str]:
    """Parameter-owning components whose parameters no optimizer param group holds."""
    if "param_group" not in trace.columns("components") or "lr_groups" not in trace.columns("steps"):
        return []
    if trace.one("SELECT count(*) FROM steps WHERE lr_groups IS NOT NULL")[0] == 0:
        return []  # the run was recorded without an optimizer: nothing to hold them
    rows = trace.con.execute("""SELECT DISTINCT component FROM components
                                WHERE param_count > 0 AND param_group IS NULL ORDER BY component""").fetchall()
    return [r[0] for r in rows]


def with_lr(health: pl.LazyFrame, trace: Trace) -> pl.LazyFrame:
    """Health rows with each component's `lr` column (null where none applies or none was recorded)."""
    return join_lr(health, component_lr(trace))


def join_lr(health: F, schedule: Schedule | None) -> F:
    """Health rows with the `lr` column of the schedule joined on (rank, step) and (rank, component):
    lazy for lazy rows, eager for eager ones (a lazy query's rows come back in several chunks,
    which every later column added or taken copies whole again).

    A component whose parameters get gradients while no param group holds them has lr NaN: its
    gradients are computed every step and never applied (the registry's stagnant condition reads
    it). Without gradients (frozen on purpose, `requires_grad=False`) its lr is null: no verdict.
    """
    if schedule is None:
        return health
    # the rows are read once (a scan read twice may not give one order), and eagerly: the joins
    # below then run on rows in memory, not as one more lazy plan over the scan
    rows = (health.collect() if isinstance(health, pl.LazyFrame) else health).with_columns(
        pl.col("rank").cast(pl.Int64), pl.col("step").cast(pl.Int64))
    if "grad_norm_l2" in rows.columns:
        unheld = pl.col("lr").is_nan() & ~(pl.col("grad_norm_l2").cast(pl.Float64) > 0).fill_null(False)
        read = ["rank", "step", "component", "grad_norm_l2"]
    else:  # no gradients recorded: nothing says they are computed
        unheld = pl.col("lr").is_nan()
        read = ["rank", "step", "component"]
    lr = _lr_indexed(rows, schedule)
    if lr is None:  # names as strings, or keys too sparse for a table: joined
        # the joins take only the columns the lr is made of, and the lr goes beside the rows:
        # joining the whole rows copied every column twice. The
        # small tables hold one row per (rank, step) and per (rank, component), so the joins keep
        # the rows' number and order
        lr = (rows.select(read)
              .join(schedule.steps, on=["rank", "step"], how="left", maintain_order="left")
              .join(schedule.owners.with_columns(pl.col("component").cast(rows.schema["component"])),
                    on=["rank", "component"], how="left", maintain_order="left")
              .with_columns(schedule.lr_expr().alias("lr"))
              .select(pl.when(unheld).then(None).otherwise(pl.col("lr")).alias("lr"))).to_series()
    rows = rows.with_columns(lr)
    return rows.lazy() if isinstance(health, pl.LazyFrame) else rows  # type: ignore[return-value]


_TABLE_CELLS = 1 << 24  # `_lookup`: the most cells of a lookup table (128 MB of int64)


def _lookup(a: np.ndarray, b: np.ndarray, a_span: tuple[int, int], b_span: tuple[int, int]) -> np.ndarray | None:
    """A table of the rows of a small table with integer key columns `a`, `b` (no key twice),
    by (a - a_span[0]) * width + (b - b_span[0]) over the spans given (-1: no row); None where
    it would hold more than `_TABLE_CELLS`."""
    width = b_span[1] - b_span[0] + 1
    cells = (a_span[1] - a_span[0] + 1) * width
    if cells > _TABLE_CELLS:
        return None
    inside = (a >= a_span[0]) & (a <= a_span[1]) & (b >= b_span[0]) & (b <= b_span[1])
    place = np.full(cells, -1, dtype=np.int64)
    place[(a[inside] - a_span[0]) * width + (b[inside] - b_span[0])] = np.flatnonzero(inside)
    return place


@numba.njit(cache=True, nogil=True)
def _lr_of_rows(rank: np.ndarray, step: np.ndarray, code: np.ndarray, r0: int, s0: int, c0: int,
                at_step: np.ndarray, s_width: int, owner: np.ndarray, c_width: int, column: np.ndarray,
                width: int, value: np.ndarray, null: np.ndarray, grad: np.ndarray, out: np.ndarray,
                missing: np.ndarray) -> None:  # pragma: no cover - compiled
    """Per row, the lr of its step's row of the schedule (`at_step`) in the column of its
    owner's group (`owner`, `column`): `value`, null where `null`, no step or no owner, and
    where the lr is NaN and the gradient (NaN: none) is not above 0 (unheld, see `join_lr`)."""
    for i in range(len(rank)):
        r = rank[i] - r0
        si = at_step[r * s_width + step[i] - s0]
        oi = owner[r * c_width + code[i] - c0]
        if si < 0 or oi < 0:
            out[i], missing[i] = np.nan, True
            continue
        cell = si * width + column[oi]
        v = value[cell]
        out[i] = v
        missing[i] = null[cell] or (math.isnan(v) and not grad[i] > 0)


def _lr_indexed(rows: pl.DataFrame, schedule: Schedule) -> pl.Series | None:
    """`join_lr`'s lr column of `rows`, by lookups instead of joins (two joins hash every row of a
    window on two keys; here the lr of each (step, group) is taken once from
    the small tables, then one compiled pass over the rows): for rows whose component is
    Categorical (`health_window(categorical=True)`) and whose keys span tables of at most
    `_TABLE_CELLS`. None otherwise."""
    if (rows.is_empty() or rows.schema["component"] != pl.Categorical
            or any(rows[c].null_count() for c in ("rank", "step", "component"))):
        return None
    rank, step = (rows[c].to_numpy().astype(np.int64, copy=False) for c in ("rank", "step"))
    code = rows["component"].to_physical().to_numpy()  # the Categorical's codes, as they are
    ranks, steps_at, codes = ((int(x.min()), int(x.max())) for x in (rank, step, code))
    steps = schedule.steps.filter(pl.col("step").is_between(*steps_at))
    owners = schedule.owners.with_columns(pl.col("component").cast(pl.Categorical)).drop_nulls("component")
    if steps.is_empty() or owners.is_empty():
        return pl.Series("lr", [None] * rows.height, dtype=pl.Float64)
    at_step = _lookup(steps["rank"].to_numpy(), steps["step"].to_numpy(), ranks, steps_at)
    owner = _lookup(owners["rank"].to_numpy(), owners["component"].to_physical().to_numpy().astype(np.int64),
                    ranks, codes)
    if at_step is None or owner is None:
        return None
    # the lr of every step at hand (rows) for every group an owner names (columns; the first:
    # none), by `Schedule.lr_expr` itself, and each owner's column
    grouped = "__lr_groups" in steps.columns and "__group" in owners.columns
    groups = owners["__group"].drop_nulls().unique().sort() if grouped else pl.Series([], dtype=pl.Int64)
    column = np.zeros(owners.height, dtype=np.int64)
    if grouped:
        held = ~owners["__group"].is_null().to_numpy()
        column[held] = np.searchsorted(groups.to_numpy(), owners["__group"].to_numpy()[held]) + 1
    lrs = [steps.with_columns(pl.lit(g, pl.Int64).alias("__group"), pl.lit(True).alias("__owner"))
           .select(schedule.lr_expr())[:, 0] for g in [None, *groups]]
    value = np.column_stack([lr.cast(pl.Float64).fill_null(np.nan).to_numpy() for lr in lrs]).ravel()
    null = np.column_stack([lr.is_null().to_numpy() for lr in lrs]).ravel()
    grad = (rows["grad_norm_l2"].cast(pl.Float64).fill_null(np.nan).to_numpy() if "grad_norm_l2" in rows.columns
            else np.full(rows.height, np.nan))  # no gradients recorded: nothing says they are computed
    lr, missing = np.empty(rows.height), np.empty(rows.height, dtype=np.bool_)
    _lr_of_rows(rank, step, code, ranks[0], steps_at[0], codes[0], at_step, steps_at[1] - steps_at[0] + 1,
                owner, codes[1] - codes[0] + 1, column, len(lrs), value, null, grad, lr, missing)
    return pl.Series("lr", lr, dtype=pl.Float64).set(pl.Series(missing), None)
