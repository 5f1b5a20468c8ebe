"""How a verdict is worded for a person: the one place the CLI, the report and live alarms ask.

Everything here turns the typed analysis (`analysis.Root`, `analysis.Alarm`,
`analysis.Detectors`, `rollback.Rollback`) into text; nothing decides anything.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from warninglight.forensics.explaining.analysis import HEALTHY, Alarm, Analysis, Detectors, Root
from warninglight.forensics.explaining.findings import Finding
from warninglight.forensics.explaining.repairable import Soundness
from warninglight.forensics.explaining.replay import Event
from warninglight.forensics.explaining.rollback import Rollback
from warninglight.forensics.presenting.texttable import text_table  # noqa: F401  (one table format for every command and the report)

ALARM_TABLE_COLUMNS = ("step", "onset_step", "observed_on", "attributed_to", "condition", "metric", "magnitude")



def steps(n: int | None) -> str:
    """`n` steps, in words that agree with the number ("1 step", "3 steps")."""
    return f"{n} step" if n == 1 else f"{n} steps"

def step_range(steps: Sequence[int]) -> str:
    """[first, last] steps in words: "step 150" when they are one, else "steps 150–151"."""
    first, last = steps
    return f"step {first}" if first == last else f"steps {first}–{last}"


def number(v: Any) -> str:
    """A value as a person reads it: 3 significant digits, a dash for missing, a–b for a range."""
    if v is None:
        return "—"
    if isinstance(v, float):
        return "—" if math.isnan(v) else f"{v:.3g}"
    if isinstance(v, list | tuple):
        return "–".join(number(x) for x in v) if len(v) <= 2 else f"{len(v)} items"
    return str(v)


def summary_line(root: Root | None, rollback: Rollback, detectors: Detectors, verdict: str = HEALTHY) -> str:
    """The verdict as one line an operator can act on: what, where, since when, and where to go back to."""
    if root is None:
        return f"{verdict.upper()}: no component left its baseline; no rollback needed."
    z = "" if root.magnitude is None else f"|z| {number(root.magnitude)} "  # none: NaN/Inf, or ranks compared
    line = (f"ALARM {root.name}: {root.condition} ({z}on {root.metric}), "
            f"onset step {root.onset_step}, alarm step {root.alarm_step}")
    if root.scope == "setup":  # a fact, not a departure: no condition, no magnitude
        line = f"ALARM {root.name}, since step {root.onset_step} (on {root.metric})"
    first = detectors.first_alarm_step
    if first is not None and first < root.alarm_step:
        line += f" (the light first lit at step {first})"
    if rollback.checkpoint_step is None:
        return line + " — no checkpoint before the onset: restart from scratch."
    line += (f" — roll back to step {rollback.checkpoint_step} ({rollback.checkpoint_path or 'checkpoint'}), "
             f"discard {steps(rollback.steps_discarded)}")
    if rollback.skip_step_range:
        line += f", skip the batches of {step_range(rollback.skip_step_range)}"
    elif root.scope == "setup":
        line += ", after fixing the set-up"
    return line + _loss_only_clause(rollback) + "."


def _loss_only_clause(rollback: Rollback) -> str:
    other = rollback.loss_only
    if other.alarm_step is None:
        return "; the loss-spike rule never fired"
    if other.contaminated:
        return f"; the loss-only choice (step {other.checkpoint_step}) already held the damage"
    if other.steps_discarded is not None and rollback.steps_discarded is not None:
        saved = other.steps_discarded - rollback.steps_discarded
        return (f"; the loss-only choice (step {other.checkpoint_step}, clean) "
                f"would discard {other.steps_discarded}: {steps(saved)} saved")
    return ""


def analysis_summary_line(a: Analysis) -> str:
    """`summary_line` of a whole analysis."""
    return summary_line(a.root, a.rollback, a.detectors, a.verdict)


def root_line(root: Root) -> str:
    """The root in one line: where, what, since when, how strongly, and why this component."""
    z = "" if root.magnitude is None else f", magnitude z={root.magnitude:.1f}"
    seen = "" if root.observed_on == root.attributed_to else f" (observed on {root.observed_on})"
    if root.scope == "optimizer":
        seen = f" (led by {root.observed_on})"
    if root.ranks_disagree:
        seen += f" on rank {', '.join(str(r) for r in root.ranks)} only"
    elif root.rank is None and len(root.ranks) > 1:
        seen += " on every rank"
    if root.scope == "setup":  # a fact of the set-up: where it held, since when, and what it is
        only = f" on rank {', '.join(str(r) for r in root.ranks)} only" if root.ranks_disagree else ""
        return f"root: {root.name}{only}: from step {root.onset_step}; {root.evidence}"
    return (f"root: {root.name}{seen} {root.condition}: onset step {root.onset_step}, "
            f"alarm step {root.alarm_step}{z} on {root.metric}; {root.evidence}")


def alarm_line(alarm: Alarm) -> str:
    """One alarm in one line, as a live monitor announces it."""
    z = "" if alarm.magnitude is None else f" z={alarm.magnitude:.1f}"
    where = alarm.observed_on if alarm.observed_on == alarm.attributed_to else (
        f"{alarm.attributed_to} (observed on {alarm.observed_on})")
    return (f"step {alarm.step}: {where or '(whole model)'} {alarm.condition} on {alarm.metric}{z}, "
            f"onset step {alarm.onset_step}")


def timeline_lines(events: Sequence[Event]) -> list[str]:
    """`replay`'s timeline: when the light would have lit, and when each comparator rule fired."""
    lines = []
    for e in events:
        if e.source == "light":
            z = "" if e.magnitude is None else f" z={e.magnitude:.1f}"
            lines.append(f"step {e.step:>6}  LIGHT  {e.observed_on} {e.condition} ({e.metric}{z}), onset {e.onset_step}")
        else:
            lines.append(f"step {e.step:>6}  {e.source.replace('_', '-')} rule fires")
    return lines or ["no alarm: the light never lit"]


