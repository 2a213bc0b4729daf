"""PyTorch tensors in, a PyTorch tensor out, through DLPack: no copies.

cupy.from_dlpack(t) is a CuPy view of a torch tensor (cuattn's input) and
torch.from_dlpack(out) a torch view of cuattn's result. Both libraries enqueue on one
stream (a torch stream, entered in CuPy as an ExternalStream), so the kernels are ordered
without any synchronisation. The result is checked against torch's
scaled_dot_product_attention.

    python examples/interop_torch.py   # exit 0: ran and matched; 1: wrong; 2: could not run
"""
from __future__ import annotations

import sys

from _example import cannot_run, need_gpu, need_module


def main() -> int:
    need_gpu()
    torch = need_module("torch", "see https://pytorch.org for a CUDA build")
    if not torch.cuda.is_available():
        cannot_run(f"this torch {torch.__version__} has no CUDA device")
    import cupy as cp

    import cuattn

    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream), cp.cuda.ExternalStream(stream.cuda_stream):
        q = torch.randn(2, 1024, 16, 128, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(2, 1024, 16, 128, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(2, 1024, 16, 128, device="cuda", dtype=torch.bfloat16)
        q_view = cp.from_dlpack(q)                    # (batch, seqlen, heads, headdim) views
        out_view = cuattn.flash_forward(q_view, cp.from_dlpack(k), cp.from_dlpack(v),
                                        causal=True)
        out = torch.from_dlpack(out_view)
        # torch's SDPA takes (batch, heads, seqlen, headdim): transposed views
        ref = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        ).transpose(1, 2)
        err = (out.float() - ref.float()).abs().max().item()   # .item() waits for the stream
    shared = q_view.data.ptr == q.data_ptr() and out.data_ptr() == out_view.data.ptr
    print(f"flash_forward on torch tensors: shape {tuple(out.shape)}, {out.dtype}, "
          f"max |out - SDPA| = {err:.2e}, memory shared (no copy): {shared}")
    return 0 if shared and err < 2e-2 else 1


if __name__ == "__main__":
    sys.exit(main())
