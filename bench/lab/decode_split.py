"""Lab: where v2 decode time goes at batch 1 -- the main kernel alone, the partition reduce
alone, and the whole call (paged_attention), per partition size (L2 flushed, CUDA-graph
replays).

python bench/lab/decode_split.py [--flush clean|dirty]   (default clean; see harness.L2Flush)
bf16, 32 query heads, head 128, block 16, batch 1 x 32768, 8 and 32 KV heads.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import cupy
import ml_dtypes
import numpy as np

import cuattn
from bench.harness import format_table, measure_ceilings, median_ms
from cuattn import paged

BF16 = np.dtype(ml_dtypes.bfloat16)
CTX, HEADS, HS, BS = 32768, 32, 128, 16


def main():
    flush = sys.argv[sys.argv.index("--flush") + 1] if "--flush" in sys.argv else "clean"
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
            paged._plans.clear()

            def call():
                cuattn.paged_attention(q, k, v, bt, sl, version="v2", partition_size=ps, out=out)
            call()
            plan = next(iter(paged._plans.values()))
            scratch = cupy.cuda.alloc(plan.tmp_bytes)
            tmp_out, tmp_lse = scratch.ptr, scratch.ptr + plan.tmp_out_bytes
            params = np.frombuffer(
                paged._PTR.pack(0, 0, tmp_out, tmp_lse, q.data.ptr, k.data.ptr, v.data.ptr,
                                bt.data.ptr, sl.data.ptr, 0) + plan.tail, paged.PARAMS.dtype)[0]
            rparams = np.frombuffer(paged._RPTR.pack(out.data.ptr, 0, tmp_out, tmp_lse,
                                                     sl.data.ptr) + plan.rtail,
                                    paged.REDUCE_PARAMS.dtype)[0]

            def main_only():   # on the current stream: the one the harness captures
                plan.kernel(plan.grid, plan.block, (params,), shared_mem=plan.smem,
                            stream=cupy.cuda.get_current_stream())

            def reduce_only():
                plan.reduce(plan.rgrid, plan.rblock, (rparams,),
                            stream=cupy.cuda.get_current_stream())
            t = {name: 1e3 * median_ms(fn, n_warmup=5, n_repeat=30, flush_l2=flush, graph=1)
                 for name, fn in (("main", main_only), ("reduce", reduce_only), ("call", call))}
            rows.append({"kv heads": kvh, "partition": ps, "blocks": int(np.prod(plan.grid)),
                         "main us": t["main"], "reduce us": t["reduce"], "call us": t["call"],
                         "floor us": mb / ceil.read_gbps * 1e3,
                         "% read BW (call)": 100 * mb / ceil.read_gbps * 1e3 / t["call"]})
            del scratch
        paged._plans.clear()
        del k, v
        cupy.get_default_memory_pool().free_all_blocks()
    print(format_table([ceil.row()], "ceilings"))
    print(format_table(rows, f"batch 1 x 32768, v2: main kernel / reduce / whole call ({flush} L2)"))


if __name__ == "__main__":
    main()
