"""Ranks compared step by step: replicas that diverged, and a rank whose local gradients left the band.

Reads the `replicas` table (tracer/replicas.py), which data-parallel ranks record when the world
size is above 1. Two findings, each naming a rank (or every rank), a component and a first step:

- **Replicas diverged**: at step s the ranks' weight checksums of a component differ (they must
  be bit-identical after every optimizer step). The odd rank is the one outside a strict majority
  of equal checksums; with no majority (two ranks, or equal groups) it is the rank whose weights
  drifted (changed outside the optimizer) at s, else the ranks each rank's own evidence sets
  apart (`oddrank.py`: an all-reduce skipped, a gradient dropped, a gradient or update that left
  the rank's own past, or its own components' line, while the others' stayed), else every rank,
  with the reason. When at least
  half of the parameter-owning components diverge at the same first step, and the evidence does
  not narrow them, the whole model (`""`) is named: the step was not synchronised (e.g. it
  trained outside DDP).
- **Local gradient out of band**: a rank's local (pre-all-reduce) gradient norm of a component,
  relative to the ranks' median at the same step, departs from its own trailing history of that
  relative value (robust z). Relative to the other ranks, so the run's own trends cancel; against
  its own history, so ranks that always see different data do not alarm. With two ranks (or
  equal groups) every rank's ratio moves (mirror images): the ranks named are those whose own
  norm left its own history while the others' stayed in theirs (`oddrank.split`). A rank whose
  local gradient is exactly zero on every component while another's is not contributed nothing
  to the average: named at once, on the whole model, with no history needed.

Memory is bounded: both scans read a window of `STEP_WINDOW` steps at a time (plus the trailing
history) and stop at the first window that holds a finding.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import polars as pl
from warninglight.forensics.explaining import oddrank
from warninglight.forensics.trace.store import Trace

STEP_WINDOW = 2000     # steps read per query
DIVERGED_SHARE = 0.5   # of parameter-owning components diverging together: the whole model
HISTORY = oddrank.HISTORY          # steps of a rank's own history of its relative local gradient norm
MIN_HISTORY = oddrank.MIN_HISTORY  # steps before a rank's band exists
LOG_SCALE_FLOOR = oddrank.LOG_SCALE_FLOOR  # log units: the band never gets narrower than ±5%
IQR_TO_SIGMA = oddrank.IQR_TO_SIGMA
BAND_Z = 10.0          # robust z beyond which the local norm has left the band ...
BAND_FOLD = 0.7        # ... and by at least this much in log units (2x)
REPLICAS, LOCAL = "replicas", "local_gradient"


@dataclass(frozen=True)
class RankFinding:
    """A rank-level fault: which rank (None: every rank, or the group in `ranks`), component,
    first step, and why."""

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
    world: int = 0  # ranks in the run

    @property
    def some_ranks(self) -> bool:
        """Whether it names one rank or a group, not every rank."""
        return self.rank is not None or 0 < len(self.ranks) < self.world


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


def _odd_ranks(trace: Trace, step: int, components: list[str], world: int) -> tuple[list[int], str, list[str]]:
    """The ranks outside the majority of equal checksums (or that drifted, or that their own
    evidence sets apart), how they were found, and the components that evidence lies on (empty:
    all of `components`)."""
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
        return sorted(odd), f"its weight checksum differs from the majority of {world} ranks", []
    drifted = trace.con.execute(
        "SELECT DISTINCT rank FROM health WHERE step BETWEEN ? AND ? AND weight_drift_l2 > 0 AND "
        f"component IN ({', '.join('?' * len(components))}) ORDER BY rank",
        [step - 2, step, *components]).fetchall()
    ranks = [int(r) for (r,) in drifted]
    if 0 < len(ranks) < world:
        return ranks, "no majority of equal checksums; its weights changed outside the optimizer", []
    found = oddrank.at_divergence(trace, step, components, world)
    return found.ranks, found.how, found.components


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
        odd, how, pointed = _odd_ranks(trace, step, diverged, world)
        lead = [c for c in diverged if c in pointed] or diverged
    whole = len(lead) >= max(2, DIVERGED_SHARE * n_param)
    synced = trace.one(f"SELECT bool_or(grad_allreduced) FROM replicas WHERE step = {step}")[0]
    distinct = trace.one(f"SELECT max(k) FROM (SELECT count(DISTINCT weight_checksum) AS k FROM replicas "
                         f"WHERE step = {step} GROUP BY component)")[0]
    who = _who(odd) if odd else "every rank"
    what = f"{len(diverged)} of {n_param} components" if len(diverged) > 1 else f"component {diverged[0]}"
    evidence = (f"replicas diverged: the ranks' weight checksums of {what} differ after step {step} "
                f"({who}: {how})")
    if synced is False:
        evidence += f"; no gradient was all-reduced in step {step}: it trained outside DDP"
    return RankFinding(REPLICAS, "" if whole else lead[0], lead[0], step,
                       odd[0] if len(odd) == 1 else None, odd or list(range(world)),
                       _condition(trace, step, lead[0], odd), "weight_checksum", float(distinct or 0),
                       None, None, evidence, diverged, world)


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
    """Rows (rank, component, step, g) with the band columns: d (log norm − ranks' median), z, own_z,
    silent (the rank's local gradient is zero on every component, some other rank's is not), hit."""
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

    # a rank whose local gradient is exactly zero on every component while some rank's is not
    # contributed nothing to the average (zeroed or detached before the all-reduce): exact, no history
    silent = (pl.col("g") == 0).all().over(["rank", "step"])
    frame = frame.with_columns(*band("d"), *band("x"), silent.alias("silent")).with_columns(
        (pl.col("silent") & (pl.col("rank").filter(pl.col("silent")).n_unique().over("step")
                             < pl.col("rank").n_unique().over("step"))).alias("silent"))
    return frame.with_columns(
        ((pl.col("d") - pl.col("d_med")) / pl.col("d_scale")).alias("z"),
        ((pl.col("x") - pl.col("x_med")) / pl.col("x_scale")).alias("own_z"),
    ).with_columns(
        (~pl.col("g").cast(pl.Float64).is_finite() | pl.col("silent")
         | ((pl.col("z").abs() >= BAND_Z) & ((pl.col("d") - pl.col("d_med")).abs() >= BAND_FOLD))
         ).fill_null(False).alias("hit"))


def _local_outlier(trace: Trace, world: int, first: int, last: int) -> RankFinding | None:
    for lo in range(first, last + 1, STEP_WINDOW):
        table = trace.con.sql("""
            SELECT rank, component, step, local_grad_norm_l2 AS g FROM replicas
            WHERE step BETWEEN ? AND ? AND g IS NOT NULL AND NOT coalesce(sharded, false)""",
            params=[max(first, lo - HISTORY - 1), lo + STEP_WINDOW - 1]).to_arrow_table()
        found = local_finding(pl.DataFrame(pl.from_arrow(table)), world, lo)
        if found is not None:
            return found
    return None


def local_finding(rows: pl.DataFrame, world: int, since: int | None = None) -> RankFinding | None:
    """The first local-gradient finding in rows (rank, component, step, g: the local gradient norm)
    at or after step `since` (earlier rows are history), or None."""
    if rows.is_empty():
        return None
    scored = score_local(rows, world)
    hits = scored.filter(pl.col("hit") & (pl.col("step") >= (since if since is not None else rows["step"].min())))
    return None if hits.is_empty() else _name_local(scored, hits, world)


def _name_local(scored: pl.DataFrame, hits: pl.DataFrame, world: int) -> RankFinding:
    step = int(hits["step"].min())
    at = hits.filter(pl.col("step") == step)
    now = scored.filter(pl.col("step") == step)
    named, hows = _local_groups(at, now, world)
    size = pl.col("z").abs().fill_nan(np.inf)
    lead = at.filter(pl.col("component").is_in(list(named)) if named else pl.lit(True)).sort(size, descending=True).row(0, named=True)
    comp = lead["component"]
    group = named.get(comp, [])
    here = now.filter(pl.col("component") == comp)
    how = hows.get(comp, BAND)
    alike = [c for c, g in named.items() if g == group]
    whole = bool(group) and len(alike) >= max(2, DIVERGED_SHARE * now["component"].n_unique())
    if whole:
        how += f", on {len(alike)} of {now['component'].n_unique()} components"
    rank = group[0] if len(group) == 1 else None
    row = here.filter(pl.col("rank") == group[0]).row(0, named=True) if group else lead
    others = here.filter(~pl.col("rank").is_in(group or [row["rank"]]))["g"]
    up = not np.isfinite(row["g"]) or row["d"] > (row["d_med"] or 0.0)
    who = _who(group) if group else "no single rank"
    flagged = sorted(at.filter(pl.col("component") == comp)["rank"].to_list())
    return RankFinding(
        LOCAL, "" if whole else comp, comp, step, rank, group or flagged,
        "exploding" if up else "losing_gradient", "local_grad_norm_l2", _num(row["g"]),
        _num(others.median()) if len(others) else None, _num(row["z"]),
        f"local gradient before the all-reduce: {who}, {how} at step {step} "
        f"({_num(row['g']):.4g} against a median of {_num(others.median()) or 0.0:.4g} on the others)",
        sorted(alike) if whole else [], world)


BAND = "its local gradient norm left the band of the other ranks'"


def _local_groups(at: pl.DataFrame, now: pl.DataFrame, world: int) -> tuple[dict[str, list[int]], dict[str, str]]:
    """Per component hit at the step: the ranks named, and how. Named:
    the ranks whose local gradient was zero on every component, others' not; else one rank alone
    outside the band of more than two; else those whose own norm left its own history while the
    others' stayed in theirs (mirror images: two ranks, or equal groups)."""
    named: dict[str, list[int]] = {}
    how: dict[str, str] = {}  # how each was named
    for (comp,), part in at.group_by("component"):
        flagged = sorted(part["rank"].to_list())
        silent = sorted(part.filter(pl.col("silent"))["rank"].to_list())
        if silent:
            named[str(comp)], how[str(comp)] = silent, ("its local gradient was exactly zero on every component "
                                                        "while the other ranks' was not")
        elif len(flagged) == 1 and world > 2:
            named[str(comp)], how[str(comp)] = flagged, BAND
        elif group := _own_departed(now.filter(pl.col("component") == comp)):
            named[str(comp)], how[str(comp)] = group, (f"{BAND}, and its own norm left its own history "
                                                       "while the others' stayed in theirs")
    return named, how


def _own_departed(here: pl.DataFrame) -> list[int]:
    """The ranks (rows of one component and step) whose own local norm left its own history while
    every other rank's stayed in its own; a non-finite norm has left it."""
    z: dict[int, float | None] = {}
    move: dict[int, float | None] = {}
    for r in here.iter_rows(named=True):
        finite = r["g"] is not None and np.isfinite(r["g"])
        z[int(r["rank"])] = r["own_z"] if finite else np.inf
        move[int(r["rank"])] = (r["x"] - r["x_med"]) if finite and r["x_med"] is not None else (None if finite else np.inf)
    return oddrank.split(z, move)


def _who(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}, each"


def _num(v: Any) -> float | None:
    return None if v is None or not np.isfinite(v) else float(v)


# --- into the analysis --------------------------------------------------------------------------

def root_fields(f: RankFinding) -> dict[str, Any]:
    """A rank finding as the fields of the analysis' `Root`."""
    return {"attributed_to": f.component, "observed_on": f.observed_on, "condition": f.condition,
            "onset_step": f.step, "alarm_step": f.step, "magnitude": f.magnitude, "metric": f.metric,
            "rank": f.rank, "ranks": f.ranks, "ranks_disagree": f.some_ranks,
            "evidence": f.evidence, "scope": REPLICAS if f.kind == REPLICAS else "component"}


def alarm_frame(found: list[RankFinding], schema: dict[str, Any]) -> pl.DataFrame:
    """The findings as alarm rows (the columns of `schema`; one per rank of a group, `rank` null
    for every rank)."""
    rows = [{"rank": r, "observed_on": f.observed_on, "condition": f.condition, "step": f.step,
             "last_step": f.step, "metric": f.metric, "value": f.value, "median": f.median,
             "magnitude": f.magnitude, "onset_step": f.step, "attributed_to": f.component}
            for f in found for r in (f.ranks if f.rank is None and f.some_ranks else [f.rank])]
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
