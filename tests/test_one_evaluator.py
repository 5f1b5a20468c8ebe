"""One evaluator of the rules, whatever feeds it: a run alone, a run against a reference run, a
live monitor. A rule added in a config of the test's own fires in all three, and a run judged
against a reference gives the oracle's alarms and heatmap."""

from __future__ import annotations

import functools
from dataclasses import replace
from pathlib import Path
from typing import Any

import polars as pl
import pytest
import torch
import torch.nn.functional as F
from rehearsed import ROOT
from rules_oracle import classify, heat_of
from warninglight.forensics import analyze, open_trace
from warninglight.forensics.explaining.analysis import classify_trace
from warninglight.forensics.explaining.reference import reference_baseline
from warninglight.forensics.judging.conditions import UP, Condition, Config, Rule
from warninglight.forensics.trace.schedule import with_lr
from warninglight.forensics.trace.store import health_frame
from warninglight.lab import zoo
from warninglight.lab.drills import WeightCorruption
from warninglight.tracer import watch

FAULT_STEP, STEPS = 100, 130
# A condition no registry has: a layer's weight norm up by half of its baseline in one step.
JUMP = Condition("weights_jumped", "weights jumped", "weight norm", (Rule("weight_norm_l2", UP, fold=1.5),),
                 persistence=1, ceiling=0.1, precedence=1)
CONFIG = replace(Config(), conditions=(*Config().conditions, JUMP))


class Received:
    def __init__(self) -> None:
        self.got: list[dict[str, Any]] = []

    def send(self, alarm: dict[str, Any]) -> None:
        self.got.append(alarm)


def _train(path: Path, seed: int, fault: bool, sink: Received | None = None) -> None:
    """An MLP trained `STEPS` steps (layer "2"'s weights scaled 10x at `FAULT_STEP` if `fault`),
    watched with the test's config for live alarms when a sink is given."""
    torch.manual_seed(seed)
    model = zoo.mlp()
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    data = zoo.batches(*zoo.teacher_classification(n=1024), 64)
    drill = WeightCorruption("2", FAULT_STEP, mode="scale", factor=10.0)
    if fault:
        drill.attach(model, opt)
    live = {"alarms": [sink], "alarm_config": CONFIG} if sink is not None else {}
    try:
        with watch(model, opt, path, **live) as rec:
            for step in range(1, STEPS + 1):
                ids, x, y = next(data)
                if fault:
                    drill.before_step(step, model, opt)
                loss = F.cross_entropy(model(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                rec.log(loss=loss.item())
                rec.batch(ids)
    finally:
        if fault:
            drill.detach()


@functools.cache
def runs() -> tuple[Path, Path, list[dict[str, Any]]]:
    """(a faulty run, a clean run of the same model with another seed, the faulty run's live alarms)."""
    torch.set_num_threads(1)
    sink = Received()
    faulty, clean = ROOT / "evaluator-faulty", ROOT / "evaluator-clean"
    _train(faulty, seed=0, fault=True, sink=sink)
    _train(clean, seed=1, fault=False)
    return faulty, clean, sink.got


def _jumps(alarms: list[Any]) -> list[tuple[str, int]]:
    return sorted({(a["observed_on"] if isinstance(a, dict) else a.observed_on,
                    a["step"] if isinstance(a, dict) else a.step)
                   for a in alarms if (a["condition"] if isinstance(a, dict) else a.condition) == JUMP.name})


def test_a_rule_added_in_a_config_fires_offline_live_and_against_a_reference() -> None:
    faulty, clean, live = runs()
    offline = _jumps(analyze(faulty, config=CONFIG).alarm_list())
    assert offline == [("2", FAULT_STEP)]
    assert _jumps(live) == offline  # the live monitor raised it at the same step
    assert _jumps(analyze(faulty, config=CONFIG, reference=clean).alarm_list()) == offline
    # and the defaults know no such condition
    assert _jumps(analyze(faulty).alarm_list()) == []


@pytest.mark.parametrize("chunk", [9, 1000])
@pytest.mark.parametrize("run", ["faulty", "clean"])
def test_a_run_against_a_reference_gives_the_oracles_alarms_and_heatmap(run: str, chunk: int) -> None:
    faulty, clean, _ = runs()
    ref = reference_baseline(clean, CONFIG.baseline)
    trace = open_trace(faulty if run == "faulty" else clean)
    try:
        components = trace.frame("components").collect()
        frame = with_lr(health_frame(trace), trace).with_columns(pl.col("component").cast(pl.String))
        scored, want = classify(frame, CONFIG, reference=ref)
        clf = classify_trace(trace, CONFIG, components, heat_width=1, chunk_steps=chunk, reference=ref)
        assert clf.alarms().equals(want)
        assert clf.heat().equals(heat_of(scored, 1).sort("component", "step"))
        if run == "faulty":
            assert len(want) > 0 and JUMP.name in want["condition"].to_list()
    finally:
        trace.close()
