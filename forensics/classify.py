"""The classifier: condition rules as Polars expressions over the baseline, and alarms from hits.

One classifier serves the offline analysis (whole trace) and the live replay (a sliding window of
`BaselineConfig.history` steps): both call `score` then `hits` then `alarms`. Every expression
is causal (it reads the current step and the baseline of earlier steps only), so a hit at step t
is exactly what a live monitor would have seen at t.

A *hit* is a (component, condition, rule, step) whose rule held for the condition's persistence;
an *alarm* is the first hit of an episode (hits of one component and condition no more than
`episode_gap` steps apart).
"""

from __future__ import annotations

import polars as pl
from warninglight.tracer import schema
from warninglight.tracer.schema import COUNT_METRICS, FORWARD, GRADIENT, HEAD, WEIGHTS

from .baseline import DERIVED_METRICS, POS, metrics_in, with_baseline
from .conditions import DOWN, EITHER, NONFINITE, UNCLASSIFIED, UP, Condition, Config, Rule

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


def _rule_expr(rule: Rule) -> pl.Expr:
    """True where `rule` holds at a step (before persistence); null-safe."""
    v = pl.col(rule.metric).cast(pl.Float64)
    if rule.direction == NONFINITE:
        hit = v > 0 if rule.metric in COUNT_METRICS else v.is_not_null() & ~v.is_finite()
        return hit.fill_null(False)
    med, z = pl.col(f"{rule.metric}__med"), pl.col(f"{rule.metric}__z")
    up, down = rule.direction in (UP, EITHER), rule.direction in (DOWN, EITHER)
    parts_up: list[pl.Expr] = [v.is_finite()]
    parts_down: list[pl.Expr] = [v.is_finite()]
    if rule.z is not None:
        parts_up.append(z >= rule.z)
        parts_down.append(z <= -rule.z)
    if rule.fold is not None:
        parts_up += [med > 0, v >= med * rule.fold]
        parts_down += [med > 0, v <= med / rule.fold]
    if rule.delta is not None:
        parts_up.append(v - med >= rule.delta)
        parts_down.append(med - v >= rule.delta)
    if rule.level is not None:
        parts_up.append(v >= rule.level)
        parts_down.append(v <= rule.level)
    hit = pl.lit(False)
    if up:
        hit = hit | pl.all_horizontal(parts_up)
    if down:
        hit = hit | pl.all_horizontal(parts_down)
    if rule.peers_fold is not None:  # the typical component still moves: this one alone stopped
        hit = hit & (pl.col(f"{rule.metric}__peers") >= rule.peers_fold)
    if rule.roles:
        hit = hit & pl.col("role").is_in(list(rule.roles))
    return hit.fill_null(False)


def _persisted(hit: pl.Expr, steps: int) -> pl.Expr:
    """True where `hit` held on this and the `steps - 1` previous rows of the component.

    One rolling sum down the whole sorted frame; a window that reaches into the previous series
    is cut off by the row's place in its own (`POS`)."""
    if steps == 1:
        return hit
    held = hit.cast(pl.Int32).rolling_sum(window_size=steps, min_samples=steps)
    return ((held == steps) & (pl.col(POS) >= steps - 1)).fill_null(False)


def _rules(config: Config) -> list[tuple[Condition, Rule, str]]:
    return [(c, r, f"hit__{c.name}__{i}") for c in config.conditions for i, r in enumerate(c.rules)]


def lead(config: Config) -> int:
    """Rows before a judged one whose rule verdicts it reads (the longest persistence, less one)."""
    return max(c.persistence_of(r) for c in config.conditions for r in c.rules) - 1


def score(frame: pl.LazyFrame, config: Config, reference: pl.DataFrame | None = None,
          judged: str | None = None) -> pl.LazyFrame:
    """Health rows with baseline columns and one boolean column per (condition, rule).

    `reference`: judge against a reference run's baseline instead of each component's past.
    `judged`: a boolean column marking the rows that will be judged: only those are scored
    exactly (with the rows their persistence reads); the frame keeps fewer of the others.
    """
    scored = with_baseline(frame, config.baseline, reference=reference, judged=judged, lead=lead(config))
    present = set(metrics_in(scored))  # with the metrics the baseline derives (lr_surge)
    peers = {r.metric for c in config.conditions for r in c.rules if r.peers_fold is not None} & present
    scored = scored.with_columns([  # the median component's value/baseline at each step
        (pl.col(m).cast(pl.Float64) / pl.col(f"{m}__med")).median().over(["rank", "step"]).alias(f"{m}__peers")
        for m in peers])
    cols = [_persisted(_rule_expr(r), c.persistence_of(r)).alias(name)
            for c, r, name in _rules(config) if r.metric in present]
    return scored.with_columns(cols).drop(POS)


def _magnitude(rule: Rule) -> pl.Expr:
    if rule.direction == NONFINITE:  # a count has baseline 0 and scale 1: its z is the count
        return pl.col(rule.metric).cast(pl.Float64) if rule.metric in COUNT_METRICS else pl.lit(None, pl.Float64)
    return pl.col(f"{rule.metric}__z")


def hits(scored: pl.LazyFrame, config: Config) -> pl.DataFrame:
    """Every (component, condition, step) that fired, with the rule's metric and robust z."""
    names = set(scored.collect_schema().names())
    rules = [(c, r, name) for c, r, name in _rules(config) if name in names]
    if rules:  # hits are rare: one pass keeps the rows with any, and each rule reads those
        scored = scored.filter(pl.any_horizontal([name for _, _, name in rules])).collect().lazy()
    parts = []
    for c, r, name in rules:
        med = pl.col(f"{r.metric}__med") if r.direction != NONFINITE else pl.lit(None, pl.Float64)
        parts.append(scored.filter(pl.col(name)).select(
            "rank", "component", "step", pl.lit(c.name).alias("condition"),
            pl.lit(r.metric).alias("metric"), pl.col(r.metric).cast(pl.Float64).alias("value"),
            med.cast(pl.Float64).alias("median"), _magnitude(r).cast(pl.Float64).alias("magnitude")))
    return finish_hits(pl.concat(pl.collect_all(parts)) if parts else None)


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


def classify(frame: pl.LazyFrame, config: Config,
             reference: pl.DataFrame | None = None) -> tuple[pl.DataFrame, pl.DataFrame]:
    """(scored rows, alarms) for a whole health frame (against a reference run's baseline if given)."""
    scored = score(frame, config, reference).collect()
    return scored, alarms(hits(scored.lazy(), config), config)
