"""A tiny serving engine's attention steps on cuattn's paged KV cache (NHD layout).

A shared system prompt is written once into cached blocks; two requests reuse those blocks
(prefix caching) and prefill their own prompts in chunks against them (chunked prefill);
then each decode step verifies 4 draft tokens per request in one call (speculative
decoding), accepts a random number of them and appends the next. Every call is
paged_prefill (new tokens against the whole cached context) after reshape_and_cache (the
new tokens' K/V into freshly allocated blocks), and every output is checked against a
float64 NumPy attention over the request's whole context.

    python examples/engine_step.py    # exit 0: ran and matched; 1: wrong; 2: could not run
"""
from __future__ import annotations

import math
import sys

import numpy as np

from _example import need_gpu

NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE, BLOCK_SIZE = 16, 4, 128, 16
SYSTEM_PROMPT, PROMPTS, CHUNK, DRAFT, STEPS = 64, (300, 150), 128, 4, 5


def reference(q, k, v):
    """Float64 causal attention (bottom-right) of q (n, H, D) against k, v (ctx, Hkv, D)."""
    group = NUM_HEADS // NUM_KV_HEADS
    n, ctx = q.shape[0], k.shape[0]
    out = np.zeros(q.shape)
    visible = np.arange(ctx)[None, :] <= np.arange(n)[:, None] + ctx - n
    for h in range(NUM_HEADS):
        s = q[:, h] @ k[:, h // group].T / math.sqrt(HEAD_SIZE)
        s = np.where(visible, s, -np.inf)
        p = np.exp(s - s.max(axis=1, keepdims=True))
        out[:, h] = p @ v[:, h // group] / p.sum(axis=1, keepdims=True)
    return out


class Engine:
    """The cache, its free blocks, and each request's block table and tokens."""

    def __init__(self, cupy, cuattn, dtype, rng):
        self.cp, self.ca, self.dtype, self.rng = cupy, cuattn, dtype, rng
        shape, _ = cuattn.paged_kv_cache_shapes(256, NUM_KV_HEADS, HEAD_SIZE, BLOCK_SIZE, dtype,
                                                kv_layout="nhd")
        self.k_cache = cupy.zeros(shape, dtype)
        self.v_cache = cupy.zeros(shape, dtype)
        self.free = list(rng.permutation(shape[0]))
        self.tables: list[list[int]] = []
        self.k: list[np.ndarray] = []      # each request's keys and values so far (host)
        self.v: list[np.ndarray] = []

    def new_request(self, prefix_blocks: list[int], prefix_k, prefix_v) -> int:
        self.tables.append(list(prefix_blocks))
        self.k.append(prefix_k.copy())
        self.v.append(prefix_v.copy())
        return len(self.tables) - 1

    def append(self, r: int, n: int):
        """n new tokens of request r: random K/V written into its (grown) blocks."""
        k = self.rng.standard_normal((n, NUM_KV_HEADS, HEAD_SIZE)).astype(self.dtype)
        v = self.rng.standard_normal((n, NUM_KV_HEADS, HEAD_SIZE)).astype(self.dtype)
        start = len(self.k[r])
        while len(self.tables[r]) * BLOCK_SIZE < start + n:
            self.tables[r].append(int(self.free.pop()))
        pos = np.arange(start, start + n)
        slots = np.array(self.tables[r])[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE
        self.ca.reshape_and_cache(self.cp.asarray(k), self.cp.asarray(v), self.k_cache,
                                  self.v_cache, self.cp.asarray(slots.astype(np.int64)),
                                  kv_layout="nhd")
        self.k[r] = np.concatenate([self.k[r], k])
        self.v[r] = np.concatenate([self.v[r], v])

    def attend(self, q_per_request: dict[int, np.ndarray]) -> float:
        """One paged_prefill over the requests' new tokens (already appended); returns the
        largest error against the float64 reference, in units of the bf16 rounding rule."""
        reqs = sorted(q_per_request)
        q = np.concatenate([q_per_request[r] for r in reqs])
        q_lens = [len(q_per_request[r]) for r in reqs]
        width = max(len(self.tables[r]) for r in reqs)
        tables = np.zeros((len(reqs), width), np.int32)
        for i, r in enumerate(reqs):
            tables[i, :len(self.tables[r])] = self.tables[r]
        cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
        lens = np.array([len(self.k[r]) for r in reqs], np.int32)
        out = self.ca.paged_prefill(self.cp.asarray(q), self.k_cache, self.v_cache,
                                    self.cp.asarray(tables), self.cp.asarray(lens),
                                    self.cp.asarray(cu), max(q_lens), kv_layout="nhd")
        got = out.get().astype(np.float64)
        worst = 0.0
        for i, r in enumerate(reqs):
            ref = reference(q[cu[i]:cu[i + 1]].astype(np.float64), self.k[r].astype(np.float64),
                            self.v[r].astype(np.float64))
            rounding = np.abs(ref.astype(self.dtype).astype(np.float64) - ref).max()
            err = np.abs(got[cu[i]:cu[i + 1]] - ref).max()
            worst = max(worst, err / (2 * rounding + 1e-3))
        return worst


def main() -> int:
    need_gpu()
    import cupy
    import ml_dtypes

    import cuattn

    dtype = np.dtype(ml_dtypes.bfloat16)
    rng = np.random.default_rng(0)
    engine = Engine(cupy, cuattn, dtype, rng)

    def queries(n):
        return rng.standard_normal((n, NUM_HEADS, HEAD_SIZE)).astype(dtype)

    # The system prompt: written once by a request of its own, its blocks then shared.
    system = engine.new_request([], np.zeros((0, NUM_KV_HEADS, HEAD_SIZE), dtype),
                                np.zeros((0, NUM_KV_HEADS, HEAD_SIZE), dtype))
    engine.append(system, SYSTEM_PROMPT)
    worst = engine.attend({system: queries(SYSTEM_PROMPT)})
    shared = engine.tables[system][:SYSTEM_PROMPT // BLOCK_SIZE]
    requests = [engine.new_request(shared, engine.k[system][:SYSTEM_PROMPT],
                                   engine.v[system][:SYSTEM_PROMPT]) for _ in PROMPTS]

    # Chunked prefill of both prompts, one call per chunk round (both requests together).
    todo = dict(zip(requests, PROMPTS))
    while any(todo.values()):
        step = {}
        for r, left in todo.items():
            if left:
                n = min(CHUNK, left)
                engine.append(r, n)
                step[r] = queries(n)
                todo[r] = left - n
        worst = max(worst, engine.attend(step))

    # Decode with speculative verification: DRAFT tokens per request per step.
    for _ in range(STEPS):
        for r in requests:
            engine.append(r, DRAFT)
        worst = max(worst, engine.attend({r: queries(DRAFT) for r in requests}))
        for r in requests:        # accept a few drafts: the rejected ones leave the cache
            keep = len(engine.k[r]) - DRAFT + int(rng.integers(0, DRAFT + 1))
            engine.k[r], engine.v[r] = engine.k[r][:keep], engine.v[r][:keep]
            used = -(-keep // BLOCK_SIZE)
            engine.free.extend(engine.tables[r][used:])      # blocks no token holds now
            engine.tables[r] = engine.tables[r][:used]

    contexts = [len(engine.k[r]) for r in requests]
    print(f"engine_step: system prompt {SYSTEM_PROMPT} tokens shared by {len(requests)} "
          f"requests, prompts {PROMPTS} in chunks of {CHUNK}, {STEPS} steps of {DRAFT}-token "
          f"verification; contexts now {contexts}; worst error {worst:.2f} of the tolerance")
    return 0 if worst <= 1.0 else 1


if __name__ == "__main__":
    sys.exit(main())
