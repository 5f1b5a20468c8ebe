"""`warninglight info` and `warninglight query`: what a trace holds, and SQL over its views."""

# Annotations stay evaluated (no `from __future__ import annotations`): Typer reads every
# command's signature at each start, and a string annotation costs it an eval (a test holds it).

from enum import StrEnum
from typing import Annotated

import typer
from warninglight.cli.common import TraceArg, bad_input, fail, table, warn


class Format(StrEnum):
    table = "table"
    csv = "csv"
    json = "json"


def info_cmd(trace: TraceArg) -> None:
    """Summarise a trace: run id, steps, incarnations, components, ranks, segments, size, dropped steps, precision of the estimates, how the run ended."""
    from warninglight.forensics.trace.store import info, open_trace

    with bad_input():
        t = open_trace(trace)
        try:
            summary = info(t)
        finally:
            t.close()
    warn(t.warnings)
    if summary["dropped_steps"] is None:
        summary["dropped_steps"] = "unknown (a rank has no manifest)"
    if summary["ended"] == "running":
        summary["ended"] = "running (never closed: the process was killed, or is still training)"
    bits = summary["estimate_bits"]
    summary["estimate_bits"] = "every bit" if bits is None else f"{bits} significand bits (docs/trace-format.md, Precision)"
    labels = {"run_id": "run", "size_bytes": "size (bytes)", "dropped_steps": "dropped steps",
              "first_step": "first step", "last_step": "last step", "estimate_bits": "estimates stored to"}
    for key, value in summary.items():
        typer.echo(f"{labels.get(key, key)}: {'' if value is None else value}")


def query_cmd(
    trace: TraceArg,
    sql: Annotated[str, typer.Argument(help="SQL over the views health, steps, components, events, checkpoints, scalars (and *_all for every incarnation).")],
    fmt: Annotated[Format, typer.Option("--format", help="How to print the result: an aligned table, CSV or a JSON list of rows.")] = Format.table,
    allow_external: Annotated[bool, typer.Option(
        "--allow-external", help="Allow statements that write (COPY, CREATE, ...) and reading files "
                                 "outside the trace directory; by default a query only reads the trace.")] = False,
) -> None:
    """Run SQL over a trace's DuckDB views and print the result (read-only unless --allow-external)."""
    from warninglight.forensics.trace.query import run_query
    from warninglight.forensics.trace.store import open_trace

    with bad_input():
        t = open_trace(trace)
        try:
            result = run_query(t, sql, allow_external)
        finally:
            t.close()
    warn(t.warnings)
    if result is None:  # empty SQL, a comment, or a statement that makes no rows
        raise fail(f"query {sql!r} returns no result to print — give a SELECT, "
                   "e.g. 'SELECT * FROM health LIMIT 5'")
    if fmt == Format.csv:
        nested = result.nested()
        if nested:
            raise fail(f"CSV cannot hold the list/struct column(s) {', '.join(nested)} — use "
                       "--format json or table, or unnest them in the SQL")
        typer.echo(result.csv(), nl=False)
    elif fmt == Format.json:
        typer.echo(result.json())
    else:
        typer.echo(table(result.dicts(), result.columns))


def register(app: typer.Typer) -> None:
    """Add these commands to `app`."""
    app.command("info")(info_cmd)
    app.command("query")(query_cmd)
