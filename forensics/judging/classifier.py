"""The classifier fed step by step: what `analyze`, `replay`, a reference run and live alarms run.

`Classifier.feed(rows)` takes the health rows of steps later than any it has seen, judges them
with the one evaluator (`judge.judge`) on those rows plus the trailing rows it carried, and
returns the alarms whose episode begins in them. It carries only the last `history` rows of each
(rank, component) — every past value a rule reads — and the first and last step of each alarm's
episode (and, per series, the highest lr of the rows it let go, so an lr surge is judged against
the whole run), so its memory does not grow with the run (except by the alarms themselves). Fed a
whole trace at once or one step at a time, it raises the same alarms at the same steps.

Given a reference run's baseline (`reference.reference_baseline`), each row is judged against it
for the metrics it has (joined by component and step as the rows come in), with the same rules.

With `since`, rows of earlier steps only fill the trailing history (an incident window's
warm-up): nothing before `since` is judged. It can also keep the report's heatmap, bounded: the
worst |robust z| per component and bin of `heat_width` steps (width 1 keeps every step; a wider
bin's rows are judged against the baseline of its first, `heatbins`, whose statistics a bin fed
across calls carries, so the cells too are the same in any chunks).
"""

from __future__ import annotations

import collections
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import polars as pl
from warninglight.forensics.judging.baseline import (
    KEYS,
    LR_PEAK,
    SERIES_KEY,
    increasing,
    lr_peaks,
    series_order,
    series_starts,
    with_series_values,
)
from warninglight.forensics.judging.conditions import Config
from warninglight.forensics.judging.hits import ALARM_SCHEMA, alarms, lead
from warninglight.forensics.judging.judge import judge
from warninglight.forensics.judging.kernels.heatbins import Open
from warninglight.tracer import schema

GROUP = ["rank", "component", "condition"]
HEAT_SCHEMA = {"component": pl.String, "step": pl.Int64, "score": pl.Float64}
_NEW = "__new"  # marks the rows of the current call among the carried ones
_JUDGED = "__judged"  # ... and of those, the rows judged (not before `since`)
_COMPONENT_COLUMNS = ("role",)  # what the rules read of the components table (`Rule.roles`)


class StepOrderError(ValueError):
    """Rows were fed for a step the classifier has already judged."""


