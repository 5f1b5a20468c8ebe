"""Ranks compared step by step: replicas that diverged, and a rank whose local gradients left the band.

Reads the `replicas` table (tracer/replicas.py), which data-parallel ranks record when the world
size is above 1. Two findings, each naming a rank (or every rank), a component and a first step:

- **Replicas diverged**: at step s the ranks' weight checksums of a component differ (they must
  be bit-identical after every optimizer step). The odd rank is the one outside a strict majority
  of equal checksums; with no majority (two ranks, or every rank different) it is the rank whose
  weights drifted (changed outside the optimizer) at s, else every rank. When at least half of
  the parameter-owning components diverge at the same first step, the whole model (`""`) is
  named: the step was not synchronised (e.g. it trained outside DDP).
- **Local gradient out of band**: a rank's local (pre-all-reduce) gradient norm of a component,
  relative to the ranks' median at the same step, departs from its own trailing history of that
  relative value (robust z). Relative to the other ranks, so the run's own trends cancel; against
  its own history, so ranks that always see different data do not alarm. With two ranks both
  ratios move (mirror images): the rank named is the one whose own norm left its own history.

Memory is bounded: both scans read a window of `STEP_WINDOW` steps at a time (plus the trailing
history) and stop at the first window that holds a finding.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import polars as pl
from warninglight.forensics.trace.store import Trace

STEP_WINDOW = 2000     # steps read per query
DIVERGED_SHARE = 0.5   # of parameter-owning components diverging together: the whole model
HISTORY = 32           # steps of a rank's own history of its relative local gradient norm
MIN_HISTORY = 8        # steps before a rank's band exists
BAND_Z = 10.0          # robust z beyond which the local norm has left the band ...
BAND_FOLD = 0.7        # ... and by at least this much in log units (2x)
LOG_SCALE_FLOOR = 0.05  # log units: the band never gets narrower than ±5%
OWN_LEAD = 2.0         # two-rank tie: the named rank's own |z| must be this many times the other's
IQR_TO_SIGMA = 1.349
REPLICAS, LOCAL = "replicas", "local_gradient"


@dataclass(frozen=True)
class RankFinding:
    """A rank-level fault: which rank (None: every rank), component, first step, and why."""

    kind: str  # REPLICAS | LOCAL
    component: str  # the attributed component ("" = the whole model)
    observed_on: str  # the component whose evidence tripped
    step: int
    rank: int | None
    ranks: list[int]
    condition: str
    metric: str
    value: float | None
    median: float | None
    magnitude: float | None
    evidence: str
    components: list[str] = field(default_factory=list)


def _has_replicas(trace: Trace) -> bool:
    row = trace.one("SELECT count(DISTINCT rank), min(step), max(step) FROM replicas")
    return bool(row[0] and row[0] > 1)


def findings(trace: Trace) -> list[RankFinding]:
    """Every rank finding of the trace, earliest first (empty for a single rank)."""
    if not _has_replicas(trace):
        return []
    world, first, last = trace.one("SELECT count(DISTINCT rank), min(step), max(step) FROM replicas")
    out = [f for f in (_divergence(trace, int(world), int(first), int(last)),
                       _local_outlier(trace, int(world), int(first), int(last))) if f is not None]
    return sorted(out, key=lambda f: (f.step, f.kind != REPLICAS))


# --- replicas that diverged ------------------------------------------------------------------

def _first_divergence(trace: Trace, world: int, first: int, last: int) -> tuple[int, list[str]] | None:
    for lo in range(first, last + 1, STEP_WINDOW):
        rows = trace.con.execute("""
            SELECT step, component FROM replicas
            WHERE step BETWEEN ? AND ? AND NOT coalesce(sharded, false) AND weight_checksum IS NOT NULL
            GROUP BY step, component
            HAVING count(*) = ? AND count(DISTINCT weight_checksum) > 1
            ORDER BY step""", [lo, lo + STEP_WINDOW - 1, world]).fetchall()
        if rows:
            step = rows[0][0]
            return int(step), [c for s, c in rows if s == step]
    return None


def _odd_ranks(trace: Trace, step: int, components: list[str], world: int) -> tuple[list[int], str]:
    """The ranks outside the majority of equal checksums (or that drifted), and how they were found."""
    rows = trace.con.execute(
        "SELECT component, rank, weight_checksum FROM replicas WHERE step = ? AND component IN "
        f"({', '.join('?' * len(components))})", [step, *components]).fetchall()
    odd: set[int] = set()
    for comp in components:
        groups: dict[int, list[int]] = {}
        for c, r, s in rows:
            if c == comp:
                groups.setdefault(s, []).append(int(r))
        biggest = max(groups.values(), key=len)
        if 2 * len(biggest) > world:
            odd |= {r for g in groups.values() if g is not biggest for r in g}
    if odd:
        return sorted(odd), f"its weight checksum differs from the majority of {world} ranks"
    drifted = trace.con.execute(
        "SELECT DISTINCT rank FROM health WHERE step BETWEEN ? AND ? AND weight_drift_l2 > 0 AND "
        f"component IN ({', '.join('?' * len(components))}) ORDER BY rank",
        [step - 2, step, *components]).fetchall()
    ranks = [int(r) for (r,) in drifted]
    if 0 < len(ranks) < world:
        return ranks, "no majority of equal checksums; its weights changed outside the optimizer"
    return [], "no majority of equal checksums and no rank's weights drifted"


def _exact_drift(trace: Trace, step: int) -> list[tuple[int, str]]:
    """(rank, component) whose weights at step `step`'s forward differ from after step - 1."""
    if "weight_checksum_fwd" not in trace.columns("replicas"):
        return []  # written before the forward checksum existed
    rows = trace.con.execute("""
        SELECT a.rank, a.component FROM replicas a JOIN replicas b
          ON a.rank = b.rank AND a.component = b.component AND b.step = a.step - 1
        WHERE a.step = ? AND a.weight_checksum_fwd IS NOT NULL
          AND a.weight_checksum_fwd <> b.weight_checksum ORDER BY a.rank""", [step]).fetchall()
    return [(int(r), str(c)) for r, c in rows]


