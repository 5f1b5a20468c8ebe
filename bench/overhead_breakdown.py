"""Where the recorder's time goes: wall time per step inside each of its entry points.

Wraps the recorder's hooks and probes with timers (so the figures include the timers' own small
cost), trains the overhead benchmark's GPT for a few steps with and without the recorder, and
prints milliseconds and minor page faults per step for each part (nested parts are printed
indented under their caller, and counted in it too), their total, and the process's minor page
faults per step each way (getrusage). Run:
`python bench/overhead_breakdown.py [--steps N] [--threads T] [--model bench|small] [--plain-first]`.

`--model nanogpt-ddp` trains inside DistributedDataParallel (a process group of one gloo rank)
with the per-rank evidence on (tracer/replicas.py), and adds its parts.

`--split-from N` moves the size from which the norm passes run in parts on torch's threads
(`kernels.SPLIT_FROM`; a huge N turns that off).

`--phases` instead times the phases of a training step (batch, forward, backward, clip,
optimizer step, zero_grad and `rec.log`) of the nanoGPT layout, a plain and a watched copy
alternated step by step, and prints each phase's cost with the recorder: where its cost lands,
what it makes the training's own ops cost included (the timers above see only the time inside
the recorder's own functions). With `--without PART[,PART...]` the watched copy leaves those
parts of its work out, as `bench/overhead.py --without` does; with `--against factor|copies` a
third copy, watched by a recorder with one of its savings turned off, runs beside the two.

`--norms-ab [--blas-from N]` instead times the parameter probe's three entry points in one
watched run whose steps alternate the CPU norm and sketch passes between the compiled path
(tracer/kernels.py; tensors of `--blas-from` values or more as BLAS dot products, default
`params.BLAS_FROM`) and the eager ops, and prints ms per step of each, both ways.
"""

from __future__ import annotations

import argparse
import collections
import functools
import itertools
import resource
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
from cases import CASES
from overhead import leave_out, parts_to_leave_out, run_block
from warninglight.tracer import kernels, loopfacts, params, probes, recorder, replicas, watch

# the component hooks `Recorder._make_hook` makes, timed as one line
_HOOKS = "component hooks"
# (class, method, indent): what a step's recorder work is made of; indented = part of the line
# above (`_copy_noted`: the noted outputs of a pass like the last, in one call; `observe`: all
# its calls, at the forward's end for the other noted outputs, and in the hooks of the others)
PARTS = ((recorder.Recorder, "_root_pre_hook", 0), (params.ParamProbe, "begin", 1),
         (loopfacts.LoopProbe, "forward", 1),
         (recorder.Recorder, _HOOKS, 0), (recorder.Recorder, "_root_hook", 0), (probes.ForwardProbe, "copy_deferred", 1),
         (probes.ForwardProbe, "drain", 2), (probes.ForwardProbe, "_copy_noted", 3),
         (probes.ForwardProbe, "observe", 3),
         (probes.ForwardProbe, "end_forward", 1),
         (recorder.Recorder, "_on_output_grad", 0),
         (loopfacts.LoopProbe, "backward_begins", 1), (recorder.Recorder, "_after_backward", 0),
         (recorder.Recorder, "_pre_step", 0), (params.ParamProbe, "grads", 1),
         (loopfacts.LoopProbe, "step_facts", 1),
         (recorder.Recorder, "_post_step", 0), (params.ParamProbe, "end", 1),
         (loopfacts.LoopProbe, "step_ended", 1),
         (recorder.Recorder, "_reduce_pending", 1), (params.ParamProbe, "reduce", 2),
         (probes.ForwardProbe, "compute", 2), (recorder.Recorder, "_flush", 1),
         (recorder.Recorder, "log", 0))
# under DistributedDataParallel (`--model nanogpt-ddp`): the entry point of the per-rank evidence
# alone, then its parts inside the entry points above (indented: counted in their callers)
REPLICA_PARTS = ((recorder.Recorder, "_backward_ending", 0), (replicas.ReplicaProbe, "backward_ending", 1),
                 (params.ParamProbe, "local_norms", 2), (replicas.ReplicaProbe, "begin", 1),
                 (replicas.ReplicaProbe, "backward_ended", 1), (replicas.ReplicaProbe, "end_step", 1))


