"""`warninglight repair`: a thin shell over warninglight.recovery.repair."""

# Annotations stay evaluated (no `from __future__ import annotations`): Typer reads every
# command's signature at each start, and a string annotation costs it an eval (a test holds it).

import json
from pathlib import Path
from typing import Annotated

import typer
from warninglight.cli.common import CheckpointsOpt, TraceArg, bad_input, fail

REFUSED_EXIT = 1  # a component repair is not sound here: the whole rollback stays the answer


def repair_cmd(
    trace: TraceArg,
    latest: Annotated[Path, typer.Option("--from", help="The latest checkpoint: a torch.save file, a Trainer checkpoint-N/ folder or a Lightning .ckpt.")],
    out: Annotated[Path, typer.Option("-o", "--out", help="Where to write the repaired checkpoint (a new path, in the latest's format).")],
    clean: Annotated[Path | None, typer.Option("--clean", help="The clean checkpoint to take the root component from (default: the one the rollback names).")] = None,
    model_key: Annotated[str | None, typer.Option("--model-key", help="The key of the model's state dict in a torch.save dict (default: model, state_dict or model_state_dict).")] = None,
    optimizer_key: Annotated[str | None, typer.Option("--optimizer-key", help="The key of the optimizer's state dict (default: optimizer or optimizer_state_dict).")] = None,
    weights_only: Annotated[bool, typer.Option("--weights-only", help="Repair the weights only and keep the latest optimizer state whole (for checkpoints without one, or traces that predate the recorded optimizer order).")] = False,
    checkpoints: CheckpointsOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print what was changed as one JSON object.")] = False,
) -> None:
    """Write a checkpoint that keeps the latest one's work and puts back only the root component from the clean one.

    Refused (exit 1, with the reason) where the damage is not one component's; bad input exits 2.
    """
    from warninglight.recovery.repair import RepairRefused, repair, repair_lines

    with bad_input():
        try:
            result = repair(trace, latest, out, clean, model_key=model_key, optimizer_key=optimizer_key,
                            weights_only=weights_only, checkpoints_glob=checkpoints)
        except RepairRefused as exc:
            raise fail(f"refused: {exc}", REFUSED_EXIT) from None
        except OSError as exc:
            raise fail(f"cannot write {out}: {exc.strerror or exc} — pass a writable -o path") from None
    typer.echo(json.dumps(result.to_dict(), indent=2) if as_json else "\n".join(repair_lines(result)))


def register(app: typer.Typer) -> None:
    """Add these commands to `app`."""
    app.command("repair")(repair_cmd)
