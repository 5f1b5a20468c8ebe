"""Step-time ratio with/without the recorder (every step, every component), measured side by side.

Two copies of the model (same initial weights, same batches) train in one process, one of them
watched from start to end like a real run; blocks of steps of the two alternate (order swapped
every other pair), so drift in machine load hits both. The watched run flushes at the recorder's
default interval (100 steps; `--flush-every` to change it) and a block is a whole number of flush
intervals (`--steps`, 100 by default), so every watched block pays for its share of flushes, and
the writer thread's work is charged to it too (each watched block ends by waiting for the writer
to be idle); the first, early segment is written before the timed blocks. The figure is the median
over block pairs of time(with) / time(without), with its spread, and the ratio of the summed
times. Wall-clock is the figure that matters; the process-CPU ratio is printed too because on
a shared machine it is less disturbed by others' load. Every metric of every component is
recorded at every step (forward statistics are computed for 8 steps at once, but each step
keeps its own values). Run: `python bench/overhead.py [--steps N] [--pairs N] [--threads T]`;
`--interleave N` alternates single steps instead of blocks (see `measure_interleaved`);
`--whole-runs N` alternates whole runs of N steps, set-up and close included, in this process or,
with `--fresh-process`, each a new process timed from its start to its exit, as a user times a run
(see `measure_whole_runs`); `--evaluations N` alternates evaluation forwards (eval() mode,
no_grad) of the nanoGPT layout's cases. The models are bench/cases.py's; `--nanogpt` adds one in nanoGPT's
layout and loop (bench/nanogpt.py) to the interleaved and whole-run measurements; `--case NAME`
(repeatable) measures the named cases instead, e.g. `nanogpt-compiled` (its forward compiled).

`--split-from N` moves the size from which the norm passes run in parts on torch's threads
(`kernels.SPLIT_FROM`; a huge N turns that off), in this process only.

`--without PART[,PART...]` leaves parts of the recorder's work out of the watched copy, so that
the same bench prints what each part costs in the step (in this process only: not with
`--fresh-process`): `preclip`, `grads` and `weights` replace that pass over the tensors with a
constant written into the step's row; `forward` drops the forward statistics (the hooks still
fire); `reduce` drops the reductions of the queued steps every 8 steps, parameters' and
forward statistics' (the passes and the hooks' copies still run); `all` is the three passes and
`forward`; `work` leaves only the hooks themselves (every
entry point returns at once: what registering them costs).
"""

from __future__ import annotations

import argparse
import functools
import glob
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable

import torch
from cases import CASES, Training, adamw_loop, mlp_case
from nanogpt import nanogpt_case
from warninglight.tracer import Recorder, kernels, params, probes, watch


def run_block(step: Callable[[], torch.Tensor], steps: int, rec: Recorder | None) -> tuple[float, float]:
    """Wall seconds and process CPU seconds per step over `steps` training steps (with `rec`:
    until its writer thread is idle again, so the writing it was given counts too)."""
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(steps):
        loss = step()
        if rec is not None:
            rec.log(loss=loss)
    if rec is not None:
        rec.writer.ready()
    return (time.perf_counter() - t0) / steps, (time.process_time() - c0) / steps




def _others_running() -> int:
    """Runnable threads on the machine that are not this process's (Linux; 0 elsewhere)."""
    try:
        with open("/proc/loadavg") as f:
            running = int(f.read().split()[3].split("/")[0])
        mine = 0
        for stat in glob.glob(f"/proc/{os.getpid()}/task/*/stat"):
            with open(stat) as f:
                mine += f.read().rsplit(")", 1)[1].split()[0] == "R"
        return max(0, running - mine)
    except (OSError, ValueError, IndexError):
        return 0


class Contention:
    """Samples, every 50 ms in a thread, whether other processes want the CPUs."""

    def __init__(self) -> None:
        self.samples = self.busy = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            self.samples += 1
            self.busy += _others_running() > 0

    def fraction(self) -> float:
        """Share of samples so far with another process runnable; resets the count."""
        f = self.busy / max(1, self.samples)
        self.samples = self.busy = 0
        return f

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def wait_for_quiet(max_wait_s: float) -> bool:
    """Wait until no other process has been runnable for 2 s (at most `max_wait_s`)."""
    deadline, quiet_since = time.monotonic() + max_wait_s, None
    while time.monotonic() < deadline:
        now = time.monotonic()
        if _others_running():
            quiet_since = None
        elif quiet_since is None:
            quiet_since = now
        elif now - quiet_since >= 2.0:
            return True
        time.sleep(0.1)
    return False


