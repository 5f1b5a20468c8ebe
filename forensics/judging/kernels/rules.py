"""What a rule means, compiled: the rule table, its exact test at a row, and that test loosened.

The registry (`conditions.py`) declares each rule; `table` turns the rules of one metric into a
table of numbers (one row per rule, one column per threshold, NaN where unset) that compiled
loops read. Everything that evaluates a rule reads it here:

- `holds`: whether a rule holds at one row, from its value, its baseline's median and z, and its
  role; `hits` runs it down a metric's rows with the rule's persistence (what the classifier
  reports). Its arithmetic and comparisons are Polars' (a division by a constant is a product
  with its inverse, a NaN is above every number), so a Polars expression of the same rule, kept
  as a test oracle, gives the same rows.
- `thresholds`: the same tests with the median known only to lie between two bounds, each
  loosened to the bound that makes it likeliest to hold: a value between a rule's thresholds
  cannot fire it (`screen.candidates` passes such rows over without taking their baseline).

A rule fires when every threshold it sets holds; direction `up` compares above the median,
`down` below, `either` both; `nonfinite` fires on a count above 0 or a NaN/inf value, with no
baseline.
"""

from __future__ import annotations

import math

import numba
import numpy as np
from warninglight.forensics.judging.conditions import DOWN, EITHER, NONFINITE, UP, Condition, Rule
from warninglight.tracer.schema import COUNT_METRICS

DIRECTIONS = {UP: 0, DOWN: 1, EITHER: 2, NONFINITE: 3}  # the DIR column's codes
DIR, Z, FOLD, INV_FOLD, DELTA, LEVEL, COUNT, PERSIST, ROLE, PEERS = range(10)  # the table's columns


def table(rules: list[tuple[Condition, Rule]], role_sets: list[tuple[str, ...]]) -> np.ndarray:
    """The rule table of `rules` (a metric's, each with its condition); a rule's ROLE is its
    place in `role_sets` (-1: every role). A non-finite rule reads neither roles nor peers."""
    nan = math.nan
    out = np.full((len(rules), 10), nan)
    for k, (c, rule) in enumerate(rules):
        threshold = rule.direction != NONFINITE
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


@numba.njit(nogil=True, inline="always")
def _ge(a: float, b: float) -> bool:  # pragma: no cover - compiled
    """a >= b in Polars' order of floats: a NaN is above every number and equal to a NaN."""
    if math.isnan(a):
        return True
    if math.isnan(b):
        return False
    return a >= b


@numba.njit(nogil=True, inline="always")
def z_passes(rules: np.ndarray, r: int, z: float, z_valid: bool) -> bool:  # pragma: no cover - compiled
    """Whether rule r's |z| test (if it has one) holds: the test most rows fail, made first."""
    rz = rules[r, Z]
    if math.isnan(rz):
        return True
    direction = rules[r, DIR]
    return z_valid and (((direction == 0 or direction == 2) and _ge(z, rz))
                        or ((direction == 1 or direction == 2) and _ge(-rz, z)))


@numba.njit(nogil=True, inline="always")
def holds(rules: np.ndarray, r: int, v: float, missing: bool, m: float, z: float, z_valid: bool,
          role_held: bool) -> bool:  # pragma: no cover - compiled
    """Whether rule r holds at a row (before persistence and the peers' median): value `v`
    (`missing`: null), the baseline's median `m` (NaN: none) and z (`z_valid`: it has one), and
    whether the row's component has a role the rule reads (`role_held`). A null operand makes the
    Polars expression null, then false."""
    direction = rules[r, DIR]
    if direction == 3:  # non-finite: a count above 0, or a value that is NaN or ±inf
        if missing:
            return False
        return _ge(v, 0.0) and v != 0.0 if rules[r, COUNT] > 0 else not math.isfinite(v)
    fold, delta, level = rules[r, FOLD], rules[r, DELTA], rules[r, LEVEL]
    has_z, has_fold, has_delta, has_level = (not math.isnan(rules[r, Z]), not math.isnan(fold),
                                             not math.isnan(delta), not math.isnan(level))
    if missing or not math.isfinite(v) or (has_z and not z_valid) or ((has_fold or has_delta) and math.isnan(m)):
        return False
    up, down = direction == 0 or direction == 2, direction == 1 or direction == 2
    if has_z:
        up = up and _ge(z, rules[r, Z])
        down = down and _ge(-rules[r, Z], z)
    if has_fold:
        up = up and m > 0 and _ge(v, m * fold)
        down = down and m > 0 and _ge(m * rules[r, INV_FOLD], v)
    if has_delta:
        up = up and _ge(v - m, delta)
        down = down and _ge(m - v, delta)
    if has_level:
        up = up and _ge(v, level)
        down = down and _ge(level, v)
    return (up or down) and role_held