def _minflt() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _timed(totals: dict[str, float], faults: dict[str, float], name: str,
           f: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(f)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():  # traced into a graph: its time is the graph's
            return f(*args, **kwargs)
        t0, f0 = time.perf_counter(), _minflt()
        try:
            return f(*args, **kwargs)
        finally:
            totals[name] += time.perf_counter() - t0
            faults[name] += _minflt() - f0
    return wrapper


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30, help="timed steps each way")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: leave as is)")
    ap.add_argument("--model", choices=sorted(CASES), default="bench",
                    help="bench: the bench GPT; small: the small GPT (small ops, many hooks); "
                         "nanogpt: nanoGPT's layout and loop (bench/nanogpt.py)")
    ap.add_argument("--plain-first", action="store_true",
                    help="time the pass without the recorder first (its page faults then owe nothing "
                         "to the allocator state the watched pass leaves)")
    ap.add_argument("--phases", action="store_true",
                    help="time the phases of the nanoGPT layout's step, plain and watched, steps alternated")
    ap.add_argument("--against", choices=sorted(_AGAINST), default=None,
                    help="with --phases: a third copy, watched without this saving: " +
                         "; ".join(f"{k}: {v[0]}" for k, v in _AGAINST.items()))
    ap.add_argument("--without", default="", metavar="PART[,PART...]",
                    help="with --phases: leave these parts out of the watched copy (bench/overhead.py --without)")
    ap.add_argument("--norms-ab", action="store_true",
                    help="time the parameter probe with compiled and eager norm passes, steps alternated")
    ap.add_argument("--blas-from", type=int, default=None,
                    help="with --norms-ab: tensors of this many values or more through BLAS")
    ap.add_argument("--split-from", type=int, default=None, metavar="N",
                    help="the norm passes in parts on torch's threads from N values in all "
                         f"(kernels.SPLIT_FROM, default {kernels.SPLIT_FROM}; a huge N: never)")
    args = ap.parse_args()
    if args.split_from is not None:
        kernels.SPLIT_FROM = args.split_from
    # the steady state: the compiled passes from the first watched step (a process loads them in
    # the background at its first watch(); --fresh-process times that too)
    kernels.available()
    if args.threads:
        torch.set_num_threads(args.threads)
    if (args.without or args.against) and not args.phases:
        ap.error("--without and --against go with --phases")
    if args.phases:
        without = parts_to_leave_out(ap, args.without)
        if without:
            leave_out(without)
            print(f"the watched copy without: {', '.join(sorted(without))}")
        phases(args.steps, args.against)
        return
    if args.norms_ab:
        if args.blas_from is not None:
            params.BLAS_FROM = args.blas_from
        torch.manual_seed(0)
        norms_ab(*CASES[args.model][1](), args.steps)
        return
    totals: dict[str, float] = collections.defaultdict(float)
    part_faults: dict[str, float] = collections.defaultdict(float)
    ddp = args.model.endswith("-ddp")
    parts = PARTS + REPLICA_PARTS if ddp else PARTS
    for cls, name, _ in parts:
        if name == _HOOKS:
            continue
        setattr(cls, name, _timed(totals, part_faults, f"{cls.__name__}.{name}", getattr(cls, name)))
    make_hook = recorder.Recorder._make_hook
    recorder.Recorder._make_hook = lambda self: _timed(  # type: ignore[method-assign]
        totals, part_faults, f"Recorder.{_HOOKS}", make_hook(self))
    torch.manual_seed(0)
    model, opt, step = CASES[args.model][1]()

    faults: dict[bool, float] = {}  # minor page faults per step, by whether the recorder ran

    def train(steps: int, rec: Any = None) -> float:
        before = _minflt()
        step_s = run_block(step, steps, rec)[0]
        faults[rec is not None] = (_minflt() - before) / steps
        return step_s

    train(3)
    without = train(args.steps) if args.plain_first else None
    with tempfile.TemporaryDirectory() as tmp:
        rec = watch(model, opt, tmp, flush_every_steps=50, **({"replicas": True} if ddp else {}))
        train(3, rec)
        totals.clear()
        part_faults.clear()
        with_rec = train(args.steps, rec)
        rec.close()
    if without is None:
        without = train(args.steps)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {CASES[args.model][0]}")
    print(f"step: {without * 1e3:.1f} ms without, {with_rec * 1e3:.1f} ms with the recorder "
          f"(ratio {with_rec / without:.3f}, one pass each way: noisier than bench/overhead.py)")
    print(f"minor page faults per step: {faults[False]:.0f} without "
          f"({'before' if args.plain_first else 'after'} the watched pass), {faults[True]:.0f} with the recorder "
          "(of which inside its entry points, below: the nested ones are counted in their callers too)")
    lines = [(f"{cls.__name__}.{name}", indent) for cls, name, indent in PARTS]
    if ddp:  # the evidence's parts, after everything else (their callers are above)
        lines += [("the per-rank evidence (begin, backward_ended, end_step: inside the entry points above)", -1)]
        lines += [(f"{cls.__name__}.{name}", indent) for cls, name, indent in REPLICA_PARTS]
    _print_parts(lines, totals, part_faults, args.steps)


