"""The benchmark's verdict: each target met or missed, every miss listed, and docs/results.md.

`targets` and `misses` read `RunScore`s (lab/evaluation.py); `document` writes the whole results
page from one benchmark run, so `warninglight eval --seeds 5 --results docs/results.md` is the one
command that regenerates it. Runs of a step-one fault analysed without a reference (`reference`
False) are reported on their own line: a trailing baseline has no "before" to compare with, so
they are not counted in the accuracy targets.
"""

from __future__ import annotations

import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .evaluation import (
    CLEAN,
    GRADUAL_LEAD_TARGET,
    ONSET_ACCURACY_TARGET,
    ONSET_TOLERANCE,
    ROOT_ACCURACY_TARGET,
    RunScore,
    summarise_clean,
    summarise_faults,
    summarise_recovery,
)

if TYPE_CHECKING:  # the recoveries' module loads torch; `eval --trace` writes this page without it
    from .recovery import Recovery


def scored(runs: Sequence[RunScore]) -> list[RunScore]:
    """The fault runs the accuracy targets count (all but the blind step-one twins)."""
    return [r for r in runs if r.kind != CLEAN and r.reference is not False]


def _share(k: int, n: int, target: float) -> str:
    return f"{k}/{n} = {k / n:.0%} " + ("MET" if k / n >= target else "MISSED")


def targets(runs: Sequence[RunScore]) -> list[str]:
    """Each target, with the measured value and MET / MISSED."""
    faults = scored(runs)
    cleans = [r for r in runs if r.kind == CLEAN]
    lines = []
    if faults:
        k = sum(bool(r.root_correct) for r in faults)
        lines.append(f"root right in ≥ {ROOT_ACCURACY_TARGET:.0%} of fault runs: {_share(k, len(faults), ROOT_ACCURACY_TARGET)}")
        k = sum(bool(r.onset_ok) for r in faults)
        lines.append(f"onset within tolerance ({', '.join(f'{t} steps {k}' for k, t in ONSET_TOLERANCE.items())}) "
                     f"in ≥ {ONSET_ACCURACY_TARGET:.0%} of fault runs: {_share(k, len(faults), ONSET_ACCURACY_TARGET)}")
        gradual = [r for r in faults if r.kind == "gradual"]
        if gradual:
            ok = sum(1 for r in gradual if r.fault_verdict
                     and (r.loss_rule_step is None or (r.lead_loss or 0) >= GRADUAL_LEAD_TARGET))
            lines.append(f"gradual faults alarm ≥ {GRADUAL_LEAD_TARGET} steps before the loss-spike rule "
                         f"(or it never fires): {ok}/{len(gradual)} " + ("MET" if ok == len(gradual) else "MISSED"))
        data = [r for r in faults if r.skip_cover is not None or r.truth_scope == "data"]
        if data:
            ok = sum(1 for r in data if (r.skip_cover or 0.0) >= 1.0)
            lines.append(f"bad-data faults: the skip list covers the whole bad window: {ok}/{len(data)} "
                         + ("MET" if ok == len(data) else "MISSED"))
    if cleans:
        bad = sum(r.fault_verdict for r in cleans)
        lines.append(f"zero fault verdicts on clean runs (every schedule): {bad}/{len(cleans)} "
                     + ("MET" if bad == 0 else "MISSED"))
    blind = [r for r in runs if r.reference is False and r.kind != CLEAN]
    if blind:
        k = sum(bool(r.root_correct) for r in blind)
        lines.append(f"(not a target) faults present from step one, analysed without a reference: "
                     f"{k}/{len(blind)} named — a trailing baseline has no before to compare with")
    return lines


def _why(r: RunScore) -> str:
    if r.kind == CLEAN:
        return f"fault verdict on a clean run: {r.root_component or r.root_scope!r} ({r.root_condition})"
    if not r.fault_verdict:
        return "no alarm raised" if r.alarms == 0 else f"{r.alarms} alarms, no root"
    said = f"{r.root_scope}-wide" if r.root_scope in ("data", "optimizer") else repr(r.root_component)
    want = f"{r.truth_scope}-wide" if r.truth_scope in ("data", "optimizer") else repr(r.truth_component)
    parts = []
    if not r.root_correct:
        parts.append(f"named {said} ({r.root_condition}), truth {want}")
    if not r.onset_ok:
        parts.append(f"onset {r.onset_error} steps off (tolerance {ONSET_TOLERANCE.get(r.kind, 2)})")
    if r.skip_cover is not None and r.skip_cover < 1.0:
        parts.append(f"skip list covers {r.skip_cover:.0%} of the bad window")
    return "; ".join(parts)


