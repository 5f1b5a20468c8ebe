"""The table the compiled rules read: one row per `conditions.Rule` of a metric, one column per
threshold (NaN where unset), so a compiled loop reads a rule as numbers (`judge._hits`,
`screen.candidates`). Built from the registry, never written by hand."""

from __future__ import annotations

import math

import numpy as np
from warninglight.tracer.schema import COUNT_METRICS

from .conditions import DOWN, EITHER, NONFINITE, UP, Condition, Rule

DIRECTIONS = {UP: 0, DOWN: 1, EITHER: 2, NONFINITE: 3}  # the DIR column's codes
DIR, Z, FOLD, INV_FOLD, DELTA, LEVEL, COUNT, PERSIST, ROLE, PEERS = range(10)  # its columns


def table(rules: list[tuple[Condition, Rule]], role_sets: list[tuple[str, ...]]) -> np.ndarray:
    """The rule table of `rules`; a rule's ROLE is its place in `role_sets` (-1: every role)."""
    nan = math.nan
    out = np.full((len(rules), 10), nan)
    for k, (c, rule) in enumerate(rules):
        threshold = rule.direction != NONFINITE  # `classify._rule_expr` returns before roles and peers
        out[k, DIR] = DIRECTIONS[rule.direction]
        out[k, Z] = nan if rule.z is None else rule.z
        out[k, FOLD] = nan if rule.fold is None else rule.fold
        out[k, INV_FOLD] = nan if rule.fold is None else 1.0 / rule.fold  # Polars' x / c is x * (1 / c)
        out[k, DELTA] = nan if rule.delta is None else rule.delta
        out[k, LEVEL] = nan if rule.level is None else rule.level
        out[k, COUNT] = rule.metric in COUNT_METRICS
        out[k, PERSIST] = c.persistence_of(rule)
        out[k, ROLE] = role_sets.index(rule.roles) if rule.roles and threshold else -1
        out[k, PEERS] = rule.peers_fold is not None and threshold
    return out
