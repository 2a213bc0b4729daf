#!/usr/bin/env bash
# compute-sanitizer (memcheck, racecheck, initcheck, synccheck) over a reduced GPU suite that
# still reaches every kernel and boundary path, on a GPU machine:
#   scripts/sanitize.sh OUTDIR
# writes OUTDIR/sanitize_<tool>.txt (the whole run under that tool), sanitize_plain.txt (the
# same suite without a sanitizer, run first), sanitize_summary.txt (one line per tool: tool,
# exit code, pytest's summary line, the sanitizer's ERROR SUMMARY line; exit 9 = the
# sanitizer reported errors, 124/137 = timed out, else pytest's); exits 1 if any tool or the
# plain run failed. Environment:
#   TOOLS="memcheck racecheck"     which tools (default all four; one 10-minute device call
#                                  may not hold all four: split them over calls)
#   SANITIZE_TESTS="tests/..."     the suite for every tool; MEMCHECK_TESTS, RACECHECK_TESTS,
#                                  INITCHECK_TESTS, SYNCCHECK_TESTS override it for one tool
#   SANITIZE_TIMEOUT=300           seconds per tool; MEMCHECK_TIMEOUT, ... for one tool
#   MEMCHECK_FLAGS, ...            extra compute-sanitizer flags for one tool (racecheck and
#                                  synccheck default to --kernel-name kns=cuattn_)
#   COMPUTE_SANITIZER=/path/to/compute-sanitizer
# Kernels are compiled before any tool runs (precompile, then the plain run compiles what
# the suite uses beyond the shipped set), so NVRTC never runs under a sanitizer.
# memcheck and initcheck check every kernel, CuPy's too: initcheck then tracks the memory
# CuPy's kernels write, and a test that reads an output element no kernel wrote is
# reported. CuPy's memory pool recycles blocks, so initcheck sees as uninitialised only
# memory never written since cudaMalloc: a kernel that reads an output or scratch element
# before writing it shows up where that memory is fresh (out=None calls, split-KV and v2
# scratch), not where a test pre-filled it with NaN. racecheck and synccheck look at shared
# memory and barriers, so they check only cuattn's kernels (and run several times faster).
set -uo pipefail
set -f                                # test ids hold [...]: no globbing
out=${1:?usage: scripts/sanitize.sh OUTDIR}
mkdir -p "$out" && out=$(cd "$out" && pwd)
cd "$(dirname "$0")/.." || exit 2
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
export CUATTN_CACHE_DIR=${CUATTN_CACHE_DIR:-/tmp/cuattn-cache}
export CUATTN_TEST_KEEP_CACHE=1       # the tests use the kernels compiled here
cs=${COMPUTE_SANITIZER:-compute-sanitizer}
command -v "$cs" > /dev/null || { echo "sanitize.sh: $cs not found (set COMPUTE_SANITIZER)" >&2; exit 2; }

