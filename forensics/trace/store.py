"""Open a trace directory as DuckDB views (and Polars frames for the classifier).

Views (every one has `rank` and `incarnation` columns, from the hive partitions):

- `health_all`, `steps_all`, `scalars_all`, `events_all`, `components_all`: every row recorded,
  every incarnation.
- `health`, `steps`, `scalars`, `events`: the *effective timeline*: a restarted run (a new
  incarnation starting at step s) supersedes what earlier incarnations recorded from step s on,
  so each (rank, step) appears once, from the latest incarnation that reached it.
- `components`: one row per (rank, component), from the latest incarnation.
- `checkpoints`: the `checkpoint` events of the effective timeline (step, path, detail).
- `replicas`: per-rank evidence (weight checksums, local gradient norms) of the effective timeline;
  empty for a single-rank run.
- `ranks`: the ranks side by side, one row per (step, component): `ranks` (how many recorded
  it), `fingerprints` (distinct weight checksums: 1 when the replicas agree), the local gradient
  norm's min / median / max over ranks and `max_rank` (the rank holding the max), and
  `all_reduced` (every rank all-reduced its gradients). Sharded (FSDP) components are left out.

Checks on open (each a named `TraceError` whose message names the file and the fix): not a trace
directory, no segments, a segment that is not readable Parquet or lacks its key columns, an unknown
format version. Which files are read is decided by `segments.list_segments` (committed segments
only, as an explicit list: a path is never a glob); what the reading went past is named in
`Trace.warnings` (`checks`).
"""

from __future__ import annotations

import bisect
import functools
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import duckdb
from warninglight.tracer import schema

if TYPE_CHECKING:  # Polars loads with the first frame asked for: `info` needs none
    from collections.abc import Callable, Hashable

    import polars as pl

from warninglight.forensics.trace import checks
from warninglight.forensics.trace.errors import (
    CorruptSegmentError,
    EmptyTraceError,
    FormatVersionError,
    NotATraceError,
    TraceError,
)
from warninglight.forensics.trace.footers import SegmentSpan, read_files, read_spans, same_schema
from warninglight.forensics.trace.segments import list_segments

_DUCK_TYPES = {"int64": "BIGINT", "float": "FLOAT", "double": "DOUBLE", "string": "VARCHAR",
               "bool": "BOOLEAN", "list<item: int64>": "BIGINT[]", "list<item: double>": "DOUBLE[]",
               "list<item: string>": "VARCHAR[]", "list<item: bool>": "BOOLEAN[]"}
_TIMELINE_TABLES = ("health", "steps", "scalars", "events", "replicas")
# DuckDB's own working memory (its default is 80% of the machine): above it, aggregates and joins
# over a large trace spill to disk instead of growing the process.
DUCKDB_MEMORY = "1GB"
# Health rows a step window holds: larger windows hold more memory, smaller ones re-read more of
# the rows each window carries from the last (docs/scale.md has the measurements).
CHUNK_ROWS = 1_000_000


_T = TypeVar("_T")


