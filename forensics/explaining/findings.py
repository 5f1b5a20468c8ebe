"""Findings: facts of the training set-up the recorder saw, judged without any baseline or reference.

A trailing baseline cannot see a bug present from the first step: there is no "before". But the
recorder sees facts of the loop itself (tracer/loopfacts.py, the `steps` table's `eval_forwards`,
`grads_not_cleared`, `params_with_grad`, `input_rows`, `input_shape`; the `components` table's
`requires_grad` and `optimizer_index`), and a fact needs no baseline. Each finding names its
kind, the step it first held, the steps it held, the components it concerns and its evidence.

A finding is a `fault` when it changes what the run learns whatever the intent: the model trained
in eval() mode, gradients never cleared between steps, a batch the model saw that is not the one
the loop recorded, trainable parameters no optimizer holds, an optimizer with nothing to apply,
a learning rate of zero held on trainable parameters. It is a `warning` where a deliberate set-up
looks the same (a component kept in eval() mode: frozen batch norm; a module never called; one
optimizer step without gradients).
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

import polars as pl
from warninglight.forensics.trace.store import Trace

FAULT, WARNING = "fault", "warning"
# Consecutive steps a no-op step (no gradient, all-zero gradients, a zero learning rate) must
# hold to be a fault: a schedule's first or last step at lr 0, or one batch whose every label is
# ignored, holds for one.
PERSIST_STEPS = 10
# A batch the model saw is "collapsed" when its rows fall to at most this share of the run's own
# usual rows and stay there for `PERSIST_STEPS` steps (a last, short batch of an epoch does not stay).
COLLAPSED_SHARE = 0.5

# kind -> (the column that holds the evidence, how the root names it, whether the root is the
# finding's first component (in forward order) rather than no single one)
KINDS: dict[str, tuple[str, str, bool]] = {
    "eval_mode": ("eval_forwards", "the training loop: the model in eval() mode", False),
    "grads_not_cleared": ("grads_not_cleared", "the training loop: gradients never cleared", False),
    "batch_collapsed": ("input_rows", "the data pipeline: the model saw fewer samples than drawn", False),
    "not_in_optimizer": ("optimizer_index", "parameters no optimizer holds", True),
    "no_gradient": ("grad_norm_l2", "parameters that never get a gradient", False),
    "optimizer_idle": ("params_with_grad", "the optimizer: no gradient to apply", False),
    "zero_gradients": ("grad_norm_total_l2", "the training loop: every gradient zero", False),
    "lr_zero": ("lr_groups", "the optimizer: a learning rate of zero", False),
    "component_eval_mode": ("events", "components in eval() mode", False),
    "trains_where_reference_frozen": ("update_norm_l2", "a component the reference keeps frozen", True),
}


@dataclass(frozen=True)
class Finding:
    """One fact of the set-up: what, from which step, on which components and ranks, and why."""

    kind: str  # a KINDS key
    severity: str  # FAULT | WARNING
    step: int  # the first step it held
    last_step: int
    steps: int  # how many steps it held
    components: list[str] = field(default_factory=list)
    ranks: list[int] = field(default_factory=list)
    evidence: str = ""
    from_start: bool = False  # held from the first step the fact can be seen at all

    @property
    def column(self) -> str:
        """The trace column whose values are the evidence."""
        return KINDS[self.kind][0]

    @property
    def name(self) -> str:
        """What it is, as the root names it."""
        return KINDS[self.kind][1]

    @property
    def component(self) -> str:
        """The component a root made of it is attributed to: its first, for a kind that names one
        (or when it concerns one alone), else "" (no single component)."""
        return self.components[0] if self.components and (KINDS[self.kind][2] or len(self.components) == 1) else ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def findings(trace: Trace, steps: pl.DataFrame, components: pl.DataFrame) -> list[Finding]:
    """Every finding of the trace, faults first, then by step; empty for a trace written before
    the recorder wrote these facts."""
    have = set(steps.columns)
    if steps.is_empty() or "step" not in have:
        return _components_in_eval(trace)  # no steps table: no per-step fact to judge
    found: list[Finding] = []
    for rank, rows in _by_rank(steps):
        rows = rows.sort("step")
        if {"eval_forwards", "micro_batches", "params_with_grad"} <= have:
            found += _eval_mode(rows, rank)
        if "grads_not_cleared" in have:
            found += _not_cleared(rows, rank)
        if {"input_rows", "input_shape"} <= have:
            found += _batch(rows, rank)
        if "params_with_grad" in have:
            found += _no_op_steps(rows, rank)
        if "lr_groups" in have and "param_group" in components.columns and not components.is_empty():
            found += _lr_zero(rows, _of_rank(components, rank), rank)
    if "requires_grad" in components.columns and not components.is_empty():
        found += _parameters(trace, steps, components)
    found += _components_in_eval(trace)
    return sorted(_merge_ranks(found), key=lambda f: (f.severity != FAULT, f.step, f.kind))


def faults(found: Iterable[Finding]) -> list[Finding]:
    """The findings that are faults, earliest first."""
    return sorted((f for f in found if f.severity == FAULT), key=lambda f: (f.step, f.kind))


# --- per-step facts --------------------------------------------------------------------------

def _eval_mode(rows: pl.DataFrame, rank: int) -> list[Finding]:
    bad = rows.filter((pl.col("eval_forwards") > 0) & (pl.col("micro_batches") == 0)
                      & (pl.col("params_with_grad") > 0))
    if bad.is_empty():
        return []
    first, n = int(bad["step"][0]), len(bad)
    return [Finding("eval_mode", FAULT, first, int(bad["step"][-1]), n, ranks=[rank], evidence=(
        f"every forward of {_steps(n)} from step {first} ran in eval() mode with gradients on, "
        "and the optimizer stepped on their gradients: dropout and batch norm behaved as at "
        "inference, and no forward statistics were recorded; call model.train() before training"))]


def _not_cleared(rows: pl.DataFrame, rank: int) -> list[Finding]:
    bad = rows.filter(pl.col("grads_not_cleared") > 0)
    if bad.is_empty():
        return []
    first, n = int(bad["step"][0]), len(bad)
    k, held = int(bad["grads_not_cleared"][0]), bad["params_with_grad"][0] if "params_with_grad" in bad.columns else None
    of = f" of the {held}" if held else ""
    # a gradient left from the previous step shows at the second step's backward at the earliest
    seen_from = int(rows["step"][min(1, len(rows) - 1)])
    return [Finding("grads_not_cleared", FAULT, first, int(bad["step"][-1]), n, ranks=[rank],
                    from_start=first <= seen_from, evidence=(
        f"at {_steps(n)} from step {first}, {k}{of} parameters the optimizer holds still had the "
        "previous step's gradient when their next backward pass began (never set to None or "
        "zeroed): gradients summed across steps, so each update applied every earlier gradient "
        "again; call optimizer.zero_grad() once per step (gradient accumulation's micro-batches "
        "within a step are told apart)"))]


def _batch(rows: pl.DataFrame, rank: int) -> list[Finding]:
    """The batch the model saw against the ids the loop recorded, and against its own usual rows."""
    out = []
    cols = ["step", "input_rows", "input_shape", "micro_batches", "eval_forwards", "batch_ids"]
    seen = rows.select([c for c in cols if c in rows.columns]).filter(pl.col("input_rows").is_not_null())
    short = [r for r in seen.iter_rows(named=True) if _fewer_than_recorded(r)]
    if short:
        r, n = short[0], len(short)
        out.append(Finding("batch_collapsed", FAULT, r["step"], short[-1]["step"], n, ranks=[rank], evidence=(
            f"at {_steps(n)} from step {r['step']} the model's input held {_rows(r['input_rows'])} "
            f"(shape {r['input_shape']}) where the loop recorded {len(r['batch_ids'])} sample ids "
            "(rec.batch): the batch was cut or collapsed before the forward (a packed batch, many "
            "samples in one row, looks the same)")))
    drop = _collapse(seen["step"].to_list(), seen["input_rows"].to_list())
    if drop is not None and not short:
        first, last, n, usual, now = drop
        out.append(Finding("batch_collapsed", FAULT, first, last, n, ranks=[rank], evidence=(
            f"from step {first} the model's input held {_rows(now)} for {_steps(n)}, where the run's "
            f"earlier steps held {usual}: the batch collapsed")))
    return out


def _fewer_than_recorded(r: dict[str, Any]) -> bool:
    """Fewer input rows than recorded ids, unless the input is sequence-first: (T, B, ...) with
    T > 1 rows and a forward's ids in dim 1."""
    ids = r.get("batch_ids")
    if not ids or len(ids) < 2 or r["input_rows"] >= len(ids):
        return False
    forwards = max(1, (r.get("micro_batches") or 0) + (r.get("eval_forwards") or 0))
    shape = r["input_shape"] or []
    return not (len(shape) > 1 and shape[0] > 1 and shape[1] == len(ids) // forwards)


def _collapse(steps: list[int], rows: list[int]) -> tuple[int, int, int, int, int] | None:
    """(first, last step, steps, usual rows, rows) of the first run of `PERSIST_STEPS` steps whose
    rows are at most `COLLAPSED_SHARE` of the most common rows of the steps before it (seen at
    least `PERSIST_STEPS` times), or None."""
    counts: Counter[int] = Counter()
    i = 0
    while i < len(rows):
        usual, times = counts.most_common(1)[0] if counts else (0, 0)
        if times >= PERSIST_STEPS and rows[i] <= COLLAPSED_SHARE * usual:
            j = i
            while j < len(rows) and rows[j] <= COLLAPSED_SHARE * usual:
                j += 1
            if j - i >= PERSIST_STEPS:
                return steps[i], steps[j - 1], j - i, usual, rows[i]
            for k in range(i, j):
                counts[rows[k]] += 1
            i = j
            continue
        counts[rows[i]] += 1
        i += 1
    return None


def _no_op_steps(rows: pl.DataFrame, rank: int) -> list[Finding]:
    """Optimizer steps with no gradient on any parameter it holds, or with every gradient zero."""
    out = []
    none = rows.filter(pl.col("params_with_grad") == 0)["step"].to_list()
    if none:
        every = len(none) == len(rows)
        out.append(_held_for("optimizer_idle", none, rank, every, (
            "the optimizer never had a gradient to apply: none of the parameters it holds got one "
            "in any step (all frozen, or not reached by the loss)" if every else
            f"{_steps(len(none))} from step {none[0]} ran optimizer.step() with no gradient on any "
            "parameter it holds: those steps changed nothing")))
    if "grad_norm_total_l2" in rows.columns:
        zero = rows.filter((pl.col("params_with_grad") > 0) & (pl.col("grad_norm_total_l2") == 0))["step"].to_list()
        if zero:
            out.append(_held_for("zero_gradients", zero, rank, len(zero) == len(rows), (
                f"at {_steps(len(zero))} from step {zero[0]} every gradient the optimizer stepped on "
                "was exactly zero (zeroed between the backward pass and optimizer.step, or a loss "
                "that does not depend on the parameters)")))
    return out


def _held_for(kind: str, steps: list[int], rank: int, every: bool, evidence: str) -> Finding:
    """A no-op finding: a fault when it held for `PERSIST_STEPS` steps in a row, or every step."""
    run = _longest_run(steps)
    severity = FAULT if every or run >= PERSIST_STEPS else WARNING
    return Finding(kind, severity, steps[0], steps[-1], len(steps), ranks=[rank], evidence=evidence)


def _lr_zero(rows: pl.DataFrame, components: pl.DataFrame, rank: int) -> list[Finding]:
    """A param group whose learning rate was exactly 0 for `PERSIST_STEPS` steps in a row (or the
    whole run) while components it holds got gradients."""
    trainable = components.filter(pl.col("param_group").is_not_null())
    out = []
    lrs = rows.select("step", "lr_groups").filter(pl.col("lr_groups").is_not_null())
    for group in sorted(set(trainable["param_group"].to_list())):
        at = [s for s, lr in zip(lrs["step"].to_list(), lrs["lr_groups"].to_list(), strict=True)
              if group < len(lr) and lr[group] == 0]
        if not at or not (_longest_run(at) >= PERSIST_STEPS or len(at) == len(lrs)):
            continue
        names = sorted(trainable.filter(pl.col("param_group") == group)["component"].to_list())
        out.append(Finding("lr_zero", FAULT, at[0], at[-1], len(at), names, [rank], (
            f"the learning rate of param group {group} was 0 at {_steps(len(at))} from step {at[0]}: "
            f"its {len(names)} components ({_names(names)}) computed gradients the optimizer "
            "could not apply")))
    return out


# --- per-parameter facts ---------------------------------------------------------------------

def _parameters(trace: Trace, steps: pl.DataFrame, components: pl.DataFrame) -> list[Finding]:
    """Trainable parameters no optimizer holds; held ones that never got a gradient."""
    comps = _of_rank(components, int(components["rank"].min())) if "rank" in components.columns else components
    owners = comps.filter(pl.col("param_names").is_not_null() & pl.col("requires_grad").is_not_null())
    if owners.is_empty() or "optimizer_index" not in owners.columns or not any(
            i is not None for idx in owners["optimizer_index"].to_list() for i in (idx or [])):
        return []  # no optimizer watched: nothing is "not held"
    loose, held = [], []
    for c in owners.iter_rows(named=True):
        pairs = list(zip(c["requires_grad"], c["optimizer_index"] or [None] * len(c["requires_grad"]), strict=False))
        if any(rg and i is None for rg, i in pairs):
            loose.append(c)
        if any(rg and i is not None for rg, i in pairs):
            held.append(c)
    first, last = int(steps["step"].min()), int(steps["step"].max())
    if "params_with_grad" in steps.columns and steps["params_with_grad"].max() == sum(
            rg and i is not None for c in held for rg, i in zip(c["requires_grad"], c["optimizer_index"], strict=False)):
        held = []  # at some step every trainable parameter the optimizer holds had a gradient
    with_grad = _grad_steps(trace, [c["component"] for c in loose + held])
    out = []
    got = [c["component"] for c in loose if with_grad.get(c["component"], 0)]
    if got:
        out.append(Finding("not_in_optimizer", FAULT, first, last, last - first + 1, got, evidence=(
            f"{len(got)} components ({_names(got)}) have parameters that require grad and got "
            "gradients, but no optimizer param group holds them: those gradients were never applied")))
    never = [c for c in held if not with_grad.get(c["component"], 0)]
    called = [c["component"] for c in never if c["forward_index"] is not None]
    idle = [c["component"] for c in never if c["forward_index"] is None]
    if called:
        out.append(Finding("no_gradient", FAULT, first, last, last - first + 1, called, evidence=(
            f"{len(called)} components ({_names(called)}) ran in the forward with trainable "
            "parameters the optimizer holds, but no gradient reached them in any step: their "
            "output is detached from the loss (a .detach(), no_grad, or a branch the loss never reads)")))
    if idle:
        out.append(Finding("no_gradient", WARNING, first, last, last - first + 1, idle, evidence=(
            f"{len(idle)} components ({_names(idle)}) with trainable parameters the optimizer holds "
            "were never called in a recorded forward: unused modules")))
    return out


def _grad_steps(trace: Trace, names: list[str]) -> dict[str, int]:
    """Steps with a gradient norm, per component of `names` (one scan of that column)."""
    if not names:
        return {}
    listed = ", ".join("'" + n.replace("'", "''") + "'" for n in sorted(set(names)))
    rows = trace.con.execute(f"SELECT component, count(grad_norm_l2) FROM health WHERE component IN ({listed}) "
                             "GROUP BY component").fetchall()
    return {str(c): int(n) for c, n in rows}


def trains_where_frozen(trace: Trace, frozen: list[str], components: pl.DataFrame) -> list[Finding]:
    """Components a reference run keeps frozen (no gradient, no update in any step) that this run
    updates: the intent was to freeze them (`reference.frozen_in`). Their update departs where the
    reference has none to compare with, so no rule of the classifier can fire on it, while the
    components they feed depart: the component itself, not its neighbour, is the root."""
    if not frozen:
        return []
    listed = ", ".join("'" + n.replace("'", "''") + "'" for n in sorted(set(frozen)))
    rows = trace.con.execute(f"SELECT component, min(step) FROM health WHERE component IN ({listed}) "
                             "AND grad_norm_l2 IS NOT NULL AND update_norm_l2 > 0 GROUP BY component").fetchall()
    if not rows:
        return []
    first = {str(c): int(s) for c, s in rows}
    order = dict(zip(components["component"].to_list(), components["forward_index"].to_list(), strict=False))
    names = sorted(first, key=lambda c: (order.get(c) is None, order.get(c) or 0, c))
    step, last = min(first.values()), int(trace.one("SELECT max(step) FROM health")[0])
    return [Finding("trains_where_reference_frozen", FAULT, step, last, last - step + 1, names, evidence=(
        f"{len(names)} components ({_names(names)}) got gradients and updated their weights from "
        f"step {step}, where the reference run never did (frozen there: no gradient, no update in "
        "any step): the freezing this run was meant to have did not happen"))]


# --- events ----------------------------------------------------------------------------------

def _components_in_eval(trace: Trace) -> list[Finding]:
    """Components the recorder saw in eval() mode while the model trained (its `finding` events)."""
    if "detail" not in trace.columns("events") or "kind" not in trace.columns("events"):
        return []
    rows = trace.con.execute("SELECT rank, step, detail FROM events WHERE kind = 'finding' ORDER BY step").fetchall()
    seen: dict[str, tuple[int, str, set[int]]] = {}
    for rank, step, detail in rows:
        try:
            fact = json.loads(detail)
        except (TypeError, ValueError):
            continue
        if fact.get("finding") == "component_eval_mode" and isinstance(fact.get("component"), str):
            first, kind, ranks = seen.get(fact["component"], (int(step) + 1, str(fact.get("kind", "")), set()))
            seen[fact["component"]] = (min(first, int(fact.get("step", step))), kind, ranks | {int(rank)})
    if not seen:
        return []
    names = sorted(seen, key=lambda c: seen[c][0])
    first = seen[names[0]][0]
    kinds = sorted({seen[c][1] for c in names})
    return [Finding("component_eval_mode", WARNING, first, first, 1, names,
                    sorted(set().union(*(seen[c][2] for c in names))), (
        f"{len(names)} components ({_names(names)}; {', '.join(kinds)}) ran their forward in eval() "
        f"mode while the model trained, from step {first}: no forward statistics were recorded for "
        "them; deliberate for frozen batch norm, else call .train() on them"))]


# --- helpers ---------------------------------------------------------------------------------

def _by_rank(steps: pl.DataFrame) -> list[tuple[int, pl.DataFrame]]:
    if "rank" not in steps.columns:
        return [(0, steps)]
    return [(int(k[0]), g) for k, g in steps.group_by("rank", maintain_order=True)]


def _of_rank(components: pl.DataFrame, rank: int) -> pl.DataFrame:
    return components.filter(pl.col("rank") == rank) if "rank" in components.columns else components


def _merge_ranks(found: list[Finding]) -> list[Finding]:
    """One finding per kind and components, holding the ranks it was seen on (earliest step)."""
    merged: dict[tuple[str, str, tuple[str, ...]], Finding] = {}
    for f in found:
        key = (f.kind, f.severity, tuple(f.components))
        if key in merged:
            m = merged[key]
            first = min(m, f, key=lambda x: x.step)
            merged[key] = Finding(f.kind, f.severity, first.step, max(m.last_step, f.last_step),
                                  max(m.steps, f.steps), f.components, sorted({*m.ranks, *f.ranks}),
                                  first.evidence)
        else:
            merged[key] = f
    return list(merged.values())


def _longest_run(steps: list[int]) -> int:
    best = run = 0
    for i, s in enumerate(steps):
        run = run + 1 if i and s == steps[i - 1] + 1 else 1
        best = max(best, run)
    return best


def _steps(n: int) -> str:
    return f"{n} step" if n == 1 else f"{n} steps"


def _rows(n: int) -> str:
    return f"{n} row" if n == 1 else f"{n} rows"


def _names(names: list[str], most: int = 4) -> str:
    shown = ", ".join(n or "(root)" for n in names[:most])
    return shown + (f" and {len(names) - most} more" if len(names) > most else "")