def _divergence(trace: Trace, world: int, first: int, last: int) -> RankFinding | None:
    found = _first_divergence(trace, world, first, last)
    if found is None:
        return None
    step, diverged = found
    order = dict(trace.con.execute(
        "SELECT component, min(forward_index) FROM components GROUP BY component").fetchall())
    diverged.sort(key=lambda c: (order.get(c) is None, order.get(c) or 0, c))
    n_param = trace.one(f"SELECT count(DISTINCT component) FROM replicas WHERE step = {step}")[0]
    drifted = _exact_drift(trace, step)
    drift_ranks = sorted({r for r, _ in drifted})
    lead = [c for c in diverged if c in {c for _, c in drifted}]
    if lead and len(drift_ranks) < world:  # a write outside the optimizer on some ranks: direct
        odd, how = drift_ranks, ("its weights were written outside the optimizer before the step "
                                 "(checksum at the forward differs from after the previous step)")
    else:
        lead = diverged
        odd, how = _odd_ranks(trace, step, diverged, world)
    whole = len(lead) >= max(2, DIVERGED_SHARE * n_param)
    synced = trace.one(f"SELECT bool_or(grad_allreduced) FROM replicas WHERE step = {step}")[0]
    distinct = trace.one(f"SELECT max(k) FROM (SELECT count(DISTINCT weight_checksum) AS k FROM replicas "
                         f"WHERE step = {step} GROUP BY component)")[0]
    who = f"rank {', '.join(map(str, odd))}" if odd else "every rank"
    what = f"{len(diverged)} of {n_param} components" if len(diverged) > 1 else f"component {diverged[0]}"
    evidence = (f"replicas diverged: the ranks' weight checksums of {what} differ after step {step} "
                f"({who}: {how})")
    if synced is False:
        evidence += f"; no gradient was all-reduced in step {step}: it trained outside DDP"
    return RankFinding(REPLICAS, "" if whole else lead[0], lead[0], step,
                       odd[0] if len(odd) == 1 else None, odd or list(range(world)),
                       _condition(trace, step, lead[0], odd), "weight_checksum", float(distinct or 0),
                       None, None, evidence, diverged)


