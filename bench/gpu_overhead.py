"""The recorder's cost on a GPU: a 124M-parameter GPT in bf16 autocast, eager and torch.compile'd.

Two copies of the same model (same initial weights, same batches) train side by side in one
process: one watched by the recorder (every step, every component), one not. Blocks of steps
alternate between them (order swapped every other pair), so drift in clocks and load hits both;
each model is compiled once, so no recompilation sits inside a timed block. Prints step times
(median, quartiles), the median ratio with/without and its quartiles, and the GPU model.

Run: `python bench/gpu_overhead.py` (one short run on a CUDA machine: ~2 compilations and 400
timed steps), or `python bench/gpu_overhead.py --tiny` to check the script itself on CPU (a tiny
GPT; torch.compile with the "eager" backend unless --backend is given).
"""

from __future__ import annotations

import argparse
import copy
import glob
import statistics
import tempfile
import time
from collections.abc import Callable

import pyarrow.parquet as pq
import torch
import torch.nn.functional as F
from warninglight.lab import zoo
from warninglight.tracer import schema, watch


def build(tiny: bool, device: str) -> tuple[torch.nn.Module, zoo.GPTConfig]:
    """The GPT-2 small shape (weights of the head tied to the embedding: 124M), or a tiny one."""
    if tiny:
        cfg = zoo.GPTConfig(vocab_size=96, block_size=64, n_layer=2, n_head=2, n_embd=64)
    else:
        cfg = zoo.GPTConfig(vocab_size=50304, block_size=1024, n_layer=12, n_head=12, n_embd=768)
    model = zoo.TinyGPT(cfg)
    model.lm_head.weight = model.wte.weight  # GPT-2 ties them
    return model.to(device), cfg


def _own_forward(cls: type) -> type:
    """A subclass of `cls` whose forward is a code object of its own. Dynamo caches compiled
    graphs per code object, and a graph traced without hooks does not guard against them: the
    watched copy would otherwise run the plain copy's graph and record no forward statistics
    after its first step."""
    def forward(self: torch.nn.Module, idx: torch.Tensor) -> torch.Tensor:
        return cls.forward(self, idx)
    return type(f"Plain{cls.__name__}", (cls,), {"forward": forward})


