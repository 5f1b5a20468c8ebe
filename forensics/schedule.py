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

from dataclasses import dataclass

import polars as pl

from .store import Trace


def _columns(trace: Trace, view: str) -> set[str]:
    return {d[0] for d in trace.con.execute(f"SELECT * FROM {view} LIMIT 0").description}


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
    """The lr schedule of every parameter-owning component; None if no lr was recorded."""
    steps, comps = _columns(trace, "steps"), _columns(trace, "components")
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
    if "param_group" not in _columns(trace, "components") or "lr_groups" not in _columns(trace, "steps"):
        return []
    if trace.one("SELECT count(*) FROM steps WHERE lr_groups IS NOT NULL")[0] == 0:
        return []  # the run was recorded without an optimizer: nothing to hold them
    rows = trace.con.execute("""SELECT DISTINCT component FROM components
                                WHERE param_count > 0 AND param_group IS NULL ORDER BY component""").fetchall()
    return [r[0] for r in rows]


def with_lr(health: pl.LazyFrame, trace: Trace) -> pl.LazyFrame:
    """Health rows with each component's `lr` column (null where none applies or none was recorded)."""
    return join_lr(health, component_lr(trace))


def join_lr(health: pl.LazyFrame, schedule: Schedule | None) -> pl.LazyFrame:
    """Health rows with the `lr` column of the schedule joined on (rank, step) and (rank, component).

    A component whose parameters get gradients while no param group holds them has lr NaN: its
    gradients are computed every step and never applied (the registry's stagnant condition reads
    it). Without gradients (frozen on purpose, `requires_grad=False`) its lr is null: no verdict.
    """
    if schedule is None:
        return health
    health = health.with_columns(pl.col("rank").cast(pl.Int64), pl.col("step").cast(pl.Int64))
    if "grad_norm_l2" in health.collect_schema().names():
        unheld = pl.col("lr").is_nan() & ~(pl.col("grad_norm_l2").cast(pl.Float64) > 0).fill_null(False)
        read = ["rank", "step", "component", "grad_norm_l2"]
    else:  # no gradients recorded: nothing says they are computed
        unheld = pl.col("lr").is_nan()
        read = ["rank", "step", "component"]
    # the joins take only the columns the lr is made of, and the lr goes beside the rows: joining
    # the whole rows copied every column twice (~7% of `analyze` on a large run). The small
    # tables hold one row per (rank, step) and per (rank, component), so the joins keep the rows'
    # number and order; the rows are read once (a scan read twice may not give one order), and
    # eagerly: the same joins as a lazy query took ~2.4x as long on a large run's window
    rows = health.collect()
    lr = (rows.select(read)
          .join(schedule.steps, on=["rank", "step"], how="left", maintain_order="left")
          .join(schedule.owners, on=["rank", "component"], how="left", maintain_order="left")
          .with_columns(schedule.lr_expr().alias("lr"))
          .select(pl.when(unheld).then(None).otherwise(pl.col("lr")).alias("lr")))
    return rows.with_columns(lr.to_series()).lazy()