def _condition(trace: Trace, step: int, component: str, odd: list[int]) -> str:
    """`exploding` when the odd ranks' weight norm is above 1.5x the others', else `unclassified`."""
    if not odd:
        return "unclassified"
    rows = trace.con.execute("SELECT rank, weight_norm_l2 FROM health WHERE step = ? AND component = ?",
                             [step, component]).fetchall()
    mine = [v for r, v in rows if r in odd and v is not None]
    others = [v for r, v in rows if r not in odd and v is not None]
    if mine and others and float(np.median(mine)) > 1.5 * float(np.median(others)):
        return "exploding"
    return "unclassified"


# --- local gradients out of the band of the others ----------------------------------------------

def score_local(rows: pl.DataFrame, world: int) -> pl.DataFrame:
    """Rows (rank, component, step, g) with the band columns: d (log norm − ranks' median), z, own_z."""
    keys = ["rank", "component"]
    roll = {"window_size": HISTORY, "min_samples": MIN_HISTORY}
    x = pl.max_horizontal(pl.col("g").cast(pl.Float64), pl.lit(1e-30)).log()
    frame = (rows.with_columns(x.alias("x"))
             .with_columns(pl.len().over(["step", "component"]).alias("n"),
                           pl.col("x").median().over(["step", "component"]).alias("m"))
             .filter(pl.col("n") == world)
             .with_columns((pl.col("x") - pl.col("m")).alias("d"))
             .sort([*keys, "step"]))

    def band(col: str) -> list[pl.Expr]:
        past = pl.col(col).shift(1)
        med = past.rolling_median(**roll).over(keys)
        iqr = (past.rolling_quantile(0.75, **roll) - past.rolling_quantile(0.25, **roll)).over(keys)
        scale = pl.max_horizontal(iqr / IQR_TO_SIGMA, pl.lit(LOG_SCALE_FLOOR))
        return [med.alias(f"{col}_med"), scale.alias(f"{col}_scale")]

    frame = frame.with_columns(*band("d"), *band("x"))
    return frame.with_columns(
        ((pl.col("d") - pl.col("d_med")) / pl.col("d_scale")).alias("z"),
        ((pl.col("x") - pl.col("x_med")) / pl.col("x_scale")).alias("own_z"),
    ).with_columns(
        (~pl.col("g").cast(pl.Float64).is_finite()
         | ((pl.col("z").abs() >= BAND_Z) & ((pl.col("d") - pl.col("d_med")).abs() >= BAND_FOLD))
         ).fill_null(False).alias("hit"))


def _local_outlier(trace: Trace, world: int, first: int, last: int) -> RankFinding | None:
    for lo in range(first, last + 1, STEP_WINDOW):
        table = trace.con.sql("""
            SELECT rank, component, step, local_grad_norm_l2 AS g FROM replicas
            WHERE step BETWEEN ? AND ? AND g IS NOT NULL AND NOT coalesce(sharded, false)""",
            params=[max(first, lo - HISTORY - 1), lo + STEP_WINDOW - 1]).to_arrow_table()
        rows = pl.DataFrame(pl.from_arrow(table))
        if rows.is_empty():
            continue
        scored = score_local(rows, world)
        hits = scored.filter(pl.col("hit") & (pl.col("step") >= lo))
        if not hits.is_empty():
            return _name_local(scored, hits, world)
    return None


def _name_local(scored: pl.DataFrame, hits: pl.DataFrame, world: int) -> RankFinding:
    step = int(hits["step"].min())
    at = hits.filter(pl.col("step") == step)
    lead = at.sort(pl.col("z").abs().fill_nan(np.inf), descending=True).row(0, named=True)
    comp = lead["component"]
    here = scored.filter((pl.col("step") == step) & (pl.col("component") == comp))
    flagged = at.filter(pl.col("component") == comp)["rank"].to_list()
    rank: int | None = flagged[0] if len(flagged) == 1 and world > 2 else None
    how = "its local gradient norm left the band of the other ranks'"
    if rank is None:  # mirror images: the rank whose own norm left its own history
        own = sorted(((abs(r["own_z"]) if r["own_z"] is not None and np.isfinite(r["own_z"]) else np.inf,
                       int(r["rank"])) for r in here.iter_rows(named=True)), reverse=True)
        if len(own) == 1 or own[0][0] >= OWN_LEAD * own[1][0]:
            rank, how = own[0][1], how + ", and its own norm left its own history"
    row = here.filter(pl.col("rank") == rank).row(0, named=True) if rank is not None else lead
    others = here.filter(pl.col("rank") != row["rank"])["g"]
    up = not np.isfinite(row["g"]) or row["d"] > (row["d_med"] or 0.0)
    who = f"rank {rank}" if rank is not None else "no single rank"
    return RankFinding(
        LOCAL, comp, comp, step, rank, [rank] if rank is not None else sorted(flagged),
        "exploding" if up else "losing_gradient", "local_grad_norm_l2", _num(row["g"]),
        _num(others.median()) if len(others) else None, _num(row["z"]),
        f"local gradient before the all-reduce: {who}, {how} at step {step} "
        f"({_num(row['g']):.4g} against a median of {_num(others.median()) or 0.0:.4g} on the others)")


