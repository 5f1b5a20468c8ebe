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
`Trace.warnings` (forensics/checks.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import duckdb
import polars as pl
from warninglight.tracer import schema

from . import checks
from .segments import list_segments

_DUCK_TYPES = {"int64": "BIGINT", "float": "FLOAT", "double": "DOUBLE", "string": "VARCHAR",
               "bool": "BOOLEAN", "list<item: int64>": "BIGINT[]"}
_TIMELINE_TABLES = ("health", "steps", "scalars", "events", "replicas")


class TraceError(Exception):
    """The path cannot be read as a trace."""


class NotATraceError(TraceError):
    """The path is not a trace directory."""


class EmptyTraceError(TraceError):
    """The trace directory holds no recorded steps."""


class CorruptSegmentError(TraceError):
    """A segment file is not readable Parquet."""


class FormatVersionError(TraceError):
    """The trace was written in a format version this reader does not know."""


@dataclass
class Trace:
    """An open trace: a DuckDB connection with the views above, and the manifests."""

    root: Path
    con: duckdb.DuckDBPyConnection
    manifests: list[dict[str, Any]] = field(default_factory=list)
    segments: list[Path] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)  # named problems the reading went past

    def sql(self, query: str) -> duckdb.DuckDBPyRelation:
        """Run SQL over the views."""
        return self.con.sql(query)

    def one(self, query: str) -> tuple[Any, ...]:
        """The first row of a query's result."""
        rows = self.con.execute(query).fetchall()
        assert rows, "an aggregate query returns one row"
        return rows[0]

    def frame(self, view: str) -> pl.LazyFrame:
        """A view as a Polars lazy frame (materialised once through Arrow)."""
        table = self.con.sql(f"SELECT * FROM {view}").to_arrow_table()
        return pl.from_arrow(table).lazy()  # type: ignore[union-attr]

    def close(self) -> None:
        self.con.close()


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
    cols = [f"CAST(NULL AS {_DUCK_TYPES[str(c.type)]}) AS {c.name}" for c in schema.COLUMNS[table]]
    return f"SELECT {', '.join(cols)}, CAST(NULL AS BIGINT) AS rank, CAST(NULL AS BIGINT) AS incarnation WHERE false"


def _literal(path: Path) -> str:
    """`path` as a DuckDB file name that matches only itself: DuckDB globs every name it is given,
    so a trace under `runs/exp[1]` would also read `runs/exp1`; each glob character becomes a
    one-character class (`[` -> `[[]`), and quotes are doubled for the SQL string."""
    return "'" + "".join(f"[{c}]" if c in "[*?{" else c for c in str(path)).replace("'", "''") + "'"


def _raw_view(con: duckdb.DuckDBPyConnection, table: str, files: list[Path]) -> None:
    if files:  # an explicit list of literal names: never another run's files
        listed = ", ".join(_literal(p) for p in files)
        src = (f"SELECT * FROM read_parquet([{listed}], hive_partitioning = true, "
               "hive_types = {'rank': BIGINT, 'incarnation': BIGINT}, union_by_name = true)")
    else:
        src = _empty_select(table)
    con.execute(f"CREATE VIEW {table}_all AS {src}")


def _timeline_views(con: duckdb.DuckDBPyConnection) -> None:
    # An incarnation is superseded from the first step of any later incarnation of the same rank.
    con.execute("""
        CREATE VIEW incarnations AS
        SELECT rank, incarnation, min(step) AS first_step, max(step) AS last_step, count(*) AS rows
        FROM (SELECT rank, incarnation, step FROM health_all UNION ALL
              SELECT rank, incarnation, step FROM steps_all)
        GROUP BY rank, incarnation""")
    con.execute("""
        CREATE VIEW _superseded AS
        SELECT a.rank, a.incarnation, min(b.first_step) AS at_step
        FROM incarnations a LEFT JOIN incarnations b
          ON a.rank = b.rank AND b.incarnation > a.incarnation
        GROUP BY a.rank, a.incarnation""")
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
        raise NotATraceError(
            f"no trace segments under {root / 'health'} — is this a trace directory? "
            f"expected files like {example}")
    segments = listing.files
    checks.check_files(by_table)
    con = duckdb.connect()
    for table in schema.TABLES:
        _raw_view(con, table, by_table[table])
    _timeline_views(con)
    trace = Trace(root=root, con=con, manifests=manifests, segments=segments)
    trace.warnings = warnings + listing.warnings
    if listing.files:
        trace.warnings += checks.trace_warnings(trace, by_table)
    return trace


def info(trace: Trace) -> dict[str, Any]:
    """The summary `warninglight info` prints: run, steps, incarnations, components, ranks, size."""
    row = trace.one("SELECT count(DISTINCT step), min(step), max(step), count(DISTINCT rank) FROM steps")
    incarnations = trace.one("SELECT count(*) FROM incarnations")
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
        "incarnations": int(incarnations[0]), "components": int(components[0]),
        "ranks": int(row[3]),
        "segments": len(trace.segments),
        "size_bytes": sum(p.stat().st_size for p in trace.segments),
        "dropped_steps": dropped,
    }


COMPONENT_KEYS = ("rank", "component", "kind", "role", "bound", "parent_param", "forward_index")


def health_frame(trace: Trace) -> pl.LazyFrame:
    """Effective-timeline health rows joined with each component's role, bound, parent and order."""
    if trace.one("SELECT count(*) FROM health")[0] == 0:  # empty segments: closed before a step
        steps = trace.one("SELECT count(*) FROM steps")[0]
        why = (f"it recorded {steps} steps but no component (the model has no submodules or "
               "parameters to watch)" if steps else
               "the run recorded no complete steps (it stopped before its first optimizer step, "
               "or was killed before its first segment was written)")
        raise EmptyTraceError(f"no health rows in {trace.root}: {why} — nothing to analyse; "
                              "`warninglight info` shows what it holds")
    comps = trace.frame("components")
    comps = comps.select(*[c for c in COMPONENT_KEYS if c in comps.collect_schema().names()])
    return trace.frame("health").join(comps, on=["rank", "component"], how="left")
