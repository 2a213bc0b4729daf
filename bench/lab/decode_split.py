"""Lab: where v2 decode time goes at batch 1 -- the main kernel alone, the partition reduce
alone, and the whole call (paged_attention), per partition size (L2 flushed, CUDA-graph
replays).

python bench/lab/decode_split.py [--flush clean|dirty]   (default clean; see harness.L2Flush)
bf16, 32 query heads, head 128, block 16, batch 1 x 32768, 8 and 32 KV heads.
Shipped choices (form, ring); the two kernels are read from the launch plan of one call
(cuattn._launch.Plan in cuattn.paged.attention._plans: its launches, main kernel then
reduce), their params packed with Launch.params over the call's pointers and a scratch
buffer of the plan's size, and each launched alone.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import cupy
import ml_dtypes
import numpy as np

import cuattn
from bench.harness import format_table, measure_ceilings, median_ms
from cuattn import _launch
from cuattn.paged import attention

BF16 = np.dtype(ml_dtypes.bfloat16)
CTX, HEADS, HS, BS = 32768, 32, 128, 16


def _alone(launch, ptrs):
    """Launch one kernel of a plan on the current stream (the one the harness captures)."""
    params = launch.params(ptrs)

    def run():
        launch.kernel(launch.grid, launch.block, (params,), shared_mem=launch.smem,
                      stream=cupy.cuda.get_current_stream())
    return run


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--flush", default="clean", choices=("clean", "dirty"),
                    help="L2 state before each rep (bench.harness.L2Flush)")
    flush = ap.parse_args().flush
    ceil = measure_ceilings(quick=True)
    rng = np.random.default_rng(0)
    rows = []
    for kvh in (8, 32):
        nblk = CTX // BS
        num_blocks = max(nblk, (1 << 30) // (2 * kvh * HS * BS * 2))
        kshape, vshape = cuattn.paged_kv_cache_shapes(num_blocks, kvh, HS, BS, BF16)
        k = cupy.random.standard_normal(kshape, dtype=np.float32).astype(BF16)
        v = cupy.random.standard_normal(vshape, dtype=np.float32).astype(BF16)
        bt = cupy.asarray(rng.permutation(num_blocks)[:nblk].astype(np.int32).reshape(1, -1))
        sl = cupy.full((1,), CTX, np.int32)
        q = cupy.asarray(rng.standard_normal((1, HEADS, HS)).astype(BF16))
        out = cupy.empty_like(q)
        mb = CTX * kvh * HS * 2 * 2 / 1e6
        for ps in (256, 512, 1024):
            _launch.clear_plans()

            def call():
                cuattn.paged_attention(q, k, v, bt, sl, version="v2", partition_size=ps, out=out)
            call()
            (plan,) = attention._plans.values()
            main_launch, reduce_launch = plan.launches   # v2 with a non-empty context
            assert not plan.outputs, "out is given: the plan allocates nothing"
            scratch = cupy.cuda.alloc(plan.scratch_bytes)
            # the pointer slots of cuattn._launch.Slots: null, the arguments in
            # paged_attention's order (attention._NAMES), then the scratch parts
            # (tmp_out, tmp_lse)
            given = dict(q=q, k_cache=k, v_cache=v, block_tables=bt, seq_lens=sl, out=out)
            ptrs = [0] + [given[n].data.ptr if n in given else 0 for n in attention._NAMES]
            ptrs += [scratch.ptr + off for off in plan.scratch]
            main_only, reduce_only = _alone(main_launch, ptrs), _alone(reduce_launch, ptrs)
            t = {name: 1e3 * median_ms(fn, n_warmup=5, n_repeat=30, flush_l2=flush, graph=1)
                 for name, fn in (("main", main_only), ("reduce", reduce_only), ("call", call))}
            rows.append({"kv heads": kvh, "partition": ps,
                         "blocks": int(np.prod(main_launch.grid)),
                         "main us": t["main"], "reduce us": t["reduce"], "call us": t["call"],
                         "floor us": mb / ceil.read_gbps * 1e3,
                         "% read BW (call)": 100 * mb / ceil.read_gbps * 1e3 / t["call"]})
            del scratch
        _launch.clear_plans()
        k = v = None   # free the caches (a closure above refers to them)
        cupy.get_default_memory_pool().free_all_blocks()
    print(format_table([ceil.row()], "ceilings"))
    print(format_table(rows, f"batch 1 x 32768, v2: main kernel / reduce / whole call ({flush} L2)"))


if __name__ == "__main__":
    main()
