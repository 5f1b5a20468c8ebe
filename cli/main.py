"""Entry point of the `warninglight` command: builds the Typer app from the command modules."""

import typer

app = typer.Typer(no_args_is_help=True, add_completion=False, help="Is this run failing, and where?")


@app.callback()
def main() -> None:
    """Warning Light: per-component health traces and the forensics that read them."""


# Command modules register themselves on `app`; importing them is all main has to do.
from warninglight.cli import analyze_cmds, lab_cmds, report_cmds, trace_cmds  # noqa: E402,F401