def make_step(model: torch.nn.Module, opt: torch.optim.Optimizer, cfg: zoo.GPTConfig, batch: int,
              device: str, amp: bool, rec: object | None) -> Callable[[int], None]:
    """One training step on synthetic tokens drawn from a per-step seed (the same for both copies)."""
    gen = torch.Generator(device=device)

    def step(i: int) -> None:
        gen.manual_seed(i)
        x = torch.randint(0, cfg.vocab_size, (batch, cfg.block_size + 1), device=device, generator=gen)
        with torch.autocast(device_type=device, dtype=torch.bfloat16, enabled=amp):
            logits = model(x[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), x[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if rec is not None:
            rec.log(loss=loss)  # type: ignore[attr-defined]
    return step


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def timed_block(step: Callable[[int], None], first: int, steps: int, device: str) -> float:
    """Seconds per step over `steps` steps (synchronised at the block's ends only)."""
    sync(device)
    t0 = time.perf_counter()
    for i in range(first, first + steps):
        step(i)
    sync(device)
    return (time.perf_counter() - t0) / steps


def quartiles(xs: list[float]) -> tuple[float, float, float]:
    q = statistics.quantiles(xs, n=4) if len(xs) > 1 else [xs[0]] * 3
    return q[0], statistics.median(xs), q[2]


def measure(label: str, plain_step: Callable[[int], None], rec_step: Callable[[int], None],
            args: argparse.Namespace, device: str) -> None:
    """Warm both up (compilation happens here), then alternate timed blocks; print the figures."""
    t0 = time.perf_counter()
    for i in range(args.warmup):
        plain_step(i)
        rec_step(i)
    sync(device)
    print(f"{label}: warm-up (incl. compilation) {time.perf_counter() - t0:.1f} s")
    with_t, without_t, ratio = [], [], []
    start = args.warmup
    for pair in range(args.pairs):
        order = (rec_step, plain_step) if pair % 2 else (plain_step, rec_step)
        times = {}
        for fn in order:
            times[fn] = timed_block(fn, start, args.steps, device)
        start += args.steps
        with_t.append(times[rec_step])
        without_t.append(times[plain_step])
        ratio.append(times[rec_step] / times[plain_step])
    for name, xs, scale, unit in (("step without", without_t, 1e3, "ms"), ("step with", with_t, 1e3, "ms"),
                                  ("ratio with/without", ratio, 1.0, "")):
        lo, mid, hi = quartiles(xs)
        print(f"  {name:<20s} median {mid * scale:8.3f}{unit}  quartiles {lo * scale:.3f}-{hi * scale:.3f}{unit}")


def forward_rows(trace: str) -> tuple[int, int]:
    """(health rows with forward statistics, all health rows) in a trace (read with pyarrow: a
    GPU image may lack the engine's packages)."""
    rows = [pq.read_table(f, columns=["out_rms"]).column(0) for f in glob.glob(schema.segment_glob(trace, "health"))]
    return sum(len(c) - c.null_count for c in rows), sum(len(c) for c in rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="a tiny GPT on CPU: checks the script, measures nothing")
    ap.add_argument("--batch", type=int, default=None, help="sequences per step (default 16; tiny 4)")
    ap.add_argument("--steps", type=int, default=None, help="steps per timed block (default 20; tiny 3)")
    ap.add_argument("--pairs", type=int, default=None, help="with/without block pairs (default 5; tiny 2)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed steps each (default 5; tiny 2)")
    ap.add_argument("--backend", default=None, help="torch.compile backend (default inductor; tiny eager)")
    ap.add_argument("--skip-compile", action="store_true", help="eager mode only")
    args = ap.parse_args()
    tiny = args.tiny
    device = "cpu" if tiny else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run on a GPU machine, or use --tiny to check the script on CPU")
    args.batch = args.batch or (4 if tiny else 16)
    args.steps = args.steps or (3 if tiny else 20)
    args.pairs = args.pairs or (2 if tiny else 5)
    args.warmup = args.warmup or (2 if tiny else 5)
    backend = args.backend or ("eager" if tiny else "inductor")
    torch.manual_seed(0)
    plain, cfg = build(tiny, device)
    watched = copy.deepcopy(plain)
    plain.__class__ = _own_forward(type(plain))
    n_params = sum(p.numel() for p in plain.parameters())
    gpu = torch.cuda.get_device_name() if device == "cuda" else "none (CPU, --tiny: not a GPU figure)"
    print(f"torch {torch.__version__}; device: {gpu}")
    print(f"GPT {cfg.n_layer} layers, d={cfg.n_embd}, seq {cfg.block_size}, vocab {cfg.vocab_size}, "
          f"{n_params / 1e6:.1f}M parameters; batch {args.batch}; bf16 autocast; AdamW")
    opt_plain = torch.optim.AdamW(plain.parameters(), lr=3e-4)
    opt_watched = torch.optim.AdamW(watched.parameters(), lr=3e-4)
    modes = [("eager", None)] if args.skip_compile else [("eager", None), ("torch.compile", backend)]
    with tempfile.TemporaryDirectory() as tmp:
        for label, be in modes:
            trace = f"{tmp}/{label.replace('.', '_')}"
            rec = watch(watched, opt_watched, trace)  # hooks first, then compile (as users do)
            run_plain = torch.compile(plain, backend=be) if be else plain
            run_watched = torch.compile(watched, backend=be) if be else watched
            if be:
                label = f"{label} (default mode, backend {be})"
            measure(label, make_step(run_plain, opt_plain, cfg, args.batch, device, True, None),
                    make_step(run_watched, opt_watched, cfg, args.batch, device, True, rec), args, device)
            rec.close()
            seen, rows = forward_rows(trace)
            print(f"  trace: {rows} health rows, {seen} with forward statistics; "
                  f"{rec.dropped_steps} steps dropped")
    if device == "cuda":
        print(f"peak GPU memory {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB (both copies)")


if __name__ == "__main__":
    main()
