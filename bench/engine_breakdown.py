"""Where `analyze`'s time goes on a large trace: seconds in each part, and the parts' unit costs.

Runs one whole-trace analysis in this process as `warninglight analyze` runs it (no heatmap),
with timers around the engine's parts (nested parts are counted in their callers too; after the
classifier, the tail: localisation, the comparators, the step series and lr schedule they read),
then, on one step window of the same run (the third the classifier judged), the baseline
kernel's nanoseconds per row for each metric at every row (one thread: the window's order
statistics, then median, scale and z) and their sum; the heatmap's pass over all metrics at the
width `report` gives the trace (`heatbins.fold`; each row's own z at one step a cell); the
screen's (`screen.wanted`: which rows a rule can fire at) and the share of rows it leaves; the
window's sort by names against `sort_series` and `series_order`, and its other columns gathered
in that order from the two chunks it comes in against made one chunk first; last, opening the
trace (best of 5), and the classifier's window reads again alone against a DuckDB scan of the
same files. Four kinds of thread run at once: the reader (`health_window`, `join_lr`: the
next window), the main thread (`submit`: a window's sort and carry), the judging thread
(`judge`: the window before) and the baseline's workers (the metric columns, the screen, the
kernel and the compiled rules, `rules.hits`), whose seconds are summed over them: the parts add
up to more than the wall time. The trace is a GPT sample trace grown to `--size` component-steps
(bench/grow.py, the faulty one) unless `--trace` names one. Run: `python bench/engine_breakdown.py
[--size 1e7 | --trace DIR] [--heat]` (with the heatmap, as `report` runs it: also the cells'
scores, what its picture holds, the root's band read beside the analysis' tail, and the report's
page written from the analysis: its figures)."""

from __future__ import annotations

import argparse
import collections
import functools
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl

sys.path.insert(0, str(Path(__file__).resolve().parent))
import engine_scale  # noqa: E402
import grow  # noqa: E402
from warninglight.forensics.comparators import static_rules  # noqa: E402
from warninglight.forensics.explaining import analysis  # noqa: E402
from warninglight.forensics.judging import baseline, judge  # noqa: E402
from warninglight.forensics.judging import classifier as stream  # noqa: E402
from warninglight.forensics.judging.conditions import Config  # noqa: E402
from warninglight.forensics.judging.kernels import heatbins, quantiles, screen  # noqa: E402
from warninglight.forensics.judging.kernels import rules as ruletable  # noqa: E402
from warninglight.forensics.presenting import plots, report  # noqa: E402
from warninglight.forensics.trace.store import health_window, open_trace, window_spans  # noqa: E402
from warninglight.tracer import schema  # noqa: E402

PARTS = ((stream.Classifier, "submit", 0), (stream, "series_order", 1), (stream.Classifier, "_carry", 1),
         (stream, "judge", 0), (judge, "prepare", 1), (judge, "column_of", 1), (screen, "wanted", 1),
         (quantiles, "baseline_at", 1), (quantiles, "baseline", 1), (ruletable, "hits", 1),
         (quantiles, "fold_baseline", 1), (heatbins, "fold", 1), (judge, "_heat", 1), (stream.Classifier, "heat", 0),
         (analysis, "health_window", 0), (analysis, "join_lr", 0), (static_rules.StaticScan, "feed", 0),
         (analysis, "component_lr", 0), (analysis, "locate_alarms", 0), (analysis, "comparators", 0),
         (analysis, "_step_series", 0), (plots, "png_bytes", 0), (analysis, "_baseline_frame", 0))
# run on the baseline's workers: their seconds are summed over them
THREADS = {"column_of", "wanted", "baseline_at", "baseline", "hits", "fold_baseline", "fold"}
READER = {"health_window", "join_lr"}  # run on the reader thread, beside the classifier
JUDGE = {"judge"}  # runs on a thread of its own, beside `submit` sorting the next window
BAND = {"_baseline_frame"}  # `report` reads the root's band on a thread of its own, beside the analysis' tail
WINDOW = 3  # the window whose unit costs are timed (the first ones are shorter: no history yet)


def _label(owner: Any, name: str) -> str:
    return f"{owner.__name__.rsplit('.', 1)[-1]}.{name}"


def _timed(totals: dict[str, float], cpu: dict[str, float], name: str, f: Callable[..., Any]) -> Callable[..., Any]:
    """`f`, adding each call's wall seconds to `totals[name]` and its thread's CPU seconds to
    `cpu[name]` (which do not grow while the thread waits for a core)."""
    @functools.wraps(f)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            return f(*args, **kwargs)
        finally:
            totals[name] += time.perf_counter() - t0
            cpu[name] += time.thread_time() - c0
    return wrapper


def _kept(calls: list[tuple[Any, ...]], f: Callable[..., Any]) -> Callable[..., Any]:
    """`f`, keeping the arguments of its first `WINDOW` calls (every window's would hold the
    whole trace in memory, and slow the run timed)."""
    @functools.wraps(f)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if len(calls) < WINDOW:
            calls.append(args)
        return f(*args, **kwargs)
    return wrapper


