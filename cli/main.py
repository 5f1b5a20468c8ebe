"""Entry point of the `warninglight` command: builds the Typer app from the command modules."""

import ctypes
import gc
import os
import sys

# Polars' allocator (jemalloc) hands freed pages back to the OS soon after they fall idle, and
# takes them again (a page fault each) for the next step window of a large trace: kept 5 s, the
# pages one window freed serve the next. Read once, when Polars loads: set before any import of
# it, and never over a setting of the user's.
os.environ.setdefault("_RJEM_MALLOC_CONF", "dirty_decay_ms:5000,muzzy_decay_ms:5000")
# The same for Arrow's allocator (mimalloc, which purges freed pages after 10 ms), read when
# pyarrow loads; and for the C library's (glibc), which gives each block of 32 MiB or less
# (a step window's metric column, 8 MiB) pages of its own and returns them when it is freed,
# and trims the heap past 128 KiB free: blocks under 64 MiB now come from the heap, which keeps
# up to 256 MiB free: a step window's columns take the pages the last window's gave back, not
# fresh ones from the OS (a page fault each).
os.environ.setdefault("MIMALLOC_PURGE_DELAY", "2000")
if sys.platform.startswith("linux") and "MALLOC_MMAP_THRESHOLD_" not in os.environ:
    try:
        _libc = ctypes.CDLL("libc.so.6")
        _libc.mallopt(-3, 64 << 20)  # M_MMAP_THRESHOLD
        _libc.mallopt(-1, 256 << 20)  # M_TRIM_THRESHOLD
    except (OSError, AttributeError):  # not glibc: its allocator as it is
        pass

import typer  # noqa: E402

app = typer.Typer(no_args_is_help=True, add_completion=False, help="Is this run failing, and where?")


@app.callback()
def main() -> None:
    """Warning Light: per-component health traces and the forensics that read them."""


from warninglight.cli import (  # noqa: E402
    analyze_cmds,
    lab_cmds,
    repair_cmds,
    report_cmds,
    rerun_cmds,
    trace_cmds,
)

for _commands in (trace_cmds, analyze_cmds, repair_cmds, rerun_cmds, report_cmds, lab_cmds):
    _commands.register(app)


def run() -> None:
    """The installed `warninglight` command: the app, with the collector set for a process that
    starts, answers and exits.

    Starting a command imports many modules (typer, DuckDB's Python layer, ours) and makes a
    great many objects, none of them garbage; the collector's default (a pass every 700 new
    objects) walked them again and again, and the interpreter's exit walked them all once more,
    time a quick command spent on nothing it needed. A pass every
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