# Odd lengths and partial tiles (113x203, 37x91, 1x147), seqlen_k = 0 and rows that see no
# key, varlen with empty sequences, split-KV (+ combine) for head dims 64/96/128/256, every
# flash form (plain, causal, window) on both flash kernels (mma.sync and, on sm_90, wgmma:
# TMA and cp.async loads, the fetched varlen schedule, narrow key tiles, windows on the
# paired row tiles); the FP8 forward (dense: hooks, windows, GQA, split, varlen with empty
# sequences; paged_prefill on FP8 math: both query modes, per-KV-head scales, split); paged
# v1/v2 with one and many partitions (128..1024), partial last KV blocks at block sizes
# 8/16/32, empty sequences, GQA 1..16, fp8, ALiBi, both forms of the
# paged kernel (tensor-core, CUDA-core) on odd groups; reshape_and_cache; merge (pair,
# stacked, +/-inf); CUDA-graph replays of all of them; paged_prefill (both layouts, block
# sizes 1 and 8, few and many rows, split + sinks, every hook, prefix sharing, graph replay;
# long chunks of both layouts on the Hopper kernel; the few-token form v1 and v2, hooks and
# windows, 3 n-tiles; fp8 caches in both layouts), NHD reshape_and_cache, the hooks on flash
# (softcap alone too: the Hopper kernel's ping-pong and raw-max paths) and on both decode
# forms (v1 and v2, NHD block sizes 1 and 256, windows); the backward: its pre-pass, main kernel
# one-pass (hd 64) and two-pass (hd 192 / 256) in each mask form (none, causal with rows that
# see no key, a window), the Hopper kernel's causal schedule (sections of pairs), every hook
# in both, varlen with empty sequences, dQ convert of one and of three (deterministic) dQ
# slices, the sinks' gradient.
reduced="tests/test_merge.py
 tests/test_flash.py::test_small_against_numpy_float64
 tests/test_flash.py::test_seqlen_k_zero_and_no_key_rows
 tests/test_flash.py::test_sweep[mma-d64-113x203-nc]
 tests/test_flash.py::test_sweep[mma-d128-113x203-nc]
 tests/test_flash.py::test_sweep[mma-d256-113x203-c]
 tests/test_flash.py::test_window[mma-w16_8-113-203-64]
 tests/test_flash.py::test_window[mma-w40_0c-113-203-256]
 tests/test_flash.py::test_window[mma-w-1_5-1-147-128]
 tests/test_flash.py::test_strided_bhsd_views_and_scale[mma-128]
 tests/test_flash.py::test_varlen[mma-3-True-mixed]
 tests/test_flash.py::test_varlen[mma-3-False-decode-like]
 tests/test_flash.py::test_varlen[mma-1-False-with-empty]
 tests/test_flash.py::test_num_splits_match_unsplit[mma-128-1-8192-False]
 tests/test_flash.py::test_num_splits_match_unsplit[mma-64-16-5000-True]
 tests/test_flash.py::test_num_splits_match_unsplit[mma-256-3-3000-False]
 tests/test_flash.py::test_sweep[wgmma-d64-113x203-nc]
 tests/test_flash.py::test_sweep[wgmma-d128-113x203-nc]
 tests/test_flash.py::test_sweep[wgmma-d256-113x203-c]
 tests/test_flash.py::test_window[wgmma-w16_8-113-203-64]
 tests/test_flash.py::test_window[wgmma-w40_0c-113-203-256]
 tests/test_flash.py::test_window[wgmma-w-1_5-1-147-128]
 tests/test_flash.py::test_window[wgmma-w40_0c-1024-1023-128]
 tests/test_flash.py::test_window[wgmma-w100_300-1024-1023-64]
 tests/test_flash.py::test_strided_bhsd_views_and_scale[wgmma-128]
 tests/test_flash.py::test_varlen[wgmma-3-True-mixed]
 tests/test_flash.py::test_varlen[wgmma-3-False-decode-like]
 tests/test_flash.py::test_varlen[wgmma-1-False-with-empty]
 tests/test_flash.py::test_num_splits_match_unsplit[wgmma-128-1-8192-False]
 tests/test_flash.py::test_num_splits_match_unsplit[wgmma-64-16-5000-True]
 tests/test_flash.py::test_num_splits_match_unsplit[wgmma-256-3-3000-False]
 tests/test_flash.py::test_tma_and_cp_async_loads[wgmma]
 tests/test_flash.py::test_varlen_more_row_tiles_than_sms[wgmma-1-c-256]
 tests/test_flash.py::test_varlen_more_row_tiles_than_sms[wgmma-2-c-128]
 tests/test_flash.py::test_varlen_windows_with_narrow_key_tiles[wgmma-w300_0-256]
 tests/test_flash_fp8.py::test_fp8_features[all-128]
 tests/test_flash_fp8.py::test_fp8_features[all-256]
 tests/test_flash_fp8.py::test_fp8_features[window-64]
 tests/test_flash_fp8.py::test_fp8_shapes_and_gqa[True-shape2]
 tests/test_flash_fp8.py::test_fp8_head_dims_and_split[192]
 tests/test_flash_fp8.py::test_fp8_varlen_with_empty_sequences[True]
 tests/test_prefill_fp8.py::test_fp8_math_prefill[64-8-e4m3-q]
 tests/test_prefill_fp8.py::test_fp8_math_prefill[256-16-q_scale]
 tests/test_prefill_fp8.py::test_fp8_math_device_scales[per-kv-head]
 tests/test_prefill_fp8.py::test_fp8_math_features[num_splits=3]
 tests/test_paged.py::test_gqa_ratios_v1_v2_auto_agree tests/test_paged.py::test_block_sizes
 tests/test_paged.py::test_fp8_cache tests/test_paged.py::test_partition_sizes_and_gqa_16
 tests/test_paged.py::test_alibi tests/test_paged.py::test_reshape_and_cache_round_trip
 tests/test_paged.py::test_both_forms tests/test_paged.py::test_large_scores_and_one_dominant_token
 tests/test_stress.py::test_graph_replay_with_new_data_equals_eager
 tests/test_prefill.py::test_mixed_query_lengths_both_layouts[vllm-8]
 tests/test_prefill.py::test_mixed_query_lengths_both_layouts[nhd-1]
 tests/test_prefill.py::test_head_sizes_groups_dtypes[vllm-spec-192-4-bf16]
 tests/test_prefill.py::test_head_sizes_groups_dtypes[nhd-chunk-96-2-f16]
 tests/test_prefill.py::test_prefill_hooks_windows_and_splits[mma-3-True-window0-softcap+alibi+sinks]
 tests/test_prefill.py::test_prefill_hooks_windows_and_splits[mma-0-False-window3-softcap+alibi+sinks]
 tests/test_prefill.py::test_prefill_hooks_windows_and_splits[wgmma-3-True-window0-softcap+alibi+sinks]
 tests/test_prefill.py::test_nhd_chunks_on_both_flash_kernels[wgmma-128-4-bf16-16]
 tests/test_prefill.py::test_nhd_chunks_on_both_flash_kernels[wgmma-256-2-f16-8]
 tests/test_prefill.py::test_vllm_chunks_on_both_flash_kernels[wgmma-128-4-bf16-16]
 tests/test_prefill.py::test_vllm_chunks_on_both_flash_kernels[wgmma-256-2-f16-32]
 tests/test_prefill.py::test_few_token_form_layouts_and_splits[5-vllm-8]
 tests/test_prefill.py::test_few_token_form_layouts_and_splits[1-nhd-1]
 tests/test_prefill.py::test_few_token_form_hooks_and_windows[4-False-window3-softcap+alibi+sinks]
 tests/test_prefill.py::test_few_token_form_head_sizes_and_groups[vllm-96-2-6-bf16]
 tests/test_prefill.py::test_few_token_form_one_token_with_empty_sequences[5]
 tests/test_prefill.py::test_fp8_caches_both_layouts[vllm-8]
 tests/test_prefill.py::test_fp8_caches_both_layouts[nhd-1]
 tests/test_prefill.py::test_fp8_caches_head_sizes_hooks_splits[softcap+alibi+sinks-False-window1-0-80-8-bf16]
 tests/test_prefill.py::test_prefix_sharing tests/test_prefill.py::test_nhd_reshape_and_cache_round_trip
 tests/test_prefill.py::test_captured_in_a_cuda_graph_replays_with_new_lengths
 tests/test_prefill.py::test_flash_hooks[mma-128-False-window2-softcap+alibi+sinks]
 tests/test_prefill.py::test_flash_hooks[mma-256-True-window1-softcap+alibi+sinks]
 tests/test_prefill.py::test_flash_hooks[wgmma-64-False-window0-softcap]
 tests/test_prefill.py::test_flash_hooks[wgmma-128-True-window1-softcap]
 tests/test_prefill.py::test_flash_hooks[wgmma-128-False-window2-softcap+alibi+sinks]
 tests/test_prefill.py::test_flash_hooks[wgmma-256-True-window1-softcap+alibi+sinks]
 tests/test_prefill.py::test_flash_varlen_hooks_with_empty_sequences
 tests/test_prefill.py::test_decode_hooks_windows_and_layouts[window1-v1-softcap+alibi+sinks-nhd-256-mma]
 tests/test_prefill.py::test_decode_hooks_windows_and_layouts[window1-v2-softcap+alibi+sinks-nhd-1-mma]
 tests/test_prefill.py::test_decode_hooks_windows_and_layouts[window1-v1-softcap+alibi+sinks-vllm-8-simt]
 tests/test_prefill.py::test_decode_hooks_windows_and_layouts[window1-v2-softcap+alibi+sinks-vllm-8-simt]
 tests/test_flashinfer_tables.py::test_matches_numpy[300-256-300]
 tests/test_flashinfer_tables.py::test_writes_into_row_strided_out_buffers_and_nothing_else
 tests/test_flash_bwd.py::test_bwd_sweep[wgmma-d64-97x131-nc]
 tests/test_flash_bwd.py::test_bwd_sweep[wgmma-d128-97x131-c]
 tests/test_flash_bwd.py::test_bwd_causal_schedule[wgmma-2]
 tests/test_flash_bwd.py::test_bwd_sweep[mma-d64-97x131-nc]
 tests/test_flash_bwd.py::test_bwd_sweep[mma-d192-97x131-nc]
 tests/test_flash_bwd.py::test_bwd_rows_that_see_no_key_get_zero_gradients[wgmma]
 tests/test_flash_bwd.py::test_bwd_rows_that_see_no_key_get_zero_gradients[mma]
 tests/test_flash_bwd.py::test_bwd_features[wgmma-7-128]
 tests/test_flash_bwd.py::test_bwd_features[mma-7-256]
 tests/test_flash_bwd.py::test_bwd_varlen_every_kernel[wgmma-64]
 tests/test_flash_bwd.py::test_bwd_varlen_every_kernel[mma-64]
 tests/test_flash_bwd.py::test_bwd_varlen_every_kernel[mma-192]"
