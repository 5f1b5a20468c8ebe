"""What every command shares: the one-line error convention, the shared options, the analysis."""

from __future__ import annotations

import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

if TYPE_CHECKING:  # the engine (DuckDB, Polars) and the conditions load when a command needs them
    from warninglight.forensics.explaining.analysis import Analysis
    from warninglight.forensics.judging.conditions import Config

BAD_INPUT = 2  # exit code for input we cannot use (not a trace, bad SQL, bad option)

ConfigOpt = Annotated[Path | None, typer.Option(
    "--config", exists=True, dir_okay=False,
    help="A TOML file of thresholds (see `warninglight conditions` and docs/conditions.md).")]
SetOpt = Annotated[list[str] | None, typer.Option(
    "--set", help="Override one threshold, e.g. --set exploding.out_rms.z=10 (repeatable).")]
# Not `exists=True`: the store's own check gives a one-line error naming the path and the fix.
TraceArg = Annotated[Path, typer.Argument(help="The trace directory given to watch(...).")]
CheckpointsOpt = Annotated[str | None, typer.Option(
    "--checkpoints", help="A glob of checkpoint files (quote it); the step is the last number in each name.")]
EveryOpt = Annotated[int | None, typer.Option(
    "--checkpoint-every", min=1, help="Assume a checkpoint every N steps instead of the recorded ones.")]
ReferenceOpt = Annotated[Path | None, typer.Option(
    "--reference", help="A known-good trace of the same model and schedule: judge every component "
                        "against it step by step, to find faults present from the first step.")]
StepsOpt = Annotated[str | None, typer.Option(
    "--steps", metavar="A:B",
    help="An incident window: judge only steps A..B (reading just the files that hold them and the "
         "baseline history before A).")]


def steps_from(text: str | None) -> tuple[int, int] | None:
    """`--steps A:B` as (A, B); a one-line error for anything else."""
    if text is None:
        return None
    first, sep, last = text.partition(":")
    if not sep or not first.strip().isdigit() or not last.strip().isdigit():
        raise fail(f"--steps {text!r}: expected A:B with whole step numbers, e.g. --steps 9000:9500")
    if int(first) > int(last):
        raise fail(f"--steps {text}: the first step is after the last; e.g. --steps {last.strip()}:{first.strip()}")
    return int(first), int(last)


def table(rows: Sequence[dict[str, Any]], columns: Sequence[str]) -> str:
    """A plain aligned text table (forensics.texttable)."""
    from warninglight.forensics.presenting.texttable import text_table

    return text_table(rows, columns)


def fail(message: str, code: int = BAD_INPUT) -> typer.Exit:
    """Print `message` as one line on stderr; return the Exit to raise."""
    typer.echo(f"error: {' '.join(message.split())}", err=True)
    return typer.Exit(code)


def warn(warnings: Sequence[str]) -> None:
    """Print each warning about the trace as one `warning: ...` line on stderr."""
    for w in warnings:
        typer.echo(f"warning: {' '.join(w.split())}", err=True)


def refuse_overwrite(path: Path, force: bool, flag: str = "-o") -> None:
    """Fail unless `path` is new or `--force` was given: no command overwrites a file unasked."""
    if path.exists() and not force:
        raise fail(f"{flag} {path} already exists — pass --force to overwrite it, or choose "
                   "another path")


# Input errors the engine raises, by the module that defines them: looked up only in modules
# already loaded (an error cannot come from one that is not), so `conditions` loads no engine
# and `info` no thresholds.
_INPUT_ERRORS = {"warninglight.forensics.trace.store": "TraceError", "warninglight.forensics.explaining.rollback": "CheckpointError",
                 "warninglight.forensics.explaining.analysis": "StepWindowError",
                 "warninglight.recovery.repair": "RepairError",
                 "warninglight.recovery.rerun": "RerunError",
                 "warninglight.forensics.judging.conditions": "ConfigError"}


@contextmanager
def bad_input() -> Iterator[None]:
    """Turn the library's input errors into a one-line message and exit code 2."""
    try:
        yield
    except Exception as exc:
        known = tuple(getattr(sys.modules[m], name) for m, name in _INPUT_ERRORS.items() if m in sys.modules)
        if known and isinstance(exc, known):
            raise fail(str(exc)) from None
        duckdb = sys.modules.get("duckdb")
        if duckdb is not None and isinstance(exc, duckdb.Error):
            raise fail(f"{str(exc).splitlines()[0]} — the views are health, steps, scalars, components, "
                       "events, checkpoints (and *_all for every incarnation); try "
                       "'DESCRIBE health'") from None
        raise


def config_from(path: Path | None, overrides: list[str] | None) -> Config:
    """The thresholds the command runs with."""
    from warninglight.forensics.judging.conditions import load_config

    with bad_input():
        return load_config(path, overrides)


def analysis_from(trace: Path, config: Path | None, overrides: list[str] | None,
                  checkpoints: str | None, every: int | None, steps: str | None = None,
                  reference: Path | None = None, heat: bool = False, band: bool = False) -> Analysis:
    """The analysis a command prints, with the thresholds, checkpoints, window and reference the
    user chose (`heat`, `band`: with the report's heatmap and root band)."""
    from warninglight.forensics.explaining.analysis import analyze

    cfg = config_from(config, overrides)
    window = steps_from(steps)
    with bad_input():
        return analyze(trace, config=cfg, checkpoints_glob=checkpoints, checkpoint_every=every,
                       steps=window, reference=reference, heat=heat, band=band)