def _print_parts(lines: list[tuple[str, int]], totals: dict[str, float], part_faults: dict[str, float],
                 steps: int) -> None:
    for key, indent in lines:
        if indent < 0:  # a heading
            print(key)
            continue
        print(f"{'    ' * indent}{key:<28s} {totals[key] / steps * 1e3:6.2f} ms/step "
              f"{part_faults[key] / steps:7.0f} faults/step")
    outermost = sum(totals[key] for key, indent in lines if indent == 0)
    print(f"{'in all (the unindented lines)':<28s} {outermost / steps * 1e3:6.2f} ms/step")


_PHASES = ("batch", "forward", "backward", "clip", "optimizer step", "zero_grad, log")


def _phased_step(model: torch.nn.Module, opt: torch.optim.Optimizer, rec: Any,
                 get_batch: Callable[[], tuple[torch.Tensor, torch.Tensor]], laps: dict[str, float]) -> None:
    """One step of nanoGPT's train.py loop (bench/nanogpt.py's, without its lr schedule), its
    phases' wall seconds added into `laps`."""
    t = [time.perf_counter()]
    x, y = get_batch()
    t.append(time.perf_counter())
    _, loss = model(x, y)
    t.append(time.perf_counter())
    loss.backward()
    t.append(time.perf_counter())
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    t.append(time.perf_counter())
    opt.step()
    t.append(time.perf_counter())
    opt.zero_grad(set_to_none=True)
    if rec is not None:
        rec.log(loss=loss.detach())
    t.append(time.perf_counter())
    for name, a, b in zip(_PHASES, t, t[1:], strict=False):
        laps[name] += b - a


# --phases --against PART: a recorder of this process with one of its ways of saving work turned
# off, on its own instance (so that it runs beside the whole recorder)
_AGAINST = {
    "factor": ("the exact pre-clip pass at every step, no factor learnt",
               lambda rec: setattr(rec.params, "_learn_rescale", lambda finite: None)),
    "copies": ("the forward samples copied one by one, never in one call",
               lambda rec: setattr(rec.fwd, "_copies_of", lambda noted: None)),
}