def _num(v: Any) -> float | None:
    return None if v is None or not np.isfinite(v) else float(v)


# --- into the analysis --------------------------------------------------------------------------

def root_fields(f: RankFinding) -> dict[str, Any]:
    """A rank finding as the fields of the analysis' `Root`."""
    return {"attributed_to": f.component, "observed_on": f.observed_on, "condition": f.condition,
            "onset_step": f.step, "alarm_step": f.step, "magnitude": f.magnitude, "metric": f.metric,
            "rank": f.rank, "ranks": f.ranks, "ranks_disagree": f.rank is not None,
            "evidence": f.evidence, "scope": REPLICAS if f.kind == REPLICAS else "component"}


def alarm_frame(found: list[RankFinding], schema: dict[str, Any]) -> pl.DataFrame:
    """The findings as alarm rows (the columns of `schema`; `rank` null for every rank)."""
    rows = [{"rank": f.rank, "observed_on": f.observed_on, "condition": f.condition, "step": f.step,
             "last_step": f.step, "metric": f.metric, "value": f.value, "median": f.median,
             "magnitude": f.magnitude, "onset_step": f.step, "attributed_to": f.component}
            for f in found]
    frame = pl.DataFrame(rows, schema={k: v for k, v in schema.items() if k in rows[0]}) if rows else None
    return frame if frame is not None else pl.DataFrame(schema=schema)


PANEL_BINS = 600  # step bins of the report's rank x step panel


def panel(trace: Trace) -> pl.DataFrame:
    """Per (rank, step bin): its log local gradient norm − the ranks' median, the one largest in
    size over components (signed: above or below the others), and whether its weights differed
    from the majority (every rank, when there is none); empty for one rank.

    `step` is the first step of the bin; at most `PANEL_BINS` bins, so its size is bounded.
    """
    if not _has_replicas(trace):
        return pl.DataFrame(schema={"rank": pl.Int64, "step": pl.Int64, "local_dev": pl.Float64,
                                    "diverged": pl.Boolean})
    first, last = trace.one("SELECT min(step), max(step) FROM replicas")
    width = max(1, -(-(int(last) - int(first) + 1) // PANEL_BINS))
    table = trace.con.sql(f"""
        WITH r AS (SELECT rank, step, component, weight_checksum AS c,
                          ln(greatest(local_grad_norm_l2, 1e-30)) AS x
                   FROM replicas WHERE NOT coalesce(sharded, false)),
        m AS (SELECT step, component, median(x) AS mx, mode(c) AS mc, count(*) AS n,
                     count(DISTINCT c) AS k FROM r GROUP BY step, component),
        v AS (SELECT step, component, count(*) AS votes FROM r
              JOIN m USING (step, component) WHERE r.c = m.mc GROUP BY step, component)
        SELECT r.rank::BIGINT AS rank, ((r.step - {first}) // {width}) * {width} + {first} AS step,
               arg_max(r.x - m.mx, abs(r.x - m.mx)) AS local_dev,
               bool_or(m.k > 1 AND (r.c <> m.mc OR 2 * v.votes <= m.n)) AS diverged
        FROM r JOIN m USING (step, component) JOIN v USING (step, component)
        GROUP BY ALL ORDER BY rank, step""").to_arrow_table()
    return pl.DataFrame(pl.from_arrow(table))
