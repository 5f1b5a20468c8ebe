"""`warninglight demo` and `eval`: thin shells over the lab's demo and detection benchmark."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from warninglight.cli.common import fail, refuse_overwrite
from warninglight.cli.main import app


@app.command("demo")
def demo_cmd(
    out: Annotated[Path, typer.Option("--out", help="Folder for the trace, checkpoints and report.html: new, empty, or a previous demo's (whose files it replaces).")] = Path("runs/demo"),
    scenario: Annotated[str, typer.Option(help="Rehearsal scenario to run (see `warninglight eval --list`).")] = "gpt_weight_corruption",
    seed: Annotated[int, typer.Option(help="Seed of the model, data and drill.")] = 0,
) -> None:
    """Train a small GPT on CPU with an injected fault, record it, find it, and write the report."""
    from warninglight.lab import demo
    from warninglight.lab.rehearsal import ScenarioError

    try:
        result = demo.run_demo(out, scenario, seed)
    except (demo.DemoError, ScenarioError) as e:
        raise fail(str(e)) from None
    s = result.seconds
    typer.echo(demo.describe_truth(result.truth))
    typer.echo(result.line)
    typer.echo(f"report: {result.report}  (train {s['train']:.1f} s, analyse {s['analyze']:.1f} s, "
               f"report {s['report']:.1f} s)")


@app.command("eval")
def eval_cmd(
    scenarios: Annotated[list[str] | None, typer.Argument(help="Scenarios to run; all registered ones if none.")] = None,
    seeds: Annotated[int, typer.Option(min=1, help="Seeds per scenario (0..N-1).")] = 3,
    steps: Annotated[int | None, typer.Option(min=1, help="Override each scenario's step count.")] = None,
    json_out: Annotated[Path | None, typer.Option("--json", help="Also write every run's scores to this JSON file.")] = None,
    workdir: Annotated[Path | None, typer.Option(help="Keep the traces here (default: a temporary folder).")] = None,
    list_: Annotated[bool, typer.Option("--list", help="List the scenarios and exit.")] = False,
    twins: Annotated[bool, typer.Option("--clean-twins/--no-clean-twins",
                                        help="Also run a drill-free copy of every training set-up no clean scenario covers.")] = True,
    force: Annotated[bool, typer.Option("--force", help="Overwrite the --json file if it exists.")] = False,
) -> None:
    """Run scenarios over seeds and print detection accuracy, onset error, lead over other detectors, rollback."""
    from warninglight.lab import distributed, evaluation
    from warninglight.lab.rehearsal import SCENARIOS

    if list_:
        for name, sc in SCENARIOS.items():
            typer.echo(f"{name}\t{sc.model}\t{sc.steps} steps")
        for name, rs in distributed.SCENARIOS.items():
            typer.echo(f"{name}\tgpt, {rs.world_size} {rs.wrapper} ranks\t{rs.steps} steps")
        return
    if json_out is not None and not json_out.parent.is_dir():  # checked before minutes of training
        raise fail(f"--json {json_out}: folder {json_out.parent} does not exist — create it or pass another path")
    if json_out is not None:
        refuse_overwrite(json_out, force, "--json")
    if workdir is not None and workdir.exists() and (not workdir.is_dir() or any(workdir.iterdir())):
        raise fail(f"--workdir {workdir} is not an empty folder — the benchmark writes traces and "
                   "checkpoints there and would mix with what it holds; pass a new or empty folder")
    names = scenarios or [*SCENARIOS, *distributed.SCENARIOS]
    unknown = [n for n in names if n not in SCENARIOS and n not in distributed.SCENARIOS]
    if unknown:
        raise fail(f"unknown scenario {unknown[0]!r}; run `warninglight eval --list` for the names")

    def progress(r: evaluation.RunScore) -> None:
        verdict = f"root {r.root_component} ({r.root_condition})" if r.fault_verdict else "no fault verdict"
        typer.echo(f"  {r.scenario} seed {r.seed}: {verdict}, truth {r.truth_component or r.fault}, {r.seconds:.1f} s", err=True)

    try:
        extra = evaluation.clean_twins(names) if twins else []
        runs = evaluation.run_benchmark([*names, *extra], seeds, workdir, steps, progress)
    except evaluation.EvaluationError as e:
        raise fail(str(e)) from None
    typer.echo(evaluation.format_tables(runs))
    if json_out is not None:
        json_out.write_text(json.dumps([r.to_dict() for r in runs], indent=1))
