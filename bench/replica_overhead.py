"""Cost of the per-rank evidence (tracer/replicas.py) against the training step, under real DDP.

Two ranks, each its own process, joined in one gloo process group, train the same GPT as
bench/overhead.py three ways at once: plain DistributedDataParallel, watched without the
per-rank evidence (`replicas=False`), and watched with it (`replicas=True`, the default when the
world size is above 1). The three are three copies of the model (same initial weights), each
wrapped in its own DDP (its own reducer and communication hook) and watched from start to end
like a real run, flushing at the recorder's default interval. Their steps alternate one by one,
the order rotating every round, so drift in machine load hits all three alike; a watched step is
timed until its writer thread is idle again, so the writing it was given counts too. Every rank
runs the same schedule, so their all-reduces pair up. Two figures:

1. side by side: (summed time with the evidence - summed time without it) / summed plain time,
   the evidence's share of the step, with its spread over five parts of the run; wall-clock on
   rank 0 (the ranks wait for each other at every all-reduce) and process CPU, the mean of the
   ranks (on a shared machine wall time waits on others' load as much as on the step);
2. direct: process-CPU time of each part of the evidence, timed over many calls on rank 0 of
   the same group, as a share of the plain step.

Run: `python bench/replica_overhead.py [--steps N] [--threads T]` (also printed at the end of
bench/overhead.py).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from warninglight.lab import zoo
from warninglight.tracer import kernels, watch

WORLD = 2
ARMS = ("plain", "without", "with")


MODELS = {"bench": "TinyGPT 4x256 seq 128", "nanogpt": "nanoGPT layout 4x128 seq 64, clipped, tied head"}


def _case(seed: int, rank: int, batch: int, model_name: str = "bench"
          ) -> tuple[torch.nn.Module, torch.optim.Optimizer, Callable[[], torch.Tensor]]:
    """A DDP-wrapped model (the same weights on every rank and arm), its optimizer, and a
    closure computing one of this rank's batches' loss (for the nanoGPT layout: its backward
    and clipping done, as train.py does them before the optimizer step)."""
    torch.manual_seed(seed)
    if model_name == "nanogpt":
        from nanogpt import NanoConfig, NanoGPT

        cfg = NanoConfig(block_size=64, vocab_size=96, n_layer=4, n_head=4, n_embd=128)
        inner = NanoGPT(cfg)
        model = torch.nn.parallel.DistributedDataParallel(inner)
        opt = inner.configure_optimizers(weight_decay=0.1, lr=1e-3)
        batches = zoo.text_batches(zoo.char_corpus(200_000), batch, cfg.block_size, seed=rank)

        def clipped() -> torch.Tensor:
            _, x, y = next(batches)
            _, loss = model(x, y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            return loss.detach()
        return model, opt, clipped
    gpt = zoo.GPTConfig(n_layer=4, n_embd=256, n_head=4, block_size=128)
    model = torch.nn.parallel.DistributedDataParallel(zoo.TinyGPT(gpt))
    data = zoo.text_batches(zoo.char_corpus(200_000), batch, gpt.block_size, seed=rank)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def loss() -> torch.Tensor:
        _, x, y = next(data)
        return F.cross_entropy(model(x).flatten(0, 1), y.flatten())
    return model, opt, loss


def _step(loss_fn: Callable[[], torch.Tensor], opt: torch.optim.Optimizer, rec: Any) -> tuple[float, float]:
    """Wall and process-CPU seconds of one training step (with a recorder: until its writer
    thread is idle again, so the writing it was given counts too)."""
    t0, c0 = time.perf_counter(), time.process_time()
    loss = loss_fn()
    if loss.requires_grad:  # else the closure ran its backward itself
        loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    if rec is not None:
        rec.log(loss=loss)
        rec.writer.ready()
    return time.perf_counter() - t0, time.process_time() - c0


def _cpu_per_call(fn: Callable[[], object], n: int = 100) -> float:
    fn()
    c0 = time.process_time()
    for _ in range(n):
        fn()
    return (time.process_time() - c0) / n


class _Bucket:
    """What the communication hook reads of a DDP bucket: the gradients are views of one flat buffer."""

    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        self.params = params
        self.flat = torch.randn(sum(p.numel() for p in params))
        self.views = [v.view_as(p) for v, p in zip(self.flat.split([p.numel() for p in params]), params,
                                                   strict=True)]

    def gradients(self) -> list[torch.Tensor]:
        return self.views

    def parameters(self) -> list[torch.nn.Parameter]:
        return self.params

    def index(self) -> int:
        return 0


def _direct(model: torch.nn.Module, rec: Any) -> dict[str, float]:
    """Process-CPU seconds per call of each part of the evidence, on the watched model's probe."""
    probe = rec.replicas
    bucket = _Bucket(list(model.parameters()))  # the whole model as one bucket
    step = rec.step_count + 1

    def end() -> None:
        probe.end_step(step)
        probe.rows.pop(step, None)

    params, addrs = rec.params, rec.params._weight_memory()
    fused = params._with_sums

    def weight_pass(with_sums: bool) -> Callable[[], None]:
        def run() -> None:  # the step end's pass over the weights, with or without the checksums
            params._with_sums = with_sums
            params._norms_into("end_norms", params._flat, "weights", addrs)
            if with_sums:
                probe.end_step(step, params._sums)
                probe.rows.pop(step, None)
        return run
    # where the checksums are taken in the weight-norm pass: what they add to it
    after = (_cpu_per_call(weight_pass(True)) - _cpu_per_call(weight_pass(False))) if fused else _cpu_per_call(end)
    params._with_sums = fused

    parts = {"checksum after the step" + (", beyond the weight-norm pass that takes it" if fused else ""): after,
             "checks at the forward": _cpu_per_call(probe.begin)}
    if probe._ddp is not None:  # read in `.grad` at the end of backward: a pass of its own
        held = [p.grad for p in model.parameters()]
        for p in model.parameters():
            p.grad = torch.zeros_like(p) if p.grad is None else p.grad

        def read() -> None:
            probe.backward_ending(rec.params.local_norms)
            rec.params._checked_grads = None  # each call reads the gradients afresh, as each step does
            probe.backward_ended()
        parts["local gradient norms, read in .grad"] = _cpu_per_call(read)
        for p, g in zip(model.parameters(), held, strict=True):
            p.grad = g
        return parts

    def local_norms() -> None:  # the hook's reading of a bucket (scaling it by 1, as DDP would by 1/world)
        probe._observe_bucket(bucket, bucket.flat, 1.0)
        if not probe._scaled:
            bucket.flat.mul_(1.0)
        probe._buckets.clear()
    parts["local gradient norms, beyond DDP's own scaling of the bucket"] = max(
        0.0, _cpu_per_call(local_norms) - _cpu_per_call(lambda: bucket.flat.mul_(1.0)))
    return parts