@dataclass
class Trace:
    """An open trace: a DuckDB connection with the views above, and the manifests."""

    root: Path
    con: duckdb.DuckDBPyConnection
    manifests: list[dict[str, Any]] = field(default_factory=list)
    segments: list[Path] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)  # named problems the reading went past
    spans: list[SegmentSpan] = field(default_factory=list)  # every segment's step range
    _read: dict[Hashable, Any] = field(default_factory=dict, repr=False)  # `once`

    def once(self, key: Hashable, read: Callable[[], _T]) -> _T:
        """`read()` the first time `key` is asked for while the trace is open, then what it gave:
        an analysis asks for the run's loss, gradient norm and lr schedule more than once (each a
        query over every steps file)."""
        if key not in self._read:
            self._read[key] = read()
        return self._read[key]

    def sql(self, query: str) -> duckdb.DuckDBPyRelation:
        """Run SQL over the views."""
        return self.con.sql(query)

    def one(self, query: str) -> tuple[Any, ...]:
        """The first row of a query's result."""
        rows = self.con.execute(query).fetchall()
        assert rows, "an aggregate query returns one row"
        return rows[0]

    def columns(self, view: str) -> list[str]:
        """The column names of a view (no row read)."""
        return self.con.sql(f"SELECT * FROM {view} LIMIT 0").columns

    def frame(self, view: str) -> pl.LazyFrame:
        """A view as a Polars lazy frame (materialised once through Arrow)."""
        import polars as pl

        table = self.con.sql(f"SELECT * FROM {view}").to_arrow_table()
        return pl.from_arrow(table).lazy()  # type: ignore[union-attr]

    @functools.cached_property
    def restarted(self) -> bool:
        """Whether a later incarnation of a rank supersedes an earlier one's steps (`_superseded`):
        if not, every recorded row is on the effective timeline."""
        return bool(self.one("SELECT count(*) FROM _superseded WHERE at_step IS NOT NULL")[0])

    @functools.cached_property
    def component_enum(self) -> str | None:
        """The name of a DuckDB enum type holding every component name of the components
        table (`health_window(categorical=True)` reads through it); None if it has none."""
        if not self.one("SELECT count(component) FROM components")[0]:
            return None
        self.con.execute(f"CREATE TYPE {_COMPONENT_ENUM} AS ENUM "
                         "(SELECT DISTINCT component FROM components WHERE component IS NOT NULL)")
        return _COMPONENT_ENUM

    def close(self) -> None:
        self.con.close()


_COMPONENT_ENUM = "__wl_component"


def _read_manifests(root: Path, warnings: list[str]) -> list[dict[str, Any]]:
    manifests = []
    for path in sorted((root / schema.MANIFEST_DIR).glob("rank=*.json")):
        if not path.is_file():  # a FIFO would block read_text forever
            warnings.append(f"manifest {path} is not a regular file; ignored")
            continue
        try:
            manifest = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise CorruptSegmentError(
                f"manifest {path} is not valid JSON ({exc}) — restore it or delete it; "
                "the Parquet segments can be read without it") from exc
        problem = checks.manifest_problem(manifest)
        if problem:
            warnings.append(f"unusable manifest: {path} {problem}; ignored, so dropped steps and "
                            "the run's status are unknown")
            continue
        version = manifest.get("format_version")
        if version not in schema.SUPPORTED_FORMAT_VERSIONS:
            known = ", ".join(str(v) for v in sorted(schema.SUPPORTED_FORMAT_VERSIONS))
            raise FormatVersionError(
                f"{path} says format_version {version!r}; this warninglight reads version {known} "
                "— upgrade warninglight to read it (pip install -U warninglight)")
        manifests.append(manifest)
    return manifests


def _empty_select(table: str) -> str:
    cols = [f"CAST(NULL AS {_DUCK_TYPES[c.type_name]}) AS {c.name}" for c in schema.COLUMNS[table]]
    return f"SELECT {', '.join(cols)}, CAST(NULL AS BIGINT) AS rank, CAST(NULL AS BIGINT) AS incarnation WHERE false"


def _traces_inside(root: Path, depth: int = 2) -> list[Path]:
    """Trace directories (a `health` folder beside a `manifest` one) at most `depth` folders
    below `root`, at most three: a run folder given where its trace was meant."""
    found: list[Path] = []
    level = [root]
    for _ in range(depth):
        level = sorted(p for d in level for p in d.iterdir() if p.is_dir() and not p.is_symlink()) \
            if level else []
        found += [p for p in level if (p / "health").is_dir() and (p / schema.MANIFEST_DIR).is_dir()]
        if found:
            return found[:3]
    return []


