#!/usr/bin/env bash
# One device call of a session's verification, by stage, every log under OUTDIR:
#   scripts/device_session.sh OUTDIR tests      info, precompile, the GPU test suite but fuzz
#   scripts/device_session.sh OUTDIR fuzz       the fuzz suite (CUATTN_FUZZ_CASES, default 300)
#   scripts/device_session.sh OUTDIR ab         bench/ab.py against AB_OLD (default out/ab_old,
#                                               made by scripts/ab_prepare.sh), then the host-
#                                               cost and cold-start suites
#   scripts/device_session.sh OUTDIR peers      the flash suite (cuattn, FA2, cuDNN; both methods)
#   scripts/device_session.sh OUTDIR prefill    the prefill suite, then bench/lab/prefill_sweep.py
#   scripts/device_session.sh OUTDIR sanitize   scripts/sanitize.sh (TOOLS=... to pick)
#   scripts/device_session.sh OUTDIR bwd        the backward's and its adapters' GPU tests,
#                                               the backward fuzz, then the bwd suite (its
#                                               FA3 column where PYTHONPATH has the wheel)
#   scripts/device_session.sh OUTDIR fp8        the FP8 paths' checks all at once (their tests
#                                               and the flash / prefill suites in shards, the
#                                               FP8 fuzz, the adapters' FP8 tests, memcheck and
#                                               racecheck over sanitize.sh's FP8 ids, the
#                                               accuracy table), then alone on the GPU
#                                               bench/lab/fp8_ab.py (fp8 / bf16) and
#                                               suite_fp8's paged rows; FP8_PATCHED=DIR (a copy
#                                               of the tree with a lab patch applied) adds its
#                                               FP8 tests beside and its fp8_ab after; made
#                                               here, carried as out/fp8_patched:
#     mkdir -p out/fp8_patched && git archive HEAD | tar -x -C out/fp8_patched &&
#     patch -d out/fp8_patched -p1 < bench/lab/fp8_split_producer_pingpong.patch
# The test stages run as SHARDS (default 12) pytest processes (scripts/pytest_shards.py), so
# that kernels compile in parallel; PYTEST_ARGS / FUZZ_ARGS narrow them (-k ..., node ids).
# Several stages in one call: scripts/device_session.sh OUTDIR tests fuzz. Each stage runs
# under its own time limit (<STAGE>_TIMEOUT seconds) so that a call returns its logs.
# CUATTN_CACHE_DIR defaults to out/cache (carry it to reuse kernels compiled elsewhere).
set -uo pipefail
out=${1:?usage: scripts/device_session.sh OUTDIR STAGE...}
shift
mkdir -p "$out" && out=$(cd "$out" && pwd)
cd "$(dirname "$0")/.." || exit 2
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
export CUATTN_CACHE_DIR=${CUATTN_CACHE_DIR:-$PWD/out/cache}
export CUATTN_TEST_KEEP_CACHE=1
status=0

run() {   # run NAME TIMEOUT CMD...: CMD's output to the console and OUTDIR/NAME.txt
  local name=$1 limit=$2
  shift 2
  echo "== $name ($(date +%T), limit ${limit}s): $*"
  timeout "$limit" "$@" 2>&1 | tee "$out/$name.txt"
  local rc=${PIPESTATUS[0]}
  echo "== $name exit $rc"
  [ "$rc" = 0 ] || status=1
}

shards() {   # shards NAME TIMEOUT PYTEST_ARGS...: scripts/pytest_shards.py, SHARDS processes; the
             # shard logs packed into OUTDIR/NAME_logs.tgz (a device call returns few files)
  local name=$1 limit=$2 logs=/tmp/cuattn-shards/$1
  shift 2
  rm -rf "$logs"
  run "$name" "$((limit + 30))" python3 scripts/pytest_shards.py -n "${SHARDS:-12}" \
      --logdir "$logs" --timeout "$limit" -- "$@"
  tar -czf "$out/${name}_logs.tgz" -C "$logs" .
}

in_patched() {   # in_patched CMD...: CMD in FP8_PATCHED's tree, with a kernel cache of its own
  (cd "$FP8_PATCHED" && CUATTN_CACHE_DIR=$CUATTN_CACHE_DIR-patched PYTHONPATH=$PWD "$@")
}