def _twins(make: Callable[[], Training]) -> list[Training]:
    """Two copies of a case (same initial weights, same batches), each with its own optimizer:
    [the plain copy, the copy to watch]."""
    out = []
    for _ in range(2):
        torch.manual_seed(0)
        out.append(make())
    return out


def measure(name: str, make: Callable[[], Training], pairs: int, steps: int, wait_s: float = 0.0,
            flush_every: int | None = None) -> None:
    """Alternate blocks of a plain and a watched copy; print the median ratio and its spread.

    `wait_s` > 0: before each pair, wait up to that long for other processes to leave the CPUs;
    the ratio is also printed over the pairs during which none of them ran ("clean" pairs)."""
    (_, _, plain_step), (model, opt, step) = _twins(make)
    wall, cpu, base, watched, busy = [], [], [], [], []
    contention = Contention()
    with tempfile.TemporaryDirectory() as tmp:
        run_block(plain_step, 3, None)  # warm-up: allocator, thread pools
        rec = watch(model, opt, f"{tmp}/run",
                    **({} if flush_every is None else {"flush_every_steps": flush_every}))
        run_block(step, 11, rec)  # settles components, writes the early first segment
        for i in range(pairs):
            if wait_s > 0:
                wait_for_quiet(wait_s)
            contention.fraction()
            if i % 2:  # alternate the order inside a pair: load drift does not favour one side
                recorded = run_block(step, steps, rec)
                plain = run_block(plain_step, steps, None)
            else:
                plain = run_block(plain_step, steps, None)
                recorded = run_block(step, steps, rec)
            wall.append(recorded[0] / plain[0])
            watched.append(recorded[0])
            cpu.append(recorded[1] / plain[1])
            base.append(plain[0])
            busy.append(contention.fraction())
        rec.close()
        lost = rec.dropped_steps
    contention.stop()
    print(f"{name}: {statistics.median(base) * 1e3:.2f} ms/step without the recorder "
          f"({pairs} block pairs of {steps} steps, a flush every {rec.flush_every_steps} steps"
          f"{f'; {lost} steps DROPPED' if lost else ''})")
    for label, ratios in (("wall-clock", wall), ("process CPU", cpu)):
        _print_ratios(f"{label} ratio with/without", ratios)
    print(f"  wall-clock ratio of the summed times (every block's flushes and noise counted): "
          f"{sum(watched) / sum(base):.3f}")
    clean = [i for i, b in enumerate(busy) if b == 0]
    print(f"  other processes runnable during {statistics.mean(busy):.0%} of the time; "
          f"{len(clean)} of {pairs} pairs ran with none")
    if clean and len(clean) < pairs:
        _print_ratios("wall-clock ratio, clean pairs only", [wall[i] for i in clean])
    print(f"  load average after: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")