def misses(runs: Sequence[RunScore]) -> list[str]:
    """One line per run that missed a target: scenario, seed, and what the engine said instead."""
    out = []
    for r in runs:
        if r.reference is False:
            continue
        bad = (r.fault_verdict if r.kind == CLEAN else
               not (r.root_correct and r.onset_ok) or (r.skip_cover is not None and r.skip_cover < 1.0))
        if bad:
            out.append(f"{r.scenario} seed {r.seed}: {_why(r)}")
        elif r.kind == "gradual" and r.loss_rule_step is not None and (r.lead_loss or 0) < GRADUAL_LEAD_TARGET:
            out.append(f"{r.scenario} seed {r.seed}: the light lit {r.lead_loss} steps before the loss-spike "
                       f"rule (target {GRADUAL_LEAD_TARGET}); first alarm {r.latency} steps after the injection")
    return out


def commit() -> str:
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True, cwd=Path(__file__).parent).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, check=True, cwd=Path(__file__).parent).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "an unknown commit (not a git checkout)"
    return f"`{head}`" + (" (uncommitted changes)" if dirty else " (clean working tree)")


HEADER = """# Detection benchmark: results

Generated by `{command}` on commit {commit}; do not edit by hand — rerun the command.
{seconds:.0f} s of training and analysis in all{load}.

How small a fault Warning Light can see, how early, and how that compares with the rules people
run today, on this repository's rehearsals: real small training runs on a CPU (an MLP on a
teacher task, a CNN with or without BatchNorm on blob images, a 2-block character GPT on
Python's standard-library source), under real recipes (step decay, warmup + cosine, one-cycle,
linear decay, warm restarts, a manual lr change, per-group lr), with a fault drilled at a known
step, or none. `warninglight eval --list` names the scenarios; `--workdir DIR` keeps the traces.

**Columns.** *root right*: the engine's root is the drilled component — or, for a fault of no
single component, a root of that scope: `optimizer` (a learning-rate spike on every group, a
forgotten `zero_grad`) or `data` (corrupted batches). *onset in tol*: |onset − injection| within
2 steps (abrupt) or 10 (gradual). *latency*: the light's first alarm − injection. *lead vs loss
rule / grad rule*: the rule's first firing at or after the injection − the light's first alarm
(+ = the light was earlier). Loss rule: loss > mean + 6σ of the previous 128 steps (OLMo-core's).
Grad rule: ZClip as published (EMA z-score of the total gradient norm, α 0.97, z > 2.5, a 25-step
warm-up, the adaptive clip fed back into the EMA). *discarded*: steps thrown away by the rollback.
*static rules*: SageMaker-Debugger-style fixed thresholds. `+ref` rows: a fault present from step
one analysed with `analyze --reference` against a clean run of the same set-up (another seed);
the same scenario without `+ref` is the blind analysis. `~clean` rows: drill-free twins of a
fault scenario's set-up that no clean scenario covers.

## The tables, as measured

```text
{tables}
```

## What this benchmark does not show

- The models are tiny (5–18 components) and the faults are drills with a known step; real
  hardware faults and real data problems are what the product is for, and are not measured here.
- Five seeds per scenario: 5/5 is an observation, not a probability. The scenarios and the
  engine were developed side by side by the same team; the scoring knows no scenario by name,
  but the drills are not a held-out test set.
"""


def document(runs: Sequence[RunScore], command: str, at_commit: str | None = None, loaded: bool = True,
             recoveries: Sequence[Recovery] = ()) -> str:
    """docs/results.md for these runs (`at_commit`: the commit they ran on, taken before they ran)."""
    load = " on a shared 2-core machine under load (times are not comparable)" if loaded else ""
    page = HEADER.format(command=command, commit=at_commit or commit(), seconds=sum(r.seconds for r in runs),
                         load=load, tables=format_tables(runs))
    return page + (f"\n{recovery_section(recoveries)}" if recoveries else "")


