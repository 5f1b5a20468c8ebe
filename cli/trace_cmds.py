"""`warninglight info` and `warninglight query`: what a trace holds, and SQL over its views."""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated

import typer
from warninglight.cli.common import TraceArg, bad_input, fail, table
from warninglight.cli.main import app
from warninglight.forensics import open_trace
from warninglight.forensics.store import info


class Format(StrEnum):
    table = "table"
    csv = "csv"
    json = "json"


@app.command("info")
def info_cmd(trace: TraceArg) -> None:
    """Summarise a trace: run id, steps, incarnations, components, ranks, segments, size, dropped steps."""
    with bad_input():
        t = open_trace(trace)
        try:
            summary = info(t)
        finally:
            t.close()
    labels = {"run_id": "run", "size_bytes": "size (bytes)", "dropped_steps": "dropped steps",
              "first_step": "first step", "last_step": "last step"}
    for key, value in summary.items():
        typer.echo(f"{labels.get(key, key)}: {'' if value is None else value}")


@app.command("query")
def query_cmd(
    trace: TraceArg,
    sql: Annotated[str, typer.Argument(help="SQL over the views health, steps, components, events, checkpoints, scalars (and *_all for every incarnation).")],
    fmt: Annotated[Format, typer.Option("--format", help="How to print the result: an aligned table, CSV or a JSON list of rows.")] = Format.table,
) -> None:
    """Run SQL over a trace's DuckDB views and print the result."""
    with bad_input():
        t = open_trace(trace)
        try:
            relation = t.sql(sql)
            if relation is None:  # empty SQL, a comment, or a statement that makes no rows
                raise fail(f"query {sql!r} returns no result to print — give a SELECT, "
                           "e.g. 'SELECT * FROM health LIMIT 5'")
            frame = relation.pl()
        finally:
            t.close()
    if fmt == Format.csv:
        nested = [name for name, dtype in frame.schema.items() if dtype.is_nested()]
        if nested:
            raise fail(f"CSV cannot hold the list/struct column(s) {', '.join(nested)} — use "
                       "--format json or table, or unnest them in the SQL")
        typer.echo(frame.write_csv(), nl=False)
    elif fmt == Format.json:
        typer.echo(frame.write_json())
    else:
        typer.echo(table(frame.to_dicts(), frame.columns))
