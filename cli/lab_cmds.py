"""`warninglight demo` and `eval`: thin shells over the lab's demo and detection benchmark."""

# Annotations stay evaluated (no `from __future__ import annotations`): Typer reads every
# command's signature at each start, and a string annotation costs it an eval (a test holds it).

import json
from pathlib import Path
from typing import Annotated, Any

import typer
from warninglight.cli.common import fail, refuse_overwrite


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


def eval_cmd(
    scenarios: Annotated[list[str] | None, typer.Argument(help="Scenarios to run; all registered ones if none.")] = None,
    seeds: Annotated[int, typer.Option(min=1, help="Seeds per scenario (0..N-1).")] = 3,
    steps: Annotated[int | None, typer.Option(min=1, help="Override each scenario's step count.")] = None,
    json_out: Annotated[Path | None, typer.Option("--json", help="Also write every run's scores to this JSON file.")] = None,
    results: Annotated[Path | None, typer.Option("--results", help="Also write the results page (docs/results.md) from this run.")] = None,
    workdir: Annotated[Path | None, typer.Option(help="Keep the traces here (default: a temporary folder).")] = None,
    list_: Annotated[bool, typer.Option("--list", help="List the scenarios and exit.")] = False,
    twins: Annotated[bool, typer.Option("--clean-twins/--no-clean-twins",
                                        help="Also run a drill-free copy of every training set-up no clean scenario covers.")] = True,
    force: Annotated[bool, typer.Option("--force", help="Overwrite the --json file if it exists.")] = False,
    traces: Annotated[list[Path] | None, typer.Option("--trace", help="Score this recorded trace against its truth.json instead of training (repeatable).")] = None,
    recovery: Annotated[bool | None, typer.Option("--recovery/--no-recovery",
                                                  help="Also rehearse component repair against the full rollback (lab/recovery.py, seed 0; default: with the full benchmark only).")] = None,
    reruns: Annotated[bool | None, typer.Option("--reruns/--no-reruns",
                                                help="Also rehearse `rerun` on transient, poisoned-sample, bad-batch and lr-spike incidents (lab/incidents.py, seed 0; default: with the full benchmark only).")] = None,
) -> None:
    """Run scenarios over seeds and print detection accuracy, onset error, lead over other detectors, rollback."""
    if traces and not list_:  # nothing to train: the lab's models (and torch) are not loaded
        _check_outputs(json_out, results, force)
        _judge_recorded(traces, scenarios, results, json_out)
        return
    from warninglight.lab import distributed, evaluation
    from warninglight.lab.rehearsal import SCENARIOS

    if list_:
        for name, sc in SCENARIOS.items():
            typer.echo(f"{name}\t{sc.model}\t{sc.steps} steps")
        for name, rs in distributed.SCENARIOS.items():
            typer.echo(f"{name}\tgpt, {rs.world_size} {rs.wrapper} ranks\t{rs.steps} steps")
        return
    _check_outputs(json_out, results, force)  # before minutes of training
    if workdir is not None and workdir.exists() and (not workdir.is_dir() or any(workdir.iterdir())):
        raise fail(f"--workdir {workdir} is not an empty folder — the benchmark writes traces and "
                   "checkpoints there and would mix with what it holds; pass a new or empty folder")
    names = scenarios or [*SCENARIOS, *distributed.SCENARIOS]
    unknown = [n for n in names if n not in SCENARIOS and n not in distributed.SCENARIOS]
    if unknown:
        raise fail(f"unknown scenario {unknown[0]!r}; run `warninglight eval --list` for the names")

    from warninglight.lab import results as results_page

    at_commit = results_page.commit() if results is not None else None
    try:
        extra = evaluation.clean_twins(names) if twins else []
        runs = evaluation.run_benchmark([*names, *extra], seeds, workdir, steps, _progress)
    except evaluation.EvaluationError as e:
        raise fail(str(e)) from None
    typer.echo(results_page.format_tables(runs))
    recoveries = _recoveries(workdir) if (recovery if recovery is not None else not scenarios) else []
    if recoveries:
        typer.echo(f"\nComponent repair, rehearsed (lab/recovery.py):\n\n{results_page.recovery_table(recoveries)}")
    if reruns if reruns is not None else not scenarios:
        typer.echo(f"\nRe-runs, rehearsed (lab/incidents.py):\n\n{_reruns(workdir)}")
    if json_out is not None:
        json_out.write_text(json.dumps([r.to_dict() for r in runs], indent=1))
    if results is not None:
        command = "warninglight eval" + (f" {' '.join(scenarios)}" if scenarios else "") + f" --seeds {seeds}"
        results.write_text(results_page.document(runs, at_commit=at_commit, command=command + (f" --steps {steps}" if steps else "") + f" --results {results}",
                                                 recoveries=recoveries))


def _reruns(workdir: Path | None) -> str:
    """The rehearsed re-runs' table (seed 0), in `workdir`/reruns or a temporary folder."""
    import tempfile

    from warninglight.lab import incidents

    if workdir is not None:
        return incidents.table(incidents.run_reruns(workdir / "reruns"))
    with tempfile.TemporaryDirectory(prefix="wl-reruns-") as tmp:
        return incidents.table(incidents.run_reruns(Path(tmp)))


def _recoveries(workdir: Path | None) -> list[Any]:
    """The rehearsed component repairs (seed 0), in `workdir`/recovery or a temporary folder."""
    import tempfile

    from warninglight.lab import recovery

    if workdir is not None:
        return recovery.run_recoveries(workdir / "recovery")
    with tempfile.TemporaryDirectory(prefix="wl-recovery-") as tmp:
        return recovery.run_recoveries(Path(tmp))


def _check_outputs(json_out: Path | None, results: Path | None, force: bool) -> None:
    """--json and --results can be written: their folders exist, and --json is new (or --force)."""
    for flag, path in (("--json", json_out), ("--results", results)):
        if path is not None and not path.parent.is_dir():
            raise fail(f"{flag} {path}: folder {path.parent} does not exist — create it or pass another path")
    if json_out is not None:
        refuse_overwrite(json_out, force, "--json")


def _progress(r: Any) -> None:
    """One scored run, on stderr as it ends."""
    verdict = f"root {r.root_component or r.root_scope} ({r.root_condition})" if r.fault_verdict else "no fault verdict"
    typer.echo(f"  {r.scenario} seed {r.seed}: {verdict}, truth {r.truth_component or r.fault}, {r.seconds:.1f} s", err=True)


def _judge_recorded(traces: list[Path], scenarios: list[str] | None, results: Path | None, json_out: Path | None) -> None:
    """`eval --trace`: score traces already recorded against their truth.json, print the tables."""
    from warninglight.lab import evaluation
    from warninglight.lab import results as results_page

    if scenarios:
        raise fail(f"--trace scores recorded traces; scenario {scenarios[0]!r} would train a new one — pass one or the other")
    if results is not None:
        raise fail("--results writes the results page of rehearsed scenarios over seeds, not of --trace runs — "
                   "drop --results or run the scenarios")
    try:
        runs = evaluation.judge_recorded(traces, _progress)
    except evaluation.EvaluationError as e:
        raise fail(str(e)) from None
    typer.echo(results_page.format_tables(runs))
    if json_out is not None:
        json_out.write_text(json.dumps([r.to_dict() for r in runs], indent=1))


def register(app: typer.Typer) -> None:
    """Add these commands to `app`."""
    app.command("demo")(demo_cmd)
    app.command("eval")(eval_cmd)
