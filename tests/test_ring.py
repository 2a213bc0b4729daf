"""cuattn.ring (issue 37): the zigzag layout and each step's rows on the CPU; on a GPU, the
ring simulated in one process (every rank's shard on one GPU, the blocks passed by
indexing: rank r holds rank (r - s) mod world's block at step s), forward and backward,
against the float64 reference of the whole sequence by the project's tolerance rule."""
from __future__ import annotations

import math

import numpy as np
import pytest

from cuattn import ring
from tests.reference import attention_backward_reference, attention_reference, check_attention
from tests.test_flash_bwd import BF16, F16, _randn, check_grads

WORLDS = (1, 2, 3, 4)


@pytest.mark.parametrize("world", WORLDS)
def test_zigzag_split_and_join(world):
    x = np.arange(2 * 2 * world * 3).reshape(2, 2 * world * 3)
    shards = ring.zigzag_split(x, world)
    chunk = 3
    for r, s in enumerate(shards):
        assert s.tolist() == np.concatenate(
            [x[:, r * chunk:(r + 1) * chunk],
             x[:, (2 * world - 1 - r) * chunk:(2 * world - r) * chunk]], axis=1).tolist()
    assert np.array_equal(ring.zigzag_join(shards), x)
    with pytest.raises(ValueError, match="multiple of 2 x world"):
        ring.zigzag_split(np.zeros((1, 2 * world + 1)), world)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("causal", [False, True])
def test_steps_cover_every_visible_pair_once(world, causal):
    """Over the world steps of every rank, each (query, key) position pair the mask keeps is
    computed exactly once, and no other; and under a causal mask every rank's steps after its
    own do the same work."""
    chunk = 4
    n = 2 * world * chunk
    pos = ring.zigzag_split(np.arange(n)[None, :], world)          # positions of each shard
    seen = np.zeros((n, n), int)
    for rank in range(world):
        work = []
        for step in range(world):
            source = (rank - step) % world
            part = ring.step_rows(rank, source, world, 2 * chunk, causal)
            qp, kp = pos[rank][0, part.q], pos[source][0, part.kv]
            keep = np.ones((len(qp), len(kp)), bool)
            if part.causal:
                keep = np.tril(keep)
            seen[np.ix_(qp, kp)] += keep
            work.append(int(keep.sum()))
        if causal:
            assert len(set(work[1:])) <= 1 and all(w == 2 * chunk * chunk for w in work[1:])
    want = np.tril(np.ones((n, n), int)) if causal else np.ones((n, n), int)
    assert np.array_equal(seen, want)


# ---- GPU: the ring simulated on one device ---------------------------------------------------

def simulate(q, k, v, dout, world, causal):
    """Forward then backward of the ring over ``world`` simulated ranks; the whole sequence's
    out, lse, dq, dk, dv (dk / dv summed where each block lives)."""
    import cupy
    qs, ks, vs, ds = (ring.zigzag_split(x, world) for x in (q, k, v, dout))
    fwd = [ring.RingForward(qs[r], rank=r, world=world, causal=causal) for r in range(world)]
    for step in range(world):
        for r in range(world):
            src = (r - step) % world
            fwd[r].add(ks[src], vs[src], src)
    outs, lses = zip(*(f.result() for f in fwd))
    dq = [cupy.zeros(x.shape, cupy.float32) for x in qs]
    dk = [cupy.zeros(x.shape, cupy.float32) for x in ks]
    dv = [cupy.zeros(x.shape, cupy.float32) for x in vs]
    for step in range(world):
        for r in range(world):
            src = (r - step) % world
            gk, gv = ring.ring_backward_step(ds[r], qs[r], ks[src], vs[src], outs[r], lses[r],
                                             dq[r], rank=r, source=src, world=world,
                                             causal=causal)
            dk[src] += gk
            dv[src] += gv
    join = ring.zigzag_join
    return (join(list(outs)), join(list(lses), axis=2),
            *(join([g.astype(q.dtype) for g in grads]) for grads in (dq, dk, dv)))


@pytest.mark.gpu
@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [BF16, F16], ids=["bf16", "f16"])
def test_ring_equals_the_whole_sequence(rng, world, causal, dtype):
    b, h, hkv, d, chunk = 2, 4, 2, 64, 24
    n = 2 * world * chunk
    q, dout = (_randn(rng, (b, n, h, d), dtype) for _ in range(2))
    k, v = (_randn(rng, (b, n, hkv, d), dtype) for _ in range(2))
    out, lse, dq, dk, dv = simulate(q, k, v, dout, world, causal)
    scale = 1 / math.sqrt(d)
    host = [x.get() for x in (q, k, v, dout)]
    for bi in range(b):
        ref, ref_lse = attention_reference(host[0][bi], host[1][bi], host[2][bi], scale,
                                           causal=causal)
        check_attention(out[bi], lse[bi], ref, ref_lse, dtype)
        args = [x[bi] for x in host]
        want = attention_backward_reference(*args, scale, causal=causal)
        lowp = attention_backward_reference(*args, scale, causal=causal, lowp=dtype)
        for name, got, w, lp in zip(("dq", "dk", "dv"), (dq[bi], dk[bi], dv[bi]), want, lowp):
            check_grads(got, w, lp, dtype, f"{name}[{bi}] world {world}")
