"""Entry point of the `warninglight` command: builds the Typer app from the command modules."""

import gc
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


def run() -> None:
    """The installed `warninglight` command: the app, with the collector set for a process that
    starts, answers and exits.

    Starting a command imports ~250 modules (typer, DuckDB's Python layer, ours) and makes some
    hundred thousand objects, none of them garbage; the collector's default (a pass every 700 new
    objects) walked them again and again, and the interpreter's exit walked them all once more:
    ~0.1 s of a quick command's ~0.5 s (`warninglight info` on a sample trace). A pass every
    20,000 new objects still collects a long analysis's cycles (a cycle waits for more new
    objects before it is freed), and what is alive at the end is frozen out of the exit's
    passes (`gc.freeze`): no object of the engine needs a collector's pass to flush or close,
    and the `atexit` handlers (the recorder's) run as before.
    """
    gc.set_threshold(20_000, 10, 10)
    try:
        app()
    finally:
        gc.freeze()
