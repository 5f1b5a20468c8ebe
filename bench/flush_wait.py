"""What one-segment-in-flight costs the training thread: time waited at flushes, per run.

A flush waits for the previous segment to be committed before handing over the next (so a kill
never loses a backlog). This trains the zoo's MLP and GPT under `watch` with the default flush
settings and with small segments (a flush every 10 steps, the worst case for waiting), and prints
the training thread's total wait (the manifest's `flush_wait_s`) beside the run's wall time.

    python bench/flush_wait.py [--steps 400]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from warninglight.lab import zoo
from warninglight.tracer import schema, watch


def _mlp() -> tuple[torch.nn.Module, object]:
    model = zoo.mlp()
    data = zoo.batches(*zoo.teacher_classification(4096), 64)
    return model, ((x, y) for _, x, y in data)


def _gpt() -> tuple[torch.nn.Module, object]:
    tokens = zoo.char_corpus()
    model = zoo.TinyGPT(zoo.GPTConfig())
    return model, ((x, y) for _, x, y in zoo.text_batches(tokens, 8, 64))


def run(name: str, steps: int, flush_every_steps: int, root: Path) -> tuple[float, float, int]:
    """(wall seconds, seconds waited at flushes, segments) of one recorded run."""
    torch.manual_seed(0)
    model, batches = (_mlp if name == "mlp" else _gpt)()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    path = root / f"{name}-{flush_every_steps}"
    t0 = time.perf_counter()
    with watch(model, opt, path, flush_every_steps=flush_every_steps):
        for _, (x, y) in zip(range(steps), batches, strict=False):
            out = model(x)
            F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1)).backward()
            opt.step()
            opt.zero_grad()
    wall = time.perf_counter() - t0
    entry = json.loads(schema.manifest_path(path, 0).read_text())["incarnations"][-1]
    return wall, entry["flush_wait_s"], entry["segments"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=400)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores (figures from a shared "
          "machine are noisy; the wait is what matters, not the wall time)")
    print(f"{'model':6} {'flush every':>11} {'steps':>6} {'segments':>8} {'wall s':>8} {'waited s':>9} {'waited %':>8}")
    with tempfile.TemporaryDirectory() as tmp:
        for name in ("mlp", "gpt"):
            for every in (100, 10):
                wall, waited, segments = run(name, args.steps, every, Path(tmp))
                print(f"{name:6} {every:>11} {args.steps:>6} {segments:>8} {wall:>8.2f} "
                      f"{waited:>9.4f} {100 * waited / wall:>7.2f}%")


if __name__ == "__main__":
    main()
