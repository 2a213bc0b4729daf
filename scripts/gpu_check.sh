#!/usr/bin/env bash
# One call on a GPU machine: device info, precompile, the GPU test suite and the
# benchmarks, every log written into the directory given as $1 (default ./out).
#   SUITES="merge flash decode"  benchmark suites (default: all)     QUICK=1  fewer configs
#   PYTEST_ARGS="-k merge"       extra pytest arguments              SANITIZE=1  also run
#   compute-sanitizer (memcheck, racecheck) over the tests named by SANITIZE_TESTS
set -uo pipefail
out=${1:-out}
mkdir -p "$out"
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
export CUATTN_CACHE_DIR=${CUATTN_CACHE_DIR:-/tmp/cuattn-cache}
export CUATTN_TEST_KEEP_CACHE=1   # tests reuse the precompiled kernels

python3 -m cuattn info 2>&1 | tee "$out/info.txt"
python3 -m cuattn precompile -q 2>&1 | tee "$out/precompile.txt"

# shellcheck disable=SC2086
python3 -m pytest -q -m gpu -p no:cacheprovider -rfE ${PYTEST_ARGS:-} tests/ 2>&1 \
    | tee "$out/pytest.txt"
echo "pytest exit: ${PIPESTATUS[0]}" | tee -a "$out/pytest.txt"

if [ "${SANITIZE:-0}" = 1 ]; then
  for tool in memcheck racecheck; do
    # shellcheck disable=SC2086
    compute-sanitizer --tool "$tool" --error-exitcode 9 python3 -m pytest -q -x -m gpu \
        -p no:cacheprovider ${SANITIZE_TESTS:-tests/test_merge.py} > "$out/sanitize_$tool.txt" 2>&1
    echo "compute-sanitizer $tool exit: $?" | tee -a "$out/sanitize_$tool.txt"
    tail -n 3 "$out/sanitize_$tool.txt"
  done
fi

quick=(); [ "${QUICK:-0}" = 1 ] && quick=(--quick)
# shellcheck disable=SC2086
python3 bench/run.py ${SUITES:+--suite $SUITES} "${quick[@]}" --json "$out/bench.json" \
    --plot "$out/bench.png" 2>&1 | tee "$out/bench.txt"