def measure_interleaved(name: str, make: Callable[[], Training], steps: int, chunks: int = 10) -> None:
    """Alternate single steps of a plain and a watched copy (`steps` each, order swapped every
    step); print the ratio of the summed step times, and its spread over `chunks` runs of steps.

    A block of steps on a shared machine varies from the next: noise that lasts longer than a
    step hits one side of a block pair. Single steps, alternated, share it. Every
    watched step is timed until the writer thread is idle again, so a flush's writing is charged
    to the watched side in full (more than a real run pays: there it overlaps the next steps);
    flushes at the recorder's default interval (100 steps)."""
    (_, _, plain_step), (model, opt, step) = _twins(make)
    plain_t, watched_t = [], []
    with tempfile.TemporaryDirectory() as tmp:
        run_block(plain_step, 3, None)
        rec = watch(model, opt, f"{tmp}/run")
        run_block(step, 11, rec)  # settles components, writes the early first segment
        for i in range(steps):
            for watched in ((False, True) if i % 2 else (True, False)):
                if watched:
                    watched_t.append(run_block(step, 1, rec)[0])  # waits for the writer
                else:
                    plain_t.append(run_block(plain_step, 1, None)[0])
        rec.close()
        lost = rec.dropped_steps
    chunks = max(1, min(chunks, steps))  # a short run: fewer, shorter runs of steps
    n = steps // chunks
    per_chunk = [sum(watched_t[k * n:(k + 1) * n]) / sum(plain_t[k * n:(k + 1) * n]) for k in range(chunks)]
    print(f"{name}: {statistics.median(plain_t) * 1e3:.2f} ms/step without the recorder, median "
          f"({steps} steps each way, alternated step by step{f'; {lost} steps DROPPED' if lost else ''})")
    print(f"  wall-clock ratio of the summed step times: {sum(watched_t) / sum(plain_t):.3f}; of the "
          f"median steps: {statistics.median(watched_t) / statistics.median(plain_t):.3f}")
    _print_ratios(f"ratio of the summed times per run of {n} steps", per_chunk)
    print(f"  load average after: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")


def measure_evaluations(name: str, make: Callable[[], Training], passes: int) -> None:
    """Alternate single evaluation forwards (eval() mode, no_grad: the case's `evaluate`, one
    batch of each split) of a plain and a watched copy, after a few training steps each; print
    the ratio of the summed times."""
    (_, _, plain_step), (model, opt, step) = _twins(make)
    if not hasattr(step, "evaluate"):
        raise SystemExit(f"--evaluations: the case {name!r} has no evaluation (the nanoGPT layout has)")
    times: dict[bool, list[float]] = {False: [], True: []}
    with tempfile.TemporaryDirectory() as tmp:
        run_block(plain_step, 3, None)
        rec = watch(model, opt, f"{tmp}/run")
        run_block(step, 11, rec)
        for i in range(passes):
            for watched in ((False, True) if i % 2 else (True, False)):
                t0 = time.perf_counter()
                (step if watched else plain_step).evaluate(1)
                times[watched].append(time.perf_counter() - t0)
        rec.close()
    print(f"{name}: {statistics.median(times[False]) * 1e3:.2f} ms an evaluation (a batch of each split) "
          f"without the recorder, median ({passes} each way, alternated)")
    print(f"  wall-clock ratio of the summed evaluation times: {sum(times[True]) / sum(times[False]):.3f}")


def _whole_run(make: Callable[[], Training], steps: int, path: str | None) -> float:
    """Wall seconds of one training run of `steps` steps from a fresh model, in this process:
    with `path`, from `watch()` to the end of its `with` block (hooks, the first step's settling,
    every flush, the last segment written and the writer joined)."""
    torch.manual_seed(0)
    model, opt, step = make()
    t0 = time.perf_counter()
    if path is None:
        run_block(step, steps, None)
    else:
        with watch(model, opt, path) as rec:
            for _ in range(steps):
                rec.log(loss=step())
    return time.perf_counter() - t0


# glibc's allocator, told to keep what it got: a run no longer hands memory back to the system and
# faults it in again, which moves a whole run's time by more than the recorder costs
STEADY_MALLOC = {"MALLOC_TOP_PAD_": str(256 << 20), "MALLOC_TRIM_THRESHOLD_": str(2**32 - 1),
                 "MALLOC_MMAP_THRESHOLD_": str(256 << 20)}


def _fresh_process_run(case: str, steps: int, path: str | None, threads: int,
                       faults: list[int] | None = None, steady: bool = False) -> float:
    """Wall seconds of `python bench/cases.py CASE STEPS` from its start to its exit: a
    training run as a user times `python train.py`, the process's imports (torch's, and with
    `path` the recorder's and llvmlite's) and the recorder's set-up included. Appends the
    process's minor page faults to `faults`."""
    cmd = [sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)), "cases.py"), case,
           str(steps), "--threads", str(threads)] + ([] if path is None else ["--trace", path])
    # bytecode cached, as for an installed package (an environment that turns the cache off would
    # charge the watched runs for compiling the recorder's modules in every process)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_minflt
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, env={**env, **STEADY_MALLOC} if steady else env)
    took = time.perf_counter() - t0
    if faults is not None:
        faults.append(resource.getrusage(resource.RUSAGE_CHILDREN).ru_minflt - before)
    return took