fp8_checks() {   # fp8_checks LIMIT: the checks of the fp8 stage as processes at once, each
                 # under LIMIT seconds, logs in OUTDIR; then a line of each log's outcome
  local -   # (set -f below: the test ids hold [...])
  set -f
  local limit=$1 fp8="tests/test_flash_fp8.py tests/test_prefill_fp8.py"
  local fuzz=tests/test_flash_fp8.py::test_fp8_fuzz
  local ids; ids=$(grep -oE "tests/test_(flash|prefill)_fp8.py::[^ ]+" scripts/sanitize.sh)
  local shards=/tmp/cuattn-shards/fp8 patched_shards=/tmp/cuattn-shards/fp8_patched
  rm -rf "$shards" "$patched_shards"
  timeout -k 10 "$limit" python3 scripts/pytest_shards.py -n "${SHARDS:-9}" --logdir "$shards" \
      --timeout "$((limit - 10))" -- -m gpu -rfE --deselect "$fuzz" $fp8 tests/test_flash.py \
      tests/test_prefill.py > "$out/fp8_tests.txt" 2>&1 &
  timeout -k 10 "$limit" python3 -m pytest -q -p no:cacheprovider -m gpu -rfE "$fuzz" \
      > "$out/fp8_fuzz.txt" 2>&1 &
  XLA_PYTHON_CLIENT_PREALLOCATE=false \
  timeout -k 10 "$limit" python3 -m pytest -q -p no:cacheprovider -m gpu -rfE -k fp8 \
      tests/test_adapters_torch.py tests/test_adapters_jax.py > "$out/fp8_adapters.txt" 2>&1 &
  timeout -k 10 "$limit" python3 bench/lab/fp8_accuracy.py > "$out/fp8_accuracy.txt" 2>&1 &
  (for tool in memcheck racecheck; do   # racecheck: cuattn's kernels only (sanitize.sh)
     timeout -k 5 "$((limit / 2 - 10))" "${COMPUTE_SANITIZER:-compute-sanitizer}" \
         --tool "$tool" --error-exitcode 9 \
         --print-limit 50 $([ "$tool" = racecheck ] && echo --kernel-name kns=cuattn_) \
         python3 -m pytest -q -p no:cacheprovider -m gpu $ids > "$out/fp8_$tool.txt" 2>&1
     echo "exit $?" >> "$out/fp8_$tool.txt"
   done) &
  if [ -n "${FP8_PATCHED:-}" ]; then
    in_patched timeout -k 10 "$limit" python3 scripts/pytest_shards.py -n 3 \
        --logdir "$patched_shards" --timeout "$((limit - 10))" -- -m gpu -rfE $fp8 \
        > "$out/fp8_patched_tests.txt" 2>&1 &
  fi
  wait
  for log in "$out"/fp8_{tests,fuzz,adapters,memcheck,racecheck,patched_tests}.txt; do
    [ -f "$log" ] || continue
    echo "-- $(basename "$log"): $(grep -E "FAILED|ERROR|passed|failed|skipped|killed|total|exit " \
        "$log" | tail -n 4 | paste -sd ';' -)"
  done
  tail -n 12 "$out/fp8_accuracy.txt"
  for dir in "$shards" "$patched_shards"; do
    [ -d "$dir" ] && tar -czf "$out/$(basename "$dir")_logs.tgz" -C "$dir" .
  done
}

for stage in "$@"; do
  case $stage in
    tests)
      run info 60 python3 -m cuattn info
      run precompile 60 python3 -m cuattn precompile -q
      shards pytest "${TESTS_TIMEOUT:-420}" -m gpu -rfE --ignore=tests/test_fuzz.py \
          ${PYTEST_ARGS:-} tests/ ;;
    fuzz)
      shards fuzz "${FUZZ_TIMEOUT:-300}" -m gpu -rfE ${FUZZ_ARGS:-} tests/test_fuzz.py ;;
    ab)
      run ab "${AB_TIMEOUT:-360}" python3 bench/ab.py --old "${AB_OLD:-out/ab_old}" \
          --json "$out/ab.json"
      run host 90 python3 -m bench.suite_host --profile
      run cold 90 python3 bench/cold_start.py ;;
    peers)
      run peers "${PEERS_TIMEOUT:-240}" python3 bench/run.py --suite flash --json "$out/peers.json" ;;
    prefill)
      run prefill "${PREFILL_TIMEOUT:-300}" python3 bench/run.py --suite prefill \
          --json "$out/prefill.json"
      run sweep "${SWEEP_TIMEOUT:-240}" python3 bench/lab/prefill_sweep.py ;;
    bwd)
      shards bwd_tests "${BWD_TIMEOUT:-300}" -m gpu -rfE tests/test_flash_bwd.py \
          tests/test_adapters.py tests/test_adapters_jax.py tests/test_adapters_torch.py \
          "tests/test_fuzz.py::test_fuzz[flash_backward]" \
          "tests/test_fuzz.py::test_fuzz[flash_varlen_backward]"
      run bwd_suite "${BWD_SUITE_TIMEOUT:-240}" python3 bench/run.py --suite bwd \
          --json "$out/bwd.json" ;;
    fp8)
      fp8_checks "${FP8_TIMEOUT:-270}"
      run fp8_ab 120 python3 bench/lab/fp8_ab.py --tag tree --bf16
      if [ -n "${FP8_PATCHED:-}" ]; then
        in_patched run fp8_ab_patched 80 python3 bench/lab/fp8_ab.py --tag patched
      fi
      run fp8_paged 90 python3 -c "from bench.suite_fp8 import paged_rows
for r in paged_rows(): print({k: round(v, 3) if isinstance(v, float) else v for k, v in r.items()})" ;;
    sanitize)
      run sanitize "${SANITIZE_TIMEOUT_ALL:-540}" bash scripts/sanitize.sh "$out" ;;
    *)
      echo "unknown stage $stage" >&2
      exit 2 ;;
  esac
done
exit $status