RECOVERY_TITLE = "## Component repair, rehearsed"


def recovery_table(recoveries: Sequence[Recovery]) -> str:
    """The rehearsed recoveries (lab/recovery.py), one row a family and seed, and the rule's answer."""
    rows = [{"scenario": r.scenario, "seed": r.seed, "root": f"{r.root} ({r.condition})",
             "repaired": _loss(r.loss_repaired) if r.refused is None else "refused",
             "rollback": _loss(r.loss_rollback), "no action": _loss(r.loss_no_action), "clean twin": _loss(r.loss_clean),
             "steps kept": r.steps_kept if r.steps_kept is not None else "—",
             "repair ≥ rollback": {True: "yes", False: "**no**", None: "—"}[r.repair_no_worse]} for r in recoveries]
    from .recovery import recommended

    found = sorted(recommended(recoveries))
    return "\n".join([_markdown(rows, "scenario"), "", "Repair recommended by `analyze` for root conditions: "
                      + (", ".join(found) or "none") + "; not for the others above."])


def _loss(v: float | None) -> str:
    return "—" if v is None else f"{v:.3g}"


def recovery_section(recoveries: Sequence[Recovery]) -> str:
    """The results page's section on component repair."""
    from .recovery import EVAL_BATCHES, ON_STEPS

    return f"""{RECOVERY_TITLE}

After each fault family that writes one component's weights, the last checkpoint is repaired
(`warninglight repair`) and training goes on for {ON_STEPS} steps from (a) the repaired checkpoint,
(b) the full rollback's clean checkpoint and (c) the damaged latest one, on the same batches and
with no drill; the clean twin (same seed, no drill) trains the same batches from its own last
checkpoint. Equal compute: every start trains the same {ON_STEPS} steps; *steps kept* is the
learning of every other component the repair keeps and the rollback throws away. Each loss is the
mean cross-entropy on {EVAL_BATCHES} later batches (`lab/recovery.py`).

{recovery_table(recoveries)}
"""


def _markdown(rows: Sequence[Mapping[str, Any]], first: str) -> str:
    cols = [first] + [c for c in rows[0] if c != first]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(str(r[c]) for c in cols) + " |" for r in rows]
    return "\n".join(lines)


def format_tables(runs: Sequence[RunScore]) -> str:
    """The benchmark's tables (markdown) and the targets, as printed by `warninglight eval`."""
    faults = [r for r in runs if r.kind != CLEAN]
    cleans = [r for r in runs if r.kind == CLEAN]
    out = []
    if faults:
        names = list(dict.fromkeys(r.scenario for r in faults))
        for title, summarise in (
            ("Fault runs, detection (steps are optimizer steps; latency = the light's first alarm − injection; "
             "lead = the rule's first firing at/after the injection − the light's first alarm, + means we were earlier):",
             summarise_faults),
            ("Fault runs, rollback and fixed rules (discarded = last step − checkpoint step; "
             "static = SageMaker-style thresholds, first firing at/after the injection):", summarise_recovery),
        ):
            rows = [{"scenario": n, **summarise([r for r in faults if r.scenario == n])} for n in names]
            # the targets' runs: a step-one fault analysed blind (no reference) is reported apart
            rows.append({"scenario": "**all faults**", **summarise([r for r in faults if r.reference is not False])})
            blind = [r for r in faults if r.reference is False]
            if blind:
                rows.append({"scenario": "**step-one faults, no reference**", **summarise(blind)})
            out += [title, "", _markdown(rows, "scenario"), ""]
    if cleans:
        rows = [{"scenario": s, **summarise_clean([r for r in cleans if r.scenario == s])}
                for s in dict.fromkeys(r.scenario for r in cleans)]
        rows.append({"scenario": "**all clean**", **summarise_clean(cleans)})
        out += ["Clean runs (a `~clean` name is a drill-free twin of that scenario's training set-up; "
                "the comparators' columns count runs where they fired at all, i.e. false alarms):", "",
                _markdown(rows, "scenario"), ""]
    out += ["Targets:"] + [f"- {line}" for line in targets(runs)]
    missed = misses(runs)
    if missed:
        out += ["", "Misses (every run that missed a target, and what the engine said instead):"]
        out += [f"- {line}" for line in missed]
    return "\n".join(out)
