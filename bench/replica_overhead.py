"""Cost of the per-rank evidence (tracer/replicas.py) against the training step, every step.

Two figures on the same GPT as bench/overhead.py, wrapped in DistributedDataParallel over a
one-process gloo group (the communication hook then runs for real):

1. direct: process-CPU time of what the replica probe adds per step (two weight checksums and the
   local gradient norms in the comm hook), timed over many calls, as a share of the plain step;
2. side by side: step-time ratio of the recorder with and without the replica probe, blocks
   alternating in one process (noisier: the difference is small against machine load).

Run: `python bench/replica_overhead.py [--steps N]` (also printed at the end of bench/overhead.py).
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from warninglight.lab import zoo
from warninglight.tracer import watch
from warninglight.tracer.components import discover
from warninglight.tracer.replicas import ReplicaProbe


def _init_one_process_group() -> None:
    if dist.is_initialized():
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=0, world_size=1)


def _case(batch: int) -> tuple[torch.nn.Module, torch.optim.Optimizer, object]:
    cfg = zoo.GPTConfig(n_layer=4, n_embd=256, n_head=4, block_size=128)
    model = torch.nn.parallel.DistributedDataParallel(zoo.TinyGPT(cfg))
    data = zoo.text_batches(zoo.char_corpus(200_000), batch, cfg.block_size)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step() -> None:
        _, x, y = next(data)
        F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model, opt, step


def _block(step: object, steps: int) -> float:
    c0 = time.process_time()
    for _ in range(steps):
        step()  # type: ignore[operator]
    return (time.process_time() - c0) / steps


def _cpu_per_call(fn: object, n: int = 200) -> float:
    fn()  # type: ignore[operator]
    c0 = time.process_time()
    for _ in range(n):
        fn()  # type: ignore[operator]
    return (time.process_time() - c0) / n


def direct_share(model: torch.nn.Module, step: object, steps: int) -> tuple[float, dict[str, float]]:
    """(plain step CPU s, {part: CPU s per step}): the probe's work timed on its own, by part."""
    plain = statistics.median(_block(step, steps) for _ in range(3))
    probe = ReplicaProbe(discover(model), model.module, 2)  # not DDP: no second comm hook
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]

    def local_norms() -> None:  # what the comm hook computes per step: fused norms, per component
        norms = torch.stack(torch._foreach_norm(grads)).float()
        probe._buckets[0] = (probe.param_comp, norms * norms, probe.is_param)

    def end() -> None:
        probe.end_step(0)
        probe.rows.clear()
    parts = {"checksum after the step": _cpu_per_call(end),
             "checksum at the forward": _cpu_per_call(probe.begin),
             "local gradient norms": _cpu_per_call(local_norms)}
    return plain, parts


def side_by_side(model: torch.nn.Module, opt: torch.optim.Optimizer, step: object, pairs: int,
                 steps: int) -> list[float]:
    """Process-CPU ratio per block pair: recorder with the replica probe / without it."""
    ratios = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(pairs):
            timed = {}
            for on in ((True, False) if i % 2 else (False, True)):
                rec = watch(model, opt, f"{tmp}/r{i}{on}", rank=0, world_size=2, replicas=on,
                            flush_every_steps=50)
                _block(step, 1)  # first step settles components
                timed[on] = _block(step, steps)
                rec.close()
            ratios.append(timed[True] / timed[False])
    return ratios


def report(steps: int = 5, pairs: int = 4, batch: int = 8) -> None:
    """Print both figures."""
    _init_one_process_group()
    torch.manual_seed(0)
    model, opt, step = _case(batch)
    _block(step, 2)  # warm-up
    plain, parts = direct_share(model, step, steps)
    cost = sum(parts.values())
    print(f"replica evidence, TinyGPT 4x256 seq 128 in DDP: {cost * 1e3:.2f} ms CPU per step against "
          f"a {plain * 1e3:.0f} ms CPU step = {100 * cost / plain:.2f}% (target <= 1%); by part: "
          + ", ".join(f"{k} {v * 1e3:.2f} ms ({100 * v / plain:.2f}%)" for k, v in parts.items()))
    ratios = side_by_side(model, opt, step, pairs, steps)
    print(f"  side by side, recorder with/without replica evidence (process CPU): median "
          f"{statistics.median(ratios):.3f} over {pairs} block pairs of {steps} steps "
          f"(min {min(ratios):.3f}, max {max(ratios):.3f}); on a shared, loaded machine the direct "
          "figure is the one to read")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=5, help="steps per timed block")
    ap.add_argument("--pairs", type=int, default=4, help="with/without block pairs")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (default 1: on a loaded 2-core machine OpenMP threads spin "
                         "and turn every parallel reduction, ours and the model's, into noise)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    report(args.steps, args.pairs)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
