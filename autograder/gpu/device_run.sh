#!/bin/bash
# One call on a CUDA machine lent by the device tool (an image with torch but not the course's
# other packages): install those from .whl/ (autograder/gpu/fetch_wheels.sh, run here beforehand),
# then at once: the allocation-census probe, `gclab gpu-check` (every lesson on CUDA and on CPU), the
# device test modules, and the grading of the submissions in autograder/gpu/wrong_fixes/ and
# .gpu_extra/ (mistakes only a GPU shows).  Everything lands in $OUT.
#
#   bash autograder/gpu/device_run.sh [LESSON ...] [--side cuda]     (timeout_s: about 360;
#   carry [".whl"]; measured: 291 s with both sides, 285 s with --side cuda on an H100)
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/gclab-gpu-out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile .whl/*.whl -e . \
    > "$OUT/install.log" 2>&1 || { tail -20 "$OUT/install.log"; exit 3; }
python3 -c "import torch, gclab.tools.gpucheck as g; print(g.device_line())" || exit 3
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
timeout 60 python3 autograder/gpu_census_probe.py > "$OUT/probe.log" 2>&1; cut -c1-600 "$OUT/probe.log"
timeout 280 python3 -m pytest -q -p no:cacheprovider -n 3 --dist loadfile -rfE --durations=10 \
    tests/test_memory.py tests/test_held.py tests/test_cycles.py tests/test_cycle_detector.py \
    tests/test_gcwatch.py tests/test_checks.py tests/test_serving.py tests/test_traces.py \
    > "$OUT/device_tests.log" 2>&1 &
extra=$(ls autograder/gpu/wrong_fixes/*.ipynb .gpu_extra/*.ipynb 2>/dev/null)
if [ -n "$extra" ]; then
    timeout 280 python3 -m gclab grade $extra > "$OUT/extra.log" 2>&1 &
fi
timeout 280 python3 -m gclab gpu-check --no-tests --jobs 4 --json "$OUT/gpucheck.json" "$@" > "$OUT/gpucheck.log" 2>&1
echo "gpu-check exit $?"
wait
grep -v "^\[" "$OUT/gpucheck.log" | cut -c1-300
echo "== device tests"; grep -E "passed|failed|FAILED|ERROR" "$OUT/device_tests.log" | tail -15
echo "== extra"; cat "$OUT/extra.log" 2>/dev/null | cut -c1-300 | tail -30
