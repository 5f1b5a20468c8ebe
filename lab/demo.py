"""The one-minute demo: train a small GPT on CPU with a fault injected, record, analyse, report.

Everything the demo does is a public call a user can make themselves: `rehearse` (a real training
run under `watch`, with a drill), `analyze`, `report.write_html`. It writes under one folder::

    OUT/trace/          the recorded trace (plus truth.json, the drill's answer key)
    OUT/checkpoints/    real checkpoint files, every 100 steps
    OUT/report.html     the self-contained report
    OUT/.warninglight-demo.json   the list of files the demo wrote

It never deletes a file it did not write: a rerun into the same folder replaces the files the
previous demo listed, and refuses a folder holding anything else.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DEMO_SCENARIO = "gpt_weight_corruption"  # memory corruption of one MLP layer's weights mid-run
DEMO_RECORD = ".warninglight-demo.json"  # what the demo wrote into OUT: the only files it may replace


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


def _own_files(out: Path) -> set[Path]:
    """Files a previous demo recorded writing into `out` (none if it has no record)."""
    try:
        listed = json.loads((out / DEMO_RECORD).read_text())["files"]
        return {out / f for f in listed}
    except (OSError, ValueError, KeyError, TypeError):
        return set()


def _clear(out: Path) -> None:
    """Make `out` ready for a demo: new, empty, or holding only a previous demo's own files.

    A previous demo's files (listed in its record) are replaced; anything else in the folder is a
    user's, so the demo refuses rather than delete or mix with it. Nothing is removed unless every
    file in the folder is the demo's own.
    """
    if not out.exists():
        return
    if not out.is_dir():
        raise DemoError(f"--out {out} is a file; the demo writes a folder (trace, checkpoints, "
                        "report.html), e.g. --out runs/demo")
    present = {p for p in out.rglob("*") if not p.is_dir()}
    ours = _own_files(out)
    others = sorted(present - ours - {out / DEMO_RECORD})
    if others:
        shown = ", ".join(str(p.relative_to(out)) for p in others[:3])
        more = f" and {len(others) - 3} more" if len(others) > 3 else ""
        raise DemoError(f"--out {out} is not empty and holds files the demo did not write "
                        f"({shown}{more}); nothing was deleted — pass --out with a new or empty folder")
    for path in sorted(present, key=lambda p: len(p.parts), reverse=True):
        path.unlink()
    for folder in sorted((d for d in out.rglob("*") if d.is_dir()), key=lambda p: len(p.parts),
                         reverse=True):
        folder.rmdir()  # empty now: every file in it was the demo's


def _record(out: Path) -> None:
    """List every file the demo wrote, so a later run may replace exactly those.

    Written once the demo is done: the files of a demo stopped half-way are not listed, and a
    later run refuses the folder rather than guess which files were its own.
    """
    files = sorted(str(p.relative_to(out)) for p in out.rglob("*") if not p.is_dir())
    (out / DEMO_RECORD).write_text(json.dumps({"files": files}, indent=1))


def run_demo(out: Path | str, scenario: str = DEMO_SCENARIO, seed: int = 0,
             steps: int | None = None, threads: int = 1) -> DemoResult:
    """Train, record, analyse and report one rehearsal into `out`.

    `threads`: torch CPU threads while training. One is fastest for a model this small: its ops
    are too small to split, and on a shared machine two threads spin against each other.
    """
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return _run(Path(out), scenario, seed, steps)
    finally:
        torch.set_num_threads(previous)


def _run(out: Path, scenario: str, seed: int, steps: int | None) -> DemoResult:
    from warninglight.forensics import analyze
    from warninglight.forensics.presenting import report, wording
    from warninglight.lab.rehearsal import rehearse

    trace, ckpt = out / "trace", out / "checkpoints"
    _clear(out)
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
    _record(out)
    return DemoResult(trace, html, wording.analysis_summary_line(analysis), truth, analysis.to_dict(), seconds)


def describe_truth(truth: dict[str, Any]) -> str:
    """The injected fault in one line, to print beside the verdict."""
    if truth.get("healthy", "fault" not in truth):
        return "injected: nothing (clean run)"
    return (f"injected: {truth.get('fault')} on {truth.get('component') or 'all components'} "
            f"at step {truth.get('step')} ({truth.get('kind')}; expected condition {truth.get('condition')})")