pytest=(python3 -m pytest -q -m gpu -p no:cacheprovider)

summarize() {   # $1 name, $2 exit code, $3 log -> one line on stdout and in the summary file
  local tests errors
  tests=$(grep -E "^(=+ )?[0-9]+ (passed|failed|skipped|error)|no tests ran" "$3" | tail -n 1)
  errors=$(grep -E "(ERROR|RACECHECK) SUMMARY" "$3" | tail -n 2 | sed 's/^=* *//' | paste -sd ';' -)
  printf '%-9s exit %-3s | %s | %s\n' "$1" "$2" "${tests:-no pytest summary}" "${errors:--}" \
      | tee -a "$out/sanitize_summary.txt"
}

: > "$out/sanitize_summary.txt"
"$cs" --version 2>&1 | tail -n 1 | tee -a "$out/sanitize_summary.txt"
python3 -m cuattn precompile -q > "$out/sanitize_precompile.txt" 2>&1
tail -n 1 "$out/sanitize_precompile.txt" | tee -a "$out/sanitize_summary.txt"
# shellcheck disable=SC2086
"${pytest[@]}" ${SANITIZE_TESTS:-$reduced} > "$out/sanitize_plain.txt" 2>&1
rc=$?
summarize plain "$rc" "$out/sanitize_plain.txt"
failed=$((rc != 0))

for tool in ${TOOLS:-memcheck racecheck initcheck synccheck}; do
  up=${tool^^}
  tests_var=${up}_TESTS timeout_var=${up}_TIMEOUT flags_var=${up}_FLAGS
  default_flags=""
  case $tool in racecheck|synccheck) default_flags="--kernel-name kns=cuattn_" ;; esac
  log=$out/sanitize_$tool.txt
  # shellcheck disable=SC2086
  timeout -k 30 "${!timeout_var:-${SANITIZE_TIMEOUT:-300}}" \
      "$cs" --tool "$tool" --error-exitcode 9 --print-limit 100 ${!flags_var-$default_flags} \
      "${pytest[@]}" ${!tests_var:-${SANITIZE_TESTS:-$reduced}} > "$log" 2>&1
  rc=$?
  case $rc in 124|137) echo "sanitize.sh: $tool timed out" >> "$log" ;; esac
  summarize "$tool" "$rc" "$log"
  [ "$rc" = 0 ] || failed=1
done
exit "$failed"
