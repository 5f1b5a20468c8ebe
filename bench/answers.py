"""The engine's answers, written down so two versions can be held to each other.

For every shipped sample trace: `analyze`'s JSON, the replay's events and the benchmark's score
of the trace (`eval --trace`); with `--rehearse`, also the rehearsal benchmark's scores of fresh
runs (`warninglight eval`, one seed). Timings are left out. Run it once per version and compare:

    python bench/answers.py --out /tmp/new.json
    PYTHONPATH=/path/to/old/tree python bench/answers.py --out /tmp/old.json
    python bench/answers.py --compare /tmp/old.json /tmp/new.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
TIMING = ("seconds", "elapsed", "wall")


def _plain(x: Any) -> Any:
    """`x` without its timing fields, in JSON's types."""
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items() if not any(t in k for t in TIMING)}
    if isinstance(x, list | tuple):
        return [_plain(v) for v in x]
    return x


def answers(rehearse: bool) -> dict[str, Any]:
    from warninglight.forensics import analyze, replay
    from warninglight.lab import evaluation

    traces = sorted(p for p in (ROOT / "sample_traces").iterdir() if (p / "manifest").is_dir())
    out: dict[str, Any] = {}
    for t in traces:
        out[t.name] = {"analyze": _plain(analyze(t).to_dict()), "replay": _plain(replay(t).to_dict())}
        print(t.name, file=sys.stderr)
    out["eval --trace"] = _plain([r.to_dict() for r in evaluation.judge_recorded(traces)])
    if rehearse:
        from warninglight.lab.rehearsal import SCENARIOS

        runs = evaluation.run_benchmark(list(SCENARIOS), 1)
        out["eval"] = _plain([r.to_dict() for r in runs])
    return out


def compare(old: dict[str, Any], new: dict[str, Any]) -> int:
    """Print each key whose answer differs; the number that differ."""
    differ = 0
    for key in sorted(set(old) | set(new)):
        if old.get(key) != new.get(key):
            differ += 1
            print(f"DIFFERS: {key}")
    print(f"{len(set(old) | set(new)) - differ} of {len(set(old) | set(new))} answers the same")
    return differ


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, help="write this version's answers here (JSON)")
    parser.add_argument("--rehearse", action="store_true", help="also train the rehearsal benchmark's runs (minutes)")
    parser.add_argument("--compare", nargs=2, type=Path, metavar=("OLD", "NEW"), help="compare two answer files")
    args = parser.parse_args()
    if args.compare:
        old, new = (json.loads(p.read_text()) for p in args.compare)
        sys.exit(1 if compare(old, new) else 0)
    if args.out is None:
        parser.error("pass --out FILE or --compare OLD NEW")
    args.out.write_text(json.dumps(answers(args.rehearse), indent=1, sort_keys=True, default=str))


if __name__ == "__main__":
    main()
