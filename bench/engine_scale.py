"""The engine at the size of a real run: analyze, replay and report on grown GPT traces.

Grows the shipped GPT sample traces (bench/grow.py: components copied under new names, steps
extended by walking the second half of the run back and forth; never a random number) to each
size, one clean and one carrying the recorded weight corruption, and prints per size the wall
time and peak RSS of `warninglight analyze`, `replay`, `report` and `eval --trace` (scoring the
trace against the answer key grow.py leaves in it; each command in its own process, so each peak
is its own) next to a DuckDB scan of the same health files (the median of one before each command
and one after them all: a single scan on a shared machine moves with the others' load), each
command's time as a multiple of it, and the bytes a 1% step window (`--steps`) reads. The faulty
trace must be named at the right component and step. One `report` on a small grown trace runs
first, untimed in the table (its time is printed): the kernels are compiled, or loaded from
numba's cache, before any command is timed.

Run: `python bench/engine_scale.py [--sizes 1e6 1e7] [--copies 56] [--keep]`. Traces are written
under /tmp and deleted afterwards (`--keep` keeps them; a large trace needs room there).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import grow  # noqa: E402

CLI = [str(Path(sys.executable).parent / "warninglight")]  # the installed command, as a user runs it
SCAN = """
import sys, time, duckdb
from pathlib import Path
from warninglight.tracer import schema
cols = ", ".join(f"avg({m})" for m in schema.HEALTH_METRICS)
files = [str(p) for p in Path(sys.argv[1], "health").rglob("*.parquet")]
start, cpu = time.perf_counter(), time.process_time()
con = duckdb.connect()
con.execute("SET enable_progress_bar = false")
con.sql(f"SELECT count(*), {cols} FROM read_parquet({files})").fetchall()
print(time.perf_counter() - start, time.process_time() - cpu)
"""


CPU_SECONDS: dict[tuple[str, ...], float] = {}  # command -> user + system CPU seconds it used


def run_alone(cmd: list[str]) -> tuple[float, float, str]:
    """(wall seconds, peak RSS in GiB, stdout) of one command in its own process; a fresh Python
    starts it, so RUSAGE_CHILDREN is that command's alone. Its CPU seconds go to CPU_SECONDS:
    on a shared machine they move less with the others' load than the wall time does."""
    probe = ("import json, resource, subprocess, sys, time; t = time.perf_counter(); "
             "p = subprocess.run(sys.argv[1:], capture_output=True, text=True); "
             "u = resource.getrusage(resource.RUSAGE_CHILDREN); "
             "print(json.dumps([time.perf_counter() - t, u.ru_maxrss, u.ru_utime + u.ru_stime, "
             "p.returncode, p.stdout, p.stderr[-400:]]))")
    out = subprocess.run([sys.executable, "-c", probe, *cmd], capture_output=True, text=True, check=True)
    wall, peak_kb, cpu, code, stdout, stderr = json.loads(out.stdout)
    if code not in (0, 1):
        raise RuntimeError(f"{' '.join(cmd)} failed ({code}): {stderr}")
    CPU_SECONDS[tuple(cmd)] = cpu
    return wall, peak_kb / 2**20, stdout


def _scan(trace: Path, row: dict[str, object], scans: list[tuple[float, float]]) -> None:
    """One DuckDB scan more of `trace` into `row`: taken before each command and once after them
    all, the ratios read their median (one scan on a shared machine moves from run to run with
    the others' load)."""
    _, row["scan_gib"], out = run_alone([sys.executable, "-c", SCAN, str(trace)])
    wall, cpu = (float(x) for x in out.split())  # the query alone
    scans.append((wall, cpu))
    row["scan_s"] = statistics.median(w for w, _ in scans)
    row["scan_cpu_s"] = statistics.median(c for _, c in scans)
    row["scans_s"] = [round(w, 2) for w, _ in scans]


def window_bytes(trace: Path, steps: int) -> tuple[str, int, int]:
    """A 1% window ending at the fault's step range, the bytes of the files it reads, of all files."""
    from warninglight.forensics.judging.conditions import Config
    from warninglight.forensics.trace.store import open_trace, window_files

    first = steps - (grow.RECORDED - grow.FAULT_SOURCE) - steps // 200
    last = first + steps // 100 - 1
    history = Config().baseline.history(Config().conditions)
    t = open_trace(trace)
    try:
        read = window_files(t, "health", first - history, last)
        every = window_files(t, "health", 1, steps)
    finally:
        t.close()
    return f"{first}:{last}", sum(p.stat().st_size for p in read), sum(p.stat().st_size for p in every)


