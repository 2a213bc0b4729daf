"""Training a small causal transformer in JAX with cuattn.jax.flash_attention.

Two layers (bf16 attention through cuattn's forward and backward inside the jitted step),
trained for 300 steps with Adam on made-up sequences that follow a fixed rule (each token
is a function of the two before it), so the loss can fall. Checked: the gradients of step
0 against the same model with jax.nn.dot_product_attention (error against the float32
model at most twice that of dot_product_attention in bf16, plus a small floor), and the
loss at the end below half the loss at the start.

    python examples/train_jax.py       # exit 0: ran and checked; 1: wrong; 2: could not run
"""
from __future__ import annotations

import sys
import time

from _example import need_gpu, need_jax_gpu


VOCAB, DIM, HEADS, LAYERS, SEQ, BATCH, STEPS = 64, 256, 4, 2, 256, 16, 300


def main() -> int:
    need_gpu()
    jax = need_jax_gpu()
    import jax.numpy as jnp

    import cuattn.jax

    def cuattn_attention(q, k, v):
        return cuattn.jax.flash_attention(q, k, v, causal=True)

    def xla_attention(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, is_causal=True)

    def loss_fn(params, tokens, attention, dtype):
        """Next-token cross-entropy; attention takes q, k, v in ``dtype``."""
        x = params["embed"][tokens[:, :-1]]
        for layer in params["layers"]:
            h = layer_norm(x)
            q, k, v = (jnp.einsum("bsd,dhe->bshe", h, layer[name]).astype(dtype)
                       for name in ("wq", "wk", "wv"))
            a = attention(q, k, v).astype(jnp.float32)
            x = x + jnp.einsum("bshe,hed->bsd", a, layer["wo"])
            x = x + jax.nn.gelu(layer_norm(x) @ layer["w1"]) @ layer["w2"]
        logits = layer_norm(x) @ params["embed"].T / DIM ** 0.5
        targets = jax.nn.one_hot(tokens[:, 1:], VOCAB)
        return -jnp.mean(jnp.sum(targets * jax.nn.log_softmax(logits), axis=-1))

    def layer_norm(x):
        mean = x.mean(-1, keepdims=True)
        return (x - mean) * jax.lax.rsqrt(((x - mean) ** 2).mean(-1, keepdims=True) + 1e-5)

    def init(key):
        keys = iter(jax.random.split(key, 2 + 6 * LAYERS))
        head = DIM // HEADS

        def dense(shape, fan_in):
            return jax.random.normal(next(keys), shape) / fan_in ** 0.5

        return {"embed": dense((VOCAB, DIM), 1.0) * 0.5,
                "layers": [{"wq": dense((DIM, HEADS, head), DIM),
                            "wk": dense((DIM, HEADS, head), DIM),
                            "wv": dense((DIM, HEADS, head), DIM),
                            "wo": dense((HEADS, head, DIM), DIM) / LAYERS,
                            "w1": dense((DIM, 4 * DIM), DIM),
                            "w2": dense((4 * DIM, DIM), 4 * DIM) / LAYERS}
                           for _ in range(LAYERS)]}

    def batch(key):
        """Sequences where token t = (3 * token[t-1] + token[t-2] + 1) mod VOCAB."""
        first = jax.random.randint(key, (BATCH, 2), 0, VOCAB)

        def step(carry, _):
            a, b = carry
            c = (3 * b + a + 1) % VOCAB
            return (b, c), c

        _, rest = jax.lax.scan(step, (first[:, 0], first[:, 1]), None, length=SEQ - 1)
        return jnp.concatenate([first, rest.T], axis=1)[:, :SEQ + 1]

    params = init(jax.random.PRNGKey(0))
    tokens = batch(jax.random.PRNGKey(1))

    # Step 0's gradients: cuattn (bf16) and dot_product_attention (bf16) against the
    # float32 model.
    grads = {name: jax.jit(jax.grad(loss_fn), static_argnums=(2, 3))(params, tokens, attn, dt)
             for name, attn, dt in (("cuattn", cuattn_attention, jnp.bfloat16),
                                    ("xla bf16", xla_attention, jnp.bfloat16),
                                    ("xla f32", xla_attention, jnp.float32))}
    worst = 0.0
    for ours, peer, exact in zip(*(jax.tree.leaves(grads[n]) for n in
                                   ("cuattn", "xla bf16", "xla f32"))):
        err = float(jnp.abs(ours - exact).max())
        allowed = 2 * float(jnp.abs(peer - exact).max()) + 1e-3 * float(jnp.abs(exact).max())
        worst = max(worst, err / allowed)
    print(f"step 0 gradients: worst error / allowed = {worst:.2f} (over "
          f"{len(jax.tree.leaves(params))} parameters)")
    if worst > 1:
        print("gradients differ from jax.nn.dot_product_attention's beyond bf16 tolerance")
        return 1

    @jax.jit
    def train_step(params, moments, key, step):
        tokens = batch(key)
        loss, g = jax.value_and_grad(loss_fn)(params, tokens, cuattn_attention, jnp.bfloat16)
        m, v = moments
        m = jax.tree.map(lambda m, g: 0.9 * m + 0.1 * g, m, g)
        v = jax.tree.map(lambda v, g: 0.999 * v + 0.001 * g * g, v, g)
        lr = 1e-3 * jnp.minimum(1.0, (step + 1) / 20)
        fix1, fix2 = 1 - 0.9 ** (step + 1), 1 - 0.999 ** (step + 1)
        params = jax.tree.map(lambda p, m, v: p - lr * (m / fix1) / (jnp.sqrt(v / fix2) + 1e-8),
                              params, m, v)
        return params, (m, v), loss

    moments = (jax.tree.map(jnp.zeros_like, params), jax.tree.map(jnp.zeros_like, params))
    start = time.perf_counter()
    losses = []
    for step, key in enumerate(jax.random.split(jax.random.PRNGKey(2), STEPS)):
        params, moments, loss = train_step(params, moments, key, step)
        losses.append(loss)
    losses = [float(x) for x in losses]
    seconds = time.perf_counter() - start
    print(f"{STEPS} steps in {seconds:.1f} s (compile included): loss {losses[0]:.3f} -> "
          f"{losses[-1]:.3f}")
    if not losses[-1] < 0.5 * losses[0]:
        print("the loss did not fall")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
