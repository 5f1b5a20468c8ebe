"""`warninglight report`: a thin shell over forensics.report."""

# Annotations stay evaluated (no `from __future__ import annotations`): Typer reads every
# command's signature at each start, and a string annotation costs it an eval (a test holds it).

from enum import StrEnum
from pathlib import Path
from typing import Annotated

import typer
from warninglight.cli.common import (
    CheckpointsOpt,
    ConfigOpt,
    EveryOpt,
    SetOpt,
    StepsOpt,
    TraceArg,
    analysis_from,
    bad_input,
    fail,
    refuse_overwrite,
    warn,
)


class Format(StrEnum):
    html = "html"
    png = "png"


def report_cmd(
    trace: TraceArg,
    out: Annotated[Path, typer.Option("-o", "--out", help="Where to write: an .html file, or a folder for --format png.")] = Path("report.html"),
    fmt: Annotated[Format, typer.Option("--format", help="html: one self-contained file; png: the figures alone, into a folder.")] = Format.html,
    config: ConfigOpt = None,
    overrides: SetOpt = None,
    checkpoints: CheckpointsOpt = None,
    every: EveryOpt = None,
    steps: StepsOpt = None,
    force: Annotated[bool, typer.Option("--force", help="Overwrite an existing report file (or the figures in an existing folder).")] = False,
) -> None:
    """Write a report of a trace: health heatmap, root metric, loss with every detector, rollback, alarms.

    It reports the same analysis `warninglight analyze` prints with the same options.
    """
    from warninglight.forensics.presenting import contents, report
    from warninglight.forensics.trace.checks import is_trace_file

    if fmt is Format.html and out.is_dir():
        raise fail(f"--out {out} is a folder; pass an .html file, e.g. -o {out / 'report.html'}, "
                   "or use --format png to write the figures into it")
    if fmt is Format.png and out.exists() and not out.is_dir():
        raise fail(f"--out {out} is a file; --format png writes into a folder, e.g. -o {out.with_suffix('')}_figures")
    if not out.parent.is_dir():
        raise fail(f"--out {out}: folder {out.parent} does not exist — create it or pass another path")
    if is_trace_file(trace, out):
        raise fail(f"--out {out} is inside the trace's own files; write the report elsewhere, "
                   f"e.g. -o {trace / 'report.html'}")
    if fmt is Format.png and out.is_dir() and any(out.iterdir()) and not force:
        raise fail(f"--out {out} is a folder that is not empty — pass --force to overwrite the "
                   "figures in it, or choose a new folder")
    if fmt is Format.html:
        refuse_overwrite(out, force, "--out")
    analysis = analysis_from(trace, config, overrides, checkpoints, every, steps, heat=True, band=True)
    warn(analysis.warnings)
    _, truth_problem = contents.read_truth(trace)  # the report's own input: said beside the analysis'
    warn([truth_problem] if truth_problem else [])
    with bad_input():
        try:
            paths = (report.write_pngs(trace, out, analysis) if fmt is Format.png
                     else [report.write_html(trace, out, analysis)])
        except OSError as exc:
            raise fail(f"cannot write the report to {out}: {exc.strerror or exc} — pass a writable -o path") from None
    for path in paths:
        typer.echo(str(path))


def register(app: typer.Typer) -> None:
    """Add these commands to `app`."""
    app.command("report")(report_cmd)
