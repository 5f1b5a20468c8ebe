"""What every command shares: the one-line error convention, the shared options, the analysis."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated

import duckdb
import typer
from warninglight.forensics import (
    Analysis,
    CheckpointError,
    Config,
    ConfigError,
    TraceError,
    analyze,
    load_config,
)
from warninglight.forensics.wording import text_table as table  # noqa: F401  (the commands' tables)

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


@contextmanager
def bad_input() -> Iterator[None]:
    """Turn the library's input errors into a one-line message and exit code 2."""
    try:
        yield
    except (TraceError, ConfigError, CheckpointError) as exc:
        raise fail(str(exc)) from None
    except duckdb.Error as exc:
        raise fail(f"{str(exc).splitlines()[0]} — the views are health, steps, scalars, components, "
                   "events, checkpoints (and *_all for every incarnation); try "
                   "'DESCRIBE health'") from None


def config_from(path: Path | None, overrides: list[str] | None) -> Config:
    """The thresholds the command runs with."""
    with bad_input():
        return load_config(path, overrides)


def analysis_from(trace: Path, config: Path | None, overrides: list[str] | None,
                  checkpoints: str | None, every: int | None) -> Analysis:
    """The analysis a command prints, with the thresholds and checkpoints the user chose."""
    cfg = config_from(config, overrides)
    with bad_input():
        return analyze(trace, config=cfg, checkpoints_glob=checkpoints, checkpoint_every=every)
