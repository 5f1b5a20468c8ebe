"""The incremental classifier: any feeding gives the whole-trace classifier's alarms, in bounded memory."""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import polars as pl
import pytest
from rules_oracle import classify, heat_of
from warninglight.forensics.explaining import analysis
from warninglight.forensics.explaining.analysis import _read_ahead, classify_trace
from warninglight.forensics.judging.classifier import Classifier, StepOrderError
from warninglight.forensics.judging.conditions import Config
from warninglight.forensics.trace.footers import SegmentSpan
from warninglight.forensics.trace.schedule import with_lr
from warninglight.forensics.trace.store import (
    Trace,
    health_frame,
    health_window,
    open_trace,
    window_files,
    window_starts,
)

SAMPLES = Path(__file__).resolve().parent.parent / "sample_traces"


@pytest.mark.parametrize("name", ["gpt_dying_layer", "gpt_nan", "mlp_creeping_corruption"])
def test_feeding_in_any_chunks_gives_the_whole_trace_alarms(name: str) -> None:
    cfg = Config()
    trace = open_trace(SAMPLES / name)
    try:
        components = trace.frame("components").collect()
        # the whole trace at once, judged as analyze judges it: update metrics per unit lr
        scored, expected = classify(with_lr(health_frame(trace), trace), cfg)
        assert len(expected) > 0
        for chunk in (7, 500):
            clf = classify_trace(trace, cfg, components, heat_width=1, chunk_steps=chunk)
            assert clf.alarms().equals(expected), chunk
            # the heatmap it keeps is the whole scored frame's, cell for cell: each row's worst
            # |z| among the metrics with a baseline there, taken here from the z columns
            cells = [pl.when(pl.col(c).is_finite() & pl.col(c.replace("__z", "__med")).is_not_null())
                     .then(pl.col(c).abs()) for c in scored.columns if c.endswith("__z")]
            heat = (scored.select("component", "step", pl.max_horizontal(cells).alias("score"))
                    .group_by("component", "step").agg(pl.col("score").max()).sort("component", "step"))
            assert heat_of(scored, 1).sort("component", "step").equals(heat)
            assert heat["score"].drop_nulls().len() > 0
            assert clf.heat().equals(heat), chunk
    finally:
        trace.close()


def _fed(feed: Callable[[Classifier, Trace], list[pl.DataFrame]],
         **kwargs: Any) -> tuple[Classifier, pl.DataFrame, list[pl.DataFrame], int]:
    """gpt_dying_layer fed to a `Classifier(Config(), components, **kwargs)` by `feed`: (the
    classifier, the whole-trace classifier's alarms, what each call returned, the components)."""
    trace = open_trace(SAMPLES / "gpt_dying_layer")
    try:
        components = trace.frame("components").collect()
        _, expected = classify(health_frame(trace), Config())
        clf = Classifier(Config(), components, **kwargs)
        return clf, expected, feed(clf, trace), len(components)
    finally:
        trace.close()


def test_feed_returns_each_alarm_once_when_its_episode_begins() -> None:
    clf, expected, raised, components = _fed(
        lambda clf, trace: [clf.feed(health_window(trace, s, s)) for s in range(1, 301)])
    carried = len(clf._tail) if clf._tail is not None else 0
    assert clf.alarms().equals(expected)
    steps = [int(a["step"]) for frame in raised for a in frame.iter_rows(named=True)]
    for step, frame in zip(range(1, 301), raised, strict=True):
        assert frame["step"].to_list() == [step] * len(frame)  # raised at its own step, not later
    assert sorted(steps) == clf.alarms()["step"].to_list()
    # the rows it carries: `history` steps of every component, however long the run
    assert carried == clf.history * components


def test_windows_submitted_are_judged_one_behind_and_each_alarm_returned_once() -> None:
    # the compiled classifier judges a window on a thread of its own while the next is read:
    # what `submit` returns is the alarms of windows fed before it, and `drain` the rest
    clf, expected, raised, _ = _fed(lambda clf, trace: [*(clf.submit(health_window(trace, s, s + 9))
                                                          for s in range(1, 301, 10)), clf.drain()])
    assert clf.alarms().equals(expected) and len(expected) > 0
    for k, frame in enumerate(raised[:-1]):
        assert frame.is_empty() or frame["step"].max() <= 10 * k  # of windows 0..k-1 only
    got = pl.concat([frame for frame in raised if not frame.is_empty()])
    assert sorted(got["step"].to_list()) == clf.alarms()["step"].to_list()  # each once
    assert raised[-1].is_empty() or raised[-1]["step"].min() > 10 * (len(raised) - 3)


def test_a_step_fed_twice_is_refused() -> None:
    trace = open_trace(SAMPLES / "mlp_clean")
    try:
        rows = health_window(trace, 1, 10)
        components = trace.frame("components").collect()
    finally:
        trace.close()
    clf = Classifier(Config(), components)
    clf.feed(rows)
    with pytest.raises(StepOrderError, match="steps up to 10 were already judged"):
        clf.feed(rows.filter(pl.col("step") == 10))