class Classifier:
    """Causal, incremental classification of health rows (see the module docstring)."""

    def __init__(self, config: Config, components: pl.DataFrame | None = None,
                 heat_width: int | None = None, since: int | None = None,
                 reference: pl.DataFrame | None = None) -> None:
        self.config = config
        self.reference = reference  # a reference run's baseline (`reference.reference_baseline`), or None
        self.history = config.baseline.history(config.conditions)
        self._components = components
        # every name a window may hold, sorted: a window's sort need not find its own
        self._names = (components["component"].drop_nulls().unique().sort()
                       if components is not None and "component" in components.columns else None)
        self._tail: pl.DataFrame | None = None
        self._lr_peak: pl.DataFrame | None = None  # per series, the highest lr of the rows let go
        self._last_step: dict[int, int] = {}
        self._episodes = pl.DataFrame(schema={**{k: ALARM_SCHEMA[k] for k in GROUP},
                                              "start": pl.Int64, "last": pl.Int64})
        self._alarms: list[pl.DataFrame] = []
        self.heat_width = heat_width
        self._heat: list[pl.DataFrame] = []
        # the statistics the open bins of a heatmap of several steps a cell were judged against
        self._opened = Open() if heat_width is not None and heat_width > 1 else None
        self.since = since  # steps before it are history only: read, never judged
        self._judging: ThreadPoolExecutor | None = None  # where the compiled rules run (`submit`)
        self._pending: collections.deque[Future[tuple[pl.DataFrame, pl.DataFrame | None]]] = collections.deque()

    def feed(self, rows: pl.DataFrame) -> pl.DataFrame:
        """Judge the rows of new steps; return the alarms that begin in them (`ALARM_SCHEMA`)."""
        return _joined([self.submit(rows), self.drain()])

    def submit(self, rows: pl.DataFrame) -> pl.DataFrame:
        """`feed`, the compiled rules left to run on a thread of their own while the caller reads
        and sorts the next rows (done in turn on one thread, the rules' cores sat idle while
        a window was sorted, gathered and carried): at most one window is judged behind the caller.
        Returns the alarms that begin in the windows whose judging ended; `drain` waits for the
        rest."""
        if rows.is_empty():
            return self.drain(behind=1)
        rows = self._prepare(rows)
        if self._tail is not None and ("role" in rows.columns) != ("role" in self._tail.columns):
            # rows fed with roles and rows without: each row gets the components table's role
            # joined to it (its own where it has one); else `judge` joins it per series
            if "role" in rows.columns:
                self._tail = self._with_roles(self._tail)
            else:
                rows = self._with_roles(rows)
        # two chunks, not copied into one: each column read of it reads
        # both (`series_order` adds its key in the same two, the metrics are gathered from them)
        window = rows if self._tail is None else pl.concat([self._tail, rows], how="diagonal_relaxed")
        # once: the baseline and the carry read series in order. Only the columns that are not
        # metrics move; each metric is read in that order where it is.
        source, order = series_order(window, self._names)
        metrics = [m for m in schema.HEALTH_METRICS if m in source.columns]
        if order is not None and not increasing(source[SERIES_KEY].to_numpy()[order]):
            source, order = source[order], None  # sorted whole (also where a step's rows came twice)
        # the columns left made one chunk before the gather: Polars gathers from two chunks
        # row by row, from one chunk in one take
        window = source if order is None else source.drop(metrics).rechunk()[order]
        if self._lr_peak is not None and "lr" in window.columns:  # the run's lr before the window
            window = with_series_values(window, self._lr_peak)
        judged = pl.col(_NEW) if self.since is None else pl.col(_NEW) & (pl.col("step") >= self.since)
        window = window.with_columns(judged.alias(_JUDGED))
        if self._judging is None:
            self._judging = ThreadPoolExecutor(1, thread_name_prefix="warninglight-judge")
        self._pending.append(self._judging.submit(
            judge, window, self.config, _JUDGED, lead(self.config), self.heat_width, self._components,
            source if order is not None else None, order, self._opened))
        self._tail = self._carry(window.drop(_JUDGED), None if order is None else source, order)
        return self.drain(behind=1)

    def drain(self, behind: int = 0) -> pl.DataFrame:
        """Wait until at most `behind` windows are being judged; the alarms that begin in the
        windows whose judging ended (`ALARM_SCHEMA`), in the order they were fed."""
        new = []
        while len(self._pending) > behind:
            found, heat = self._pending.popleft().result()
            if heat is not None:
                self._heat.append(heat)
            new.append(self._episode_alarms(found))
        return _joined(new)

    def alarms(self) -> pl.DataFrame:
        """Every alarm so far, each with the last step of its episode; sorted like `hits.alarms`."""
        self.drain()
        if not self._alarms:
            return pl.DataFrame(schema=ALARM_SCHEMA)
        found = pl.concat(self._alarms)
        last = self._episodes.select(*GROUP, pl.col("start").alias("step"), pl.col("last").alias("_last"))
        found = found.join(last, on=[*GROUP, "step"], how="left").with_columns(
            pl.coalesce("_last", "last_step").alias("last_step")).drop("_last")
        return found.select(list(ALARM_SCHEMA)).sort("step", "rank", "component", "condition")

    def heat(self) -> pl.DataFrame:
        """Worst |robust z| per (component, bin start step), the largest over ranks and bins' steps."""
        self.drain()
        if not self._heat:
            return pl.DataFrame(schema=HEAT_SCHEMA)
        # one lazy query: Polars plans the group_by and the sort together
        return (pl.concat(self._heat).lazy().group_by("component", "step").agg(pl.col("score").max())
                .sort("component", "step").collect())

    def _prepare(self, rows: pl.DataFrame) -> pl.DataFrame:
        if "rank" not in rows.columns:
            rows = rows.with_columns(pl.lit(0, pl.Int64).alias("rank"))
        ranks, steps = rows["rank"], rows["step"]
        firsts = ([(ranks[0], steps.min(), steps.max())] if ranks.min() == ranks.max() else  # one rank: no grouping
                  rows.group_by("rank").agg(pl.col("step").min(), pl.col("step").max().alias("last")).iter_rows())
        for rank, first, last in firsts:
            seen = self._last_step.get(rank)
            if seen is not None and first <= seen:
                raise StepOrderError(f"rank {rank}: fed step {first}, but steps up to {seen} were already "
                                     "judged — feed each step once, in order")
            self._last_step[rank] = last
        if self.reference is not None:  # each row beside the reference's baseline at its step
            ref = self.reference.with_columns(pl.col("component").cast(rows.schema["component"]))
            rows = rows.join(ref, on=["component", "step"], how="left", maintain_order="left")
        return rows.with_columns(pl.lit(True).alias(_NEW))

    def _with_roles(self, rows: pl.DataFrame) -> pl.DataFrame:
        """`rows` with what the rules read of the components table (the role), joined to each
        row; every other column of it would ride through each window's sort, concatenation and
        carry (a string column most of all: each sort moves its strings too)."""
        comps = self._components
        if comps is None:
            return rows
        on = [k for k in KEYS if k in comps.columns]
        extra = [*on, *(c for c in _COMPONENT_COLUMNS if c in comps.columns and c not in rows.columns)]
        comps = comps.select(extra).unique(on, keep="last").with_columns(pl.col("component").cast(rows.schema["component"]))
        return rows.join(comps, on=on, how="left")

    def _carry(self, window: pl.DataFrame, source: pl.DataFrame | None = None,
               order: np.ndarray | None = None) -> pl.DataFrame:
        """The last `history` rows of each (rank, component) of `window` (sorted by them and step):
        all the past a rule reads. With `source` and `order`, `window` is `source`'s rows in that
        order less the metrics: the rows are taken, whole, from `source`."""
        starts = series_starts(window)
        kept_from = np.maximum(starts[:-1], starts[1:] - self.history)  # each series' first kept row
        if "lr" in window.columns:  # the lr of the rows let go still bounds what a surge is
            self._lr_peak = lr_peaks(window, starts, kept_from)
        keep = np.arange(window.height) >= np.repeat(kept_from, np.diff(starts))
        kept = window.filter(pl.Series(keep)) if source is None or order is None else source[order[keep]]
        return kept.drop(LR_PEAK, strict=False).with_columns(pl.lit(False).alias(_NEW))

    def _episode_alarms(self, found: pl.DataFrame) -> pl.DataFrame:
        """Alarms of the hits of new steps, continuing the episodes open before them."""
        if found.is_empty():
            return pl.DataFrame(schema=ALARM_SCHEMA)
        groups = found.select(GROUP).unique()
        open_ = self._episodes.sort("start").unique(GROUP, keep="last").join(groups, on=GROUP)
        # each open episode enters as one hit at its last step: a new hit within `episode_gap`
        # of it continues that episode instead of starting one
        carried = open_.select(*GROUP, pl.col("last").alias("step")).join(
            found.select(*GROUP, "metric", "value", "median", "magnitude").unique(GROUP, keep="first"),
            on=GROUP)
        raised = alarms(pl.concat([carried.select(found.columns), found]), self.config)
        at_last = open_.select(*GROUP, pl.col("last").alias("step"), "start")
        cont = raised.join(at_last, on=[*GROUP, "step"])
        new = raised.join(at_last, on=[*GROUP, "step"], how="anti")
        ends = pl.concat([
            cont.select(*GROUP, "start", pl.col("last_step").alias("last")),
            new.select(*GROUP, pl.col("step").alias("start"), pl.col("last_step").alias("last"))])
        self._episodes = pl.concat([self._episodes.join(ends, on=[*GROUP, "start"], how="anti"),
                                    ends]).cast(self._episodes.schema)
        if not new.is_empty():
            self._alarms.append(new)
        return new


def _joined(alarms: list[pl.DataFrame]) -> pl.DataFrame:
    kept = [a for a in alarms if not a.is_empty()]
    return pl.concat(kept) if len(kept) > 1 else kept[0] if kept else pl.DataFrame(schema=ALARM_SCHEMA)
