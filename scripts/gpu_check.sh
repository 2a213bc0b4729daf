#!/usr/bin/env bash
# One call on a GPU machine: device info, precompile, the GPU test suite and the
# benchmarks, every log written into the directory given as $1 (default ./out).
#   SUITES="merge flash decode"  benchmark suites (default: all)     QUICK=1  fewer configs
#   PYTEST_ARGS="-k merge"       extra pytest arguments
#   SANITIZE=1   also compute-sanitizer memcheck and racecheck over a reduced suite that
#                still reaches every kernel and boundary path (MEMCHECK_TESTS / RACECHECK_TESTS)
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

# Odd lengths, partial tiles, partial last KV blocks, one and many v2 partitions, split-KV,
# empty sequences, fp8, every kernel (merge, flash forward + combine, paged v1/v2/reduce,
# reshape_and_cache).
reduced="tests/test_merge.py tests/test_flash.py::test_varlen
 tests/test_flash.py::test_num_splits_match_unsplit tests/test_flash.py::test_small_against_numpy_float64
 tests/test_flash.py::test_seqlen_k_zero_and_no_key_rows tests/test_paged.py::test_gqa_ratios_v1_v2_auto_agree
 tests/test_paged.py::test_block_sizes tests/test_paged.py::test_fp8_cache
 tests/test_paged.py::test_partition_sizes_and_gqa_16 tests/test_paged.py::test_reshape_and_cache_round_trip"
if [ "${SANITIZE:-0}" = 1 ]; then
  for tool in memcheck racecheck; do
    var=$(echo "${tool^^}_TESTS")
    # shellcheck disable=SC2086
    timeout 400 compute-sanitizer --tool "$tool" --error-exitcode 9 python3 -m pytest -q -m gpu \
        -p no:cacheprovider ${!var:-$reduced} > "$out/sanitize_$tool.txt" 2>&1
    echo "compute-sanitizer $tool exit: $?" | tee -a "$out/sanitize_$tool.txt"
    grep -E "passed|failed|ERROR SUMMARY|RACECHECK SUMMARY" "$out/sanitize_$tool.txt" | tail -n 3
  done
fi

quick=(); [ "${QUICK:-0}" = 1 ] && quick=(--quick)
# shellcheck disable=SC2086
python3 bench/run.py ${SUITES:+--suite $SUITES} "${quick[@]}" --json "$out/bench.json" \
    --plot "$out/bench.png" 2>&1 | tee "$out/bench.txt"