def measure_whole_runs(name: str, case: str, pairs: int, steps: int, fresh: bool, threads: int,
                       steady: bool = False) -> None:
    """Whole runs with and without the recorder, alternated (order swapped every pair): what a
    user sees timing a training run both ways, the recorder's fixed costs (set-up, the first
    step, the last flush and close) included; print the median ratio and its spread.

    In one process (the default) the process's imports and the kernels' first compilation are paid
    by warm-up runs before the timed ones; with `fresh` every run is a new Python process, timed
    from its start to its exit, so each watched run pays for importing the recorder and loading
    its compiled kernels, as `time python train.py` does."""
    make = CASES[case][1]
    with tempfile.TemporaryDirectory() as tmp:
        if fresh:
            run = functools.partial(_fresh_process_run, case, steps, threads=threads, steady=steady)
            run(f"{tmp}/warm")  # the first run compiles the kernels (a fresh machine) and caches bytecode
        else:
            _whole_run(make, 3, None)  # warm-up: allocator, thread pools, the recorder's kernels
            _whole_run(make, 3, f"{tmp}/warm")
            run = functools.partial(_whole_run, make, steps)
        ratios, plain_s, watched_s = [], [], []
        faults: dict[bool, list[int]] = {False: [], True: []}
        for i in range(pairs):
            order = (None, f"{tmp}/run{i}") if i % 2 == 0 else (f"{tmp}/run{i}", None)
            times = {p is not None: run(p, faults=faults[p is not None]) if fresh else run(p) for p in order}
            plain_s.append(times[False])
            watched_s.append(times[True])
            ratios.append(times[True] / times[False])
    how = "each a fresh process, timed from its start to its exit" if fresh else "in this process"
    how += ", glibc's allocator keeping its memory (--steady-malloc)" if steady else ""
    print(f"{name}: whole runs of {steps} steps ({how}), {statistics.median(plain_s):.2f} s without "
          f"the recorder, {statistics.median(watched_s):.2f} s with it (median of {pairs} alternated pairs)")
    _print_ratios("wall-clock ratio of whole runs with/without", ratios)
    if fresh:
        # a page fault costs microseconds here (zeroed pages, and a VM's second-level faults): a
        # run whose allocator hands memory back and faults it in again is slower for that alone
        print("  minor page faults per run, without / with: " + " / ".join(
            ", ".join(f"{n // 1000}k" for n in faults[w]) for w in (False, True)))
    print(f"  load average after: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")


def _print_ratios(label: str, ratios: list[float]) -> None:
    q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
    print(f"  {label}: median {statistics.median(ratios):.3f} (quartiles {q[0]:.3f}-{q[2]:.3f}, "
          f"min {min(ratios):.3f}, max {max(ratios):.3f}, {len(ratios)} pairs)")


# --without: a pass left out writes a constant where its norms go (a row of zeros would send the
# later arithmetic down its rarer paths); the field names are ParamProbe's
_PASSES = {"preclip": ("pre_norms",), "grads": ("grad_norms",), "weights": ("end_norms", "fwd_norms")}
_LEAVE_OUT = (*_PASSES, "forward", "reduce", "all", "work")


def _no_statistics(fwd: probes.ForwardProbe) -> list[tuple[int, torch.Tensor]]:
    """`ForwardProbe.compute` without the statistics: the queued steps are let go as it lets
    them go (else the recorder reduces again at every step, to empty the queue)."""
    fwd.pending = []
    return []


def _no_reduction(probe: params.ParamProbe) -> None:
    """`ParamProbe.reduce` without the arithmetic: the queued steps are let go (their rows keep
    what the step buffer held)."""
    probe.pending = []


def parts_to_leave_out(ap: argparse.ArgumentParser, text: str) -> set[str]:
    """The parts a `--without PART[,PART...]` names; a one-line usage error for an unknown one."""
    parts = {p for p in text.split(",") if p}
    if parts - set(_LEAVE_OUT):
        ap.error(f"--without takes {', '.join(_LEAVE_OUT)}; got {', '.join(sorted(parts - set(_LEAVE_OUT)))}")
    return parts


