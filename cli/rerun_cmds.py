"""`warninglight rerun`: a thin shell over recovery.rerun."""

# Annotations stay evaluated (no `from __future__ import annotations`): Typer reads every
# command's signature at each start, and a string annotation costs it an eval (a test holds it).

import json
from pathlib import Path
from typing import Annotated

import typer
from warninglight.cli.common import TraceArg, bad_input, steps_from


def rerun_cmd(
    trace: TraceArg,
    entry: Annotated[str, typer.Option("--entry", metavar="FILE.py:FUNC", help="The entry function: FUNC(checkpoint_path) returns model, optimizer, optional scheduler, batch(ids) and step(model, optimizer, batch) (docs/rerun.md).")],
    steps: Annotated[str | None, typer.Option("--steps", metavar="A:B", help="Re-run steps A..B, A-1 being a recorded checkpoint (default: from the clean checkpoint through the alarm plus --margin).")] = None,
    out: Annotated[Path | None, typer.Option("--out", help="Where to write the re-run (default: TRACE.rerun beside the trace).")] = None,
    force: Annotated[bool, typer.Option("--force", help="Replace an earlier re-run at --out.")] = False,
    margin: Annotated[int, typer.Option("--margin", min=0, help="Steps re-run past the alarm.")] = 10,
    max_samples: Annotated[int, typer.Option("--max-samples", min=1, help="The most samples the Proofreader judges, one forward and backward pass each.")] = 4096,
    as_json: Annotated[bool, typer.Option("--json", help="Print the verdict, its evidence and the samples to skip as one JSON object.")] = False,
) -> None:
    """Re-execute the incident from its clean checkpoint and say why: transient (hardware), data or recipe.

    The original trace is never written; the re-run goes beside it. Bad input exits 2.
    """
    from warninglight.recovery.rerun import rerun

    window = steps_from(steps)
    with bad_input():
        result = rerun(trace, entry, steps=window, out=out, force=force, margin=margin, max_samples=max_samples)
    if as_json:
        typer.echo(json.dumps(result.to_dict(), indent=2))
        return
    typer.echo(f"verdict: {result.verdict}\nwhy: {result.reason}")
    typer.echo(f"re-run: steps {result.steps[0]}-{result.steps[1]} from {result.checkpoint_path} into {result.out}")
    if result.proofreader is not None:
        p = result.proofreader
        typer.echo(f"skip: {len(p.skip_ids)} samples ({result.skip_ids_file}); judged {p.samples_judged} against "
                   f"{p.reference_samples} clean ones: {p.backward_passes} passes, {p.replayed_steps} steps "
                   f"replayed, {p.wall_s:.1f} s")


def register(app: typer.Typer) -> None:
    """Add these commands to `app`."""
    app.command("rerun")(rerun_cmd)
