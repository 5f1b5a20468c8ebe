"""Rebuild every committed sample trace: `python sample_traces/generate.py` (about a minute on a CPU).

Each trace is a real small training run (`warninglight.lab.rehearsal.rehearse`, seed 0) with
one fault drill or none, recorded by `watch`, with a checkpoint event every 100 steps (no
checkpoint files are written: the events say where they would be) and the batch ids of each step.
Runs are deterministic (fixed seeds, one CPU thread); only wall-clock columns differ between builds.
The committed traces keep every bit of every column: they were recorded before the recorder
stored its estimate columns to 10 significand bits (docs/trace-format.md, "Precision"). A rebuild
writes what `watch` writes by default; tests/test_precision.py checks that the engine's answers
on them do not move with that rounding.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent

# name of the trace folder = rehearsal scenario; the comment says what it shows
TRACES = (
    "gpt_weight_corruption",   # memory corruption: one GPT MLP layer's weights scaled ×10 once
    "cnn_bitflip",             # memory corruption: exponent bit flips in 0.2% of a conv layer's weights
    "mlp_dying_layer",         # a layer dies gradually: its bias sinks for 100 steps, its ReLU goes dead
    "cnn_dying_layer",         # the same on a conv layer
    "gpt_dying_layer",         # the same on a GPT MLP layer
    "gpt_lr_spike",            # the optimiser's learning rate jumps ×20 for every parameter
    "gpt_nan",                 # NaN from one module's forward output
    "cnn_corrupt_batches",     # a window of 20 corrupted input batches
    "mlp_saturation_gradual",  # a tanh's inputs scaled up over 30 steps until it saturates
    "mlp_creeping_corruption", # one layer's weights grow 3% a step behind the optimizer for 150 steps
    "mlp_clean",
    "cnn_clean",
    "gpt_clean",
)


def _remove_trace(path: Path) -> None:
    """Delete a previous build of a trace (a re-run into it would add an incarnation instead)."""
    if path.exists():
        if not (path / "manifest").is_dir():
            sys.exit(f"refusing to delete {path}: it is not a trace directory")
        shutil.rmtree(path)


def size_bytes(path: Path) -> int:
    """Total size of the files under `path`."""
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def build(names: list[str], out: Path) -> list[dict[str, object]]:
    """Rehearse each scenario into `out/<name>`; return one summary row per trace."""
    from warninglight.lab.rehearsal import SCENARIOS, rehearse

    torch.set_num_threads(1)  # same reduction order on every machine
    # Run from out's parent with relative paths, so the checkpoint events name
    # `sample_traces/<name>/checkpoints/...` rather than this machine's absolute path.
    out = out.resolve()
    os.chdir(out.parent)
    rows = []
    for name in names:
        trace = Path(out.name) / name
        _remove_trace(trace)
        truth = rehearse(name, trace, seed=0, checkpoint_every=100)
        rows.append({"trace": name, "model": SCENARIOS[name].model, "steps": truth["steps"],
                     "fault": truth.get("fault", "clean"), "component": truth.get("component"),
                     "step": truth.get("step"), "kind": truth.get("kind", "—"),
                     "kB": round(size_bytes(trace) / 1024)})
        print(f"{name}: {rows[-1]['fault']} {rows[-1]['kB']} kB", flush=True)
    return rows


def write_readme(rows: list[dict[str, object]], out: Path) -> None:
    """sample_traces/README.md: what each trace holds, from the truth.json files just written."""
    lines = [
        "# Sample traces",
        "",
        "Real small training runs recorded by Warning Light, each with `truth.json`: the fault a drill",
        "injected (kind, component, first step it acted) or `\"healthy\": true` for a clean run.",
        "Checkpoint events every 100 steps (no checkpoint files are committed) and batch ids are",
        "recorded. Rebuild them all with `python sample_traces/generate.py`.",
        "",
        "Try: `warninglight analyze sample_traces/mlp_dying_layer` or",
        "`warninglight report sample_traces/gpt_weight_corruption -o report.html`.",
        "",
        "| trace | model | steps | fault | component | injected at step | kind | size (kB) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        comp = r["component"]
        comp = "—" if comp is None else ("(all parameters)" if comp == "" else f"`{comp}`")
        lines.append(f"| `{r['trace']}` | {r['model']} | {r['steps']} | {r['fault']} | {comp} | "
                     f"{r['step'] or '—'} | {r['kind']} | {r['kB']} |")
    lines += ["", f"Total: {sum(int(r['kB']) for r in rows)} kB.", ""]
    (out / "README.md").write_text("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help="traces to rebuild (default: all)")
    parser.add_argument("--out", type=Path, default=HERE, help="folder to write into (default: sample_traces/)")
    args = parser.parse_args()
    unknown = [n for n in args.names if n not in TRACES]
    if unknown:
        sys.exit(f"unknown sample trace {unknown[0]!r}; expected one of: {', '.join(TRACES)}")
    names = args.names or list(TRACES)
    out = args.out.resolve()
    rows = build(names, out)
    if not args.names:
        write_readme(rows, out)
    print(json.dumps({"traces": len(rows), "total_kB": sum(int(r["kB"]) for r in rows)}))


if __name__ == "__main__":
    main()
