"""Where the recorder's time goes: wall time per step inside each of its entry points.

Wraps the recorder's hooks and probes with timers (so the figures include the timers' own small
cost), trains the overhead benchmark's GPT for a few steps with and without the recorder, and
prints milliseconds and minor page faults per step for each part (nested parts are printed
indented under their caller, and counted in it too), their total, and the process's minor page
faults per step each way (getrusage). Run:
`python bench/overhead_breakdown.py [--steps N] [--threads T] [--model bench|small] [--plain-first]`.
"""

from __future__ import annotations

import argparse
import collections
import functools
import resource
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
from overhead import gpt_case, run_block
from warninglight.tracer import params, probes, recorder, watch

# (class, method, indent): what a step's recorder work is made of; indented = part of the line above
PARTS = ((recorder.Recorder, "_root_pre_hook", 0), (params.ParamProbe, "begin", 1),
         (probes.ForwardProbe, "observe", 0), (recorder.Recorder, "_after_backward", 0),
         (recorder.Recorder, "_pre_step", 0), (params.ParamProbe, "grads", 1),
         (recorder.Recorder, "_post_step", 0), (params.ParamProbe, "end", 1),
         (recorder.Recorder, "_reduce_pending", 1), (params.ParamProbe, "reduce", 2),
         (probes.ForwardProbe, "compute", 2), (recorder.Recorder, "_flush", 1),
         (recorder.Recorder, "log", 0))


def _minflt() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _timed(totals: dict[str, float], faults: dict[str, float], name: str,
           f: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(f)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0, f0 = time.perf_counter(), _minflt()
        try:
            return f(*args, **kwargs)
        finally:
            totals[name] += time.perf_counter() - t0
            faults[name] += _minflt() - f0
    return wrapper


MODELS = {"bench": (8, 256, 128), "small": (16, 128, 64)}  # (batch, d, seq) of bench/overhead.py's GPTs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30, help="timed steps each way")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: leave as is)")
    ap.add_argument("--model", choices=sorted(MODELS), default="bench",
                    help="bench: the bench GPT; small: the small GPT (small ops, many hooks)")
    ap.add_argument("--plain-first", action="store_true",
                    help="time the pass without the recorder first (its page faults then owe nothing "
                         "to the allocator state the watched pass leaves)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    totals: dict[str, float] = collections.defaultdict(float)
    part_faults: dict[str, float] = collections.defaultdict(float)
    for cls, name, _ in PARTS:
        setattr(cls, name, _timed(totals, part_faults, f"{cls.__name__}.{name}", getattr(cls, name)))
    torch.manual_seed(0)
    batch, n_embd, block = MODELS[args.model]
    model, loss_fn = gpt_case(batch, n_layer=4, n_embd=n_embd, block=block)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    faults: dict[bool, float] = {}  # minor page faults per step, by whether the recorder ran

    def train(steps: int, rec: Any = None) -> float:
        before = _minflt()
        step_s = run_block(loss_fn, opt, steps, rec)[0]
        faults[rec is not None] = (_minflt() - before) / steps
        return step_s

    train(3)
    without = train(args.steps) if args.plain_first else None
    with tempfile.TemporaryDirectory() as tmp:
        rec = watch(model, opt, tmp, flush_every_steps=50)
        train(3, rec)
        totals.clear()
        part_faults.clear()
        with_rec = train(args.steps, rec)
        rec.close()
    if without is None:
        without = train(args.steps)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"TinyGPT 4x{n_embd} seq {block} batch {batch}")
    print(f"step: {without * 1e3:.1f} ms without, {with_rec * 1e3:.1f} ms with the recorder "
          f"(ratio {with_rec / without:.3f}, one pass each way: noisier than bench/overhead.py)")
    print(f"minor page faults per step: {faults[False]:.0f} without "
          f"({'before' if args.plain_first else 'after'} the watched pass), {faults[True]:.0f} with the recorder "
          "(of which inside its entry points, below: the nested ones are counted in their callers too)")
    lines = [(f"{cls.__name__}.{name}", indent) for cls, name, indent in PARTS]
    for key, indent in lines:
        print(f"{'    ' * indent}{key:<28s} {totals[key] / args.steps * 1e3:6.2f} ms/step "
              f"{part_faults[key] / args.steps:7.0f} faults/step")
    outermost = sum(totals[key] for key, indent in lines if indent == 0)
    print(f"{'in all (the unindented lines)':<28s} {outermost / args.steps * 1e3:6.2f} ms/step")


if __name__ == "__main__":
    main()