def _raw_view(con: duckdb.DuckDBPyConnection, table: str, spans: list[SegmentSpan]) -> None:
    # an explicit list of literal names (the table's segments): never another run's files
    mine = [s for s in spans if s.table == table]
    src = f"SELECT * FROM {read_files([s.path for s in mine], same_schema(mine))}" if mine else _empty_select(table)
    con.execute(f"CREATE VIEW {table}_all AS {src}")


def _superseded(con: duckdb.DuckDBPyConnection, spans: list[SegmentSpan]) -> None:
    """`_superseded` (rank, incarnation, at_step) from the segments' step ranges, without a scan."""
    firsts: dict[tuple[int, int], int] = {}
    for s in spans:
        if s.table in ("health", "steps") and s.first is not None and s.rows:
            key = (s.rank, s.incarnation)
            firsts[key] = min(firsts.get(key, s.first), s.first)
    rows = []
    for (rank, inc) in sorted(firsts):
        later = [f for (r, i), f in firsts.items() if r == rank and i > inc]
        rows.append((rank, inc, min(later) if later else None))
    con.execute("CREATE TABLE _superseded (rank BIGINT, incarnation BIGINT, at_step BIGINT)")
    if rows:
        con.executemany("INSERT INTO _superseded VALUES (?, ?, ?)", rows)


def _timeline_views(con: duckdb.DuckDBPyConnection) -> None:
    # An incarnation is superseded from the first step of any later incarnation of the same rank.
    con.execute("""
        CREATE VIEW incarnations AS
        SELECT rank, incarnation, min(step) AS first_step, max(step) AS last_step, count(*) AS rows
        FROM (SELECT rank, incarnation, step FROM health_all UNION ALL
              SELECT rank, incarnation, step FROM steps_all)
        GROUP BY rank, incarnation""")
    for table in _TIMELINE_TABLES:
        con.execute(f"""
            CREATE VIEW {table} AS SELECT t.* FROM {table}_all t
            JOIN _superseded s ON t.rank = s.rank AND t.incarnation = s.incarnation
            WHERE s.at_step IS NULL OR t.step < s.at_step""")
    con.execute("""
        CREATE VIEW components AS SELECT * FROM components_all
        QUALIFY incarnation = max(incarnation) OVER (PARTITION BY rank, component)""")
    con.execute("""
        CREATE VIEW ranks AS
        SELECT step, component, count(*) AS ranks, count(DISTINCT weight_checksum) AS fingerprints,
               min(local_grad_norm_l2) AS local_grad_norm_min,
               median(local_grad_norm_l2) AS local_grad_norm_median,
               max(local_grad_norm_l2) AS local_grad_norm_max,
               arg_max(rank, local_grad_norm_l2) AS max_rank,
               bool_and(grad_allreduced) AS all_reduced
        FROM replicas WHERE NOT coalesce(sharded, false)
        GROUP BY step, component""")
    con.execute("""
        CREATE VIEW checkpoints AS SELECT step, path, detail, rank, incarnation, wall_time_s
        FROM events WHERE kind = 'checkpoint' ORDER BY step""")


