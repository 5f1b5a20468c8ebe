"""The one-minute demo: train a small GPT on CPU with a fault injected, record, analyse, report.

Everything the demo does is a public call a user can make themselves: `rehearse` (a real training
run under `watch`, with a drill), `analyze`, `report.write_html`. It writes under one folder::

    OUT/trace/          the recorded trace (plus truth.json, the drill's answer key)
    OUT/checkpoints/    real checkpoint files, every 100 steps
    OUT/report.html     the self-contained report
"""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DEMO_SCENARIO = "gpt_weight_corruption"  # memory corruption of one MLP layer's weights mid-run


class DemoError(ValueError):
    """The demo cannot write where it was asked to."""


@dataclass
class DemoResult:
    """What the demo made and how long each part took."""

    trace: Path
    report: Path
    line: str  # the verdict as one actionable line
    truth: dict[str, Any]
    result: dict[str, Any]  # the `analyze --json` object
    seconds: dict[str, float] = field(default_factory=dict)  # train / analyze / report


def _fresh(path: Path) -> None:
    """Remove a previous demo's trace or checkpoints; refuse to delete anything else."""
    if not path.exists():
        return
    ours = (path / "manifest").is_dir() or all(p.suffix == ".pt" for p in path.iterdir())
    if not ours:
        raise DemoError(f"{path} exists and is not a previous demo's output; "
                        f"pass --out with an empty or new folder")
    shutil.rmtree(path)


def run_demo(out: Path | str, scenario: str = DEMO_SCENARIO, seed: int = 0,
             steps: int | None = None, threads: int = 1) -> DemoResult:
    """Train, record, analyse and report one rehearsal into `out`.

    `threads`: torch CPU threads while training. One is fastest for a model this small: on a
    shared 2-core machine two threads spin against each other (measured 34 s vs 3 s to train).
    """
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return _run(Path(out), scenario, seed, steps)
    finally:
        torch.set_num_threads(previous)


def _run(out: Path, scenario: str, seed: int, steps: int | None) -> DemoResult:
    from warninglight.forensics import analyze, report, wording
    from warninglight.lab.rehearsal import rehearse

    trace, ckpt = out / "trace", out / "checkpoints"
    _fresh(trace)
    _fresh(ckpt)
    out.mkdir(parents=True, exist_ok=True)
    seconds: dict[str, float] = {}
    t0 = time.perf_counter()
    truth = rehearse(scenario, trace, seed=seed, steps=steps, checkpoint_every=100, checkpoint_dir=ckpt)
    seconds["train"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    analysis = analyze(trace)
    seconds["analyze"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    html = report.write_html(trace, out / "report.html", analysis)
    seconds["report"] = time.perf_counter() - t0
    return DemoResult(trace, html, wording.analysis_summary_line(analysis), truth, analysis.to_dict(), seconds)


def describe_truth(truth: dict[str, Any]) -> str:
    """The injected fault in one line, to print beside the verdict."""
    if truth.get("healthy", "fault" not in truth):
        return "injected: nothing (clean run)"
    return (f"injected: {truth.get('fault')} on {truth.get('component') or 'all components'} "
            f"at step {truth.get('step')} ({truth.get('kind')}; expected condition {truth.get('condition')})")
