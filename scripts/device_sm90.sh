#!/usr/bin/env bash
# The Hopper kernel's device check: the GPU tests of both flash kernels (tests/test_flash.py
# runs each on "mma" and "wgmma"; the flash hook tests of tests/test_prefill.py likewise;
# TESTS=0 skips them), optionally the flash fuzz (FUZZ=1: 300 cases per function) and
# compute-sanitizer over SANITIZE_TESTS (scripts/sanitize.sh, TOOLS as it says), then the
# flash suite (cuattn wgmma and mma.sync beside FA2 and cuDNN, same run; BENCH=0 skips it);
# logs under OUTDIR, summary lines on stdout.
#   scripts/device_sm90.sh OUTDIR [pytest -k expression]
set -uo pipefail
out=${1:?usage: scripts/device_sm90.sh OUTDIR [K_EXPR]}
kexpr=${2:-}
mkdir -p "$out"
cd "$(dirname "$0")/.." || exit 2
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 CUATTN_TEST_KEEP_CACHE=1
export CUATTN_CACHE_DIR=${CUATTN_CACHE_DIR:-$PWD/out/cache}
if [ "${TESTS:-1}" = 1 ]; then
  timeout "${TESTS_TIMEOUT:-300}" python3 -m pytest -q -m gpu -p no:cacheprovider -rfE \
      --maxfail="${MAXFAIL:-30}" tests/test_flash.py tests/test_prefill.py \
      -k "${kexpr:-not prefill or flash_hooks or flash_varlen_hooks}" \
      > "$out/pytest.txt" 2>&1
  echo "pytest exit $?"
  grep -E "^(FAILED|ERROR)|passed|failed" "$out/pytest.txt" | head -40
  grep -E "^E  " "$out/pytest.txt" | head -30
fi
if [ "${FUZZ:-0}" = 1 ]; then
  timeout "${FUZZ_TIMEOUT:-240}" python3 -m pytest -q -m gpu -p no:cacheprovider -rfE \
      "tests/test_fuzz.py::test_fuzz[flash_forward]" \
      "tests/test_fuzz.py::test_fuzz[flash_varlen_forward]" > "$out/fuzz.txt" 2>&1
  echo "fuzz exit $?"; grep -E "^(FAILED|ERROR)|passed|failed" "$out/fuzz.txt" | head -10
fi
if [ -n "${SANITIZE_TESTS:-}" ]; then
  SANITIZE_TESTS="$SANITIZE_TESTS" bash scripts/sanitize.sh "$out/sanitize" > "$out/sanitize.txt" 2>&1
  echo "sanitize exit $?"; cat "$out/sanitize/sanitize_summary.txt" 2>/dev/null
fi
if [ "${BENCH:-1}" = 1 ]; then
  timeout "${BENCH_TIMEOUT:-200}" python3 bench/run.py --suite flash ${BENCH_ARGS:-} \
      > "$out/flash.txt" 2>&1
  echo "flash bench exit $?"; tail -40 "$out/flash.txt"
fi
