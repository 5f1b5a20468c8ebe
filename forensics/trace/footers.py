"""What a trace's segment files say about themselves: columns, rows, step range, read by DuckDB.

Opening a trace checks every segment's footer (readable Parquet, holding its table's key
columns) and takes each one's step range: from the file name in format 2, else from the `step`
column's statistics. DuckDB reads all of a table's footers in one query per question, so neither
`info` nor `query` loads pyarrow; only when that query fails is each file read on its own, to
name the damaged one.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import duckdb
from warninglight.forensics.trace.errors import CorruptSegmentError
from warninglight.tracer import schema

# Columns without which a table's rows mean nothing (the step or the name they belong to).
KEY_COLUMNS: dict[str, tuple[str, ...]] = {
    "health": ("step", "component"), "steps": ("step",), "scalars": ("step", "name"),
    "events": ("step", "kind"), "components": ("component",), "replicas": ("step", "component"),
}


@dataclass(frozen=True)
class SegmentSpan:
    """One segment file, the first and last step it holds (None: it holds no step), and its
    footer's schema: the name of each element (the root's, each column's; the hive columns rank
    and incarnation are not among them) and each one's Parquet type (`same_schema`)."""

    table: str
    rank: int
    incarnation: int
    path: Path
    first: int | None
    last: int | None
    rows: int
    columns: tuple[str, ...] = ()
    types: tuple[str, ...] = ()


def escape_glob(name: str) -> str:
    """`name` with each glob character as a one-character class (`[` -> `[[]`): DuckDB globs every
    file name it is given, so a trace under `runs/exp[1]` would also read `runs/exp1`."""
    return "".join(f"[{c}]" if c in "[*?{" else c for c in name)


def literal(path: Path) -> str:
    """`path` as a quoted DuckDB file name that matches only itself (`escape_glob`)."""
    return "'" + escape_glob(str(path)).replace("'", "''") + "'"


def read_files(files: list[Path], one_schema: bool = False) -> str:
    """DuckDB's table function reading exactly `files`, with their rank and incarnation folders.
    Columns are matched by name across files unless `one_schema` says every file has the same
    columns of the same types in the same order: binding the union read every file's footer
    again, each time a view over it was made, so opening a trace slowed with every file."""
    return (f"read_parquet([{', '.join(literal(p) for p in files)}], hive_partitioning = true, "
            "hive_types = {'rank': BIGINT, 'incarnation': BIGINT}"
            + (")" if one_schema else ", union_by_name = true)"))


def same_schema(spans: list[SegmentSpan]) -> bool:
    """True when every one of `spans` has the same columns, types and order."""
    return len({(s.columns, s.types) for s in spans}) <= 1


def overlapping(spans: list[SegmentSpan], table: str) -> list[Path]:
    """Segments of `table` whose step range meets another's of the same rank and incarnation:
    the only places a step can be recorded twice (a segment holds each step once)."""
    groups: dict[tuple[int, int], list[SegmentSpan]] = {}
    for s in spans:
        if s.table == table and s.first is not None and s.last is not None:
            groups.setdefault((s.rank, s.incarnation), []).append(s)
    out: list[Path] = []
    for group in groups.values():
        group.sort(key=lambda s: (s.first, s.last))
        cluster, reach = [group[0]], group[0].last
        for s in [*group[1:], None]:
            if s is not None and s.first <= reach:  # type: ignore[operator]
                cluster.append(s)
                reach = max(reach, s.last)  # type: ignore[type-var]
                continue
            if len(cluster) > 1:
                out += [c.path for c in cluster]
            if s is not None:
                cluster, reach = [s], s.last
    return out


def _partition(path: Path, key: str) -> int:
    for part in path.parts:
        if part.startswith(key + "="):
            return int(part.split("=", 1)[1])
    return 0


