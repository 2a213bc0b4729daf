"""A tiny decode engine on cuattn's paged KV cache.

Three requests of different prompt lengths share one paged cache. Each step appends every
request's new key/value with reshape_and_cache (blocks handed out on demand from a free
list, in scrambled order), then decodes one token per request with paged_attention, and
checks the result against a NumPy attention over everything appended so far.

    python examples/paged_decode.py    # exit 0: ran and matched; 1: wrong; 2: could not run
"""
from __future__ import annotations

import math
import sys

import numpy as np

from _example import need_gpu


def main() -> int:
    need_gpu()
    import cupy
    import ml_dtypes

    import cuattn

    dtype = np.dtype(ml_dtypes.bfloat16)
    num_heads, num_kv_heads, head_size, block_size = 16, 4, 128, 16
    num_blocks, max_blocks_per_seq = 256, 64
    rng = np.random.default_rng(0)

    k_shape, v_shape = cuattn.paged_kv_cache_shapes(num_blocks, num_kv_heads, head_size,
                                                    block_size, dtype)
    k_cache = cupy.zeros(k_shape, dtype=dtype)
    v_cache = cupy.zeros(v_shape, dtype=dtype)
    free_blocks = list(rng.permutation(num_blocks))

    prompts = [37, 200, 5]
    num_seqs = len(prompts)
    block_tables = np.zeros((num_seqs, max_blocks_per_seq), np.int32)
    seq_lens = np.zeros(num_seqs, np.int32)
    history_k = [np.zeros((0, num_kv_heads, head_size)) for _ in prompts]   # for the check
    history_v = [np.zeros((0, num_kv_heads, head_size)) for _ in prompts]

    def append(seq: int, keys: np.ndarray, values: np.ndarray) -> None:
        """Host bookkeeping (block allocation, slots), then one reshape_and_cache launch."""
        n = keys.shape[0]
        slots = np.empty(n, np.int64)
        for i in range(n):
            pos = int(seq_lens[seq]) + i
            if pos % block_size == 0:
                block_tables[seq, pos // block_size] = free_blocks.pop()
            slots[i] = block_tables[seq, pos // block_size] * block_size + pos % block_size
        cuattn.reshape_and_cache(cupy.asarray(keys.astype(dtype)), cupy.asarray(values.astype(dtype)),
                                 k_cache, v_cache, cupy.asarray(slots))
        seq_lens[seq] += n
        history_k[seq] = np.concatenate([history_k[seq], keys.astype(dtype).astype(np.float64)])
        history_v[seq] = np.concatenate([history_v[seq], values.astype(dtype).astype(np.float64)])

    # Prefill: write each prompt's K/V (the prompt's attention itself is not this example's job).
    for seq, n in enumerate(prompts):
        append(seq, rng.standard_normal((n, num_kv_heads, head_size)),
               rng.standard_normal((n, num_kv_heads, head_size)))

    worst = 0.0
    for step in range(20):
        for seq in range(num_seqs):   # the new token's K/V joins the cache before decoding
            append(seq, rng.standard_normal((1, num_kv_heads, head_size)),
                   rng.standard_normal((1, num_kv_heads, head_size)))
        q = rng.standard_normal((num_seqs, num_heads, head_size)).astype(dtype)
        out = cuattn.paged_attention(cupy.asarray(q), k_cache, v_cache, cupy.asarray(block_tables),
                                     cupy.asarray(seq_lens))
        got = out.get().astype(np.float64)
        for seq in range(num_seqs):
            rep = num_heads // num_kv_heads
            k = np.repeat(history_k[seq], rep, axis=1)          # (n, heads, d)
            v = np.repeat(history_v[seq], rep, axis=1)
            logits = np.einsum("hd,nhd->hn", q[seq].astype(np.float64), k) / math.sqrt(head_size)
            p = np.exp(logits - logits.max(axis=1, keepdims=True))
            ref = np.einsum("hn,nhd->hd", p / p.sum(axis=1, keepdims=True), v)
            worst = max(worst, float(np.abs(got[seq] - ref).max()))
    print(f"decoded 20 steps for {num_seqs} sequences (final lengths {seq_lens.tolist()}); "
          f"max |error| vs NumPy float64 = {worst:.2e}")
    if worst > 2e-2:
        print("paged_decode: result differs from the reference")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
