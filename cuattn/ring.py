"""Ring attention's math (context parallelism, issue 37): a sequence sharded over ``world``
ranks, each rank's queries meeting every rank's K / V block in turn, the partial results
merged by their log-sum-exp; the backward meets the blocks again with the merged out and
lse, each block's dK / dV summed where the block lives.

This module is the part every transport shares: which rows of a step's block a rank's
queries see (``step_rows``), the forward's fp32 merge (``RingForward``) and a backward step
(``ring_backward_step``), all on cuattn's kernels (flash_forward with lse, flash_backward).
How the blocks travel (NCCL send / recv, jax.lax.ppermute, or copies: the one-GPU simulation
of tests/test_ring.py) is the caller's; at step s rank r holds the block of rank
(r - s) mod world.

Layout (``zigzag_split``): the sequence cut into 2 x world chunks, rank r holding chunks r
and 2 world - 1 - r, so that under a causal mask every rank does the same work at every
step (ring-flash-attn's zigzag): against its own block a rank's attention is causal over its
two chunks; against an earlier rank's block (source < r) all its rows see that block's first
chunk and none of its second; against a later rank's (source > r) only its second chunk's
rows see anything, and they see the whole block. Full (non-causal) attention takes the same
layout, every row seeing every block.
"""
from __future__ import annotations

from dataclasses import dataclass

import cupy

from .flash import flash_forward
from .flash_bwd import flash_backward


def zigzag_split(x, world: int, axis: int = 1) -> list:
    """x's sequence axis (length a multiple of 2 x world) cut into 2 x world chunks: rank r
    gets chunks r and 2 world - 1 - r, concatenated (copies)."""
    if world < 1 or x.shape[axis] % (2 * world):
        raise ValueError(f"zigzag_split: the sequence length {x.shape[axis]} must be a "
                         f"multiple of 2 x world (world = {world})")
    xp = cupy.get_array_module(x)
    chunks = xp.split(x, 2 * world, axis=axis)
    return [xp.concatenate([chunks[r], chunks[2 * world - 1 - r]], axis=axis)
            for r in range(world)]


def zigzag_join(shards: list, axis: int = 1):
    """The inverse of zigzag_split: the whole sequence from every rank's shard."""
    world = len(shards)
    xp = cupy.get_array_module(shards[0])
    halves = [xp.split(s, 2, axis=axis) for s in shards]
    return xp.concatenate([halves[r][0] for r in range(world)] +
                          [halves[r][1] for r in reversed(range(world))], axis=axis)


@dataclass(frozen=True)
class StepRows:
    """The part of one step: rows q of the rank's shard against rows kv of the block, with
    a causal mask (aligned at the top-left: the two sets are the same positions) or none."""
    q: slice
    kv: slice
    causal: bool


def step_rows(rank: int, source: int, world: int, shard_len: int, causal: bool) -> StepRows:
    """What rank ``rank``'s queries see of rank ``source``'s block (zigzag layout, each shard
    ``shard_len`` rows: two chunks of shard_len / 2)."""
    every = slice(0, shard_len)
    if not causal:
        return StepRows(every, every, False)
    half = shard_len // 2
    if source == rank:
        return StepRows(every, every, True)
    if source < rank:
        return StepRows(every, slice(0, half), False)
    return StepRows(slice(half, shard_len), every, False)


class RingForward:
    """One rank's forward: out (fp32) and lse merged over the blocks added so far.

    q: the rank's shard (batch, shard_len, nheads, headdim), fp16 / bf16. ``add(k, v,
    source)`` runs flash_forward of the step's rows (its out rounded to q's dtype, as a
    kernel's output is) and merges it in fp32; ``result()`` gives (out like q, lse float32
    (batch, nheads, shard_len)). Options (softmax_scale) are flash_forward's.
    """

    def __init__(self, q, *, rank: int, world: int, causal: bool = False, softmax_scale=None):
        self.q, self.rank, self.world, self.causal = q, rank, world, causal
        self.softmax_scale = softmax_scale
        b, s, h, d = q.shape
        self.out = cupy.zeros((b, s, h, d), cupy.float32)
        self.lse = cupy.full((b, h, s), -cupy.inf, cupy.float32)

    def add(self, k, v, source: int) -> None:
        part = step_rows(self.rank, source, self.world, self.q.shape[1], self.causal)
        out, lse = flash_forward(self.q[:, part.q], k[:, part.kv], v[:, part.kv],
                                 causal=part.causal, softmax_scale=self.softmax_scale,
                                 return_lse=True)
        acc_out, acc_lse = self.out[:, part.q], self.lse[:, :, part.q]
        m = cupy.maximum(acc_lse, lse)
        m = cupy.where(cupy.isneginf(m), 0, m)
        w_acc, w_new = cupy.exp(acc_lse - m), cupy.exp(lse - m)       # (b, h, rows)
        total = w_acc + w_new
        seen = total > 0                                                # rows with a key
        total = cupy.where(seen, total, 1)

        def rows(w):                                                    # (b, rows, h, 1)
            return (w / total).transpose(0, 2, 1)[..., None]
        acc_out[...] = acc_out * rows(w_acc) + out.astype(cupy.float32) * rows(w_new)
        acc_lse[...] = cupy.where(seen, m + cupy.log(total), -cupy.inf)

    def result(self):
        return self.out.astype(self.q.dtype), self.lse


def ring_backward_step(dout, q, k, v, out, lse, dq_acc, *, rank: int, source: int, world: int,
                       causal: bool = False, softmax_scale=None):
    """One backward step of rank ``rank`` against rank ``source``'s block (k, v): the step's
    rows through flash_backward with the merged out and lse (the whole row's softmax, so
    each block's gradients are exact parts of the whole), dQ added into ``dq_acc`` (fp32,
    like q); returns the block's dK, dV (fp32, like k and v), which belong to ``source``."""
    part = step_rows(rank, source, world, q.shape[1], causal)
    dq, dk_part, dv_part = flash_backward(
        dout[:, part.q], q[:, part.q], k[:, part.kv], v[:, part.kv], out[:, part.q],
        lse[:, :, part.q], causal=part.causal,
        softmax_scale=softmax_scale)
    dq_acc[:, part.q] += dq
    dk = cupy.zeros(k.shape, cupy.float32)
    dv = cupy.zeros(v.shape, cupy.float32)
    dk[:, part.kv] = dk_part
    dv[:, part.kv] = dv_part
    return dk, dv