def test_a_step_window_reads_only_the_files_that_hold_it() -> None:
    trace = open_trace(SAMPLES / "mlp_clean")  # format 1: step ranges come from the footers
    try:
        every = window_files(trace, "health", 1, 300)
        some = window_files(trace, "health", 150, 160)
        rows = health_window(trace, 150, 160)
    finally:
        trace.close()
    assert len(every) == 3 and len(some) == 1
    assert sorted(rows["step"].unique().to_list()) == list(range(150, 161))


def _spans(*ranges: tuple[int, int, int]) -> Trace:
    """A stand-in trace holding only health segments of (rank, first step, last step)."""
    class Spans:
        spans = [SegmentSpan("health", rank, 1, Path(f"r{rank}-{a}.parquet"), a, b, 10) for rank, a, b in ranges]
    return Spans()  # type: ignore[return-value]


def test_step_windows_end_where_the_segments_end() -> None:
    segments = _spans(*[(0, a, a + 99) for a in range(1, 1000, 100)])  # steps 1-1000, 100 a segment
    # each next start is the segment start nearest `steps` on (the shorter window on a tie)
    assert window_starts(segments, "health", 1, 1000, 290, 100) == [1, 301, 601, 901]
    assert window_starts(segments, "health", 1, 1000, 250, 100) == [1, 201, 401, 601, 801]  # the rest in one
    # none in reach (at least `least` on, at most an eighth past `steps`): a window of `steps`
    assert window_starts(segments, "health", 1, 300, 40, 35) == [1, 41, 81, 121, 161, 201, 241, 281]
    assert window_starts(segments, "health", 1, 300, 40, 20) == [1, 41, 81, 101, 141, 181, 201, 241, 281]
    # from inside a segment (an incident window's history): aligned from the next on
    assert window_starts(segments, "health", 150, 640, 200, 100) == [150, 301, 501]
    assert window_starts(segments, "events", 1, 1000, 250, 100) == [1, 251, 501, 751]  # no segments
    # a short first window (`opening`), its end the segment start nearest it as far as a window of
    # `steps` reaches (none: its length), then windows of `steps`
    assert window_starts(segments, "health", 1, 1000, 290, 100, opening=120) == [1, 101, 401, 701, 901]
    assert window_starts(segments, "health", 1, 1000, 290, 100, opening=180) == [1, 201, 501, 801]
    assert window_starts(segments, "health", 1, 1000, 290, 100, opening=40) == [1, 101, 401, 701, 901]
    assert window_starts(segments, "events", 1, 1000, 250, 100, opening=30) == [1, 31, 281, 531, 781]


def test_a_step_window_never_starts_inside_another_ranks_segment() -> None:
    # rank 1's segments start 50 steps after rank 0's: a start of rank 0 is inside one of rank 1
    ranks = _spans(*[(0, a, a + 99) for a in range(1, 600, 100)], *[(1, a, a + 99) for a in range(51, 600, 100)],
                   (1, 1, 50))
    assert window_starts(ranks, "health", 1, 600, 200, 100) == [1, 201, 401]  # every start straddled
    # only 181 starts a segment of every rank: 121 and 301 lie inside one of the other rank's
    uneven = _spans((0, 1, 120), (0, 121, 180), (0, 181, 400), (1, 1, 180), (1, 181, 300), (1, 301, 400))
    assert window_starts(uneven, "health", 1, 400, 170, 60) == [1, 181, 351]
    assert window_starts(uneven, "health", 1, 400, 130, 60) == [1, 131, 261, 391]


