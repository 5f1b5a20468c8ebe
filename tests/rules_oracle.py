"""The rules as Polars expressions: a test oracle for the compiled evaluator, never imported by
the product.

`score` writes every metric's baseline (median, scale, z; `baseline.with_baseline`, against each
component's own past or a reference run's) and one boolean column per (condition, rule); `hits`
keeps the rows where a rule fired. Written from the registry's declaration alone, apart from the
compiled `kernels.rules`, so the two can be held to each other row for row: tests compare
`judge.judge` (what `analyze`, `replay`, a reference run and live alarms run) with this.
"""

from __future__ import annotations

import polars as pl
from warninglight.forensics.judging.baseline import HEAT, POS, metrics_in, with_baseline
from warninglight.forensics.judging.conditions import (
    DOWN,
    EITHER,
    NONFINITE,
    UP,
    Condition,
    Config,
    Rule,
)
from warninglight.forensics.judging.hits import ALARM_SCHEMA, alarms, finish_hits, lead
from warninglight.tracer.schema import COUNT_METRICS

__all__ = ["ALARM_SCHEMA", "alarms", "classify", "heat_of", "hits", "lead", "score"]


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


def classify(frame: pl.LazyFrame, config: Config,
             reference: pl.DataFrame | None = None) -> tuple[pl.DataFrame, pl.DataFrame]:
    """(scored rows, alarms) for a whole health frame (against a reference run's baseline if given)."""
    scored = score(frame, config, reference).collect()
    return scored, alarms(hits(scored.lazy(), config), config)


def heat_of(scored: pl.DataFrame | pl.LazyFrame, width: int) -> pl.DataFrame:
    """Worst |robust z| over the metrics per (component, bin of `width` steps), max over ranks:
    the max of the scored rows' `HEAT` (each row's worst |z| among metrics with a baseline there)."""
    step = pl.col("step") if width == 1 else (pl.col("step") - 1) // width * width + 1
    return (scored.lazy().select("component", step.alias("step"), pl.col(HEAT).alias("score"))
            .group_by("component", "step").agg(pl.col("score").max()).collect())
