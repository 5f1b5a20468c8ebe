"""The rehearsed recovery: repair, full rollback and no action trained on the same batches."""

from __future__ import annotations

import re
from pathlib import Path

from warninglight.forensics.explaining.repairable import RECOMMENDED
from warninglight.lab import recovery
from warninglight.lab.results import RECOVERY_TITLE

RESULTS = Path(__file__).parent.parent / "docs" / "results.md"


def test_the_engines_recommended_conditions_are_the_results_pages() -> None:
    page = RESULTS.read_text()
    section = page[page.index(RECOVERY_TITLE):]
    said = re.search(r"Repair recommended by `analyze` for root conditions: ([^;]*);", section)
    assert said is not None, "regenerate the results page: warninglight eval --results docs/results.md"
    assert frozenset(c.strip() for c in said.group(1).split(",") if c.strip() != "none") == RECOMMENDED


def test_a_rehearsed_repair_agrees_with_the_registry(tmp_path: Path) -> None:
    got = recovery.rehearse_recovery("mlp_dying_layer", 0, tmp_path)
    assert got.condition == "dead" and got.refused is None
    assert got.steps_kept == 200  # checkpoints every 50 steps: repaired from 100 into 300
    # the registry says what this rehearsal measures: a dead layer's repair no worse than the rollback
    assert got.repair_no_worse is ("dead" in RECOMMENDED)
    assert got.loss_repaired is not None and got.loss_clean < got.loss_rollback  # the rollback lost 200 steps
    assert recovery.recommended([got]) == frozenset({"dead"} & RECOMMENDED)
