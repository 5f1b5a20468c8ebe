"""Entry point of the `warninglight` command: builds the Typer app from the command modules."""

import os

# Polars' allocator (jemalloc) hands freed pages back to the OS soon after they fall idle, and
# takes them again (a page fault each) for the next step window of a large trace: ~1.3 million
# faults and ~6 s of system time on a 1e7 component-step analysis. Kept 5 s, the same run takes
# ~0.8 million and ~4 s (peak +~200 MB). Read once, when Polars loads: set before any import of
# it, and never over a setting of the user's.
os.environ.setdefault("_RJEM_MALLOC_CONF", "dirty_decay_ms:5000,muzzy_decay_ms:5000")

import typer  # noqa: E402

app = typer.Typer(no_args_is_help=True, add_completion=False, help="Is this run failing, and where?")


@app.callback()
def main() -> None:
    """Warning Light: per-component health traces and the forensics that read them."""


# Command modules register themselves on `app`; importing them is all main has to do.
from warninglight.cli import analyze_cmds, lab_cmds, report_cmds, trace_cmds  # noqa: E402,F401