def _counted(count: collections.Counter[str], name: str, f: Callable[..., Any]) -> Callable[..., Any]:
    """`f`, counting its calls in `count[name]`."""
    @functools.wraps(f)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        count[name] += 1
        return f(*args, **kwargs)
    return wrapper


def _windows_read(windows: list[tuple[int, int]], f: Callable[..., Any]) -> Callable[..., Any]:
    """`f` (`health_window`), keeping the steps of each classifier window it reads (localisation's
    reads, by component, are left out)."""
    @functools.wraps(f)
    def wrapper(trace: Any, first: int, last: int, **kwargs: Any) -> Any:
        if kwargs.get("categorical") and kwargs.get("names") is None:
            windows.append((first, last))
        return f(trace, first, last, **kwargs)
    return wrapper


def _reads_alone(trace: Path, windows: list[tuple[int, int]]) -> str:
    """The classifier's reads of the run's windows again, one after another and nothing else
    beside them (wall and CPU seconds, and how often a segment file is read), against one DuckDB
    scan of the same files (`engine_scale.SCAN`, in its own process)."""
    import subprocess

    opened = open_trace(trace)
    try:
        metrics = [c for c in opened.columns("health") if c in schema.HEALTH_METRICS]
        reads = [s.path for a, b in windows for s in window_spans(opened, "health", a, b)]
        t0, c0 = time.perf_counter(), time.process_time()
        for a, b in windows:
            health_window(opened, a, b, columns=metrics, categorical=True)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    finally:
        opened.close()
    out = subprocess.run([sys.executable, "-c", engine_scale.SCAN, str(trace)], capture_output=True, text=True,
                         check=True).stdout
    scan_wall, scan_cpu = (float(x) for x in out.split())
    return (f"the {len(windows)} windows' reads alone: {wall:.1f} s, {cpu:.1f} CPU-s, {len(reads)} segment reads "
            f"of {len(set(reads))} files; one DuckDB scan of the same files: {scan_wall:.1f} s, {scan_cpu:.1f} CPU-s")


