"""Roots that are no single component: bad batches (the data), and the gradients the optimizer is fed.

A corrupted batch (a bad shard, a broken tokenizer, shuffled labels) reaches many components at
once. The root is the data when, at the earliest onset:

- the batch is unusual: the loss, or the total gradient norm (in log units), jumps — its robust
  z against its own trailing baseline (the components' baseline settings) reaches `JUMP_Z`
  within `ROOT_WINDOW` steps of the onset (a weak model's loss can barely move on garbage tokens
  while every gradient leaps);
- several components depart together (at least `MIN_COMPONENTS`, in at least two blocks);
- nothing inside the model explains it: no weight drift (nothing wrote the weights), no
  non-finite value, no optimizer-wide change, and no forward departure beginning mid-model —
  where an output departed first, it is an output of the first component to read the batch (a
  token batch can leave every embedding output normal: then only gradients depart).

When instead the gradients of most components — the head's among them — grow far past their
baseline, alarming before anything else and with no weight drift or non-finite value, what the optimizer steps on changed for the whole model: gradients not zeroed between
steps, a wrong loss scale (`gradients_wide`). Against a reference run this finds a forgotten
`optimizer.zero_grad()` present from the first step.

The bad window runs from the jump until a signal that jumped returns to its baseline as it stood
at the jump (z below the onset threshold for `CALM_STEPS` steps in a row); the rollback skips all
of it.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from warninglight.forensics.explaining.localise import ROOT_WINDOW
from warninglight.forensics.judging.conditions import BaselineConfig
from warninglight.tracer.schema import FORWARD

JUMP_Z = 6.0  # the |z| the registry's exploding rules ask of a norm far above its baseline
MIN_COMPONENTS = 3  # departing together: more than a component and its neighbour
CALM_STEPS = 3  # steps back at baseline that end a bad window: a few ordinary batches inside a
# bad shard (or a model half-adapted to the garbage) do not end it
Series = tuple[np.ndarray, np.ndarray]  # (steps, values)


def block_of(component: str) -> str:
    """The model block a component belongs to: its path up to the first numeric part (`h.1`)."""
    parts = component.split(".")
    for i, p in enumerate(parts):
        if p.isdigit():
            return ".".join(parts[: i + 1])
    return parts[0]


def _baseline(series: Series, at: int, cfg: BaselineConfig) -> tuple[float, float] | None:
    """(median, robust scale) of the values in the baseline window judging step `at`, or None."""
    steps, values = series
    past = values[(steps < at - cfg.lag + 1) & (steps >= at - cfg.lag + 1 - cfg.window)]
    past = past[np.isfinite(past)]
    if len(past) < cfg.min_samples:
        return None
    med = float(np.median(past))
    q75, q25 = np.percentile(past, [75, 25])
    return med, max(float(q75 - q25) / 1.349, 0.02 * abs(med), 1e-8)


def _z(series: Series, at: int, base: tuple[float, float]) -> float | None:
    value = series[1][series[0] == at]
    if len(value) == 0 or not np.isfinite(value[0]):
        return None
    return (float(value[0]) - base[0]) / base[1]


def jump(signals: list[Series], first: int, cfg: BaselineConfig) -> tuple[int, float, list[int]] | None:
    """(step, z, signals that jumped) at the first step in [first, first + ROOT_WINDOW] where a
    signal is `JUMP_Z` above its baseline, or None."""
    for step in range(first, first + ROOT_WINDOW + 1):
        zs: dict[int, float] = {}
        for i, series in enumerate(signals):
            base = _baseline(series, step, cfg)
            z = None if base is None else _z(series, step, base)
            if z is not None and z >= JUMP_Z:
                zs[i] = z
        if zs:
            return step, max(zs.values()), sorted(zs)
    return None


def window_end(series: Series, start: int, cfg: BaselineConfig) -> int:
    """The last step of the excursion beginning at `start`, against the baseline at `start`."""
    base = _baseline(series, start, cfg)
    end = start
    if base is None:
        return end
    for step in series[0][series[0] > start]:
        if step > end + CALM_STEPS:
            break
        z = _z(series, int(step), base)
        if z is None or z >= cfg.onset_z:
            end = int(step)
    return end


def _inside_model(near: list[dict[str, Any]], first_readers: set[str]) -> bool:
    """True when the departure has a cause inside the model (not the batch)."""
    if any(a["drift"] or a["median"] is None for a in near):
        return True  # a write outside the optimizer, or a non-finite value, has a place
    comps = {a["attributed_to"] for a in near}
    if len(comps) < MIN_COMPONENTS or len({block_of(c) for c in comps}) < 2:
        return True
    forward = [a for a in near if a["signal"] == FORWARD]
    if not forward:
        return False
    lead = min(a["forward_index"] for a in forward)
    return not any(a["forward_index"] == lead and a["attributed_to"] in first_readers for a in forward)


def data_root(root: dict[str, Any], rows: list[dict[str, Any]], first_readers: set[str],
              loss: Series, grad: Series, cfg: BaselineConfig) -> tuple[int, int, str] | None:
    """(onset, end of the bad window, evidence) when the root is the data, else None.

    `rows`: the located alarms; `first_readers`: the components that read the batch first;
    `loss`, `grad`: (steps, values) of the loss and of the total gradient norm.
    """
    if root.get("scope") != "component":
        return None
    first = root["onset_step"]
    near = [a for a in rows if first <= a["onset_step"] <= first + ROOT_WINDOW]
    if _inside_model(near, first_readers):
        return None
    signals = [loss, (grad[0], np.log(np.maximum(grad[1], 1e-12)))]
    found = jump(signals, first, cfg)
    if found is None:
        return None
    start, z, which = found
    # the first signal back at baseline ends it: one still away carries the model's damage from
    # the bad steps (a loss left high), not bad batches
    end = min(window_end(signals[i], start, cfg) for i in which)
    comps = {a["attributed_to"] for a in near}
    what = " and ".join(("the loss", "the total gradient norm")[i] for i in which)
    evidence = (f"data: {what} jumped at step {start} (z={z:.1f} against its baseline) while "
                f"{len(comps)} components in {len({block_of(c) for c in comps})} blocks departed "
                "together, with no weight drift and no departure beginning inside the model: the "
                f"batches of steps {start}-{end} (until it returned to its baseline)")
    return start, end, evidence


def gradients_wide(root: dict[str, Any], rows: list[dict[str, Any]], heads: set[str],
                   param_components: int) -> tuple[dict[str, Any], int, str] | None:
    """(the leading gradient alarm, onset, evidence) when the gradients of most components grew
    together, else None."""
    if root.get("scope") != "component":
        return None
    grew = [a for a in rows if a["metric"] == "grad_norm_l2" and a["median"] is not None
            and a["value"] > a["median"]]
    if any(a["drift"] for a in grew):
        return None
    comps = {a["attributed_to"] for a in grew}
    if len(comps) < max(MIN_COMPONENTS, 0.5 * param_components) or not comps & heads:
        return None
    if min(a["step"] for a in grew) > min(a["step"] for a in rows):
        return None  # something else alarmed first
    onset = min(a["onset_step"] for a in grew)
    lead = min(grew, key=lambda a: (a["onset_step"], a["step"]))
    return lead, onset, (f"gradients model-wide: the gradient norms of {len(comps)} of {param_components} "
                   "parameter-owning components, the head's among them, grew far past their "
                   "baseline together with no weight drift: what the optimizer steps on changed "
                   "for the whole model (gradients not zeroed between steps, a loss scale), not one component")
