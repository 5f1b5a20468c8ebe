"""The first analysis on a fresh install against the second: what the README's first command costs.

Copies the repository (its files, no `.git`, no caches, no virtual environment) into a temporary
folder, makes a fresh virtual environment there (`python3 -m venv`), installs `--torch` first
(the CPU build: a plain torch requirement would pull CUDA's) and then the copy, non-editable
unless `--editable`. So no numba cache exists: a non-editable install's is in the new
environment's site-packages, an editable one's in the copy's `__pycache__` folders. Then runs
`warninglight demo --out DIR` and reads the seconds it prints for training, its analysis
(`analyze(trace)` in the demo's process: where the kernels compile) and the report; then
`analyze(trace)` again in a new process, with whatever numba cached the first time, and
`warninglight analyze TRACE` (the command, its process start included). The two analyses are
printed side by side, with the size of the cache the first one wrote. Last, `analyze(trace)` with
`WARNINGLIGHT_KERNELS=compiled` (every kernel compiled into numba's cache) and once more with
that cache.

`--no-install` uses the interpreter running this script and its `warninglight` instead (the
repository as installed there), with a fresh `NUMBA_CACHE_DIR` in the temporary folder: quick
iteration on a change, without waiting for an install.

Run: `python bench/first_run.py [--no-install] [--editable] [--repo DIR] [--workdir DIR] [--torch SPEC]`.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# what a fresh clone does not have: history, environments, build outputs and every cache
NOT_COPIED = (".git", ".venv", "venv", "__pycache__", "*.egg-info", "build", "dist", "runs", ".pytest_cache",
              ".ruff_cache", "*.nbi", "*.nbc")
DEMO_TIMES = re.compile(r"train ([\d.]+) s, analyse ([\d.]+) s, report ([\d.]+) s")
# `analyze(trace)` as the demo calls it, in a process of its own: import seconds, analysis seconds
TIMED_ANALYZE = ("import sys, time; t0 = time.perf_counter(); from warninglight.forensics import analyze; "
                 "t1 = time.perf_counter(); analyze(sys.argv[1]); t2 = time.perf_counter(); "
                 "print(f'{t1 - t0:.3f} {t2 - t1:.3f}')")


def _run(cmd: list[str], env: dict[str, str]) -> tuple[float, str]:
    """(wall seconds, stdout) of a command; its stderr is shown only if it fails."""
    t0 = time.perf_counter()
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    if done.returncode != 0:
        sys.exit(f"{' '.join(cmd)} exited {done.returncode}:\n{done.stdout}{done.stderr}")
    return seconds, done.stdout


def _install(work: Path, repo: Path, python: str, torch_spec: str, editable: bool, env: dict[str, str]) -> Path:
    """A fresh environment in `work` with a copy of `repo` installed; its bin folder."""
    src, venv = work / "src", work / "venv"
    shutil.copytree(repo, src, ignore=shutil.ignore_patterns(*NOT_COPIED))
    made, _ = _run([python, "-m", "venv", str(venv)], env)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q"]
    torch_s, _ = _run([*pip, torch_spec], env)
    own_s, _ = _run([*pip, *(["-e"] if editable else []), str(src)], env)
    kind = "editable" if editable else "non-editable"
    print(f"install: venv {made:.1f} s, {torch_spec} {torch_s:.1f} s, warninglight ({kind}, a copy of {repo}) "
          f"{own_s:.1f} s")
    return venv / "bin"


def _cache_files(roots: list[Path]) -> tuple[int, int]:
    """(index files, bytes) of the numba cache under `roots`."""
    files = [p for r in roots if r.exists() for p in r.rglob("*") if p.suffix in (".nbi", ".nbc")]
    return sum(p.suffix == ".nbi" for p in files), sum(p.stat().st_size for p in files)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--no-install", action="store_true",
                    help="use this interpreter's warninglight, with only a fresh NUMBA_CACHE_DIR")
    ap.add_argument("--editable", action="store_true", help="install the copy with pip install -e")
    ap.add_argument("--repo", type=Path, default=REPO, help="the checkout to copy and install (default: this one)")
    ap.add_argument("--python", default="python3", help="the interpreter the fresh venv is made from")
    ap.add_argument("--torch", default="torch==2.13.0", help="the torch requirement installed first")
    ap.add_argument("--workdir", type=Path, default=None,
                    help="a new folder to work in, kept afterwards (default: a temporary one, removed)")
    args = ap.parse_args()
    if args.workdir is not None and args.workdir.exists():
        sys.exit(f"--workdir {args.workdir} exists; pass a new folder (the copy, venv and demo go there)")
    work = args.workdir or Path(tempfile.mkdtemp(prefix="warninglight-first-run-"))
    work.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    try:
        if args.no_install:  # this interpreter as it runs, PYTHONPATH included
            bin_dir = Path(sys.executable).parent
            env["NUMBA_CACHE_DIR"] = str(work / "numba-cache")
            print(f"no install: {sys.executable}, NUMBA_CACHE_DIR={env['NUMBA_CACHE_DIR']} (empty)")
        else:  # nothing of the caller's environment reaches into the new one
            for name in ("NUMBA_CACHE_DIR", "PYTHONPATH", "VIRTUAL_ENV"):
                env.pop(name, None)
            bin_dir = _install(work, args.repo.resolve(), args.python, args.torch, args.editable, env)
        _measure(work, bin_dir, env)
    finally:
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)


def _measure(work: Path, bin_dir: Path, env: dict[str, str]) -> None:
    """Run the demo, then the second analyses with the cache it left, and print the figures."""
    cli, python = str(bin_dir / "warninglight"), str(bin_dir / "python")
    out = work / "demo"
    demo_s, printed = _run([cli, "demo", "--out", str(out)], env)
    found = DEMO_TIMES.search(printed)
    if found is None:
        sys.exit(f"the demo printed no 'train N s, analyse N s, report N s' line:\n{printed}")
    train, analyse, report = (float(x) for x in found.groups())
    print(f"demo: train {train:.1f} s, analyse {analyse:.1f} s, report {report:.1f} s ({demo_s:.1f} s wall)")
    trace = str(out / "trace")
    _, timed = _run([python, "-c", TIMED_ANALYZE, trace], env)
    import_s, again = (float(x) for x in timed.split())
    cli_s, _ = _run([cli, "analyze", trace], env)
    roots = [Path(env["NUMBA_CACHE_DIR"])] if "NUMBA_CACHE_DIR" in env else [work]
    index, size = _cache_files(roots)
    print(f"{'':34s}{'first (no cache)':>18s}{'second':>18s}")
    print(f"{'analyze(trace), in its process':34s}{analyse:>16.1f} s{again:>16.2f} s")
    print(f"{'warninglight analyze TRACE, wall':34s}{'':>18s}{cli_s:>16.2f} s")
    print(f"(second process: import of warninglight.forensics.analyze {import_s:.2f} s; "
          f"numba cache: {index} index files, {size / 1e6:.1f} MB)")
    # every kernel compiled into the cache, then the analysis a later process makes with it
    _, compiling = _run([python, "-c", TIMED_ANALYZE, trace], {**env, "WARNINGLIGHT_KERNELS": "compiled"})
    _, cached = _run([python, "-c", TIMED_ANALYZE, trace], env)
    print(f"compiled: analyze(trace) with WARNINGLIGHT_KERNELS=compiled {float(compiling.split()[1]):.1f} s, "
          f"then with what it cached {float(cached.split()[1]):.2f} s")


if __name__ == "__main__":
    main()
