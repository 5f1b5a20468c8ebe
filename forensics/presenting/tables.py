"""The report's tables, row by row: where a value is missing, the cell says why in words.

A bare dash left a reader guessing whether a value was lost, not applicable or never computed;
each builder here fills a missing cell with its reason, and `report_html` lays the rows out.
"""

from __future__ import annotations

from typing import Any

from warninglight.forensics.explaining.analysis import Alarm, Analysis
from warninglight.forensics.presenting import wording

# alarm field -> column header in the report
ALARM_HEADERS = {"observed_on": "observed on", "attributed_to": "attributed to", "condition": "condition",
                 "metric": "metric", "onset_step": "onset step", "step": "alarm step",
                 "last_step": "last step", "magnitude": "|z|", "value": "value", "median": "baseline median"}
ROLLBACK_HEADERS = ("choice", "alarm step", "resume from step", "checkpoint", "steps discarded",
                    "skip steps", "skip batches", "holds the damage")
DETECTOR_HEADERS = ("detector", "first alarm step", "names a component")
STATIC_HEADERS = ("rule", "component", "step", "value", "steps_fired")
FINDING_HEADERS = ("severity", "kind", "first step", "last step", "steps", "components", "evidence")
CHECKSUM = "weight_checksum"  # a rank finding's metric: the ranks' checksums compared, no baseline


def alarm_rows(a: Analysis) -> list[dict[str, Any]]:
    """The alarm table's rows, earliest alarm first, with the report's column names."""
    alarms = sorted(a.alarm_list(), key=lambda x: (x.step, x.onset_step))
    return [{header: _alarm_cell(x, key) for key, header in ALARM_HEADERS.items()} for x in alarms]


def _alarm_cell(alarm: Alarm, key: str) -> Any:
    v = getattr(alarm, key)
    if v is not None:
        if key == "value" and alarm.metric == CHECKSUM:
            return f"{wording.number(v)} distinct checksums"
        return v if v != "" else "(whole model)"
    if alarm.metric == CHECKSUM:
        return "none: ranks compared"
    if key == "value":
        return "NaN/Inf"
    if key == "median":
        return "none: a NaN/Inf rule reads none"
    if key == "magnitude":
        return "none: NaN/Inf"
    return "not recorded"


def finding_rows(a: Analysis) -> list[dict[str, Any]]:
    """The set-up's findings, faults first, with the report's column names."""
    return [{"severity": f.severity, "kind": f.kind, "first step": f.step, "last step": f.last_step,
             "steps": f.steps, "components": ", ".join(f.components) or "the whole run",
             "evidence": f.evidence} for f in a.findings]


def rollback_rows(a: Analysis) -> list[dict[str, Any] | str]:
    """Our rollback and the loss-only operator's, one row each; a row the operator would not
    have is the sentence that says why (`report_html` spans it across the table)."""
    r, root = a.rollback, a.root
    assert root is not None, "no rollback table for a healthy run"
    ours = {"choice": "Warning Light", "alarm step": root.alarm_step,
            "resume from step": _resume(r.checkpoint_step),
            "checkpoint": r.checkpoint_path or _no_path(r.checkpoint_step, r.checkpoint_source),
            "steps discarded": r.steps_discarded,
            "skip steps": _range(r.skip_step_range) if r.skip_step_range else "none",
            "skip batches": (f"{len(r.skip_batches)} batch ids" if r.skip_batches is not None else
                             "none: the set-up, not the data" if root.scope == "setup" else
                             "not recorded: the run called no rec.batch(ids)"),
            "holds the damage": "no: saved before the onset" if r.checkpoint_step else "no: the initialisation"}
    other = r.loss_only
    if other.alarm_step is None:
        loss = ("the loss-spike rule never fired" if a.detectors.loss_steps_judged != 0 else
                f"the loss-spike rule had too few logged losses to judge any step ({a.detectors.loss_points} points)")
        return [ours, f"loss-only operator: {loss}, so it would not roll back"]
    same = other.checkpoint_step == r.checkpoint_step
    theirs = {"choice": "loss-only operator", "alarm step": other.alarm_step,
              "resume from step": _resume(other.checkpoint_step),
              "checkpoint": ("the same as ours" if same else
                             f"the one at step {other.checkpoint_step}" if other.checkpoint_step else
                             "none before the loss spike: the initialisation"),
              "steps discarded": other.steps_discarded,
              "skip steps": "none: a loss curve names no steps",
              "skip batches": "none: a loss curve names no batches",
              "holds the damage": "yes: saved at or after the onset" if other.contaminated else "no"}
    return [ours, theirs]


def _resume(step: int | None) -> Any:
    return "0 (restart from initialisation)" if step == 0 else step


def _no_path(step: int | None, source: str) -> str:
    if not step:
        return "none before the onset: restart from initialisation"
    if source == "every":
        return "not named: --checkpoint-every gives steps, not files"
    return "no file recorded for it"


def _range(steps: list[int]) -> str:
    first, last = steps
    return str(first) if first == last else f"{first}–{last}"


def detector_rows(a: Analysis) -> list[dict[str, Any]]:
    """When each detector first fired, and whether it names a component."""
    root, det = a.root, a.detectors
    ours = det.first_alarm_step or (root.alarm_step if root else None)
    rows = [{"detector": "Warning Light", "first alarm step": ours if ours is not None else "never lit",
             "names a component": root.name if root else "no: no alarm"}]
    loss = "never fired"
    if det.loss_steps_judged == 0:
        loss = f"never judged: too few logged losses ({det.loss_points} points)"
    for name, step, never in (("loss spike (mean + 6σ, 128 steps)", det.loss_spike_step, loss),
                              ("gradient-norm spike", det.grad_norm_spike_step, "never fired")):
        fired = step if root is not None or step is None else f"{step} (the light saw no fault)"
        rows.append({"detector": name, "first alarm step": fired or never,
                     "names a component": "no: it reads one number for the whole model"})
    first = a.static[0] if a.static else None
    rows.append({"detector": "static rules (SageMaker-style)",
                 "first alarm step": first.step if first else "never fired",
                 "names a component": f"{first.component or '(root)'} ({first.rule})" if first else "no: never fired"})
    return rows


def static_rows(a: Analysis) -> list[dict[str, Any]]:
    """Each fixed-threshold rule's first firing on each component."""
    rows = [s.to_dict() for s in a.static]
    return [{**d, "component": d["component"] or "(root)", "value": "NaN/Inf" if d["value"] is None else d["value"]}
            for d in rows]
