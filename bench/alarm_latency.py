"""How long a live alarm takes to reach a sink: from its step's end to the sink's `send`.

Trains the zoo's MLP under `watch(..., alarms=[...])` with a weight-corruption drill (its layer
"2" scaled 10x at `--fault`), a JSONL sink and an in-process sink that notes when each alarm
arrives, and prints per alarm the delay after the wall time of its step, beside the bound the
design gives: segments close every LIVE_FLUSH_STEPS steps or LIVE_FLUSH_S seconds, the last
finished step waits one more step for late logs, then the segment is written and classified.

    python bench/alarm_latency.py [--steps 220] [--fault 100]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from typing import Any

import torch
import torch.nn.functional as F
from warninglight.lab import zoo
from warninglight.lab.drills import WeightCorruption
from warninglight.tracer import watch
from warninglight.tracer.recorder import LIVE_FLUSH_S, LIVE_FLUSH_STEPS


class Arrivals:
    """A sink object: keeps each alarm with the wall time it arrived."""

    def __init__(self) -> None:
        self.got: list[tuple[float, dict[str, Any]]] = []

    def send(self, alarm: dict[str, Any]) -> None:
        self.got.append((time.time(), alarm))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=220, help="training steps")
    ap.add_argument("--fault", type=int, default=100, help="step at which the drill scales the layer")
    args = ap.parse_args()
    torch.manual_seed(0)
    model = zoo.mlp()
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    data = zoo.batches(*zoo.teacher_classification(n=1024), 64)
    drill = WeightCorruption("2", args.fault, mode="scale", factor=10.0)
    drill.attach(model, opt)
    arrivals, step_s = Arrivals(), []
    with tempfile.TemporaryDirectory() as tmp:
        try:
            with watch(model, opt, f"{tmp}/run", alarms=[f"jsonl:{tmp}/alarms.jsonl", arrivals]):
                for step in range(1, args.steps + 1):
                    start = time.perf_counter()
                    _, x, y = next(data)
                    drill.before_step(step, model, opt)
                    loss = F.cross_entropy(model(x), y)
                    opt.zero_grad()
                    loss.backward()
                    opt.step()
                    step_s.append(time.perf_counter() - start)
        finally:
            drill.detach()
    step_max = max(step_s)
    bound = LIVE_FLUSH_S + 2 * step_max
    print(f"{args.steps} steps of the zoo MLP, {statistics.median(step_s) * 1e3:.1f} ms/step "
          f"(max {step_max * 1e3:.1f}); segments every {LIVE_FLUSH_STEPS} steps or {LIVE_FLUSH_S:g} s; "
          f"load average {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    if not arrivals.got:
        print("no alarm reached the sink")
        return
    delays = [t - a["step_wall_time_s"] for t, a in arrivals.got]
    for (_, a), d in zip(arrivals.got, delays, strict=True):
        print(f"  step {a['step']:4d} {a['condition']:<18s} on {a['observed_on']:<6s} arrived after {d:.2f} s")
    print(f"{len(delays)} alarms: delay median {statistics.median(delays):.2f} s, max {max(delays):.2f} s; "
          f"flush interval + two steps = {bound:.2f} s, the rest is writing and classifying")


if __name__ == "__main__":
    main()
