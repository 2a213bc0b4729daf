"""Lab (issue 36): relative error ||out - ref|| / ||ref|| of the FP8 forward beside bf16's, on
random inputs and on inputs with outlier channels (4 columns of K 30x larger), causal and
not: the FP8 kernel against the float64 reference of its dequantized inputs (per-head
descales from each (batch, KV head)'s amax), next to the NumPy model of its roundings
(tests/reference.py fp8_attention_kernel_math); the bf16 kernel against the float64
reference of its bf16 inputs.
    PYTHONPATH=. python bench/lab/fp8_accuracy.py
"""
from __future__ import annotations

import math
import sys

import cupy as cp
import ml_dtypes
import numpy as np

sys.path.insert(0, ".")
import cuattn                                                   # noqa: E402
from tests.reference import attention_reference                 # noqa: E402
from tests.test_flash_fp8 import _quantize, _rel, _to_device    # noqa: E402
from tests.reference import fp8_attention_kernel_math, fp8_dequantized  # noqa: E402

BF16 = np.dtype(ml_dtypes.bfloat16)


def main():
    rng = np.random.default_rng(0)
    b, s, h, hkv, d = 1, 1024, 4, 2, 128
    scale = 1 / math.sqrt(d)
    for outlier in (False, True):
        for causal in (False, True):
            q, k, v = (rng.standard_normal((b, s, n, d)).astype(np.float32) for n in (h, hkv, hkv))
            if outlier:
                k[..., rng.choice(d, 4, replace=False)] *= 30.0
            (q8, qd), (k8, kd), (v8, vd) = (_quantize(x, True, hkv) for x in (q, k, v))
            deq = [fp8_dequantized(x8, ds) for x8, ds in ((q8, qd), (k8, kd), (v8, vd))]
            ref, _ = attention_reference(*(x[0] for x in deq), scale, causal=causal)
            model, _ = fp8_attention_kernel_math(q8, k8, v8, qd, kd, vd, scale, causal=causal)
            got = cuattn.flash_forward(*(_to_device(x) for x in (q8, k8, v8)), causal=causal,
                                       q_descale=cp.asarray(qd), k_descale=cp.asarray(kd),
                                       v_descale=cp.asarray(vd)).get().astype(np.float64)[0]
            qb, kb, vb = (x.astype(BF16) for x in (q, k, v))
            ref16, _ = attention_reference(qb[0], kb[0], vb[0], scale, causal=causal)
            got16 = cuattn.flash_forward(*(cp.asarray(x) for x in (qb, kb, vb)),
                                         causal=causal).get().astype(np.float64)[0]
            print(f"{'outliers' if outlier else 'random'} {'causal' if causal else 'full'}: "
                  f"fp8 kernel {_rel(got, ref):.4f}, "
                  f"fp8 model {_rel(model[0].astype(BF16).astype(np.float64), ref):.4f}, "
                  f"bf16 kernel {_rel(got16, ref16):.4f}")


if __name__ == "__main__":
    main()
