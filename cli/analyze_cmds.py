"""`warninglight analyze`, `rollback`, `replay`, `conditions`: thin shells over forensics."""

# Annotations stay evaluated (no `from __future__ import annotations`): Typer reads every
# command's signature at each start, and a string annotation costs it an eval (a test holds it).

import json
from pathlib import Path
from typing import Annotated

import typer
from warninglight.cli.common import (
    CheckpointsOpt,
    ConfigOpt,
    EveryOpt,
    ReferenceOpt,
    SetOpt,
    StepsOpt,
    TraceArg,
    analysis_from,
    bad_input,
    config_from,
    steps_from,
    table,
    warn,
)

FAULT_EXIT = 1  # --exit-code: a fault was found


def analyze_cmd(
    trace: TraceArg,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object (docs/analysis-json.md).")] = False,
    exit_code: Annotated[bool, typer.Option("--exit-code", help="Exit 1 when a fault was found (0 when healthy).")] = False,
    config: ConfigOpt = None,
    overrides: SetOpt = None,
    checkpoints: CheckpointsOpt = None,
    every: EveryOpt = None,
    steps: StepsOpt = None,
    reference: ReferenceOpt = None,
) -> None:
    """Is this run failing? Which component, since when, how badly, and how far to roll back."""
    from warninglight.forensics.explaining.analysis import FAULT
    from warninglight.forensics.presenting import wording

    analysis = analysis_from(trace, config, overrides, checkpoints, every, steps, reference)
    warn(analysis.warnings)
    typer.echo(json.dumps(analysis.to_dict(), indent=2) if as_json else wording.analysis_text(analysis))
    if not as_json:  # a re-run saved beside the trace: its verdict (docs/rerun.md)
        _echo_rerun(trace)
    if exit_code and analysis.verdict == FAULT:
        raise typer.Exit(FAULT_EXIT)


def rollback_cmd(
    trace: TraceArg,
    as_json: Annotated[bool, typer.Option("--json", help="Print the rollback object as JSON.")] = False,
    config: ConfigOpt = None,
    overrides: SetOpt = None,
    checkpoints: CheckpointsOpt = None,
    every: EveryOpt = None,
) -> None:
    """The smallest rollback that removes the fault, beside what a loss-curve-only operator would do."""
    from warninglight.forensics.presenting import wording

    analysis = analysis_from(trace, config, overrides, checkpoints, every)
    warn(analysis.warnings)
    rollback = analysis.rollback
    typer.echo(json.dumps(rollback.to_dict(), indent=2) if as_json else "\n".join(wording.rollback_lines(rollback)))
    if not as_json:
        _echo_rerun(trace)


def _echo_rerun(trace: Path) -> None:
    from warninglight.forensics.explaining.saved_rerun import saved_lines

    for line in saved_lines(trace):
        typer.echo(line)


def replay_cmd(
    trace: TraceArg,
    as_json: Annotated[bool, typer.Option("--json", help="Print the timeline as JSON.")] = False,
    config: ConfigOpt = None,
    overrides: SetOpt = None,
    steps: StepsOpt = None,
) -> None:
    """Stream the trace in step order and print when each alarm would have fired live."""
    from warninglight.forensics.explaining.replay import replay
    from warninglight.forensics.presenting import wording

    cfg = config_from(config, overrides)
    window = steps_from(steps)
    with bad_input():
        result = replay(trace, config=cfg, steps=window)
    warn(result.warnings)
    if as_json:
        typer.echo(json.dumps(result.to_dict(), indent=2))
        return
    typer.echo("\n".join(wording.timeline_lines(result.events)))


def conditions_cmd(config: ConfigOpt = None, overrides: SetOpt = None) -> None:
    """The registry of conditions: signal, trigger thresholds, persistence and correction ceiling."""
    from warninglight.forensics.judging.conditions import registry_rows

    rows = registry_rows(config_from(config, overrides))
    typer.echo(table(rows, ["condition", "metric", "direction", "thresholds", "persistence", "ceiling", "roles"]))


def register(app: typer.Typer) -> None:
    """Add these commands to `app`."""
    app.command("analyze")(analyze_cmd)
    app.command("rollback")(rollback_cmd)
    app.command("replay")(replay_cmd)
    app.command("conditions")(conditions_cmd)