def leave_out(parts: set[str], patch: Callable[[object, str, object], None] = setattr) -> None:
    """Patch the recorder so that the watched copy does without `parts` (see --without);
    `patch(owner, name, value)` sets each attribute (a test passes one that undoes it)."""
    from warninglight.tracer import recorder

    if "all" in parts:
        parts = parts | {*_PASSES, "forward"}
    skipped = {f for p in parts for f in _PASSES.get(p, ())}
    if skipped:
        norms_into = params.ParamProbe._norms_into

        def some_norms(self, field, tensors, kind, weight_addrs=None):  # type: ignore[no-untyped-def]
            if field not in skipped:
                return norms_into(self, field, tensors, kind, weight_addrs)
            getattr(self._row_views[self._row_index()], field).fill_(1.0)
            return True
        patch(params.ParamProbe, "_norms_into", some_norms)
    if "forward" in parts:
        patch(probes.ForwardProbe, "observe", lambda *_: None)
        patch(probes.ForwardProbe, "_copy_noted", lambda *_: False)
        patch(probes.ForwardProbe, "compute", _no_statistics)
    if "reduce" in parts:
        patch(params.ParamProbe, "reduce", _no_reduction)
        patch(probes.ForwardProbe, "compute", _no_statistics)
    if "work" in parts:
        rec, entries = recorder.Recorder, ("_root_pre_hook", "_root_hook", "_pre_step", "_post_step", "log")
        for name in (*entries, "_make_hook"):
            if not hasattr(rec, name):  # renamed: the patch would leave that work in
                raise AttributeError(f"--without work: the recorder has no {name}")
        for name in entries:
            patch(rec, name, lambda *_, **__: None)
        patch(rec, "_make_hook", lambda self: (lambda *_: None))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=100,
                    help="steps per timed block, a multiple of --flush-every (MLP: x20)")
    ap.add_argument("--flush-every", type=int, default=None,
                    help="the watched run's flush interval in steps (default: the recorder's)")
    ap.add_argument("--pairs", type=int, default=6, help="with/without block pairs")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: leave as is)")
    ap.add_argument("--skip-mlp", action="store_true", help="only the GPT figures")
    ap.add_argument("--case", action="append", choices=sorted(CASES), default=None,
                    help="measure this case of bench/cases.py (repeatable) instead of the models the "
                         "--skip flags and --nanogpt choose")
    ap.add_argument("--skip-bench-gpt", action="store_true", help="not the d=256 GPT")
    ap.add_argument("--skip-small-gpt", action="store_true", help="not the d=128 GPT")
    ap.add_argument("--nanogpt", action="store_true",
                    help="with --interleave or --whole-runs: the nanoGPT-layout model too (bench/nanogpt.py)")
    ap.add_argument("--vocab", type=int, default=None, metavar="V",
                    help="with --nanogpt, in this process: the nanoGPT layout's vocabulary (default 96; "
                         "50304 is GPT-2's, whose logits outweigh the rest of a small model's outputs)")
    ap.add_argument("--wait-quiet", type=float, default=0.0, metavar="S",
                    help="before each pair, wait up to S seconds until no other process is runnable")
    ap.add_argument("--evaluations", type=int, default=0, metavar="N",
                    help="instead of training steps: N evaluations (eval() mode, no_grad: a batch of "
                         "each split) each way, alternated (the nanoGPT layout's cases)")
    ap.add_argument("--interleave", type=int, default=0, metavar="N",
                    help="instead of blocks: N steps each way alternated step by step (the GPTs only)")
    ap.add_argument("--whole-runs", type=int, default=0, metavar="N",
                    help="instead of blocks: whole runs of N steps each way, alternated (--pairs of them; the GPTs only)")
    ap.add_argument("--fresh-process", action="store_true",
                    help="with --whole-runs: every run a new Python process, timed from its start to its exit")
    ap.add_argument("--steady-malloc", action="store_true",
                    help="with --fresh-process: both sides' runs with glibc's allocator told to keep its memory "
                         "(no page faults from memory handed back and taken again)")
    ap.add_argument("--skip-replicas", action="store_true",
                    help="skip the per-rank evidence figure (bench/replica_overhead.py)")
    ap.add_argument("--hold-outputs", action="store_true",
                    help="for comparison: the watched copy holds every forward output until the "
                         "optimizer step (as when the model's output is not judged at the forward's end)")
    ap.add_argument("--without", default="", metavar="PART[,PART...]",
                    help=f"leave these parts out of the watched copy, in this process: {', '.join(_LEAVE_OUT)}")
    ap.add_argument("--split-from", type=int, default=None, metavar="N",
                    help="cut the norm passes into parts on torch's threads from N values in all "
                         f"(kernels.SPLIT_FROM, default {kernels.SPLIT_FROM}; a huge N: never), in this process")
    ap.add_argument("--hooks-under-compile", choices=("graph", "eager", "skip"), default=None,
                    help="watch(hooks_under_compile=...) for the watched copies, in this process "
                         "(skip: no forward statistics in compiled code, for comparison)")
    args = ap.parse_args()
    without = parts_to_leave_out(ap, args.without)
    if args.steady_malloc and not args.fresh_process:
        ap.error("--steady-malloc sets the environment of --fresh-process runs")
    if without and args.fresh_process:
        ap.error("--without patches this process: it cannot reach --fresh-process runs")
    if args.vocab is not None:
        if args.fresh_process or not args.nanogpt:
            ap.error("--vocab sets the nanoGPT layout (--nanogpt) of runs in this process")
        CASES["nanogpt"] = (f"{CASES['nanogpt'][0]}, vocabulary {args.vocab}",
                            functools.partial(nanogpt_case, vocab=args.vocab))
    if args.hooks_under_compile is not None:
        if args.fresh_process:
            ap.error("--hooks-under-compile sets this process: it cannot reach --fresh-process runs")
        global watch
        watch = functools.partial(watch, hooks_under_compile=args.hooks_under_compile)
        print(f"the watched copies with hooks_under_compile={args.hooks_under_compile!r}")
    if without:
        leave_out(without)
        print(f"the watched copy without: {', '.join(sorted(without))}")
    if args.split_from is not None:
        if args.fresh_process:
            ap.error("--split-from sets this process: it cannot reach --fresh-process runs")
        kernels.SPLIT_FROM = args.split_from
        print(f"norm passes in parts from {args.split_from} values")
    # the steady state: the compiled passes from the first watched step (a process loads them in
    # the background at its first watch(); --fresh-process times that too)
    kernels.available()
    if args.hold_outputs:
        probes.ForwardProbe.end_forward = lambda *_: None  # type: ignore[method-assign]
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"load average before: {' '.join(f'{x:.1f}' for x in os.getloadavg())} on {os.cpu_count()} "
          "CPUs (a loaded, shared machine moves these figures by several points)")
    cases = [c for c, skip in (("bench", args.skip_bench_gpt), ("small", args.skip_small_gpt),
                               ("nanogpt", not args.nanogpt)) if not skip] if args.case is None else args.case
    if args.whole_runs:
        for case in cases:
            measure_whole_runs(CASES[case][0], case, args.pairs, args.whole_runs, args.fresh_process,
                               torch.get_num_threads(), args.steady_malloc)
        return
    if args.evaluations:
        for case in cases:
            measure_evaluations(CASES[case][0], CASES[case][1], args.evaluations)
        return
    if args.interleave:
        for case in cases:
            measure_interleaved(CASES[case][0], CASES[case][1], args.interleave)
        return
    for case in cases:
        measure(CASES[case][0], CASES[case][1], args.pairs, args.steps, args.wait_quiet, args.flush_every)
    if not args.skip_mlp:
        measure("MLP 32-64-64-64-10, batch 64", lambda: adamw_loop(mlp_case(batch=64)), args.pairs,
                args.steps * 20, args.wait_quiet, args.flush_every)
    if not args.skip_replicas:  # data-parallel runs only: weight checksums, local gradient norms
        from replica_overhead import report as replica_report

        replica_report(steps=max(3, args.steps // 8))


if __name__ == "__main__":
    main()
