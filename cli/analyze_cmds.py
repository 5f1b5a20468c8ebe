"""`warninglight analyze`, `rollback`, `replay`, `conditions`: thin shells over forensics."""

from __future__ import annotations

import json
from typing import Annotated, Any

import typer
from warninglight.cli.common import (
    CheckpointsOpt,
    ConfigOpt,
    EveryOpt,
    SetOpt,
    TraceArg,
    analysis_from,
    bad_input,
    config_from,
    table,
)
from warninglight.cli.main import app
from warninglight.forensics import replay
from warninglight.forensics.analysis import root_name
from warninglight.forensics.conditions import registry_rows

FAULT = 1  # --exit-code: a fault was found

def _root_line(root: dict[str, Any]) -> str:
    z = "" if root["magnitude"] is None else f", magnitude z={root['magnitude']:.1f}"
    seen = "" if root["observed_on"] == root["attributed_to"] else f" (observed on {root['observed_on']})"
    if root.get("scope") == "optimizer":
        seen = f" (led by {root['observed_on']})"
    if root["ranks_disagree"]:
        seen += f" on rank {', '.join(str(r) for r in root['ranks'])} only"
    return (f"root: {root_name(root)}{seen} {root['condition']}: onset step {root['onset_step']}, "
            f"alarm step {root['alarm_step']}{z} on {root['metric']}; {root['evidence']}")


def rollback_text(d: dict[str, Any]) -> list[str]:
    """The rollback section: our checkpoint, then the loss-only operator's."""
    r, n = d["rollback"], d["rollback"]["loss_only"]
    if r["checkpoint_step"] is None:
        return ["rollback: none needed"]
    where = f" ({r['checkpoint_path']})" if r["checkpoint_path"] else ""
    batches = "" if r["skip_batches"] is None else f", {len(r['skip_batches'])} batch ids to skip"
    lines = [f"rollback: checkpoint at step {r['checkpoint_step']}{where}, {r['steps_discarded']} steps "
             f"discarded; skip steps {r['skip_step_range'][0]}-{r['skip_step_range'][1]}{batches}"]
    if n["alarm_step"] is None:
        lines.append("loss-only operator: the loss-spike rule never fired; no rollback")
    else:
        held = "already held the damage" if n["contaminated"] else "is clean"
        lines.append(f"loss-only operator: loss spike at step {n['alarm_step']} -> checkpoint at step "
                     f"{n['checkpoint_step']}, which {held}; {n['steps_discarded']} steps discarded")
    lines.append(f"  {r['note']}")
    return lines


def analysis_text(d: dict[str, Any]) -> str:
    """The human-readable report of `analyze`."""
    lines = [f"verdict: {d['verdict']}"]
    if d["root"]:
        lines.append(_root_line(d["root"]))
        lines.append(f"affected: {', '.join(d['affected']) or 'none'}")
        lines.append("alarms:")
        cols = ["step", "onset_step", "observed_on", "attributed_to", "condition", "metric", "magnitude"]
        lines += ["  " + line for line in table(d["alarms"], cols).splitlines()]
    lines += rollback_text(d)
    det = d["detectors"]
    fired = {k: "never fired" if det[k] is None else f"step {det[k]}"
             for k in ("loss_spike_step", "grad_norm_spike_step")}
    lines.append(f"comparators: loss-spike rule {fired['loss_spike_step']}, gradient-norm (ZClip) rule "
                 f"{fired['grad_norm_spike_step']}")
    for key, name in (("light_lead_over_loss_spike", "loss spike"),
                      ("light_lead_over_grad_norm_spike", "gradient-norm spike")):
        if det.get(key) is not None:
            lead = det[key]
            lines.append(f"  the light lit {abs(lead)} steps {'before' if lead >= 0 else 'after'} the {name}")
    return "\n".join(lines)


@app.command("analyze")
def analyze_cmd(
    trace: TraceArg,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object (docs/analysis-json.md).")] = False,
    exit_code: Annotated[bool, typer.Option("--exit-code", help="Exit 1 when a fault was found (0 when healthy).")] = False,
    config: ConfigOpt = None,
    overrides: SetOpt = None,
    checkpoints: CheckpointsOpt = None,
    every: EveryOpt = None,
) -> None:
    """Is this run failing? Which component, since when, how badly, and how far to roll back."""
    result = analysis_from(trace, config, overrides, checkpoints, every).to_dict()
    typer.echo(json.dumps(result, indent=2) if as_json else analysis_text(result))
    baseline = config_from(config, overrides).baseline
    need = baseline.min_samples + baseline.lag  # the first recorded step a baseline can judge
    steps = result["trace_info"]["steps"]
    if not as_json and result["verdict"] == "healthy" and steps < need:
        typer.echo(f"note: only {steps} steps recorded; a component is first judged against its "
                   f"baseline at its recorded step {need} (baseline.min_samples + baseline.lag), "
                   "so until then only non-finite values can raise an alarm")
    if exit_code and result["verdict"] == "fault":
        raise typer.Exit(FAULT)


@app.command("rollback")
def rollback_cmd(
    trace: TraceArg,
    as_json: Annotated[bool, typer.Option("--json", help="Print the rollback object as JSON.")] = False,
    config: ConfigOpt = None,
    overrides: SetOpt = None,
    checkpoints: CheckpointsOpt = None,
    every: EveryOpt = None,
) -> None:
    """The smallest rollback that removes the fault, beside what a loss-curve-only operator would do."""
    result = analysis_from(trace, config, overrides, checkpoints, every).to_dict()
    typer.echo(json.dumps(result["rollback"], indent=2) if as_json else "\n".join(rollback_text(result)))


@app.command("replay")
def replay_cmd(
    trace: TraceArg,
    as_json: Annotated[bool, typer.Option("--json", help="Print the timeline as JSON.")] = False,
    config: ConfigOpt = None,
    overrides: SetOpt = None,
) -> None:
    """Stream the trace in step order and print when each alarm would have fired live."""
    cfg = config_from(config, overrides)
    with bad_input():
        result = replay(trace, config=cfg)
    if as_json:
        typer.echo(json.dumps(result.to_dict(), indent=2))
        return
    for e in result.events:
        if e.source == "light":
            z = "" if e.magnitude is None else f" z={e.magnitude:.1f}"
            typer.echo(f"step {e.step:>6}  LIGHT  {e.observed_on} {e.condition} ({e.metric}{z}), onset {e.onset_step}")
        else:
            typer.echo(f"step {e.step:>6}  {e.source.replace('_', '-')} rule fires")
    if not result.events:
        typer.echo("no alarm: the light never lit")


@app.command("conditions")
def conditions_cmd(config: ConfigOpt = None, overrides: SetOpt = None) -> None:
    """The registry of conditions: signal, trigger thresholds, persistence and correction ceiling."""
    rows = registry_rows(config_from(config, overrides))
    typer.echo(table(rows, ["condition", "metric", "direction", "thresholds", "persistence", "ceiling", "roles"]))