@numba.njit(nogil=True, inline="always")
def thresholds(rules: np.ndarray, lower: float, upper: float, up: np.ndarray,
               down: np.ndarray) -> tuple[float, float]:  # pragma: no cover - compiled
    """`holds` loosened: per rule, a value below `up[r]` and above `down[r]` cannot fire it, its
    median known only to lie in `lower`..`upper` (NaN: no baseline); and the least `up` and
    greatest `down`, below and above which no rule fires. Each test of `holds` is loosened to the
    bound that makes it likeliest to hold (a rounding is monotone: m >= lower gives m * fold >=
    lower * fold); a z, which also reads the scale, is not tested."""
    least_up, most_down = np.inf, -np.inf
    for r in range(rules.shape[0]):
        direction = rules[r, DIR]
        fold, delta, level = rules[r, FOLD], rules[r, DELTA], rules[r, LEVEL]
        u = -np.inf if direction == 0 or direction == 2 else np.inf
        d = np.inf if direction == 1 or direction == 2 else -np.inf
        if direction == 3 or (math.isnan(lower) and not (math.isnan(rules[r, Z]) and math.isnan(fold)
                                                         and math.isnan(delta))):
            u, d = np.inf, -np.inf  # not a threshold rule; or it reads a baseline the row has not
        if not math.isnan(fold):
            if upper > 0:
                u, d = max(u, lower * fold), min(d, upper * rules[r, INV_FOLD])
            else:
                u, d = np.inf, -np.inf
        if not math.isnan(delta):  # v - m >= delta: room for the rounding of the subtraction
            room = (abs(lower) + abs(upper) + delta) * 1e-12
            u, d = max(u, lower + delta - room), min(d, upper - delta + room)
        if not math.isnan(level):
            u, d = max(u, level), min(d, level)
        up[r], down[r] = u, d
        least_up, most_down = min(least_up, u), max(most_down, d)
    return least_up, most_down


@numba.njit(cache=True, nogil=True)
def hits(raw: np.ndarray, missing: np.ndarray, med: np.ndarray, z: np.ndarray, z_valid: np.ndarray,
         kept: np.ndarray, starts: np.ndarray, judged: np.ndarray, rules: np.ndarray, roles: np.ndarray,
         out: np.ndarray, visit: np.ndarray) -> None:  # pragma: no cover - compiled
    """`out[r, j]` = 1 where rule r of one metric fired at kept row j: it held (`holds`) on this
    and the rows before it its persistence asks (in the row's series: `starts`, over kept rows)
    and the row is judged; for a rule that reads the peers' median, 1 wherever the rest of it
    held (the peers and persistence come after, `persist`). `raw`, `missing`: the metric's values
    and nulls on every row. `visit`: the kept rows (ascending) where a threshold rule may fire,
    and `med` (NaN: null), `z`, `z_valid`: the metric's baseline there (one per row of `visit`);
    `out` comes zeroed, and is left so at the other rows."""
    every = np.arange(len(kept))
    for r in range(rules.shape[0]):
        nonfinite = rules[r, DIR] == 3
        peers, persist, role = rules[r, PEERS] > 0, rules[r, PERSIST], int(rules[r, ROLE])
        rows = every if nonfinite else visit
        g, run, last = 0, 0, -2
        for t in range(len(rows)):
            j = rows[t]
            while starts[g + 1] <= j:
                g += 1
            if j != last + 1 or j == starts[g]:
                run = 0  # a new series, or rows passed over (where it cannot have held)
            last = j
            if not nonfinite and not z_passes(rules, r, z[t], z_valid[t]):
                run = 0
                out[r, j] = 0
                continue
            i = kept[j]
            if nonfinite:
                hit = holds(rules, r, np.float64(raw[i]), missing[i], np.nan, np.nan, False, True)
            else:
                hit = holds(rules, r, np.float64(raw[i]), missing[i], med[t], z[t], z_valid[t],
                            role < 0 or roles[role, j])
            if peers:
                out[r, j] = hit
            else:
                run = run + 1 if hit else 0
                out[r, j] = judged[j] and run >= persist


@numba.njit(cache=True, nogil=True)
def persist(held: np.ndarray, starts: np.ndarray, judged: np.ndarray, steps: int) -> None:  # pragma: no cover - compiled
    """In place: `held[j]` = 1 where it held on this and the `steps - 1` rows before it in its
    series and row j is judged."""
    for g in range(len(starts) - 1):
        run = 0
        for j in range(starts[g], starts[g + 1]):
            run = run + 1 if held[j] else 0
            held[j] = judged[j] and run >= steps