def rollback_lines(rollback: Rollback) -> list[str]:
    """The rollback: our checkpoint, then the loss-only operator's, then the note."""
    if rollback.checkpoint_step is None:
        return ["rollback: none needed"]
    where = f" ({rollback.checkpoint_path})" if rollback.checkpoint_path else ""
    if rollback.skip_step_range is None:  # a fault of the set-up: the batches were sound
        return [f"rollback: checkpoint at step {rollback.checkpoint_step}{where}, "
                f"{steps(rollback.steps_discarded)} discarded; no batch to skip", f"  {rollback.note}"]
    batches = "" if rollback.skip_batches is None else f", {len(rollback.skip_batches)} batch ids to skip"
    first, last = rollback.skip_step_range
    skipped = f"step {first}" if first == last else f"steps {first}-{last}"
    lines = [f"rollback: checkpoint at step {rollback.checkpoint_step}{where}, {steps(rollback.steps_discarded)} "
             f"discarded; skip {skipped}{batches}"]
    other = rollback.loss_only
    if other.alarm_step is None:
        lines.append("loss-only operator: the loss-spike rule never fired; no rollback")
    else:
        held = "already held the damage" if other.contaminated else "is clean"
        lines.append(f"loss-only operator: loss spike at step {other.alarm_step} -> checkpoint at step "
                     f"{other.checkpoint_step}, which {held}; {steps(other.steps_discarded)} discarded")
    lines.append(f"  {rollback.note}")
    return lines


def comparator_lines(detectors: Detectors) -> list[str]:
    """When the loss-spike and gradient-norm rules fired, and the light's lead over them."""
    def fired(step: int | None) -> str:
        return "never fired" if step is None else f"step {step}"

    loss = fired(detectors.loss_spike_step)
    if detectors.loss_steps_judged == 0:  # e.g. a short run logging its loss every N steps
        loss = f"had too few logged losses to judge any step ({detectors.loss_points} points)"
    lines = [f"comparators: loss-spike rule {loss}, gradient-norm (ZClip) rule "
             f"{fired(detectors.grad_norm_spike_step)}"]
    for lead, name in ((detectors.light_lead_over_loss_spike, "loss spike"),
                       (detectors.light_lead_over_grad_norm_spike, "gradient-norm spike")):
        if lead is not None:
            lines.append(f"  the light lit {steps(abs(lead))} {'before' if lead >= 0 else 'after'} the {name}")
    return lines


def warmup_note(a: Analysis) -> str | None:
    """Why a short trace is healthy: no component is judged before its baseline exists."""
    steps = a.summary.get("steps", 0)
    if a.verdict != HEALTHY or steps >= a.warmup_steps:
        return None
    return (f"note: only {steps} steps recorded; a component is first judged against its "
            f"baseline at its recorded step {a.warmup_steps} (baseline.min_samples + baseline.lag), "
            "so until then only non-finite values can raise an alarm")


def repair_line(s: Soundness) -> str:
    """Whether to repair the root component instead of rolling back (`warninglight repair`)."""
    if not s.sound:
        return f"component repair: not sound — {s.reason}"
    what = ", ".join(s.components)
    if not s.recommended:
        return f"component repair of {what}: possible, not recommended — {s.reason}"
    return (f"component repair: recommended — `warninglight repair TRACE --from LATEST -o NEW` puts back {what} "
            f"from step {s.clean_step} and keeps {steps(s.steps_kept)} of every other component's learning "
            f"(to step {s.latest_step}); {s.reason}")


def finding_lines(found: Sequence[Finding], root: Root | None = None) -> list[str]:
    """The set-up's findings, one line each: severity, first step, kind, evidence (the root's
    said once, in its own line)."""
    if not found:
        return []
    lines = ["findings:"]
    for f in found:
        said = root is not None and root.scope == "setup" and root.finding == f.kind and root.onset_step == f.step
        lines.append(f"  {f.severity} at step {f.step}: {f.kind}" + (" (the root)" if said else f": {f.evidence}"))
    return lines


def analysis_text(a: Analysis) -> str:
    """The human-readable answer of `warninglight analyze`."""
    lines = [f"verdict: {a.verdict}"]
    if a.root is not None:
        lines.append(root_line(a.root))
        lines.append(f"affected: {', '.join(a.affected) or 'none'}")
    lines += finding_lines(a.findings, a.root)
    if a.root is not None and not a.alarms.is_empty():
        lines.append("alarms:")
        rows = [alarm.to_dict() for alarm in a.alarm_list()]
        lines += ["  " + line for line in text_table(rows, ALARM_TABLE_COLUMNS).splitlines()]
    lines += rollback_lines(a.rollback)
    lines += [repair_line(a.repair)] if a.repair is not None else []
    lines += comparator_lines(a.detectors)
    note = warmup_note(a)
    return "\n".join(lines + ([note] if note else []))