def open_trace(path: str | Path) -> Trace:
    """Open the trace at `path`; raise a `TraceError` naming the file and the fix if it cannot be read."""
    root = Path(path)
    if not root.is_dir():
        raise NotATraceError(f"{root} is not a directory — pass the trace directory given to watch(...)")
    warnings: list[str] = []
    manifests = _read_manifests(root, warnings)
    listing = list_segments(root, manifests)
    by_table = listing.by_table
    if not listing.files and manifests:  # a run killed before its first segment: say so, not fail
        warnings.append(f"no committed segments under {root}: the run recorded no complete steps "
                        "yet (the first segment closes after 10 steps or 5 s, then every "
                        "flush_every_steps)")
    elif not by_table["health"]:
        example = schema.segment_path(Path(root), "health", 0, 1, 0).relative_to(root)
        if manifests or by_table["steps"]:
            raise EmptyTraceError(
                f"no health segments under {root / 'health'} — the run recorded no complete steps "
                f"yet (segments are written every few steps and at exit); expected files like {example}")
        inside = _traces_inside(Path(root))
        if inside:
            which = f"one: pass {inside[0]}" if len(inside) == 1 else \
                f"traces: pass one of {', '.join(str(p) for p in inside)}"
            raise NotATraceError(f"{root} is not a trace directory but holds {which}")
        raise NotATraceError(
            f"no trace segments under {root / 'health'} — is this a trace directory? "
            f"expected files like {example}")
    segments = listing.files
    con = duckdb.connect(config={"memory_limit": DUCKDB_MEMORY})
    con.execute("SET enable_progress_bar = false")  # it would write into stdout (analyze --json)
    try:
        spans = read_spans(con, by_table)
    except TraceError:
        con.close()
        raise
    for table in schema.TABLES:
        _raw_view(con, table, spans)
    _superseded(con, spans)
    _timeline_views(con)
    trace = Trace(root=root, con=con, manifests=manifests, segments=segments, spans=spans)
    trace.warnings = warnings + listing.warnings
    if listing.files:
        trace.warnings += checks.trace_warnings(trace, by_table)
    return trace


def info(trace: Trace) -> dict[str, Any]:
    """The summary `warninglight info` prints: run, steps, incarnations, components, ranks, size."""
    row = trace.one("SELECT count(DISTINCT step), min(step), max(step), count(DISTINCT rank) FROM steps")
    incarnations = {(s.rank, s.incarnation) for s in trace.spans
                    if s.table in ("health", "steps") and s.rows}
    components = trace.one("SELECT count(DISTINCT component) FROM components")
    ranks = set(checks.data_ranks(trace))
    dropped: int | None = sum(int(inc.get("dropped_steps") or 0) for m in trace.manifests
                              for inc in m.get("incarnations", []))
    if not ranks <= checks.manifest_ranks(trace):
        dropped = None  # a rank without a manifest: its dropped steps are unknown, not 0
    return {
        "trace": str(trace.root),
        "run_id": next((m.get("run_id") for m in trace.manifests), None),
        "steps": int(row[0]), "first_step": row[1], "last_step": row[2],
        "incarnations": len(incarnations), "components": int(components[0]),
        "ranks": int(row[3]),
        "segments": len(trace.segments),
        "size_bytes": sum(p.stat().st_size for p in trace.segments),
        "dropped_steps": dropped,
        "estimate_bits": _estimate_bits(trace.manifests),
        "ended": checks.run_status(trace),
    }


def _estimate_bits(manifests: list[dict[str, Any]]) -> int | None:
    """The fewest significand bits any rank kept of the estimate columns (`config.significand_bits`);
    None: every bit (full precision, or a trace written before estimates were rounded)."""
    kept = [b for m in manifests for b in ((m.get("config") or {}).get("significand_bits") or {}).values()
            if isinstance(b, int)]
    return min(kept, default=None)


COMPONENT_KEYS = ("rank", "component", "kind", "role", "bound", "parent_param", "forward_index")


def no_health_error(trace: Trace) -> EmptyTraceError:
    """The error for a trace that holds no health rows, saying why (no steps, or no components)."""
    steps = trace.one("SELECT count(*) FROM steps")[0]
    why = (f"it recorded {steps} steps but no component (the model has no submodules or "
           "parameters to watch)" if steps else
           "the run recorded no complete steps (it stopped before its first optimizer step, "
           "or was killed before its first segment was written)")
    return EmptyTraceError(f"no health rows in {trace.root}: {why} — nothing to analyse; "
                           "`warninglight info` shows what it holds")


