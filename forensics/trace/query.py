"""SQL over a trace's views, read-only and confined to the trace directory unless asked otherwise.

By default a query may only read: one or more SELECT (or EXPLAIN) statements, and DuckDB's file
access is limited to the trace directory (`allowed_directories` with `enable_external_access`
off, then the configuration locked), so `COPY ... TO`, `read_csv('/etc/passwd')` or `glob('/*')`
are refused rather than writing over a file or reading one the user did not point at.
`allow_external=True` lifts both limits for a user who wants to export or join other files.
"""

from __future__ import annotations

import csv
import io
import json
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import duckdb
from warninglight.forensics.trace.footers import escape_glob
from warninglight.forensics.trace.store import TraceError

if TYPE_CHECKING:
    from warninglight.forensics.trace.store import Trace

_READ_ONLY = (duckdb.StatementType.SELECT, duckdb.StatementType.EXPLAIN)


class QueryRefusedError(TraceError):
    """A query that would write, or read outside the trace directory, without permission."""


@dataclass(frozen=True)
class QueryResult:
    """A query's rows as DuckDB returns them (no dataframe library is loaded to print them)."""

    columns: list[str]
    types: list[str]  # DuckDB's type of each column, e.g. BIGINT, DOUBLE[], STRUCT(...)
    rows: list[tuple[Any, ...]]

    def nested(self) -> list[str]:
        """Columns holding lists, structs or maps (which CSV cannot hold)."""
        return [c for c, t in zip(self.columns, self.types, strict=True)
                if t.endswith("]") or t.startswith(("STRUCT", "MAP", "UNION"))]

    def dicts(self) -> list[dict[str, Any]]:
        return [dict(zip(self.columns, r, strict=True)) for r in self.rows]

    def csv(self) -> str:
        """Header and rows as CSV: empty for null, true/false for booleans."""
        out = io.StringIO()
        writer = csv.writer(out, lineterminator="\n")
        writer.writerow(self.columns)
        writer.writerows([("" if v is None else str(v).lower() if isinstance(v, bool) else v) for v in r]
                         for r in self.rows)
        return out.getvalue()

    def json(self) -> str:
        """A JSON list of row objects; non-finite floats are null, other values their text."""
        return json.dumps([{k: _plain(v) for k, v in d.items()} for d in self.dicts()], default=str)


def _plain(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, list | tuple):
        return [_plain(x) for x in v]
    if isinstance(v, dict):
        return {str(k): _plain(x) for k, x in v.items()}
    return v


def confine(trace: Trace) -> None:
    """Limit the trace's connection to reading files under its own directory, for good."""
    con = trace.con
    if con.execute("SELECT current_setting('lock_configuration')").fetchall() == [(True,)]:
        return  # already confined (a locked configuration cannot be changed again)
    root = str(trace.root.resolve()).rstrip("/") + "/"
    # the views name files with glob characters escaped (footers.literal), and DuckDB checks the
    # name as written: allow the escaped spelling of the same directory too
    con.execute("SET allowed_directories = ?", [sorted({root, escape_glob(root)})])
    con.execute("SET enable_external_access = false")
    con.execute("SET lock_configuration = true")


def run_query(trace: Trace, sql: str, allow_external: bool = False) -> QueryResult | None:
    """The result of `sql` over the trace's views; None when the SQL makes no result."""
    if not allow_external:
        try:
            # the trace's connection parses it: `duckdb.extract_statements` opened DuckDB's default
            # database for that, a cost every quick command paid
            kinds = [s.type for s in trace.con.extract_statements(sql)]
        except duckdb.Error:
            kinds = []  # let DuckDB word the syntax error below
        writes = [k.name for k in kinds if k not in _READ_ONLY]
        if writes:
            raise QueryRefusedError(
                f"query is read-only: {writes[0]} statements are refused — use SELECT over the "
                "views, or pass --allow-external to run statements that write or read other files")
        confine(trace)
    try:
        relation = trace.con.sql(sql)
        if relation is None:
            return None
        return QueryResult(list(relation.columns), [str(t) for t in relation.types], relation.fetchall())
    except duckdb.PermissionException as exc:
        raise QueryRefusedError(
            f"{str(exc).splitlines()[0]} — query reads only files under {trace.root}; pass "
            "--allow-external to read or write other files") from None
