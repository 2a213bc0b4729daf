#!/usr/bin/env bash
# One call on a GPU machine: device info, precompile, the GPU test suite and the
# benchmarks, every log written into the directory given as $1 (default ./out).
#   SUITES="merge flash decode"  benchmark suites (default: all)     QUICK=1  fewer configs
#   PYTEST_ARGS="-k merge"       extra pytest arguments
#   SANITIZE=1   also scripts/sanitize.sh: compute-sanitizer (memcheck, racecheck, initcheck,
#                synccheck) over a reduced suite that still reaches every kernel and boundary
#                path (TOOLS, SANITIZE_TESTS, <TOOL>_TESTS, ... as documented there)
set -uo pipefail
out=${1:-out}
mkdir -p "$out"
cd "$(dirname "$0")/.." || exit 2
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
  bash scripts/sanitize.sh "$out"    # memcheck, racecheck, initcheck, synccheck: see its header
fi

quick=(); [ "${QUICK:-0}" = 1 ] && quick=(--quick)
# shellcheck disable=SC2086
python3 bench/run.py ${SUITES:+--suite $SUITES} "${quick[@]}" --json "$out/bench.json" \
    --plot "$out/bench.png" 2>&1 | tee "$out/bench.txt"
