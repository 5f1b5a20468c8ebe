"""Hits to alarms: what a rule's firing becomes in the classifier's answer.

A *hit* is a (component, condition, rule, step) whose rule held for the condition's persistence
(`judge` finds them); an *alarm* is the first hit of an episode (hits of one component and
condition no more than `episode_gap` steps apart), with the episode's strongest metric. An
unclassified hit counts only where no named condition fired on the same row.
"""

from __future__ import annotations

import polars as pl
from warninglight.forensics.judging.baseline import DERIVED_METRICS
from warninglight.forensics.judging.conditions import UNCLASSIFIED, Config
from warninglight.tracer import schema
from warninglight.tracer.schema import FORWARD, GRADIENT, HEAD, WEIGHTS

SIGNALS = (FORWARD, GRADIENT, WEIGHTS)
# Metrics whose disturbance travels with the forward pass (a head's predictions included).
FORWARD_METRICS = schema.metrics_of(FORWARD, HEAD)


def signal_of(metric: str) -> str:
    """Which way a metric's disturbance travels: one of SIGNALS (a head's predictions are forward)."""
    if metric in DERIVED_METRICS:  # the learning rate: it acts through the optimizer's step
        return WEIGHTS
    kind = schema.kind_of(metric)
    return FORWARD if kind == HEAD else kind


HIT_COLUMNS = ("rank", "component", "step", "condition", "metric", "value", "median", "magnitude")
ALARM_SCHEMA = {"rank": pl.Int64, "component": pl.String, "condition": pl.String,
                "step": pl.Int64, "last_step": pl.Int64, "metric": pl.String,
                "value": pl.Float64, "median": pl.Float64, "magnitude": pl.Float64}


def lead(config: Config) -> int:
    """Rows before a judged one whose rule verdicts it reads (the longest persistence, less one)."""
    return max(c.persistence_of(r) for c in config.conditions for r in c.rules) - 1


def finish_hits(found: pl.DataFrame | None) -> pl.DataFrame:
    """`hits`' frame from the rows of every rule that fired (`HIT_COLUMNS`, rules in the
    config's order): an unclassified hit only where no named condition fired on the row, sorted."""
    if found is None:
        return pl.DataFrame(schema={k: ALARM_SCHEMA[k] for k in HIT_COLUMNS})
    found = found.with_columns(pl.col("rank").cast(pl.Int64))
    named = found.filter(pl.col("condition") != UNCLASSIFIED)
    other = found.filter(pl.col("condition") == UNCLASSIFIED).join(
        named.select("rank", "component", "step").unique(), on=["rank", "component", "step"], how="anti")
    return pl.concat([named, other]).sort("rank", "component", "condition", "step")


def alarms(found: pl.DataFrame, config: Config) -> pl.DataFrame:
    """The first hit of each episode per (rank, component, condition), strongest metric first."""
    if found.is_empty():
        return pl.DataFrame(schema=ALARM_SCHEMA)
    group = ["rank", "component", "condition"]
    steps = found.select(*group, "step").unique().sort(*group, "step")
    steps = steps.with_columns(
        ((pl.col("step") - pl.col("step").shift(1).over(group)).fill_null(1 << 40)
         > config.baseline.episode_gap).cum_sum().over(group).alias("episode"))
    ends = steps.group_by(*group, "episode").agg(pl.col("step").min(), pl.col("step").max().alias("last_step"))
    # The episode's metric: a forward signal first (it tells localisation where the values went
    # wrong), then a non-finite one, then the largest |z|.
    forward = pl.col("metric").is_in(FORWARD_METRICS)
    strength = pl.when(pl.col("magnitude").is_null()).then(float("inf")).otherwise(pl.col("magnitude").abs())
    first = (found.join(ends.drop("last_step"), on=[*group, "step"])
             .sort(forward, strength, "metric", descending=[True, True, False])  # metric: ties, deterministic
             .unique([*group, "episode"], keep="first", maintain_order=True))
    out = first.join(ends, on=[*group, "episode", "step"]).drop("episode")
    return out.select(list(ALARM_SCHEMA)).cast(ALARM_SCHEMA).sort("step", "rank", "component", "condition")