def health_frame(trace: Trace) -> pl.LazyFrame:
    """Effective-timeline health rows joined with each component's role, bound, parent and order."""
    if trace.one("SELECT count(*) FROM health")[0] == 0:  # empty segments: closed before a step
        raise no_health_error(trace)
    comps = trace.frame("components")
    comps = comps.select(*[c for c in COMPONENT_KEYS if c in comps.collect_schema().names()])
    return trace.frame("health").join(comps, on=["rank", "component"], how="left")


def health_steps(trace: Trace) -> tuple[int, int] | None:
    """(first, last) step of the health rows, from the segments' step ranges (no scan)."""
    spans = [s for s in trace.spans if s.table == "health" and s.first is not None and s.rows]
    if not spans:
        return None
    return min(s.first for s in spans), max(s.last for s in spans)  # type: ignore[type-var]


def window_spans(trace: Trace, table: str, first: int, last: int) -> list[SegmentSpan]:
    """The segments of `table` that may hold steps first..last (their names or footers say so)."""
    return [s for s in trace.spans if s.table == table and s.rows and s.first is not None
            and s.first <= last and s.last >= first]  # type: ignore[operator]


def window_starts(trace: Trace, table: str, first: int, last: int, steps: int, least: int,
                  opening: int | None = None) -> list[int]:
    """The first step of each window of about `steps` steps that covers first..last, each window
    ending where the segments of `table` end where it can: the next start is the step nearest
    start + `steps`, within start + `least` .. start + 9/8 `steps`, that no segment straddles
    (none: start + `steps`). A window that starts inside a segment reads all of it and keeps only
    its own steps: with windows of a fixed length, the segment on each edge was read and
    filtered twice. `opening`: the first window's length instead,
    its end the segment start nearest it from `first` + 1 as far as a window of `steps` reaches (a
    short first window starts a pipeline sooner)."""
    spans = sorted((s.first, s.last) for s in trace.spans if s.table == table and s.rows and s.first is not None)
    starts, reach = set(), None  # the segment starts no segment straddles; the furthest last step so far
    for begin, end in spans:  # by first step: every segment that starts before `begin` came already
        if first < begin <= last and (reach is None or reach < begin):  # type: ignore[operator]
            starts.add(begin)
        reach = end if reach is None else max(reach, end)  # type: ignore[type-var]
    clean = sorted(starts)
    out, start = [], first
    length, low = (opening, 1) if opening else (steps, least)
    while start <= last:
        out.append(start)
        target = start + length
        if target > last:
            break  # the rest fits in one window
        at = bisect.bisect_left(clean, target)
        near = [b for b in clean[max(0, at - 1):at + 1] if start + low <= b <= start + steps + steps // 8]
        start = min(near, key=lambda b: abs(b - target)) if near else target
        length, low = steps, least
    return out


def window_files(trace: Trace, table: str, first: int, last: int) -> list[Path]:
    """The files of `window_spans`."""
    return [s.path for s in window_spans(trace, table, first, last)]


def health_window(trace: Trace, first: int, last: int, *, columns: list[str] | None = None,
                  names: list[str] | None = None, rank: int | None = None,
                  categorical: bool = False) -> pl.DataFrame:
    """Effective-timeline health rows of steps first..last, reading only the files that hold them.

    `columns`: only step, component, rank and these; `names` / `rank`: only those components /
    that rank. The components' attributes are not joined (the classifier joins the one its
    rules read, localisation the ones it reads). `categorical`: the component column comes as
    a Polars Categorical, read through a DuckDB enum of the trace's component names (no string
    is made per row: the names as strings were made for every row of the window, and every
    sort, join and gather of the window after it moved them).
    """
    import polars as pl

    spans = window_spans(trace, "health", first, last)
    if categorical and columns is not None and names is None and rank is None and not trace.restarted:
        read = _arrow_window(spans, first, last, columns)
        if read is not None:
            return read
    files = [s.path for s in spans]
    enum = trace.component_enum if categorical else None
    named = "t.component" if enum is None else f"TRY_CAST(t.component AS {enum}) AS component"
    if columns is None:
        picked = "t.*" if enum is None else f"t.* REPLACE ({named})"
    else:
        picked = ", ".join(["t.step", named, "t.rank", *(f't."{c}"' for c in dict.fromkeys(columns))])
    where = f"t.step BETWEEN {int(first)} AND {int(last)}"
    if names is not None:
        where += " AND t.component IN (" + (", ".join(_quote(n) for n in names) or "NULL") + ")"
    if rank is not None:
        where += f" AND t.rank = {int(rank)}"
    source = f"{read_files(files, same_schema(spans)) if files else 'health_all'} t"
    if trace.restarted:  # the effective timeline; with no step superseded the join keeps every
        # row, so it is made only where a rank restarted
        source += " JOIN _superseded s ON t.rank = s.rank AND t.incarnation = s.incarnation"
        where += " AND (s.at_step IS NULL OR t.step < s.at_step)"
    arrow = trace.con.sql(f"SELECT {picked} FROM {source} WHERE {where}").to_arrow_table()
    if categorical and (enum is None or arrow.column("component").null_count):
        # no components table, or a name it lacks: the names as strings, then Categorical
        plain = (pl.from_arrow(arrow) if enum is None else
                 health_window(trace, first, last, columns=columns, names=names, rank=rank))
        return plain.with_columns(pl.col("component").cast(pl.Categorical))  # type: ignore[union-attr]
    # one chunk: DuckDB hands over several, and every later column added to or taken from a frame
    # of several chunks copied all of it again: the copy is made once, here
    frame: pl.DataFrame = pl.from_arrow(arrow).rechunk()  # type: ignore[union-attr]
    return frame


def _arrow_window(spans: list[SegmentSpan], first: int, last: int, columns: list[str]) -> pl.DataFrame | None:
    """`health_window(categorical=True)` of a whole run's metric columns in steps first..last, from
    the window's segments `spans` (`window_spans`), read by Arrow's Parquet reader straight into
    the frame: the component's dictionary pages come as Categorical codes,
    and no step is copied through DuckDB's result into Arrow (a second copy of every value after
    the scan). Each file is read whole by `pyarrow.parquet.ParquetFile` (a dataset fragment's
    scan of the same columns adds the dataset layer's work to the same read), a segment on the
    window's edge filtered to its steps after. None where DuckDB must read it: a file that is not
    readable here, or whose columns are missing or differ in type from another's (DuckDB unifies
    them by name)."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq
    from polars import from_arrow

    if not spans:
        return None
    want = ["step", "component", *dict.fromkeys(columns)]
    tables, types = [], None
    try:
        for s in spans:
            with pq.ParquetFile(s.path, read_dictionary=["component"]) as file:
                fields = file.schema_arrow
                if any(fields.get_field_index(c) < 0 for c in want):
                    return None
                kinds = [fields.field(c).type for c in want]
                if types is None:
                    types = kinds
                elif kinds != types:
                    return None
                table = file.read(columns=want, use_threads=False)
            if s.first < first or s.last > last:  # type: ignore[operator]
                step = table.column("step")
                table = table.filter(pc.and_(pc.greater_equal(step, first), pc.less_equal(step, last)))
            # the rank from numpy: `np.full` fills one buffer, quicker than Arrow's scalar `repeat`
            tables.append(table.add_column(2, "rank", pa.array(np.full(table.num_rows, s.rank, dtype=np.int64))))
    except (OSError, pa.ArrowException):
        return None  # DuckDB reads it, or names the file it cannot
    frame: pl.DataFrame = from_arrow(pa.concat_tables(tables)).rechunk()  # type: ignore[assignment]
    return frame


def _quote(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"

def require_health(trace: Trace) -> tuple[int, int]:
    """(first, last) health step; an `EmptyTraceError` saying why when the trace holds none."""
    steps = health_steps(trace)
    if steps is None:
        raise no_health_error(trace)
    return steps