def _allreduce_hook(group, bucket):  # type: ignore[no-untyped-def]  # noqa: ANN001, ANN201
    """What the recorder's communication hook does besides reading the local gradients (no
    annotations: DDP checks them, and a postponed one fails its check)."""
    buffer = bucket.buffer()
    buffer.mul_(1.0 / dist.get_world_size())
    work = dist.all_reduce(buffer, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


def _rank(rank: int, port: int, args: dict[str, Any], out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(args["threads"])
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        cases = {arm: _case(0, rank, args["batch"], args["model"]) for arm in ARMS + ("hook",) * args["hook_arm"]}
        # the steady state: the compiled passes from the first watched step (a process loads
        # them in the background at its first step: tracer/kernels.py)
        kernels.available()
        with tempfile.TemporaryDirectory() as tmp:
            recs = {"plain": None}
            for arm, replicas in (("without", False), ("with", not args["null"])):
                model, opt, _ = cases[arm]
                recs[arm] = watch(model, opt, f"{tmp}/{arm}", rank=rank, world_size=WORLD,
                                  replicas=replicas)
            if "hook" in cases:  # DDP's arithmetic in a Python communication hook, nothing else
                cases["hook"][0].register_comm_hook(None, _allreduce_hook)
                recs["hook"] = None
            arms = list(cases)
            for _ in range(3):  # warm-up: compiled passes, first segments, the hooks' first steps
                for arm in arms:
                    _step(cases[arm][2], cases[arm][1], recs[arm])
            times: list[dict[str, tuple[float, float]]] = []
            for i in range(args["steps"]):
                order = arms[i % len(arms):] + arms[:i % len(arms)]
                times.append({arm: _step(cases[arm][2], cases[arm][1], recs[arm]) for arm in order})
            dist.barrier()
            direct = _direct(cases["with"][0], recs["with"]) if rank == 0 and not args["null"] else {}
            dist.barrier()
            for arm in ("without", "with"):
                recs[arm].close()
        Path(out, f"rank{rank}.json").write_text(json.dumps({"times": times, "direct": direct}))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def report(steps: int = 150, batch: int = 8, threads: int = 1, chunks: int = 5,
           hook_arm: bool = False, null: bool = False, model: str = "bench") -> None:
    """Spawn the two ranks, then print both figures."""
    args = {"steps": steps, "batch": batch, "threads": threads, "hook_arm": hook_arm, "null": null,
            "model": model}
    with tempfile.TemporaryDirectory() as out:
        mp.spawn(_rank, args=(_free_port(), args, out), nprocs=WORLD, join=True)
        ranks = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(WORLD)]
    load = os.getloadavg()[0]
    wall = [{a: t[a][0] for a in ARMS} for t in ranks[0]["times"]]
    cpu = [{a: sum(r["times"][i][a][1] for r in ranks) / WORLD for a in ARMS} for i in range(steps)]
    print(f"per-rank evidence, {MODELS[model]} batch {batch}, {WORLD} ranks of gloo DDP, "
          f"{threads} thread(s) each, {steps} steps each way, interleaved (load {load:.2f} after "
          "the run):")
    for name, rows in (("wall, rank 0", wall), ("process CPU, mean of the ranks", cpu)):
        def share(part: list[dict[str, float]]) -> float:
            total = {a: sum(t[a] for t in part) for a in ARMS}
            return 100 * (total["with"] - total["without"]) / total["plain"]
        size = max(1, len(rows) // chunks)
        spread = [share(rows[k:k + size]) for k in range(0, size * chunks, size)]
        total = {a: sum(t[a] for t in rows) for a in ARMS}
        print(f"  {name}: plain step {1e3 * total['plain'] / len(rows):.0f} ms; evidence = (with - "
              f"without) / plain, of the summed times: {share(rows):+.2f}% (target <= 1%; over "
              f"{chunks} parts {min(spread):+.2f}% .. {max(spread):+.2f}%); whole recorder / plain: "
              f"without the evidence {total['without'] / total['plain']:.3f}, with it "
              f"{total['with'] / total['plain']:.3f}")
    if hook_arm:
        for name, col in (("wall, rank 0", 0), ("process CPU, rank 0", 1)):
            total = {a: sum(t[a][col] for t in ranks[0]["times"]) for a in (*ARMS, "hook")}
            print(f"  {name}: plain DDP with a Python communication hook doing DDP's arithmetic, "
                  f"against plain: {100 * (total['hook'] - total['plain']) / total['plain']:+.2f}%")
    parts = ranks[0]["direct"]
    if not parts:
        return
    plain_cpu = sum(t["plain"] for t in cpu) / len(cpu)
    cost = sum(parts.values())
    print(f"  direct, rank 0: {cost * 1e3:.2f} ms CPU per step = {100 * cost / plain_cpu:.2f}% of "
          "the plain step; by part: " + ", ".join(
              f"{k} {v * 1e3:.2f} ms ({100 * v / plain_cpu:.2f}%)" for k, v in parts.items()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=150, help="timed steps of each of the three")
    ap.add_argument("--hook-arm", action="store_true",
                    help="a fourth copy: plain DDP with a Python communication hook that only does "
                         "DDP's arithmetic (what the hook alone costs)")
    ap.add_argument("--null", action="store_true",
                    help="an A/A run: the 'with' copy is watched without the evidence too, so the "
                         "share printed is the copies' own difference (what the figure's noise is)")
    ap.add_argument("--batch", type=int, default=8, help="sequences per rank and step")
    ap.add_argument("--model", choices=sorted(MODELS), default="bench",
                    help="bench: the bench GPT; nanogpt: nanoGPT's layout, clipping and optimizer "
                         "groups (bench/nanogpt.py)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads per rank (default 1: two ranks on a loaded 2-core machine; "
                         "more threads than cores make every parallel reduction noise)")
    args = ap.parse_args()
    print(f"torch {torch.__version__}")
    report(args.steps, args.batch, args.threads, hook_arm=args.hook_arm, null=args.null, model=args.model)


if __name__ == "__main__":
    main()