def phases(steps: int, against: str | None = None) -> list[torch.nn.Module]:
    """The nanoGPT layout's step phase by phase, a plain and a watched copy alternated step by step
    (order swapped every step): ms per step of each phase, and what the recorder adds to it.
    `against` (a key of `_AGAINST`): a third copy, watched by a recorder without that saving, the
    three in turn in every order. Returns the models (trained alike: the same weights and
    batches, side by side)."""
    sides = []
    kinds = ["plain", *(["against"] if against else []), "watched"]
    with tempfile.TemporaryDirectory() as tmp:
        for kind in kinds:
            torch.manual_seed(0)
            model, opt, step = CASES["nanogpt"][1]()
            rec = None if kind == "plain" else watch(model, opt, f"{tmp}/{kind}")
            if kind == "against":
                _AGAINST[against][1](rec)  # type: ignore[index]
            sides.append((model, opt, rec, step.get_batch, collections.defaultdict(float)))  # type: ignore[attr-defined]
        for model, opt, rec, get_batch, _ in sides:  # warm-up: allocator, thread pools, the first segment
            for _ in range(15):
                _phased_step(model, opt, rec, get_batch, collections.defaultdict(float))
        orders = list(itertools.permutations(sides))
        for i in range(steps):
            for model, opt, rec, get_batch, laps in orders[i % len(orders)]:
                _phased_step(model, opt, rec, get_batch, laps)
        for side in sides[1:]:
            side[2].close()
    laps = [side[4] for side in sides]
    plain = laps[0]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {CASES['nanogpt'][0]}: "
          f"{steps} steps each way, alternated step by step")
    if against:
        print(f"beside it, a recorder with one saving off (`{against}`): {_AGAINST[against][0]}")
        print(f"{'phase':<16s} {'plain ms':>9s} {'added ms, saving off':>21s} {'added ms':>9s}")
        for name in (*_PHASES, "the step"):
            ms = [sum(lap.values()) if name == "the step" else lap[name] for lap in laps]
            print(f"{name:<16s} {ms[0] / steps * 1e3:9.3f} {(ms[1] - ms[0]) / steps * 1e3:21.3f} "
                  f"{(ms[2] - ms[0]) / steps * 1e3:9.3f}")
        return [side[0] for side in sides]
    watched = laps[1]
    print(f"{'phase':<16s} {'plain ms':>9s} {'watched ms':>11s} {'added ms':>9s}")
    for name in _PHASES:
        print(f"{name:<16s} {plain[name] / steps * 1e3:9.3f} {watched[name] / steps * 1e3:11.3f} "
              f"{(watched[name] - plain[name]) / steps * 1e3:9.3f}")
    p, w = sum(plain.values()), sum(watched.values())
    print(f"{'the step':<16s} {p / steps * 1e3:9.3f} {w / steps * 1e3:11.3f} {(w - p) / steps * 1e3:9.3f}"
          f"   (ratio {w / p:.3f})")
    return [side[0] for side in sides]


def norms_ab(model: torch.nn.Module, opt: torch.optim.Optimizer, train: Callable[[], torch.Tensor],
             steps: int) -> None:
    """The probe's entry points, steps alternating the compiled and the eager norm passes."""
    totals: dict[tuple[str, bool], float] = collections.defaultdict(float)
    compiled = [True]
    names = ("begin", "grads", "end")
    for name in names:
        real = getattr(params.ParamProbe, name)

        def timed(self: params.ParamProbe, *a: Any, _real: Any = real, _name: str = name) -> Any:
            t0 = time.perf_counter()
            try:
                return _real(self, *a)
            finally:
                totals[(_name, compiled[0])] += time.perf_counter() - t0
        setattr(params.ParamProbe, name, timed)
    with tempfile.TemporaryDirectory() as tmp:
        rec = watch(model, opt, tmp)
        probe = rec.params
        assert probe._compiled, "no compiled passes here (the kernels cannot load here, or WARNINGLIGHT_EAGER set)"
        run_block(train, 11, rec)
        totals.clear()
        for step in range(2 * steps):
            # alternate, the order flipped every 8 steps: the exact first-forward pass of every
            # 8th step (params.EXACT_DRIFT_EVERY) then falls to each side in turn
            compiled[0] = (step + step // params.EXACT_DRIFT_EVERY) % 2 == 0
            probe._compiled_grads = compiled[0]
            if compiled[0]:
                probe.refresh()  # takes the weights' addresses again
            else:
                probe._weight_addrs = None  # the eager ops read the weights
            run_block(train, 1, rec)
        rec.close()
    print(f"parameter probe, ms per step, compiled / eager ({steps} steps each way, alternated; "
          f"BLAS from {params.BLAS_FROM:,} values, {sum(n >= params.BLAS_FROM for n in probe._numel)} "
          f"of {len(probe._numel)} tensors):")
    for name in names:
        print(f"  ParamProbe.{name:<6s} {totals[(name, True)] / steps * 1e3:6.3f} / "
              f"{totals[(name, False)] / steps * 1e3:6.3f}")
    both = [sum(totals[(n, c)] for n in names) / steps * 1e3 for c in (True, False)]
    print(f"  in all           {both[0]:6.3f} / {both[1]:6.3f}")


if __name__ == "__main__":
    main()
