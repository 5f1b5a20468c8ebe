#!/usr/bin/env bash
# The GPU checks of docs/overhead.md in one run, for a CUDA machine that reaches no network: the
# CUDA sync-debug test, then `bench/gpu_overhead.py` (arguments are passed to it). Each one's
# output goes to a file in $OUT (else ./gpu-check), and the exit status is non-zero if either
# failed. Nothing is installed: the recorder is imported from this checkout through a folder of
# links, so the machine needs only Python with torch (CUDA), numpy, pyarrow and pytest.
#
#   bash bench/gpu_check.sh           # on the GPU machine: its timeouts fit one 10-minute call
#   bash bench/gpu_check.sh --tiny    # on CPU: checks this script (the sync test is skipped)
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-gpu-check}"
mkdir -p "$out"
py="${PYTHON:-python3}"
links="$(mktemp -d)"
trap 'rm -rf "$links"' EXIT
mkdir -p "$links/warninglight"
for part in tracer lab; do ln -s "$PWD/$part" "$links/warninglight/$part"; done
export PYTHONPATH="$links${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

{
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1 || echo "no nvidia-smi"
    "$py" -c "import torch; print('torch', torch.__version__, 'CUDA', torch.cuda.is_available())"
} 2>&1 | tee "$out/machine.txt"

# without the suite's conftest, which imports the engine (polars, duckdb, numba): the recorder's
# test needs none of them
timeout 150 "$py" -m pytest -q -rs --noconftest -p no:cacheprovider tests/test_recorder_cost.py -k cuda \
    2>&1 | tee "$out/sync-test.txt"
sync=${PIPESTATUS[0]}

timeout 400 "$py" bench/gpu_overhead.py "$@" 2>&1 | tee "$out/gpu-overhead.txt"
bench=${PIPESTATUS[0]}

echo "sync test: exit $sync; gpu_overhead.py: exit $bench" | tee -a "$out/machine.txt"
[ "$sync" -eq 0 ] && [ "$bench" -eq 0 ]
