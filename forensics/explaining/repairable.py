"""Whether a fault can be repaired in one component's tensors, and whether the rehearsals say to.

A component repair (`repair.py`) takes the latest checkpoint and puts back, from the clean one,
the root component's tensors and optimizer state (and those of the components the evidence names
as damaged in their own weights). It is sound only when the damage is that one component's:

- the root is a component: not the data (`data`), not every component's update (`optimizer`),
  not a whole-model replica divergence (`replicas` with no component);
- the clean checkpoint is older than the onset, and the latest one is not (else there is nothing
  to repair, or nothing clean to repair from);
- the damage has not spread: other parameter-owning components whose *own weights* departed
  (an alarm on a weights metric: weight norm, update norm or ratio, cosine, drift) with an onset
  from the root's onset up to the latest checkpoint are damaged too and are repaired with it, but
  more than `SPREAD_LIMIT` of them, or half the model's components, is damage that has spread: the
  whole rollback. Forward and gradient alarms downstream are effects carried through the root's
  weights, and go when they are repaired.

Which conditions it is *recommended* for is measured, not assumed: `RECOMMENDED` holds the
conditions whose rehearsals (`lab/recovery.py`, printed by `warninglight eval`) trained on from
the repaired checkpoint to a loss no worse than the full rollback's at equal compute; a test
re-derives it from the rehearsals.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import polars as pl
from warninglight.tracer import schema

SPREAD_LIMIT = 2  # other components damaged in their own weights before the damage has spread
# Root conditions whose rehearsed repairs trained on no worse than the full rollback (lab/recovery.py).
RECOMMENDED: frozenset[str] = frozenset({"dead", "losing_confidence"})
UNSOUND_SCOPES = ("data", "optimizer", "setup")


@dataclass(frozen=True)
class Soundness:
    """Whether the root component can be repaired alone, which components, and why (not)."""

    sound: bool
    reason: str
    components: list[str] = field(default_factory=list)  # root first, then those damaged in their weights
    recommended: bool = False  # sound, and the rehearsals measured it no worse than the rollback
    clean_step: int | None = None  # the checkpoint the root's tensors come from
    latest_step: int | None = None  # the checkpoint whose other tensors are kept
    steps_kept: int | None = None  # latest_step - clean_step: the other components' learning kept

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def weight_damaged(alarms: pl.DataFrame, root: str, onset: int, latest_step: int, owners: set[str]) -> list[str]:
    """Other parameter owners whose own weights departed, with an onset in [onset, latest_step]."""
    if alarms.is_empty():
        return []
    weights = set(schema.metrics_of(schema.WEIGHTS))
    hit = alarms.filter(pl.col("metric").is_in(list(weights)) & pl.col("onset_step").is_between(onset, latest_step)
                        & (pl.col("attributed_to") != root) & pl.col("attributed_to").is_in(list(owners)))
    return list(dict.fromkeys(hit.sort("onset_step")["attributed_to"].to_list()))


def judge(scope: str, root: str, condition: str, onset: int, alarms: pl.DataFrame, components: pl.DataFrame,
          clean_step: int | None, latest_step: int | None) -> Soundness:
    """The rules of the module docstring, on one analysis' root and alarms."""
    owners = set(components.filter(pl.col("param_count") > 0)["component"].to_list()) if not components.is_empty() else set()
    if scope in UNSOUND_SCOPES or (scope == "replicas" and not root) or not root:
        why = {"data": "the root is the data (bad batches): every component learnt from them",
               "optimizer": "the root is the optimizer: every component's update departed together",
               "setup": "the root is the training set-up: fix it and rerun; a repair puts back weights, not the loop",
               }.get(scope, "the root is no single component (a whole-model divergence)")
        return Soundness(False, why)
    if root not in owners:
        return Soundness(False, f"the root {root} owns no parameters to put back")
    if clean_step is None:
        return Soundness(False, "no clean checkpoint before the onset to repair from")
    if onset <= clean_step:
        return Soundness(False, f"the fault (onset step {onset}) is older than the clean checkpoint (step {clean_step})")
    if latest_step is None or latest_step < onset:
        return Soundness(False, "no checkpoint since the onset holds the damage: resume from the latest one")
    damaged = weight_damaged(alarms, root, onset, latest_step, owners)
    if len(damaged) > SPREAD_LIMIT or 2 * (len(damaged) + 1) > len(owners):
        return Soundness(False, f"the damage has spread: {len(damaged)} other components' own weights departed "
                                f"since step {onset} ({', '.join(damaged[:5])})")
    recommended = condition in RECOMMENDED
    how = ("the rehearsals measured it no worse than the full rollback" if recommended else
           f"sound, but the rehearsals did not measure a repair of {condition} no worse than the full rollback")
    return Soundness(True, how, [root, *damaged], recommended, clean_step, latest_step, latest_step - clean_step)
