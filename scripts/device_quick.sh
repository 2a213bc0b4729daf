#!/usr/bin/env bash
# A first device check of new work: the GPU tests of the named files, then the prefill
# suite and sweep (quick), logs under OUTDIR; summary lines on stdout.
#   scripts/device_quick.sh OUTDIR test_file.py ...
set -uo pipefail
out=${1:?usage: scripts/device_quick.sh OUTDIR TESTFILE...}
shift
mkdir -p "$out"
cd "$(dirname "$0")/.." || exit 2
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 CUATTN_TEST_KEEP_CACHE=1
export CUATTN_CACHE_DIR=${CUATTN_CACHE_DIR:-$PWD/out/cache}
files=()
for f in "$@"; do files+=("tests/$f"); done
timeout "${TESTS_TIMEOUT:-330}" python3 -m pytest -q -m gpu -p no:cacheprovider -rfE \
    --maxfail=20 "${files[@]}" > "$out/pytest.txt" 2>&1
echo "pytest exit $?"
grep -E "^(FAILED|ERROR)|passed|failed" "$out/pytest.txt" | head -30
grep -E "^E  " "$out/pytest.txt" | head -40
timeout "${BENCH_TIMEOUT:-150}" python3 bench/run.py --suite prefill ${BENCH_ARGS:---quick} > "$out/prefill.txt" 2>&1
echo "prefill exit $?"; tail -40 "$out/prefill.txt"
timeout "${SWEEP_TIMEOUT:-100}" python3 bench/lab/prefill_sweep.py ${SWEEP_ARGS:---quick} > "$out/sweep.txt" 2>&1
echo "sweep exit $?"; tail -12 "$out/sweep.txt"
