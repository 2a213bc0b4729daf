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
    sanitize)
      run sanitize "${SANITIZE_TIMEOUT_ALL:-540}" bash scripts/sanitize.sh "$out" ;;
    *)
      echo "unknown stage $stage" >&2
      exit 2 ;;
  esac
done
exit $status