def bench_size(target: float, copies: int, workdir: Path, keep: bool,
               commands: tuple[str, ...] = ("analyze", "replay", "report", "eval"),
               kinds: tuple[str, ...] = ("clean", "fault")) -> list[dict[str, object]]:
    steps = grow.steps_for(target, 18 * copies)
    rows = []
    for faulty in [k == "fault" for k in ("clean", "fault") if k in kinds]:
        trace = workdir / f"grown-{steps}-{'fault' if faulty else 'clean'}"
        shutil.rmtree(trace, ignore_errors=True)
        t0 = time.perf_counter()
        truth = grow.grow(trace, steps, copies, faulty, checkpoint_every=max(100, steps // 10 // 100 * 100))
        row: dict[str, object] = {"trace": trace.name, "component_steps": truth["health_rows"],
                                  "bytes": truth["bytes"], "grow_s": time.perf_counter() - t0}
        scans: list[tuple[float, float]] = []
        scan = functools.partial(_scan, trace, row, scans)
        scan()
        if "analyze" in commands:
            row["analyze_s"], row["analyze_gib"], out = run_alone([*CLI, "analyze", "--json", str(trace)])
            row["analyze_cpu_s"] = CPU_SECONDS[(*CLI, "analyze", "--json", str(trace))]
            result = json.loads(out)
            root = result["root"] or {}
            if faulty:
                row["named"] = (root.get("attributed_to") == truth["component"]
                                and root.get("onset_step") == truth["step"])
                row["found"] = (f"{root.get('attributed_to')} onset {root.get('onset_step')} "
                                f"(truth {truth['component']} {truth['step']})")
            else:
                row["named"] = result["verdict"] == "healthy"
                row["found"] = result["verdict"]
        if "replay" in commands:
            scan()
            row["replay_s"], row["replay_gib"], _ = run_alone([*CLI, "replay", "--json", str(trace)])
        if "eval" in commands:
            scan()
            scores = trace.parent / f"{trace.name}.scores.json"
            row["eval_s"], row["eval_gib"], _ = run_alone([*CLI, "eval", "--trace", str(trace), "--json", str(scores)])
            scored = json.loads(scores.read_text())[0]
            row["eval_right"] = (scored["root_correct"] and scored["onset_error"] == 0) if faulty else not scored["fault_verdict"]
            scores.unlink()
        if "report" in commands:
            scan()
            report = trace.parent / f"{trace.name}.html"
            row["report_s"], row["report_gib"], _ = run_alone([*CLI, "report", str(trace), "-o", str(report)])
            report.unlink(missing_ok=True)
        if len(scans) > 1:
            scan()  # one after the last command too
        if faulty:
            window, read, total = window_bytes(trace, steps)
            row["window"], row["window_bytes"], row["health_bytes"] = window, read, total
            row["window_s"], row["window_gib"], out = run_alone([*CLI, "analyze", "--json", "--steps", window, str(trace)])
            wroot = json.loads(out)["root"] or {}
            row["window_named"] = wroot.get("attributed_to") == truth["component"] and wroot.get("onset_step") == truth["step"]
        rows.append(row)
        print(json.dumps(row), flush=True)
        if not keep:
            shutil.rmtree(trace, ignore_errors=True)
    return rows


def _cell(r: dict[str, object], key: str) -> str:
    if f"{key}_s" not in r:
        return "not run | — | "
    return f"{r[f'{key}_s']:.1f} s ({r[f'{key}_s'] / r['scan_s']:.1f}x) | {r[f'{key}_gib']:.2f} GiB | "  # type: ignore[operator]


def table(rows: list[dict[str, object]]) -> str:
    head = ("| trace | component-steps | on disk | DuckDB scan, median (CPU) | analyze (x scan) | peak RSS | "
            "replay (x scan) | peak RSS | report (x scan) | peak RSS | eval --trace (x scan) | peak RSS | "
            "analyze / scan, CPU | verdict |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        ratio = (f"{r['analyze_cpu_s'] / r['scan_cpu_s']:.1f}x"  # type: ignore[operator]
                 if "analyze_s" in r else "—")
        found = f"{r['found']}{'' if r['named'] else ' (WRONG)'}" if "found" in r else "—"
        if "eval_right" in r and not r["eval_right"]:
            found += " (eval scored it WRONG)"
        lines.append(
            f"| {r['trace']} | {r['component_steps']:.2e} | {r['bytes'] / 2**20:.0f} MiB | "
            f"{r['scan_s']:.2f} s of {len(r['scans_s'])} ({r['scan_cpu_s']:.1f} s) | "  # type: ignore[arg-type]
            f"{_cell(r, 'analyze')}{_cell(r, 'replay')}{_cell(r, 'report')}{_cell(r, 'eval')}{ratio} | {found} |")
    return "\n".join(lines)


def cli_times(trace: Path, repeats: int = 9) -> dict[str, tuple[float, float]]:
    """(median wall seconds, best CPU seconds) of the quick commands on a small trace, each a fresh
    process as typed. The installed command is timed: from an editable install under
    PYTHONDONTWRITEBYTECODE, Python compiles the CLI's own modules at every start;
    `pip install .` compiles them once."""
    import statistics

    commands = {"--help": ["--help"], "conditions": ["conditions"], "info": ["info", str(trace)],
                "query": ["query", str(trace), "SELECT count(*) FROM health"]}
    times: dict[str, tuple[list[float], list[float]]] = {name: ([], []) for name in commands}
    for _ in range(repeats):  # interleaved: a slow minute of the machine slows every command alike
        for name, args in commands.items():
            wall, _, _ = run_alone([*CLI, *args])
            times[name][0].append(wall)
            times[name][1].append(CPU_SECONDS[(*CLI, *args)])
    return {name: (statistics.median(w), min(c)) for name, (w, c) in times.items()}


def warm_up(workdir: Path, copies: int) -> float:
    """Wall seconds of one `report` on a small grown trace (two step windows), run before anything
    is timed: the compiled kernels are then in numba's cache. After an edit of a kernel's module
    its first run compiles it again (the heatmap's pass once for each of its column types), which
    would land on whichever command the bench timed first."""
    trace = workdir / "warm-up"
    shutil.rmtree(trace, ignore_errors=True)
    grow.grow(trace, grow.steps_for(2e6, 18 * copies), copies, True)
    before = os.environ.get("WARNINGLIGHT_KERNELS")
    os.environ["WARNINGLIGHT_KERNELS"] = "compiled"  # every kernel compiled, whatever a call's size
    try:
        wall, _, _ = run_alone([*CLI, "report", str(trace), "--out", str(workdir / "warm-up.html"), "--force"])
    finally:
        shutil.rmtree(trace, ignore_errors=True)
        if before is None:
            del os.environ["WARNINGLIGHT_KERNELS"]
        else:
            os.environ["WARNINGLIGHT_KERNELS"] = before
    return wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", type=float, default=[1e6, 1e7])
    parser.add_argument("--copies", type=int, default=56, help="copies of the 18 GPT components (56: 1008)")
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--keep", action="store_true", help="keep the grown traces")
    parser.add_argument("--cli-only", action="store_true", help="time the quick CLI commands only")
    parser.add_argument("--commands", nargs="*", default=["analyze", "replay", "report", "eval"],
                        help="whole-trace commands to time (none: only the scan and the 1%% window)")
    parser.add_argument("--traces", nargs="+", choices=["clean", "fault"], default=["clean", "fault"],
                        help="which grown traces to time (the faulty one also times the 1%% window)")
    args = parser.parse_args()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="wl-scale-"))
    load = os.getloadavg()[0]
    print(f"machine: {os.cpu_count()} cores, load average {load:.1f} at start"
          + (" (shared and loaded: figures are slower than on an idle machine)" if load > 1.5 else ""))
    quick = cli_times(grow.SAMPLES / "gpt_weight_corruption")
    print("CLI on a sample trace, a fresh process each, 9 runs: wall seconds median (CPU seconds best) "
          + ", ".join(f"{k} {wall:.2f} s ({cpu:.2f} s)" for k, (wall, cpu) in quick.items()), flush=True)
    if args.cli_only:
        return
    rows = []
    try:
        if args.commands:
            print(f"warm-up: `report` on a grown 2e6 trace in {warm_up(workdir, args.copies):.1f} s (the kernels "
                  "loaded from numba's cache, or compiled where a module changed since it was written)", flush=True)
        for size in args.sizes:
            rows += bench_size(size, args.copies, workdir, args.keep, tuple(args.commands), tuple(args.traces))
    finally:
        if not args.keep and args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    print(table(rows))
    for r in rows:
        if "window" in r:
            print(f"{r['trace']}: --steps {r['window']} (1% of the steps) reads {r['window_bytes'] / 2**20:.1f} MiB "
                  f"of {r['health_bytes'] / 2**20:.1f} MiB of health files "
                  f"({100 * r['window_bytes'] / r['health_bytes']:.1f}%), {r['window_s']:.1f} s, "
                  f"{r['window_gib']:.2f} GiB, root {'right' if r['window_named'] else 'WRONG'}")


if __name__ == "__main__":
    main()