def test_windows_that_end_where_the_segments_end_give_the_whole_trace_alarms(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = Config()
    trace = open_trace(SAMPLES / "gpt_dying_layer")  # 18 components, a segment every 100 steps
    try:
        components = trace.frame("components").collect()
        expected = classify(with_lr(health_frame(trace), trace), cfg)[1]
        fixed = classify_trace(trace, cfg, components, heat_width=1, chunk_steps=90)
        made: list[list[int]] = []
        monkeypatch.setattr(analysis, "CHUNK_ROWS", 90 * len(components))  # ~90 steps a window
        monkeypatch.setattr(analysis, "window_starts", lambda *a, **k: made.append(window_starts(*a, **k)) or made[-1])
        aligned = classify_trace(trace, cfg, components, heat_width=1)
    finally:
        trace.close()
    assert made == [[1, 101, 201, 291]]  # two windows end where a segment does, then 90 steps
    assert len(expected) > 0 and aligned.alarms().equals(expected)
    assert aligned.heat().equals(fixed.heat())


@pytest.mark.parametrize("module", ["warninglight.cli.main", "warninglight.forensics",
                                    "warninglight.tracer.schema"])
def test_the_cli_and_the_engine_never_import_torch(module: str) -> None:
    code = f"import sys, {module}; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize(("name", "window"), [("gpt_dying_layer", (140, 175)), ("gpt_weight_corruption", (140, 160))])
def test_an_incident_window_reports_the_whole_trace_alarms_raised_in_it(name: str, window: tuple[int, int]) -> None:
    from warninglight.forensics import analyze

    whole = analyze(SAMPLES / name)
    part = analyze(SAMPLES / name, steps=window)
    inside = whole.alarms.filter(pl.col("step").is_between(*window))
    assert len(inside) > 0
    # judged on the same history: the same alarms, onsets and root
    keys = ["observed_on", "attributed_to", "condition", "step", "onset_step", "metric", "magnitude"]
    assert part.alarms.select(keys).equals(inside.select(keys))
    assert part.root == whole.root


def test_a_window_outside_the_run_is_a_one_line_error() -> None:
    from typer.testing import CliRunner
    from warninglight.cli.main import app

    result = CliRunner().invoke(app, ["analyze", str(SAMPLES / "mlp_clean"), "--steps", "900:950"])
    assert result.exit_code == 2
    assert "holds none of the recorded steps 1-300" in result.output
    result = CliRunner().invoke(app, ["replay", str(SAMPLES / "mlp_clean"), "--steps", "9-10"])
    assert result.exit_code == 2 and "expected A:B" in result.output


def test_help_and_conditions_load_no_query_engine() -> None:
    code = ("import sys, warninglight.cli.main, warninglight.forensics.judging.conditions; "
            "print(sorted(m for m in ('duckdb', 'polars', 'torch') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("args", [["info"], ["query", "SELECT component, avg(out_rms) FROM health GROUP BY 1"]])
def test_info_and_query_read_a_trace_with_duckdb_alone(args: list[str]) -> None:
    # pyarrow (with numpy) and Polars cost ~0.4 s to import: the quick commands never load them
    trace = str(SAMPLES / "gpt_clean")
    code = ("import sys; from warninglight.cli.main import app; sys.argv = ['warninglight', *sys.argv[1:]]\n"
            "try:\n    app()\nexcept SystemExit:\n    pass\n"
            "print(sorted(m for m in ('numpy', 'polars', 'pyarrow', 'torch') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code, args[0], trace, *args[1:]], capture_output=True,
                         text=True, check=True)
    lines = out.stdout.strip().splitlines()
    assert lines[-1] == "[]" and len(lines) > 3  # the command printed its answer, then no heavy module


def _restarting_lr(steps: int = 400, period: int = 100) -> pl.DataFrame:
    """Two components under cosine decay with warm restarts to the first peak, then a real spike."""
    import math

    lrs = [1e-3 * (0.5 + 0.5 * math.cos(math.pi * ((s - 1) % period) / period)) + 1e-5 for s in range(1, steps + 1)]
    lrs[349] = 5e-3  # step 350: five times any lr set before
    rows = [{"rank": 0, "component": c, "step": s, "lr": lr, "role": "param"}
            for s, lr in enumerate(lrs, start=1) for c in ("a", "b")]
    return pl.DataFrame(rows)


def test_a_warm_restart_back_to_the_run_peak_is_no_surge_however_it_is_fed() -> None:
    frame = _restarting_lr()
    _, whole = classify(frame.lazy(), Config())
    surges = whole.filter(pl.col("metric") == "lr_surge")
    assert sorted(set(surges["step"].to_list())) == [350]  # the spike, not the restarts at 101, 201, 301
    for chunk in (1, 7, 100):
        clf = Classifier(Config())
        for first in range(1, 401, chunk):
            clf.feed(frame.filter(pl.col("step").is_between(first, first + chunk - 1)))
        assert clf.alarms().equals(whole), chunk


def test_windows_are_read_one_ahead_in_order_and_a_failed_read_fails_where_it_was() -> None:
    # nothing here waits on time: a read is handed to the reader thread only once the window
    # before it was taken, so the bounds below hold however fast either thread runs
    started: list[int] = []
    caller = threading.get_ident()
    readers: set[int] = set()

    def read(start: int) -> pl.DataFrame:
        started.append(start)
        readers.add(threading.get_ident())
        if start == 30:
            raise ValueError("segment 30 unreadable")
        return pl.DataFrame({"start": [start]})

    got = []
    with pytest.raises(ValueError, match="segment 30"):
        for rows in _read_ahead(read, [0, 10, 20, 30, 40]):
            got.append(rows["start"].item())
            assert len(started) <= len(got) + 1  # never more than one window ahead
    assert got == [0, 10, 20]  # every window before the bad one, in order; the failure where it was
    assert started == [0, 10, 20, 30]  # nothing read past it
    assert caller not in readers  # the reads ran on the reader thread, not the caller's
    assert list(_read_ahead(read, [])) == []
