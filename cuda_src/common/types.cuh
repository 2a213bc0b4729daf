// Element types and 16-byte vectors shared by every kernel: conversion of fp16 / bf16 /
// fp8 e4m3 to and from float, and the Vec16 unit of every coalesced load and store.
#pragma once
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <cuda_fp8.h>

namespace cuattn {

// Values of 16-byte vectors: 8 halves, 8 bfloat16s or 16 fp8 bytes.
template <typename T> struct ElemsPer16B { static constexpr int value = 16 / sizeof(T); };

struct __align__(16) Vec16 { uint4 raw; };

__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_float(__nv_fp8_e4m3 x) { return float(x); }

template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}
template <> __device__ __forceinline__ __nv_fp8_e4m3 from_float<__nv_fp8_e4m3>(float x) {
  return __nv_fp8_e4m3(x);
}

// Unpack a 16-byte vector of T into floats and back.
template <typename T>
__device__ __forceinline__ void unpack16(const Vec16& v, float (&out)[ElemsPer16B<T>::value]) {
  const T* elems = reinterpret_cast<const T*>(&v);
#pragma unroll
  for (int i = 0; i < ElemsPer16B<T>::value; ++i) out[i] = to_float(elems[i]);
}

template <typename T>
__device__ __forceinline__ Vec16 pack16(const float (&in)[ElemsPer16B<T>::value]) {
  Vec16 v;
  T* elems = reinterpret_cast<T*>(&v);
#pragma unroll
  for (int i = 0; i < ElemsPer16B<T>::value; ++i) elems[i] = from_float<T>(in[i]);
  return v;
}

// The scale of KV head kv_head from scales in device memory: a float per KV head (stride 1)
// or one for all (stride 0). Null: 1 (a scale given as a Python float is among the host's
// constants instead).
__device__ __forceinline__ float kv_head_scale(const void* scales, int stride, int kv_head) {
  return scales != nullptr ? static_cast<const float*>(scales)[kv_head * stride] : 1.f;
}

__device__ __forceinline__ Vec16 load16(const void* p) {
  return *reinterpret_cast<const Vec16*>(p);
}
__device__ __forceinline__ void store16(void* p, const Vec16& v) {
  *reinterpret_cast<Vec16*>(p) = v;
}
// Streamed once: keep it out of L1 (the ".nc" read-only path, evict-first).
__device__ __forceinline__ Vec16 load16_stream(const void* p) {
  Vec16 v;
  v.raw = __ldcs(reinterpret_cast<const uint4*>(p));
  return v;
}
__device__ __forceinline__ void store16_stream(void* p, const Vec16& v) {
  __stcs(reinterpret_cast<uint4*>(p), v.raw);
}

}  // namespace cuattn
