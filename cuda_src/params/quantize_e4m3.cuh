// Parameters of quantize_e4m3 (cuda_src/quantize_e4m3.cuh). Mirrored by
// cuattn.param_structs.QUANTIZE_PARAMS; every generated entry point static_asserts the size of
// each field, and tests/test_jit.py compares the offsets. Strides are in elements.
#pragma once

namespace cuattn {

struct QuantizeE4m3Params {
  const void* x;             // [rows, num_heads, head_dim]  T (fp16 / bf16)
  void* out;                 // [rows, num_heads, head_dim]  e4m3
  const void* scales;        // [num_heads / head_group] or [1] float: the scale in device memory (else null)
  long long x_stride_row, x_stride_head;
  long long out_stride_row, out_stride_head;
  float scale;               // times scales' (1 when those are given)
  int num_heads;
  int head_dim;              // a multiple of 16
  int head_group;            // heads sharing one entry of scales (a KV head's query heads)
  int scales_stride;         // 1: a scale per entry; 0: one scale
};

}  // namespace cuattn
