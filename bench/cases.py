"""The models the overhead benches train, each with its optimizer and one whole training step.

Run as a script, trains one case for a number of steps and exits (`python bench/cases.py CASE
STEPS [--trace PATH] [--threads T]`): the body of `bench/overhead.py --whole-runs N
--fresh-process`, which times such processes from start to exit. Without `--trace` the recorder
is never imported, so a plain run costs what a training script without it costs. With
`--trace PATH --setup` it prints what the recorder costs the process once, in process CPU
seconds: on the training thread importing it, `watch()`, the first step beyond a plain one and
`close()`; and the whole process's beyond plain steps, which adds the background load of the
compiled kernels (importing llvmlite, mapping them from the cache or compiling them on a fresh
machine) and the writer thread.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from nanogpt import nanogpt_case
from warninglight.lab import zoo

# a model, its optimizer, and one whole training step (forward, backward, optimizer step) returning the loss
Training = tuple[torch.nn.Module, torch.optim.Optimizer, Callable[[], torch.Tensor]]


def gpt_case(batch: int, n_layer: int, n_embd: int, block: int) -> tuple[torch.nn.Module, Callable[[], torch.Tensor]]:
    """A character GPT and a closure computing one batch's loss."""
    cfg = zoo.GPTConfig(n_layer=n_layer, n_embd=n_embd, n_head=4, block_size=block)
    model = zoo.TinyGPT(cfg)
    data = zoo.text_batches(zoo.char_corpus(200_000), batch, block)

    def loss() -> torch.Tensor:
        _, x, y = next(data)
        return F.cross_entropy(model(x).flatten(0, 1), y.flatten())
    return model, loss


def mlp_case(batch: int) -> tuple[torch.nn.Module, Callable[[], torch.Tensor]]:
    """The worst case: a tiny MLP, its step so short that the recorder's fixed costs weigh most."""
    model = zoo.mlp()
    data = zoo.batches(*zoo.teacher_classification(), batch)

    def loss() -> torch.Tensor:
        _, x, y = next(data)
        return F.cross_entropy(model(x), y)
    return model, loss


def adamw_loop(case: tuple[torch.nn.Module, Callable[[], torch.Tensor]]) -> Training:
    """A model and its loss closure as the plain loop trains them: AdamW, backward, step, zero_grad."""
    model, loss_fn = case
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step() -> torch.Tensor:
        loss = loss_fn()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss
    return model, opt, step


# name -> (what it is, its factory): the cases --whole-runs and --interleave measure
def _nanogpt_ddp() -> Training:
    """`nanogpt_case` inside DistributedDataParallel, in a process group of this process alone
    (gloo, a free local port) if none is set up."""
    import socket

    import torch.distributed as dist

    if not dist.is_initialized():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    return nanogpt_case(ddp=True)


CASES: dict[str, tuple[str, Callable[[], Training]]] = {
    "bench": ("bench GPT 4 layers, d=256, seq 128, batch 8",
              lambda: adamw_loop(gpt_case(8, n_layer=4, n_embd=256, block=128))),
    "small": ("small GPT 4 layers, d=128, seq 64, batch 16",
              lambda: adamw_loop(gpt_case(16, n_layer=4, n_embd=128, block=64))),
    "nanogpt": ("nanoGPT layout 4 layers, d=128, seq 64, batch 12, clipped, tied head",
                nanogpt_case),
    "nanogpt-accum": ("nanoGPT layout as above, 4 micro-batches of 3 sequences a step",
                      lambda: nanogpt_case(batch=3, accum=4)),
    "nanogpt-compiled": ("nanoGPT layout as above, the forward through torch.compile (inductor)",
                         lambda: nanogpt_case(compiled=True)),
    "nanogpt-eval": ("nanoGPT layout as above, train.py's estimate_loss every 50 steps (40 batches "
                     "of each split, eval() mode, no_grad)",
                     lambda: nanogpt_case(eval_interval=50, eval_iters=40)),
    "nanogpt-ddp": ("nanoGPT layout as above, inside DistributedDataParallel (a process group of one "
                    "gloo rank)", _nanogpt_ddp),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("case", choices=sorted(CASES))
    ap.add_argument("steps", type=int)
    ap.add_argument("--trace", default=None, help="watch the run, writing its trace here")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: leave as is)")
    ap.add_argument("--setup", action="store_true",
                    help="with --trace: print the recorder's one-off costs to this process")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model, opt, step = CASES[args.case][1]()
    if args.trace is None:
        for _ in range(args.steps):
            step()
        return
    if args.setup:
        setup(step, model, opt, args.trace, args.steps)
        return
    from warninglight.tracer import watch

    with watch(model, opt, args.trace) as rec:
        for _ in range(args.steps):
            rec.log(loss=step())


def setup(step: Callable[[], torch.Tensor], model: torch.nn.Module, opt: torch.optim.Optimizer,
          trace: str, steps: int) -> None:
    """The recorder's one-off costs to this process (see the module docstring): CPU seconds of
    the training thread, and of the whole process (the kernels' background load included)."""
    own, everyone = time.thread_time, time.process_time
    for _ in range(2):  # the plain step's own first-call costs
        step()
    t, p, w = own(), everyone(), time.perf_counter()
    step()
    plain, plain_p, plain_w = own() - t, everyone() - p, time.perf_counter() - w
    p0 = everyone()
    t = own()
    from warninglight.tracer import kernels, watch
    imported = own() - t
    t = own()
    rec = watch(model, opt, trace)
    watch_s = own() - t
    t, w = own(), time.perf_counter()
    rec.log(loss=step())
    first, first_w = own() - t - plain, time.perf_counter() - w - plain_w
    for _ in range(max(0, steps - 1)):
        rec.log(loss=step())
    t = own()
    rec.close()
    close = own() - t
    loader = kernels._loading.get("")
    if loader is not None:
        loader.join()
    rest = everyone() - p0 - steps * plain_p
    print(f"training thread CPU s: import the recorder {imported:.3f}, watch() {watch_s:.3f}, first step "
          f"beyond a plain one {first:.3f}, close() {close:.3f}; in all {imported + watch_s + first + close:.3f} "
          f"(a plain step: {plain:.3f}). Process CPU s beyond {steps} plain steps, the kernels' "
          f"background load and the writer thread included: {rest:.3f}; the kernels' load "
          f"{kernels._state.get('load_cpu_s', 0.0):.3f} of it (loaded: {kernels.ready()}, from the cache: "
          f"{kernels._state.get('cached')}, as {kernels._state.get('source')})")
    print(f"wall s of the first watched step beyond a plain one: {first_w:.3f} (the background load and "
          f"the writer thread's imports hold the interpreter while they run)")


if __name__ == "__main__":
    main()
