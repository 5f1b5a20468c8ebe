"""Which ranks are the odd ones where no majority says: exact facts first, then each rank's own past.

Two ranks whose weights differ, or two equal groups of ranks (a node against a node), have no
majority of equal checksums. What each rank did still differs, and up to the step their replicas
parted they share one past: every rank stepped on the same all-reduced gradient. The first of
these rules that tells the ranks apart names them (`at_divergence`):

1. **Not all-reduced** (exact): some ranks ran no all-reduce in the step while the others did.
   When none did, after earlier steps that did, it is every rank: the step trained outside DDP.
2. **No gradient** (exact): a rank steps on a zero (or no) gradient of a component where another
   rank holds a non-zero one. The all-reduce hands every rank the same gradient: the rank without
   one dropped it.
3. **More than an average can be** (exact): a rank's gradient of a component is larger than the
   mean of the ranks' local (pre-all-reduce) gradient norms, the most their average can be.
4. **Its own past**: per metric (the gradient norm at optimizer.step, then the update size), the
   step's value against the rank's own trailing median and robust scale, in log units. A rank
   whose components all moved away from their past while the others' stayed is odd (its
   gradients were zeroed or scaled). Otherwise each rank's common movement (the median over its
   components: a clipping factor, say) is taken out, and a rank whose component moved off its
   own common movement while the others' stayed is odd (one rank's clipping left a layer out).
5. **Out of line with its own components**: each component's gradient relative to what the
   all-reduce could give (the mean local norm), against the median of the rank's own components
   at the same step. A rank that rescaled its gradients unevenly (clipping that left some out)
   stands out; one that rescaled them all alike does not. It needs no history.

A rank *departed* at a robust z of at least `DEPART_Z` with a change of at least `DEPART_FOLD`
(1.5x); it *stayed* below `CALM_Z`. A group is named only when it departed and every other rank
stayed: where all moved alike, or the rules' groups disagree, no rank is named, and the reason
says why. A rule's group must be a strict subset of the ranks.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
import polars as pl
from warninglight.forensics.trace.store import Trace

HISTORY = 32            # steps of a rank's own past its value at a step is judged against
MIN_HISTORY = 8         # steps before a rank's past is a baseline
DEPART_Z = 8.0          # robust z beyond which a value has left its own past (or line) ...
DEPART_FOLD = 0.4       # ... and by at least this much in log units (1.5x)
CALM_Z = 4.0            # robust z under which a value stayed in its own past (or line)
LOG_SCALE_FLOOR = 0.05  # log units: a past is never taken as narrower than ±5%
IQR_TO_SIGMA = 1.349
LOG_TINY = 1e-30        # log(0) stand-in: a norm of exactly 0 is a collapse, not a missing value
ROUNDING = 1e-3         # relative: float32 norms of the same vector agree far closer than this
MIN_COMPONENTS = 4      # components a rank's own median over components needs
METRICS = {"g": "gradient norm at optimizer.step", "u": "update size"}


@dataclass(frozen=True)
class Odd:
    """The odd ranks (empty: not told apart), why, and the components the evidence lies on."""

    ranks: list[int]
    how: str
    components: list[str] = field(default_factory=list)  # empty: no narrower than the caller's


def split(z: Mapping[int, float | None], move: Mapping[int, float | None], depart_z: float = DEPART_Z) -> list[int]:
    """The ranks that departed (|z| >= `depart_z`, |move| >= `DEPART_FOLD` log units, and that far
    from every other rank's move) when every other rank stayed (|z| < `CALM_Z`); else none. A
    None z (no past) is neither."""
    departed = {r for r, v in z.items() if v is not None and abs(v) >= depart_z
                and abs(move.get(r) or 0.0) >= DEPART_FOLD}
    stayed = {r for r, v in z.items() if v is not None and abs(v) < CALM_Z}
    if not departed or departed | stayed != set(z) or len(departed) == len(z):
        return []
    apart = all(abs((move.get(d) or 0.0) - (move.get(s) or 0.0)) >= DEPART_FOLD for d in departed for s in stayed)
    return sorted(departed) if apart else []


def at_divergence(trace: Trace, step: int, diverged: list[str], world: int) -> Odd:
    """The odd ranks at `step`, where the checksums of `diverged` first differ with no majority."""
    return judge(_rows(trace, step), step, diverged, world)


def judge(rows: pl.DataFrame, step: int, diverged: list[str], world: int) -> Odd:
    """`at_divergence` on the rows it reads: (rank, component, step, g, u, local, synced, seen)
    of every parameter-owning component over `step` and the `HISTORY` steps before it (g:
    gradient norm at optimizer.step, u: update norm, local: local gradient norm before the
    all-reduce, synced: whether it was all-reduced; seen: whether a health row was recorded,
    true where the column is absent)."""
    if "seen" not in rows.columns:
        rows = rows.with_columns(seen=pl.lit(True))
    ranks = sorted(int(r) for r in rows["rank"].unique())
    if len(ranks) < world or rows.is_empty():
        return Odd([], "no majority of equal checksums, and not every rank recorded its health")
    now = rows.filter(pl.col("step") == step)
    unsynced = _unsynced(rows, step, ranks)
    if unsynced is not None:
        return unsynced
    for rule in (_no_gradient, _above_average):
        found = rule(now, diverged, ranks)
        if found.ranks:
            return found
    past = _own_past(rows, step)
    for metric in METRICS:
        own = _departed_from_past(past, metric, diverged)
        if own.ranks:
            line = _out_of_line(now, diverged)
            if line.ranks and line.ranks != own.ranks:
                return Odd([], "no majority of equal checksums, and the ranks' own evidence points "
                               f"both ways (ranks {_names(own.ranks)} by their own past, ranks "
                               f"{_names(line.ranks)} by their components)")
            return own
    line = _out_of_line(now, diverged)
    if line.ranks:
        return line
    return Odd([], "no majority of equal checksums, and each rank's own evidence is alike: no rank "
                   "left its own past, or its own components' line, while the others stayed")


def _rows(trace: Trace, step: int) -> pl.DataFrame:
    """(rank, component, step, g, u, local, synced, seen) of every parameter-owning component,
    over `step` and the `HISTORY` steps before it (seen: it has a health row)."""
    table = trace.con.sql("""
        SELECT r.rank, r.component, r.step, h.grad_norm_l2 AS g, h.update_norm_l2 AS u,
               r.local_grad_norm_l2 AS local, coalesce(r.grad_allreduced, false) AS synced,
               h.step IS NOT NULL AS seen
        FROM replicas r LEFT JOIN health h USING (rank, step, component)
        WHERE r.step BETWEEN ? AND ? AND NOT coalesce(r.sharded, false)""",
        params=[step - HISTORY, step]).to_arrow_table()
    frame = pl.DataFrame(pl.from_arrow(table))
    return frame.with_columns(pl.col("rank").cast(pl.Int64), pl.col("g", "u", "local").cast(pl.Float64))


def _names(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks))


# --- exact facts ---------------------------------------------------------------------------------

def _unsynced(rows: pl.DataFrame, step: int, ranks: list[int]) -> Odd | None:
    """Ranks that ran no all-reduce in `step` while others did; every rank when none did (after
    steps that did); None when the all-reduce tells nothing (every rank did, or none ever did)."""
    synced = rows.group_by("rank", pl.col("step") == step).agg(pl.col("synced").any())
    now = {int(r): bool(s) for r, at, s in synced.iter_rows() if at}
    before = bool(synced.filter(~pl.col("step"))["synced"].any())
    skipped = sorted(r for r in ranks if not now.get(r, False))
    if not skipped or (len(skipped) == len(ranks) and not before):
        return None
    if len(skipped) == len(ranks):
        return Odd([], f"no rank all-reduced its gradients in step {step}")
    return Odd(skipped, f"it ran no all-reduce of its gradients in step {step} while the other ranks did")


def _per_component(now: pl.DataFrame, diverged: list[str], odd: pl.Expr, normal: pl.Expr) -> dict[str, list[int]]:
    """Per diverged component: the ranks `odd` marks, where every other rank is `normal`."""
    marked = now.filter(pl.col("component").is_in(diverged)).with_columns(odd.alias("odd"), normal.alias("ok"))
    out: dict[str, list[int]] = {}
    for (comp,), part in marked.group_by("component"):
        bad = sorted(int(r) for r in part.filter(pl.col("odd"))["rank"])
        if bad and len(bad) < part.height and part.filter(~pl.col("odd"))["ok"].all():
            out[str(comp)] = bad
    return out


def _exact(found: dict[str, list[int]], ranks: list[int], how: str) -> Odd:
    """The union of the ranks each component proves odd, when they are not every rank."""
    odd = sorted({r for group in found.values() for r in group})
    if not odd or len(odd) == len(ranks):
        return Odd([], "")
    return Odd(odd, how, sorted(found))


def _no_gradient(now: pl.DataFrame, diverged: list[str], ranks: list[int]) -> Odd:
    g = pl.col("g")
    found = _per_component(now, diverged, pl.col("seen") & (g.is_null() | (g == 0)), g.is_not_null() & (g > 0))
    return _exact(found, ranks, "its gradient was zero (or none) at optimizer.step where the other "
                                "ranks' was not, though the all-reduce gives every rank the same one")


def _above_average(now: pl.DataFrame, diverged: list[str], ranks: list[int]) -> Odd:
    most = pl.col("local").mean().over("component")  # the mean local norm: the most an average can be
    complete = pl.col("local").is_not_null().all().over("component")
    above = complete & (pl.col("g") > most * (1.0 + ROUNDING)).fill_null(False)
    found = _per_component(now, diverged, above, ~above)
    return _exact(found, ranks, "its gradient at optimizer.step is larger than the mean of the ranks' "
                                "local gradient norms, the most their all-reduced average can be")


# --- each rank's own past --------------------------------------------------------------------------

def _log(col: str) -> pl.Expr:
    """log of a norm (`LOG_TINY` for 0), +inf for a non-finite one: it departed."""
    v = pl.col(col)
    return pl.when(v.is_finite()).then(pl.max_horizontal(v, pl.lit(LOG_TINY)).log()).otherwise(np.inf)


def _own_past(rows: pl.DataFrame, step: int) -> pl.DataFrame:
    """Per (rank, component) and metric at `step`: its move (log units) and z from its own past."""
    out = []
    for metric in METRICS:
        x = rows.filter(pl.col(metric).is_not_null()).with_columns(_log(metric).alias("x"))
        past = x.filter((pl.col("step") < step) & pl.col("x").is_finite()).group_by("rank", "component").agg(
            pl.col("x").median().alias("med"),
            (pl.col("x").quantile(0.75, "linear") - pl.col("x").quantile(0.25, "linear")).alias("iqr"),
            pl.len().alias("n"))
        scale = pl.max_horizontal(pl.col("iqr") / IQR_TO_SIGMA, pl.lit(LOG_SCALE_FLOOR))
        out.append(x.filter(pl.col("step") == step).join(past.filter(pl.col("n") >= MIN_HISTORY),
                                                          on=["rank", "component"])
                   .select("rank", "component", pl.lit(metric).alias("metric"),
                           (pl.col("x") - pl.col("med")).alias("move"), scale.alias("scale")))
    return pl.concat(out)


def _departed_from_past(past: pl.DataFrame, metric: str, diverged: list[str]) -> Odd:
    """Ranks whose `metric` left their own past at the step, whole or off their common movement."""
    mine = past.filter(pl.col("metric") == metric)
    if mine.is_empty():
        return Odd([], "")
    common = mine.group_by("rank").agg(pl.col("move").median().alias("common"),
                                      (pl.col("move") / pl.col("scale")).median().alias("z"))
    whole = split(dict(zip(common["rank"], common["z"], strict=True)),
                  dict(zip(common["rank"], common["common"], strict=True)))
    what = METRICS[metric]
    if whole:
        return Odd(whole, f"its {what} left its own past on its components together (median robust z "
                          f"{_z_of(common, whole):.0f}) while the other ranks' stayed in theirs")
    off = mine.join(common.select("rank", "common"), on="rank").with_columns(
        (pl.col("move") - pl.col("common")).alias("move")).with_columns(
        (pl.col("move") / pl.col("scale")).alias("z"))
    return _by_component(off, diverged, f"its {what} of {{components}} left its own past, off the "
                                        "movement its other components shared (robust z {z:.0f}), "
                                        "while the other ranks' stayed in theirs")


def _z_of(frame: pl.DataFrame, ranks: list[int]) -> float:
    """The largest finite |z| of `ranks` in `frame` (inf when none is finite)."""
    z = frame.filter(pl.col("rank").is_in(ranks) & pl.col("z").is_finite())["z"].abs()
    return float(z.max()) if len(z) else np.inf  # type: ignore[arg-type]


def _by_component(frame: pl.DataFrame, diverged: list[str], how: str) -> Odd:
    """The group that departed on the diverged components (columns rank, component, move, z),
    every other rank staying, when every component that departs names the same group; with the
    components where that group moved off beyond `CALM_Z` while the others stayed."""
    groups: dict[str, list[int]] = {}
    leaning: dict[str, list[int]] = {}
    for (comp,), part in frame.filter(pl.col("component").is_in(diverged)).group_by("component"):
        z = dict(zip(part["rank"], part["z"], strict=True))
        move = dict(zip(part["rank"], part["move"], strict=True))
        group = split(z, move)
        if group:
            groups[str(comp)] = group
        elif lean := split(z, move, depart_z=CALM_Z):
            leaning[str(comp)] = lean
    named = {tuple(g) for g in groups.values()}
    if len(named) != 1:
        return Odd([], "")
    group = list(named.pop())
    comps = [c for c in diverged if c in groups or leaning.get(c) == group]  # in the caller's order
    shown = comps[0] if len(comps) == 1 else f"{len(comps)} components ({', '.join(comps[:3])}{', ...' if len(comps) > 3 else ''})"
    z = _z_of(frame.filter(pl.col("component").is_in(list(groups))), group)
    return Odd(group, how.format(components=shown, z=z), comps)


# --- each rank's own components ------------------------------------------------------------------

def _out_of_line(now: pl.DataFrame, diverged: list[str]) -> Odd:
    """Ranks whose gradient, relative to what the all-reduce could give, is out of line with their
    own other components at the step, while the other ranks' is in line."""
    complete = pl.col("local").is_not_null().all().over("component") & (pl.col("local") > 0).all().over("component")
    rel = (now.filter(complete & pl.col("g").is_not_null())
           .with_columns((_log("g") - pl.col("local").mean().over("component").log()).alias("a")))
    if rel.is_empty() or rel.group_by("rank").len()["len"].min() < MIN_COMPONENTS:  # type: ignore[operator]
        return Odd([], "")
    finite = pl.col("a").filter(pl.col("a").is_finite())
    iqr = finite.quantile(0.75, "linear") - finite.quantile(0.25, "linear")
    # the scale is the spread of the rank whose components are most in line: the odd rank's own
    # components that stand out would widen its own
    rel = rel.with_columns((pl.col("a") - finite.median().over("rank")).alias("move"),
                           pl.max_horizontal(iqr.over("rank").min() / IQR_TO_SIGMA, pl.lit(LOG_SCALE_FLOOR)).alias("scale"))
    rel = rel.with_columns((pl.col("move") / pl.col("scale")).alias("z"))
    return _by_component(rel, diverged, "its gradient of {components}, relative to what the all-reduce "
                                        "could give, is out of line with its own other components "
                                        "(robust z {z:.0f}) while the other ranks' is in line")