def _query(con: duckdb.DuckDBPyConnection, sql: str, files: list[Path]) -> dict[str, tuple]:
    """`sql` (with `{files}` for the list) as {file name: the rest of its row}; a file DuckDB
    cannot read raises `CorruptSegmentError` naming it."""
    try:
        rows = con.execute(sql.format(files=f"[{', '.join(literal(p) for p in files)}]")).fetchall()
    except duckdb.Error:
        if len(files) == 1:
            _corrupt(files[0])
        for path in files:  # which one: read each on its own
            _query(con, sql, [path])
        raise
    return {r[0]: r[1:] for r in rows}


def _corrupt(path: Path) -> None:
    raise CorruptSegmentError(
        f"segment {path} is not readable Parquet — move it out of the trace directory to analyse "
        "the rest (a crash loses at most that segment)")


def _step_ranges(con: duckdb.DuckDBPyConnection, files: list[Path]) -> dict[str, tuple[int | None, int | None]]:
    """The step range of format-1 segments (no range in the name): footer statistics, else the column."""
    stats = _query(con, """SELECT file_name, min(TRY_CAST(stats_min_value AS BIGINT)),
                                  max(TRY_CAST(stats_max_value AS BIGINT)),
                                  bool_and(stats_min_value IS NOT NULL AND stats_max_value IS NOT NULL)
                           FROM parquet_metadata({files}) WHERE path_in_schema = 'step'
                           GROUP BY file_name""", files)
    ranges: dict[str, tuple[int | None, int | None]] = {}
    for path in files:
        lo, hi, complete = stats.get(str(path), (None, None, True))
        if not complete:  # a row group without statistics: read the one column
            lo, hi = con.execute(f"SELECT min(step), max(step) FROM read_parquet({literal(path)})").fetchone()
        ranges[str(path)] = (lo, hi)
    return ranges


def read_spans(con: duckdb.DuckDBPyConnection, by_table: dict[str, list[Path]]) -> list[SegmentSpan]:
    """Every segment's span, in table then file order; raise `CorruptSegmentError` for a segment
    that is not Parquet or lacks its table's key columns."""
    spans = []
    every = [p for t in schema.TABLES for p in by_table.get(t, [])]
    if not every:
        return spans
    # one query each for every table's files, not one a file: each query has a fixed cost, and a
    # quick command's whole answer is due in 0.5 s
    # each element's name and type, as one string per element with every field in its place; the
    # lists come in each file's schema order (one file's rows are one run of the table function):
    # were they not, two files would only look different, and be unified by name (`same_schema`)
    fields = ", ".join(f"coalesce(CAST({f} AS VARCHAR), '')" for f in (
        "type", "type_length", "repetition_type", "converted_type", "scale", "precision", "logical_type"))
    names = _query(con, f"SELECT file_name, list(name), list(concat_ws('|', {fields})) "
                        "FROM parquet_schema({files}) GROUP BY file_name", every)
    rows = _query(con, "SELECT file_name, num_rows FROM parquet_file_metadata({files})", every)
    unnamed = [p for p in every if schema.segment_steps(p.name) is None
               and rows[str(p)][0] and "step" in names[str(p)][0]]
    ranges = _step_ranges(con, unnamed) if unnamed else {}
    shared: dict[tuple[str, ...], tuple[str, ...]] = {}  # one tuple per distinct list of names or types
    for table, files in ((t, by_table.get(t, [])) for t in schema.TABLES):
        for path in files:
            missing = [k for k in KEY_COLUMNS[table] if k not in names.get(str(path), ((),))[0]]
            if missing:
                raise CorruptSegmentError(
                    f"segment {path} has no {' or '.join(f'`{k}`' for k in missing)} column, so "
                    f"its {table} rows belong to no step — it was not written by warninglight; "
                    "move it out of the trace directory to analyse the rest")
        for path in files:
            first, last = schema.segment_steps(path.name) or ranges.get(str(path), (None, None))
            columns, types = (tuple(x) for x in names[str(path)])
            spans.append(SegmentSpan(table, _partition(path, "rank"), _partition(path, "incarnation"),
                                     path, first, last, int(rows[str(path)][0]),
                                     shared.setdefault(columns, columns), shared.setdefault(types, types)))
    return spans