def _best_s(f: Callable[[], Any], repeat: int = 3) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        f()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", type=float, default=1e7, help="component-steps of the grown trace")
    ap.add_argument("--trace", type=Path, default=None, help="a trace to analyse instead of growing one")
    ap.add_argument("--heat", action="store_true", help="with the heatmap, as `warninglight report` analyses")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        trace = args.trace
        if trace is None:
            trace = Path(tmp) / "grown"
            grow.grow(trace, grow.steps_for(args.size, 18 * 56), 56, True)
        totals: dict[str, float] = collections.defaultdict(float)
        cpus: dict[str, float] = collections.defaultdict(float)
        for owner, name, _ in PARTS:
            setattr(owner, name, _timed(totals, cpus, _label(owner, name), getattr(owner, name)))
        sorts: list[tuple[Any, ...]] = []
        calls: collections.Counter[str] = collections.Counter()
        stream.series_order = _kept(sorts, stream.series_order)
        judge.prepare = _counted(calls, "prepare", judge.prepare)
        windows: list[tuple[int, int]] = []
        analysis.health_window = _windows_read(windows, analysis.health_window)
        t0, c0 = time.perf_counter(), time.process_time()
        # `analyze` runs it without the heatmap, `report` with it and the root's band
        result = analysis.analyze(trace, heat=args.heat, band=args.heat)
        total, cpu = time.perf_counter() - t0, time.process_time() - c0
        page = None
        if args.heat:  # the report's page from the same analysis, as `report` writes it
            t0 = time.perf_counter()
            report.write_html(trace, Path(tmp) / "report.html", result)
            page = time.perf_counter() - t0
        opened = _best_s(lambda: open_trace(trace).close(), repeat=5)
        reads = _reads_alone(trace, windows)
    print(f"analyze {trace.name}{' with the heatmap' if args.heat else ''}: {total:.1f} s in all "
          f"({cpu:.1f} CPU-s), {calls['prepare']} step windows; "
          f"root {result.root.attributed_to if result.root else None}")
    if args.heat:  # what the picture holds: the cells' scores
        score = result.heat["score"].drop_nulls().to_numpy()
        print(f"heatmap: {result.heat_width} steps a cell, {len(score):,} cells with a score; median "
              f"{np.median(score):.2f}, 99th percentile {np.quantile(score, 0.99):.2f}; at 3, 4, 6 or more: "
              + ", ".join(f"{(score >= t).mean():.1%}" for t in (3, 4, 6)))
        print(f"report's page from the analysis: {page:.2f} s (the figures: below)")
    for owner, name, indent in PARTS:
        key = _label(owner, name)
        threads = "  (summed over the threads running it)" if name in THREADS else (
            "  (on the reader thread, beside the classifier)" if name in READER else
            "  (on the judging thread, beside submit)" if name in JUDGE else
            "  (on a thread of its own, beside the analysis' tail)" if name in BAND else "")
        print(f"{'    ' * indent}{key:<28s} {totals[key]:7.2f} s {cpus[key]:7.2f} CPU-s{threads}")
    window, names = sorts[min(WINDOW, len(sorts)) - 1]  # with the trace's names, as the classifier sorts it
    frame, starts, _, lr = baseline.prepare(baseline.sort_series(window, names))  # with its metrics
    cfg, metrics = Config().baseline, baseline.metrics_in(frame)
    print(f"window {len(sorts)}: {frame.height:,} rows; sort by names "
          f"{_best_s(lambda: window.sort([*baseline.KEYS, 'step'])) * 1e3:.0f} ms, sort_series "
          f"{_best_s(lambda: baseline.sort_series(window, names)) * 1e3:.0f} ms, series_order (no row moved) "
          f"{_best_s(lambda: baseline.series_order(window, names)) * 1e3:.0f} ms")
    source, order = baseline.series_order(window, names)
    if order is not None:  # the other columns in series order (`Classifier.submit`)
        rest = source.drop([m for m in schema.HEALTH_METRICS if m in source.columns])
        print(f"    other columns gathered in series order: from the window's {rest.n_chunks()} chunks "
              f"{_best_s(lambda: rest[order]) * 1e3:.0f} ms, made one chunk first "
              f"{_best_s(lambda: rest.rechunk()[order]) * 1e3:.0f} ms")
    lr_values = frame["lr"].cast(pl.Float64).to_numpy() if lr else None
    rows = np.arange(frame.height)
    total = 0.0
    for m in metrics:
        col = baseline.column_of(frame, m, lr)
        s = _best_s(lambda col=col: quantiles.baseline(col, lr_values, starts, rows, cfg.window, cfg.lag,
                                                       cfg.min_samples, baseline.SCALES))
        total += s
        print(f"    baseline kernel {m:<22s} {s / frame.height * 1e9:6.1f} ns/row")
    print(f"    baseline kernel, all {len(metrics)} metrics  {total / frame.height * 1e9:6.1f} ns/row")
    # the heatmap's pass (`report`), at the trace's own width: every row's |z| folded into its
    # cell at one step a cell, each bin against its first row's baseline at more (`heatbins`)
    width, total = result.heat_width, 0.0  # what the analysis gives the report, heatmap drawn or not
    series = len(starts) - 1
    if width == 1:
        slot = quantiles.slots(frame.height, rows)
    else:
        where = heatbins.bins(frame["step"].cast(pl.Int64).to_numpy(), np.ones(frame.height, dtype=np.bool_), starts,
                              width)
    for m in metrics:
        col = baseline.column_of(frame, m, lr)
        if width == 1:
            cells = np.full(frame.height, np.nan)
            s = _best_s(lambda col=col, cells=cells: quantiles.fold_baseline(
                col, lr_values, starts, slot, cfg.window, cfg.lag, cfg.min_samples, baseline.SCALES, cells))
        else:
            cells = np.full(int(where.cell_start[-1]), np.nan)
            s = _best_s(lambda col=col, cells=cells: heatbins.fold(
                col, lr_values, starts, where, np.full(series, heatbins.NONE), np.full((series, 3), np.nan),
                cfg.window, cfg.lag, cfg.min_samples, baseline.SCALES, cells))
        total += s
    print(f"    heatmap fold, all {len(metrics)} metrics  {total / frame.height * 1e9:6.1f} ns/row "
          f"({width} step{'s' if width > 1 else ''} a cell)")
    config = Config()  # the screen (`screen.wanted`), every row given every role its rules read
    total = 0.0
    for m in metrics:
        rules = [(c, r) for c in config.conditions for r in c.rules if r.metric == m]
        role_sets = sorted({r.roles for _, r in rules if r.roles})
        table, roles = ruletable.table(rules, role_sets), np.ones((max(1, len(role_sets)), frame.height), dtype=np.bool_)
        col = baseline.column_of(frame, m, lr)
        if not (table[:, ruletable.DIR] != ruletable.DIRECTIONS["nonfinite"]).any():
            continue  # non-finite rules only: no baseline, no screen
        s = _best_s(lambda col=col, table=table, roles=roles: screen.wanted(
            col, lr_values, starts, rows, cfg.window, cfg.lag, cfg.min_samples, baseline.SCALES, table, roles))
        want, _ = screen.wanted(col, lr_values, starts, rows, cfg.window, cfg.lag, cfg.min_samples, baseline.SCALES,
                                table, roles)
        total += s
        left = "every row (over SPARSE)" if want is None else f"{want.mean() * 100:5.2f}% of rows left"
        print(f"    screen {m:<22s} {s / frame.height * 1e9:6.1f} ns/row, {left}")
    print(f"    screen, all metrics with a threshold rule  {total / frame.height * 1e9:6.1f} ns/row")
    print(f"open_trace: {opened * 1e3:.1f} ms (best of 5)")
    print(reads)


if __name__ == "__main__":
    main()
