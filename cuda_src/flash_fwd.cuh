// FlashAttention-2 forward: out = softmax(scale * Q K^T + mask) V per (batch, head), never
// materialising the scores, plus the natural-log log-sum-exp of each row. The algorithm is
// Dao 2023, "FlashAttention-2" (online softmax over K/V tiles, each warp owning its query
// rows); split-KV (Flash-Decoding) writes fp32 partial results merged by the combine kernel.
// The kernel is assembled from named parts: the query rows of a block (QueryRows: one head,
// or the heads of one KV head packed), a K/V tile source (KVSource: dense, or a paged cache
// in either layout, for paged_prefill), the key tiles a block visits under its mask
// (KeyTiles, common/mask.cuh), a logits hook (common/logits.cuh: softcap, ALiBi), the online
// softmax of the warp's rows (WarpSoftmax over common/softmax.cuh's SoftmaxState, with the
// attention sinks at the end) and two epilogues (the output, or split-KV partials).
#pragma once
#include "common/types.cuh"
#include "common/softmax.cuh"
#include "common/mask.cuh"
#include "common/logits.cuh"
#include "common/mma.cuh"
#include "params/flash_fwd.cuh"

namespace cuattn {

// Where K and V come from (FlashFwdTraits KV; params/flash_fwd.cuh has the layouts).
enum : int { kKvDense = 0, kKvPagedNhd = 1, kKvPagedVllm = 2 };
// What a kernel does beyond plain attention (FlashFwdTraits FEATURES, bits).
enum : int { kSoftcap = 1, kAlibi = 2, kSinks = 4, kPackGqa = 8 };

// Every knob of one forward kernel (cuattn.variants.FlashFwdVariant, chosen by
// cuattn/tuning.py) and every tile constant derived from them.
//   MASK      kMaskNone / kMaskCausal / kMaskWindow (common/mask.cuh).
//   SPLIT     split-KV: write normalised fp32 partials for flash_fwd_combine_kernel.
//   Q_SMEM    >= 1: Q fragments re-read from shared memory at every k16 step, for 32 query
//             rows per warp within 255 registers; with it, the register-lean forms of the
//             rest: one key loop, a rolled output-store loop. 2: also the compact ldmatrix
//             step offsets (SwizzledSteps COMPACT). ptxas at 255 registers tips either way on
//             each: hd64 128x128 fits only with 2, hd128 128x32 only with 1.
//   KV_SPLIT  K and V of a tile are separate cp.async groups: S = Q K^T of tile n waits only
//             for K_n (one barrier), O += P V waits for V_n (a second barrier), so the first
//             GEMM and the softmax overlap V_n's flight.
//   SOFTMAX   bit 0: branch-free rescale (O *= alpha every tile, alpha = 1 when the row max
//             stays) instead of a divergent branch per row; bit 1: P packed to T right after
//             its exp2, and no -inf guard on the row max without a band.
//   KV        kKvDense / kKvPagedNhd / kKvPagedVllm: the K/V source.
//   FEATURES  bits: kSoftcap, kAlibi (the logits hook), kSinks (a per-head logit in the
//             denominator), kPackGqa (a block's rows are the tokens x query heads of one KV
//             head: each K/V tile is read once for the whole group; paged_prefill).
//   FP8       a paged cache of fp8 e4m3 bytes: each stage also holds its tile's raw bytes,
//             copied by cp.async and widened to T (exactly: every e4m3 value is one) in
//             shared memory once the stage has landed (KVSource::widen), before any warp
//             reads it. k_scale is in the softmax scale (the host's), v_scale multiplies
//             each row's normaliser.
template <bool FP8, typename T> struct CacheElem { using type = T; };
template <typename T> struct CacheElem<true, T> { using type = unsigned char; };

// The FEATURES bits as both forward kernels' traits read them (their base).
template <int FEATURES>
struct FlashFeatures {
  static constexpr bool SOFTCAP = (FEATURES & kSoftcap) != 0;
  static constexpr bool ALIBI = (FEATURES & kAlibi) != 0;
  static constexpr bool SINKS = (FEATURES & kSinks) != 0;
  static constexpr bool PACK_GQA = (FEATURES & kPackGqa) != 0;
  using Logits = LogitsHook<SOFTCAP, ALIBI>;            // the logits hook point
};

template <typename T_, int HEAD_DIM_, int BLOCK_M_, int BLOCK_N_, int NUM_WARPS_, int STAGES_,
          int MASK_, bool SPLIT_, int Q_SMEM_, bool KV_SPLIT_, int SOFTMAX_, int KV_,
          int FEATURES_, bool FP8_>
struct FlashFwdTraits : FlashFeatures<FEATURES_> {
  using T = T_;
  using OutT = T_;                                      // the output's element
  static constexpr int P_SHIFT = 0;                     // P = 2^P_SHIFT exp(S - max): WarpSoftmax
  static constexpr bool FP8 = FP8_;
  using C = typename CacheElem<FP8, T>::type;           // an element of the K/V source
  using Mask = BandMask<MASK_>;
  static constexpr int KV = KV_;
  static constexpr bool PAGED = KV != kKvDense;
  static constexpr bool V_BY_DIM = KV == kKvPagedVllm;  // V tile is [dim][key] (vLLM's V)
  static constexpr int HEAD_DIM = HEAD_DIM_;
  static constexpr int BLOCK_M = BLOCK_M_;
  static constexpr int BLOCK_N = BLOCK_N_;
  static constexpr int NUM_WARPS = NUM_WARPS_;
  static constexpr int STAGES = STAGES_;
  static constexpr bool SPLIT = SPLIT_;
  static constexpr int Q_SMEM = Q_SMEM_;
  static constexpr bool KV_SPLIT = KV_SPLIT_;
  static constexpr bool BRANCH_FREE_RESCALE = (SOFTMAX_ & 1) != 0;
  static constexpr bool EARLY_PACK = (SOFTMAX_ & 2) != 0;

  static constexpr int THREADS = NUM_WARPS * 32;
  static constexpr int WARP_M = BLOCK_M / NUM_WARPS;    // query rows owned by one warp
  static constexpr int M_TILES = WARP_M / 16;           // m16 tiles per warp
  static constexpr int D_CHUNKS = HEAD_DIM / 8;         // 16-byte chunks per row
  static constexpr int QK_K_STEPS = HEAD_DIM / 16;      // k16 steps of S = Q K^T
  static constexpr int S_N_TILES = BLOCK_N / 8;         // n8 tiles of S per warp row block
  static constexpr int PV_K_STEPS = BLOCK_N / 16;       // k16 steps of O += P V
  static constexpr int O_N_TILES = HEAD_DIM / 8;        // n8 tiles of O
  static constexpr int Q_BYTES = BLOCK_M * HEAD_DIM * 2;
  static constexpr int KV_TILE_BYTES = BLOCK_N * HEAD_DIM * 2;
  static constexpr int FP8_TILE_BYTES = FP8 ? BLOCK_N * HEAD_DIM : 0;   // raw K (or V) bytes
  static constexpr int STAGE_BYTES = 2 * KV_TILE_BYTES + 2 * FP8_TILE_BYTES;  // K, V (, K8, V8)
  static constexpr int SMEM_BYTES = Q_BYTES + STAGES * STAGE_BYTES;
  static constexpr int KV_CHUNKS = BLOCK_N * D_CHUNKS;   // of K, and of V either way
  static constexpr int VT_CHUNKS = BLOCK_N / 8;         // V_BY_DIM: chunks (8 keys) per dim row
  static constexpr int KV_LOADS_PER_THREAD = (KV_CHUNKS + THREADS - 1) / THREADS;
  static constexpr int Q_LOADS_PER_LANE = WARP_M * D_CHUNKS / 32;
  // K/V copies: each thread copies a fixed 16-byte column chunk of every ROWS_PER_PASS-th
  // row when the chunks of a row divide the block evenly; otherwise chunk c of the tile goes
  // to thread c % THREADS.
  static constexpr bool EVEN_ROWS = THREADS % D_CHUNKS == 0;
  static constexpr int ROWS_PER_PASS = EVEN_ROWS ? THREADS / D_CHUNKS : 1;
  // Two inlined copies of the key-loop body (boundary tiles with the mask, the middle
  // without) when registers allow; above head dim 128 ptxas spills with two copies, so one
  // loop skips the mask code with a block-uniform branch instead. Q_SMEM takes the one
  // loop too: at 32 rows per warp (O + S = 160-192 accumulator registers) the second copy
  // tips ptxas into spills (hd128 128x32: 20-24 bytes with two copies, none with one).
  static constexpr bool SEPARATE_MASK_LOOP = HEAD_DIM <= 128 && Q_SMEM == 0;
  // Q fragments stay in registers for the whole key loop unless Q + O fragments alone
  // would take more than 96 of the 255 registers (hd 128 at 16 rows per warp: 32 + 64 = 96;
  // larger head dims leave too little room for S, addresses and load scheduling).
  static constexpr bool Q_IN_REGS =
      Q_SMEM == 0 && M_TILES * (QK_K_STEPS * 4 + O_N_TILES * 4) <= 96;
  // cp.async groups in commit order: Q, then per tile K+V (KV_SPLIT: K, V); every thread
  // commits the same groups, empty or not. At the top of step n, once tile n's K has
  // landed, KV_WAIT_K younger groups may still fly (V_n with KV_SPLIT, and tiles n+1 ..
  // n+STAGES-2); before O += P V (KV_SPLIT), once V_n has landed, KV_WAIT_V may.
  static constexpr int KV_GROUPS = KV_SPLIT ? 2 : 1;
  static constexpr int KV_WAIT_K = KV_SPLIT ? 2 * STAGES - 3 : STAGES - 2;
  static constexpr int KV_WAIT_V = 2 * STAGES - 2;
  // With 32 rows per warp (Q_SMEM) the output-store loop stays rolled, or ptxas hoists all
  // the 16-byte loads and spills around the end of the key loop (hd128 128x64: 184 bytes
  // -> 20).
  static constexpr int STORE_UNROLL = Q_SMEM == 0 ? Q_LOADS_PER_LANE : 1;

  static_assert(sizeof(T) == 2, "fp16 / bf16 only");
  static_assert(HEAD_DIM % 32 == 0 && HEAD_DIM <= 256, "compiled head dim: a multiple of 32");
  static_assert(BLOCK_M % (16 * NUM_WARPS) == 0, "each warp owns a multiple of 16 query rows");
  static_assert(BLOCK_N % 16 == 0, "BLOCK_N: a multiple of 16");
  static_assert(STAGES >= 2, "at least double buffering");
  static_assert((WARP_M * D_CHUNKS) % 32 == 0, "Q rows of a warp split evenly over lanes");
  static_assert(Q_SMEM >= 0 && Q_SMEM <= 2 && SOFTMAX_ >= 0 && SOFTMAX_ <= 3, "knob range");
  static_assert(KV_ >= kKvDense && KV_ <= kKvPagedVllm && FEATURES_ >= 0 && FEATURES_ < 16,
                "knob range");
  static_assert(!V_BY_DIM || BLOCK_N % 32 == 0, "a [dim][key] V tile: rows of >= 4 chunks");
  static_assert(!FP8 || (PAGED && !KV_SPLIT && HEAD_DIM % 16 == 0),
                "fp8: a paged cache, widened once the whole stage has landed");
};

// Rows of one batch entry: where they start and how many there are.
struct SeqRange {
  int start;
  int len;
};

__device__ __forceinline__ SeqRange seq_range(const void* cu_seqlens, int b, int fixed_len) {
  if (cu_seqlens == nullptr) return {0, fixed_len};
  const int* cu = static_cast<const int*>(cu_seqlens);
  const int start = cu[b];
  return {start, cu[b + 1] - start};
}

// The keys of batch entry b: its slice of the packed K / V (cu_seqlens_k), the fixed
// length, or for a paged cache (no offset) its seqused_k plus the keys this call appended,
// clamped to the capacity of its cache (seqlen_k).
template <bool PAGED>
__device__ __forceinline__ SeqRange key_range(const FlashFwdParams& p, int b) {
  if constexpr (PAGED) {
    const long long used =
        (p.seqused_k ? static_cast<const int*>(p.seqused_k)[b] : 0) + (long long)p.new_keys;
    return {0, int(min(max(used, 0LL), (long long)p.seqlen_k))};
  }
  return seq_range(p.cu_seqlens_k, b, p.seqlen_k);
}

// A paged cache (params/flash_fwd.cuh): batch entry b's block-table row, and for its key j
// the cache block (the row's entry) and the slot inside it.
__device__ __forceinline__ const int* paged_table(const FlashFwdParams& p, int b) {
  return static_cast<const int*>(p.block_tables) + b * p.bt_stride_seq;
}
__device__ __forceinline__ long long paged_block(const FlashFwdParams& p, const int* table,
                                                 int j) {
  return __ldg(table + (j >> p.block_shift));
}
__device__ __forceinline__ int paged_slot(const FlashFwdParams& p, int j) {
  return j & ((1 << p.block_shift) - 1);
}

// The query rows of a block: row R of the block's sequence of rows is token R of head
// head0, or with PACK_GQA token R / group of head head0 + R % group (the group query heads
// of one KV head, interleaved per token so that a tile's rows span few tokens).
template <bool PACK>
struct QueryRows {
  int head0;
  int group;   // PACK: query heads per KV head (else 1)
  __device__ __forceinline__ int token(int R) const { return PACK ? R / group : R; }
  __device__ __forceinline__ int head(int R) const { return PACK ? head0 + R % group : head0; }
};

// ---- K/V tile source: one KV head's K and V, dense or paged ---------------------------------
// load() copies key tile `tile` into a pipeline stage (K tile, then V tile); keys past the
// sequence and columns past head_dim are zero-filled (a zero V row keeps 0 * garbage out of
// P V; nothing past a sequence's keys is read). K tiles are [key][16-byte chunk] rows, V
// tiles the same, or with V_BY_DIM (vLLM's V layout, 8 keys of one dim in 16 bytes)
// [dim][8-key chunk] rows; all rows XOR-swizzled (common/mma.cuh).
template <typename Tr>
struct KVSource {
  using T = typename Tr::T;
  using C = typename Tr::C;
  const FlashFwdParams& p;
  const C* k;           // dense: key 0 of this sequence and KV head; paged: this KV head's
  const C* v;           // offset in the caches
  const int* block_table;   // paged: this sequence's row
  int sk;
  int head_dim_chunks;
  int tid;
  int ld_row, ld_ch;    // EVEN_ROWS: this thread's first row and its column chunk
  bool ld_ch_ok;

  __device__ __forceinline__ KVSource(const FlashFwdParams& params, const C* k_rows,
                                      const C* v_rows, const int* table, int seqlen_k,
                                      int thread)
      : p(params), k(k_rows), v(v_rows), block_table(table), sk(seqlen_k),
        head_dim_chunks(params.head_dim / 8), tid(thread),
        ld_row(Tr::EVEN_ROWS ? thread / Tr::D_CHUNKS : 0),
        ld_ch(Tr::EVEN_ROWS ? thread % Tr::D_CHUNKS : 0), ld_ch_ok(ld_ch < head_dim_chunks) {}

  // Paged: the cache block and slot of key j.
  __device__ __forceinline__ long long block_of(int j) const {
    return paged_block(p, block_table, j);
  }
  __device__ __forceinline__ int slot_of(int j) const { return paged_slot(p, j); }
  // Element offsets of chunk ch of key j's K row and of its V row
  // (vLLM's layout has its own K path and a [dim][key] V tile: dense and NHD only.)
  __device__ __forceinline__ long long k_offset(int j, int ch) const {
    if constexpr (!Tr::PAGED) return (long long)j * p.k_stride_row + ch * 8;
    return block_of(j) * p.k_stride_block + slot_of(j) * p.k_stride_row + ch * 8;
  }
  __device__ __forceinline__ long long v_offset(int j, int ch) const {
    if constexpr (!Tr::PAGED) return (long long)j * p.v_stride_row + ch * 8;
    return block_of(j) * p.v_stride_block + slot_of(j) * p.v_stride_row + ch * 8;
  }

  // fp8 (Tr::FP8): the tile's raw bytes into the stage's K8 / V8 areas, unswizzled: K (and
  // NHD's V) as [key][16 dims] 16-byte chunks, vLLM's V as [dim][8 keys] 8-byte chunks (a
  // block holds >= 8 keys); keys past the sequence and dims past head_dim zero-filled.
  __device__ __forceinline__ void load_fp8(u32 stage_base, int tile) const {
    constexpr int FC = Tr::HEAD_DIM / 16, VTC = Tr::VT_CHUNKS, THREADS = Tr::THREADS;
    const u32 k8 = stage_base + 2 * Tr::KV_TILE_BYTES, v8 = k8 + Tr::FP8_TILE_BYTES;
    const int real_fc = p.head_dim / 16;
#pragma unroll
    for (int it = 0; it < (Tr::BLOCK_N * FC + THREADS - 1) / THREADS; ++it) {
      const int c = it * THREADS + tid;
      if ((Tr::BLOCK_N * FC) % THREADS == 0 || c < Tr::BLOCK_N * FC) {
        const int r = c / FC, fc = c % FC;
        const int key = tile * Tr::BLOCK_N + r;
        const bool ok = key < sk && fc < real_fc;
        const long long blk = ok ? block_of(key) : 0;
        const C* kp = k + blk * p.k_stride_block + slot_of(key) * p.k_stride_row +
                      fc * (Tr::KV == kKvPagedVllm ? p.k_stride_chunk : 16);   // x = 16
        cp_async_16(k8 + c * 16, ok ? kp : k, ok ? 16 : 0);
        if constexpr (!Tr::V_BY_DIM) {
          const C* vp = v + blk * p.v_stride_block + slot_of(key) * p.v_stride_row + fc * 16;
          cp_async_16(v8 + c * 16, ok ? vp : v, ok ? 16 : 0);
        }
      }
    }
    if constexpr (Tr::V_BY_DIM) {
#pragma unroll
      for (int it = 0; it < (Tr::HEAD_DIM * VTC + THREADS - 1) / THREADS; ++it) {
        const int c = it * THREADS + tid;
        if ((Tr::HEAD_DIM * VTC) % THREADS == 0 || c < Tr::HEAD_DIM * VTC) {
          const int d = c / VTC, key0 = tile * Tr::BLOCK_N + (c % VTC) * 8;
          const bool ok = key0 < sk && d < p.head_dim;
          const C* vp = ok ? v + block_of(key0) * p.v_stride_block + d * p.v_stride_dim +
                                 slot_of(key0)
                           : v;
          cp_async_8(v8 + c * 8, vp, ok ? min(8, sk - key0) : 0);
        }
      }
    }
  }

  // fp8: widen the landed raw bytes of a stage (generic pointer `stage`) into its K and V
  // tiles of T, as load() would have laid them out (exact: no scale is applied here).
  __device__ __forceinline__ void widen(unsigned char* stage) const {
    constexpr int FC = Tr::HEAD_DIM / 16, VTC = Tr::VT_CHUNKS, D_CHUNKS = Tr::D_CHUNKS;
    constexpr int THREADS = Tr::THREADS;
    const unsigned char* k8 = stage + 2 * Tr::KV_TILE_BYTES;
    const unsigned char* v8 = k8 + Tr::FP8_TILE_BYTES;
    auto widen8 = [](const unsigned char* src) {   // 8 fp8 -> 8 T
      float f[8];
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        __nv_fp8_e4m3 x;
        x.__x = src[i];
        f[i] = to_float(x);
      }
      uint4 out;
      out.x = pack_pair<T>(f[0], f[1]); out.y = pack_pair<T>(f[2], f[3]);
      out.z = pack_pair<T>(f[4], f[5]); out.w = pack_pair<T>(f[6], f[7]);
      return out;
    };
#pragma unroll 1
    for (int it = 0; it < (Tr::BLOCK_N * FC + THREADS - 1) / THREADS; ++it) {
      const int c = it * THREADS + tid;
      if ((Tr::BLOCK_N * FC) % THREADS == 0 || c < Tr::BLOCK_N * FC) {
        const int r = c / FC, fc = c % FC;
        const uint4 kraw = *reinterpret_cast<const uint4*>(k8 + c * 16);
        const unsigned char* kb = reinterpret_cast<const unsigned char*>(&kraw);
#pragma unroll
        for (int h = 0; h < 2; ++h)
          *reinterpret_cast<uint4*>(stage + swizzled_offset<D_CHUNKS>(r, 2 * fc + h)) =
              widen8(kb + 8 * h);
        if constexpr (!Tr::V_BY_DIM) {
          const uint4 vraw = *reinterpret_cast<const uint4*>(v8 + c * 16);
          const unsigned char* vb = reinterpret_cast<const unsigned char*>(&vraw);
#pragma unroll
          for (int h = 0; h < 2; ++h)
            *reinterpret_cast<uint4*>(stage + Tr::KV_TILE_BYTES +
                                      swizzled_offset<D_CHUNKS>(r, 2 * fc + h)) =
                widen8(vb + 8 * h);
        }
      }
    }
    if constexpr (Tr::V_BY_DIM) {
#pragma unroll 1
      for (int it = 0; it < (Tr::HEAD_DIM * VTC + THREADS - 1) / THREADS; ++it) {
        const int c = it * THREADS + tid;
        if ((Tr::HEAD_DIM * VTC) % THREADS == 0 || c < Tr::HEAD_DIM * VTC) {
          const uint2 vraw = *reinterpret_cast<const uint2*>(v8 + c * 8);
          *reinterpret_cast<uint4*>(stage + Tr::KV_TILE_BYTES +
                                    swizzled_offset<VTC>(c / VTC, c % VTC)) =
              widen8(reinterpret_cast<const unsigned char*>(&vraw));
        }
      }
    }
  }

  __device__ __forceinline__ void load(u32 stage_base, int tile, bool do_k = true,
                                       bool do_v = true) const {
    if constexpr (Tr::FP8) {
      load_fp8(stage_base, tile);
    } else {
      load_16bit(stage_base, tile, do_k, do_v);
    }
  }

  __device__ __forceinline__ void load_16bit(u32 stage_base, int tile, bool do_k,
                                             bool do_v) const {
    constexpr int D_CHUNKS = Tr::D_CHUNKS;
    const u32 sk_base = stage_base;
    const u32 sv_base = stage_base + Tr::KV_TILE_BYTES;
    const bool rows_v = do_v && !Tr::V_BY_DIM;   // V copied here as [key][chunk] rows
    if constexpr (Tr::KV == kKvPagedVllm) {
      // vLLM's K holds chunk c of a block's consecutive tokens contiguously, so consecutive
      // threads take consecutive keys of one chunk (a warp reads whole 256-byte runs); each
      // thread keeps its keys, one block-table entry per KEYS-key pass. (With a token's
      // chunks spread over 16 threads, as for NHD, every 16-byte read was half a sector:
      // vllm/16 ran at 0.55-0.59x of the dense call against nhd's 0.83-0.88x.)
      constexpr int KEYS = Tr::BLOCK_N < Tr::THREADS ? Tr::BLOCK_N : Tr::THREADS;
      constexpr int CSTEP = Tr::THREADS / KEYS;
      static_assert(Tr::BLOCK_N % KEYS == 0 && D_CHUNKS % CSTEP == 0, "whole passes");
      if (do_k) {
#pragma unroll
        for (int rr = 0; rr < Tr::BLOCK_N / KEYS; ++rr) {
          const int r = rr * KEYS + tid % KEYS;
          const int key = tile * Tr::BLOCK_N + r;
          const bool key_ok = key < sk;
          const T* kp = key_ok ? k + block_of(key) * p.k_stride_block + slot_of(key) * p.k_stride_row
                               : k;
#pragma unroll
          for (int j = 0; j < D_CHUNKS / CSTEP; ++j) {
            const int c = j * CSTEP + tid / KEYS;
            const bool ok = key_ok && c < head_dim_chunks;
            cp_async_16(sk_base + swizzled_offset<D_CHUNKS>(r, c), ok ? kp + c * p.k_stride_chunk : k,
                        ok ? 16 : 0);
          }
        }
      }
    } else if constexpr (Tr::EVEN_ROWS && !Tr::PAGED) {
      const int key0 = tile * Tr::BLOCK_N + ld_row;
      const T* ks = k + k_offset(key0, ld_ch);
      const T* vs = v + v_offset(key0, ld_ch);
      const long long k_step = (long long)Tr::ROWS_PER_PASS * p.k_stride_row;
      const long long v_step = (long long)Tr::ROWS_PER_PASS * p.v_stride_row;
#pragma unroll
      for (int it = 0; it < Tr::BLOCK_N / Tr::ROWS_PER_PASS; ++it) {
        const int r = it * Tr::ROWS_PER_PASS + ld_row;
        const bool ok = ld_ch_ok && key0 + it * Tr::ROWS_PER_PASS < sk;
        const u32 off = swizzled_offset<D_CHUNKS>(r, ld_ch);
        if (do_k) cp_async_16(sk_base + off, ok ? ks : k, ok ? 16 : 0);
        if (rows_v) cp_async_16(sv_base + off, ok ? vs : v, ok ? 16 : 0);
        ks += k_step;
        vs += v_step;
      }
    } else if constexpr (Tr::EVEN_ROWS) {
      // NHD: thread group ld_row copies chunk ld_ch of the RPT consecutive keys
      // [ld_row * RPT, +RPT) of the tile (16 threads still cover a row's 256 bytes): they
      // share one cache block whenever block_size >= RPT, so the block table is read once
      // per tile (again only where a key starts a new block) and K and V share the entry.
      // (Strided rows, as in the dense path, cost a table read and address per row: the
      // first measurement of paged_prefill, bench/NOTES.md.)
      constexpr int RPT = Tr::BLOCK_N / Tr::ROWS_PER_PASS;
      const int r0 = ld_row * RPT;
      const int key0 = tile * Tr::BLOCK_N + r0;
      const long long chunk = ld_ch * 8;
      const T* kp = k;
      const T* vp = v;
#pragma unroll
      for (int it = 0; it < RPT; ++it) {
        const int key = key0 + it;
        const bool ok = ld_ch_ok && key < sk;
        if (it == 0 || slot_of(key) == 0) {
          const long long blk = key < sk ? block_of(key) : 0;
          kp = k + blk * p.k_stride_block + slot_of(key) * p.k_stride_row + chunk;
          vp = v + blk * p.v_stride_block + slot_of(key) * p.v_stride_row + chunk;
        }
        const u32 off = swizzled_offset<D_CHUNKS>(r0 + it, ld_ch);
        if (do_k) cp_async_16(sk_base + off, ok ? kp : k, ok ? 16 : 0);
        if (rows_v) cp_async_16(sv_base + off, ok ? vp : v, ok ? 16 : 0);
        kp += p.k_stride_row;
        vp += p.v_stride_row;
      }
    } else {
#pragma unroll
      for (int it = 0; it < Tr::KV_LOADS_PER_THREAD; ++it) {
        const int c = it * Tr::THREADS + tid;
        if (Tr::KV_CHUNKS % Tr::THREADS == 0 || c < Tr::KV_CHUNKS) {
          const int r = c / D_CHUNKS, ch = c % D_CHUNKS;
          const int key = tile * Tr::BLOCK_N + r;
          const bool ok = key < sk && ch < head_dim_chunks;
          const u32 off = swizzled_offset<D_CHUNKS>(r, ch);
          if (do_k) cp_async_16(sk_base + off, ok ? k + k_offset(key, ch) : k, ok ? 16 : 0);
          if (rows_v) cp_async_16(sv_base + off, ok ? v + v_offset(key, ch) : v, ok ? 16 : 0);
        }
      }
    }
    if constexpr (Tr::V_BY_DIM) {
      // chunk c = (dim c / VT_CHUNKS, keys 8 (c % VT_CHUNKS) ..): 8 keys of one dim, in
      // one cache block (block_size >= 8); the keys past the sequence zero-filled.
      // Each thread copies one fixed 8-key column (one block-table entry per tile) of every
      // DIMS_PER_PASS-th dim.
      constexpr int VTC = Tr::VT_CHUNKS;
      static_assert(Tr::THREADS % VTC == 0 && Tr::HEAD_DIM % (Tr::THREADS / VTC) == 0,
                    "whole dim rows per pass");
      constexpr int DIMS_PER_PASS = Tr::THREADS / VTC;
      if (do_v) {
        const int kc = tid % VTC;
        const int key0 = tile * Tr::BLOCK_N + kc * 8;
        const bool key_ok = key0 < sk;
        const T* col = key_ok ? v + block_of(key0) * p.v_stride_block + slot_of(key0) : v;
        const int bytes = key_ok ? 2 * min(8, sk - key0) : 0;
#pragma unroll
        for (int it = 0; it < Tr::HEAD_DIM / DIMS_PER_PASS; ++it) {
          const int d = it * DIMS_PER_PASS + tid / VTC;
          const bool ok = key_ok && d < p.head_dim;
          cp_async_16(sv_base + swizzled_offset<VTC>(d, kc), ok ? col + d * p.v_stride_dim : v,
                      ok ? bytes : 0);
        }
      }
    }
  }
};

// ---- the key tiles a block visits ---------------------------------------------------------
// The band of the tile's rows [m0, m_last] under its mask, cut to this block's split. Tiles
// in [full_lo, full_hi) need no mask (every key visible to every valid row). Visiting
// order: the boundary tiles first (left ones, then right ones: the diagonal sets the row
// max early), then the unmasked middle; step n visits tile_of(n).
struct KeyTiles {
  int s_lo, full_lo, full_hi;
  int n_left;     // boundary tiles left of the unmasked middle
  int n_masked;   // all boundary tiles
  int n_steps;

  __device__ __forceinline__ int tile_of(int n) const {
    return n < n_left ? s_lo + n : (n < n_masked ? full_hi + (n - n_left)
                                                 : full_lo + (n - n_masked));
  }
};

template <typename Tr>
__device__ __forceinline__ KeyTiles key_tiles(const typename Tr::Mask& mask, int m0, int m_last,
                                              int sk, int split, int num_splits) {
  constexpr int BN = Tr::BLOCK_N;
  const auto keys = mask.keys(m0, m_last, sk);
  const int t_lo = keys.begin / BN;
  const int t_hi = keys.end > keys.begin ? (keys.end + BN - 1) / BN : t_lo;
  int s_lo = t_lo, s_hi = t_hi;
  if (Tr::SPLIT) {
    const int per_split = (t_hi - t_lo + num_splits - 1) / num_splits;
    s_lo = min(t_hi, t_lo + split * per_split);
    s_hi = min(t_hi, s_lo + per_split);
  }
  KeyTiles t;
  t.s_lo = s_lo;
  t.full_lo = min(max((keys.full_begin + BN - 1) / BN, s_lo), s_hi);
  t.full_hi = min(max(keys.full_end / BN, t.full_lo), s_hi);
  t.n_left = t.full_lo - s_lo;
  t.n_masked = t.n_left + (s_hi - t.full_hi);
  t.n_steps = s_hi - s_lo;
  return t;
}

// ---- the logits hook and the mask on one tile of scores --------------------------------------
// Row (mt, hr) of this thread (rows g and g + 8 of m16 tile mt) is query row_of(mt, hr) (the
// mask's row index) with logits hook hook_of(mt, hr); element e of its n8 tile nt is key
// key0 + 8 nt + 2 t4 + e % 2. The hook on every score, then, on a boundary tile (masked),
// -inf for keys past the sequence or outside the band.
template <typename Tr, typename RowOf, typename HookOf>
__device__ __forceinline__ void hook_and_mask(float (&s)[Tr::M_TILES][Tr::S_N_TILES][4],
                                              bool masked, int key0, int t4,
                                              const typename Tr::Mask& mask, int sk,
                                              RowOf row_of, HookOf hook_of) {
  if (Tr::Logits::ACTIVE || masked) {
#pragma unroll
    for (int mt = 0; mt < Tr::M_TILES; ++mt) {
#pragma unroll
      for (int nt = 0; nt < Tr::S_N_TILES; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int i = row_of(mt, e / 2);
          const int j = key0 + nt * 8 + 2 * t4 + (e % 2);
          if (Tr::Logits::ACTIVE) s[mt][nt][e] = hook_of(mt, e / 2)(s[mt][nt][e], i + mask.diag, j);
          if (masked && !mask.visible(i, j, sk)) s[mt][nt][e] = neg_inf();
        }
      }
    }
  }
}

// ---- online softmax of a warp's rows ---------------------------------------------------------
// Rows (mt, g) and (mt, g + 8) of this thread, in raw-score units (scale = scale_log2);
// each state's sum is this thread's part (its columns only), added over the quad in finish().
template <typename Tr>
struct WarpSoftmax {
  static constexpr int M_TILES = Tr::M_TILES;
  SoftmaxState row[M_TILES][2];
  float scale;

  __device__ __forceinline__ explicit WarpSoftmax(float scale_log2) : scale(scale_log2) {
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt) row[mt][0] = row[mt][1] = SoftmaxState::empty();
  }

  // One tile of S (scores, -inf where masked) -> P = exp2(scale * S - base) in place; O and
  // the sums rescaled to the new row max. EARLY_PACK: P of each m16 tile is also packed to
  // T into `p_pack` as soon as its two row halves are done (half the registers of the fp32
  // S from there to O += P V); MAY_BE_EMPTY = false (EARLY_PACK without a band) drops the
  // -inf guard on the row max: then every tile a block visits holds a key < seqlen_k, so
  // each row max is finite from the first tile on.
  template <bool MAY_BE_EMPTY, typename PPack>
  __device__ __forceinline__ void update(float (&s)[M_TILES][Tr::S_N_TILES][4],
                                         float (&o_acc)[M_TILES][Tr::O_N_TILES][4],
                                         PPack& p_pack) {
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt) {
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {
        SoftmaxState& st = row[mt][hr];
        const float mx = row_max(s, mt, hr);
        const float b = SoftmaxState::base<MAY_BE_EMPTY>(mx, scale);
        // Branch-free: alpha = 1 exactly when the max stayed (the same product twice), 0
        // from -inf. Otherwise only a row whose max moved (from -inf or up, so to a finite
        // value) rescales.
        if (Tr::BRANCH_FREE_RESCALE || mx != st.max) {
          const float alpha = Tr::BRANCH_FREE_RESCALE ? st.rescale(mx, scale, b)
                                                      : st.rescale_finite(mx, scale);
#pragma unroll
          for (int nt = 0; nt < Tr::O_N_TILES; ++nt) {
            o_acc[mt][nt][2 * hr] *= alpha;
            o_acc[mt][nt][2 * hr + 1] *= alpha;
          }
        }
        st.sum += row_exp(s, mt, hr, b - Tr::P_SHIFT);
      }
      if constexpr (Tr::EARLY_PACK) {
#pragma unroll
        for (int kk = 0; kk < Tr::PV_K_STEPS; ++kk) pack_p(p_pack[mt][kk], s, mt, kk);
      }
    }
  }

  // update() for a caller that rescales its accumulator later (the Hopper kernel, whose
  // previous O += P V may still be in flight): P in place, the sums moved to the new row
  // max, and alpha[mt][hr], the factor row (mt, hr)'s accumulator takes. Branch-free form.
  // TILE_MAX: the caller passes each row's max over this thread's columns of the tile
  // (tile_max) instead of its being read off s: the hook of the raw scores' max for a
  // monotone logits hook (Logits::of_max), so that no exp2 waits for the whole tile's hook.
  template <bool MAY_BE_EMPTY, bool TILE_MAX = false>
  __device__ __forceinline__ void update_scores(float (&s)[M_TILES][Tr::S_N_TILES][4],
                                                float (&alpha)[M_TILES][2],
                                                const float (&tile_max)[M_TILES][2] = {}) {
    static_assert(Tr::BRANCH_FREE_RESCALE, "alpha for every row, every tile");
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt) {
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {
        SoftmaxState& st = row[mt][hr];
        const float mx = TILE_MAX ? quad_max(fmaxf(st.max, tile_max[mt][hr])) : row_max(s, mt, hr);
        const float b = SoftmaxState::base<MAY_BE_EMPTY>(mx, scale);
        alpha[mt][hr] = st.rescale(mx, scale, b);
        st.sum += row_exp(s, mt, hr, b - Tr::P_SHIFT);
      }
    }
  }

  // The two halves of a row's update: its new max over this tile (this thread's columns,
  // then the quad's), and P = exp2(scale * S - b) in place with this thread's part of the
  // row sum.
  __device__ __forceinline__ float row_max(const float (&s)[M_TILES][Tr::S_N_TILES][4], int mt,
                                           int hr) const {
    return quad_max(thread_max(s, mt, hr, row[mt][hr].max));
  }
  // The max of `mx` and row (mt, hr)'s scores in this thread's columns of the tile.
  static __device__ __forceinline__ float thread_max(const float (&s)[M_TILES][Tr::S_N_TILES][4],
                                                     int mt, int hr, float mx = neg_inf()) {
#pragma unroll
    for (int nt = 0; nt < Tr::S_N_TILES; ++nt) {
      mx = fmaxf(mx, fmaxf(s[mt][nt][2 * hr], s[mt][nt][2 * hr + 1]));
    }
    return mx;
  }
  // The max over the quad that holds a row (its four threads' columns).
  static __device__ __forceinline__ float quad_max(float mx) {
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    return fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
  }
  __device__ __forceinline__ float row_exp(float (&s)[M_TILES][Tr::S_N_TILES][4], int mt, int hr,
                                           float b) const {
    float sum = 0.f;
#pragma unroll
    for (int nt = 0; nt < Tr::S_N_TILES; ++nt) {
#pragma unroll
      for (int e = 2 * hr; e < 2 * hr + 2; ++e) {
        const float pe = SoftmaxState::weight(s[mt][nt][e], scale, b);
        s[mt][nt][e] = pe;
        sum += pe;
      }
    }
    return sum;
  }

  // P of k16 step kk of m16 tile mt, packed to T: the A operand of O += P V. e4m3 (the
  // Hopper kernel's FP8 form): k32 step kk from n8 tiles 4 kk .. 4 kk + 3, register 0 the
  // row-g values of tiles 4 kk and 4 kk + 1, register 1 their row-g + 8 values, registers 2
  // and 3 likewise of tiles 4 kk + 2 and 4 kk + 3: the A fragment's logical keys 4 t4 .. of
  // each 16 are then the accumulator's keys 2 t4, 2 t4 + 1, 8 + 2 t4, 9 + 2 t4, the order in
  // which flash_fwd_sm90.cuh's transpose_v writes V^T's keys.
  static __device__ __forceinline__ void pack_p(u32 (&pf)[4],
                                                const float (&s)[M_TILES][Tr::S_N_TILES][4],
                                                int mt, int kk) {
    using T = typename Tr::T;
    if constexpr (sizeof(T) == 1) {
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const int nt = 4 * kk + 2 * (r / 2), e = 2 * (r % 2);
        pf[r] = pack_e4m3x4(s[mt][nt][e], s[mt][nt][e + 1], s[mt][nt + 1][e], s[mt][nt + 1][e + 1]);
      }
    } else {
      pf[0] = pack_pair<T>(s[mt][2 * kk][0], s[mt][2 * kk][1]);
      pf[1] = pack_pair<T>(s[mt][2 * kk][2], s[mt][2 * kk][3]);
      pf[2] = pack_pair<T>(s[mt][2 * kk + 1][0], s[mt][2 * kk + 1][1]);
      pf[3] = pack_pair<T>(s[mt][2 * kk + 1][2], s[mt][2 * kk + 1][3]);
    }
  }

  // Whole rows: the quad's parts of each sum added, each row's normaliser and lse. With
  // sinks (WITH_SINKS), row (mt, hr)'s sink logit sink[mt][hr] (raw-score units) joins the
  // denominator as a state {sink, 1} of no value: the merged max may move, so inv_sum also
  // carries the factor that rescales the row's accumulator.
  struct Rows {
    float inv_sum[M_TILES][2];
    float lse[M_TILES][2];
  };
  template <bool WITH_SINKS>
  __device__ __forceinline__ Rows finish(const float (&sink)[M_TILES][2]) {
    Rows r;
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt) {
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {
        SoftmaxState& st = row[mt][hr];
        st.sum += __shfl_xor_sync(0xffffffffu, st.sum, 1);
        st.sum += __shfl_xor_sync(0xffffffffu, st.sum, 2);
        // (P_SHIFT: the sum and the accumulator carry 2^P_SHIFT; the state takes the true sum)
        constexpr float P_UNIT = 1.f / (1 << Tr::P_SHIFT);
        if constexpr (Tr::P_SHIFT != 0) st.sum *= P_UNIT;
        const float alpha = WITH_SINKS ? st.add_sink(sink[mt][hr], scale) : 1.f;
        r.inv_sum[mt][hr] = alpha * st.inv_sum();
        if constexpr (Tr::P_SHIFT != 0) r.inv_sum[mt][hr] *= P_UNIT;
        r.lse[mt][hr] = st.lse(scale);
      }
    }
    return r;
  }
};

// ---- epilogues ---------------------------------------------------------------------------
// Split-KV: the warp's normalised fp32 partial rows and their lse into oaccum / lseaccum.
template <typename Tr>
__device__ __forceinline__ void store_partials(
    const FlashFwdParams& p, const typename WarpSoftmax<Tr>::Rows& rows,
    const float (&o_acc)[Tr::M_TILES][Tr::O_N_TILES][4], int b, const QueryRows<Tr::PACK_GQA>& qrows,
    int num_rows, int split, const SeqRange& qr, int m0, int warp, int g, int t4,
    int head_dim_chunks) {
  const long long row_base = (p.cu_seqlens_q == nullptr ? (long long)b * p.seqlen_q : 0) +
                             qr.start;
  float* oacc = static_cast<float*>(p.oaccum);
  float* lacc = static_cast<float*>(p.lseaccum);
#pragma unroll
  for (int mt = 0; mt < Tr::M_TILES; ++mt) {
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const int R = m0 + warp * Tr::WARP_M + mt * 16 + g + hr * 8;
      if (R >= num_rows) continue;
      const int h = qrows.head(R);
      const float inv = rows.inv_sum[mt][hr];
      const long long tok = row_base + qrows.token(R);
      float* orow = oacc + (((long long)split * p.total_q + tok) * p.num_heads + h) * p.head_dim;
#pragma unroll
      for (int nt = 0; nt < Tr::O_N_TILES; ++nt) {
        if (nt < head_dim_chunks) {
          float2 v2 = make_float2(o_acc[mt][nt][2 * hr] * inv, o_acc[mt][nt][2 * hr + 1] * inv);
          *reinterpret_cast<float2*>(orow + nt * 8 + 2 * t4) = v2;
        }
      }
      if (t4 == 0) {
        lacc[((long long)split * p.num_heads + h) * p.total_q + tok] = rows.lse[mt][hr];
      }
    }
  }
}

// The output: O -> T in this warp's own rows of a BLOCK_M x HEAD_DIM shared-memory tile at
// smem_o (flash_fwd_kernel: the Q tile), then 16-byte stores; and the lse when asked.
template <typename Tr>
__device__ __forceinline__ void store_output(
    const FlashFwdParams& p, const typename WarpSoftmax<Tr>::Rows& rows,
    const float (&o_acc)[Tr::M_TILES][Tr::O_N_TILES][4], u32 smem_o, int b,
    const QueryRows<Tr::PACK_GQA>& qrows, int num_rows, const SeqRange& qr, int m0, int warp,
    int lane, int g, int t4, int head_dim_chunks) {
  using T = typename Tr::OutT;
  constexpr int D_CHUNKS = Tr::D_CHUNKS;
  // The warp's last ldmatrix of Q read these rows (in the key loop, or before it when the
  // loop ran no tile and so no barrier came between): order those reads before the writes.
  // (compute-sanitizer racecheck flagged the missing barrier on rows that see no key.)
  __syncwarp();
#pragma unroll
  for (int mt = 0; mt < Tr::M_TILES; ++mt) {
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const int r = warp * Tr::WARP_M + mt * 16 + g + hr * 8;
      const float inv = rows.inv_sum[mt][hr];
#pragma unroll
      for (int nt = 0; nt < Tr::O_N_TILES; ++nt) {
        const u32 packed = pack_pair<T>(o_acc[mt][nt][2 * hr] * inv, o_acc[mt][nt][2 * hr + 1] * inv);
        const u32 addr = smem_o + swizzled_offset<D_CHUNKS>(r, nt) + t4 * 4;
        asm volatile("st.shared.u32 [%0], %1;\n" :: "r"(addr), "r"(packed));
      }
    }
  }
  __syncwarp();
  T* o_ptr = static_cast<T*>(p.out) + b * p.o_stride_batch +
             (long long)qr.start * p.o_stride_row;
  const int row0 = warp * Tr::WARP_M;
#pragma unroll (Tr::STORE_UNROLL)
  for (int it = 0; it < Tr::Q_LOADS_PER_LANE; ++it) {
    const int c = it * 32 + lane;
    const int r = row0 + c / D_CHUNKS, ch = c % D_CHUNKS;
    const int R = m0 + r;
    if (R < num_rows && ch < head_dim_chunks) {
      Vec16 v16;
      const u32 addr = smem_o + swizzled_offset<D_CHUNKS>(r, ch);
      asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                   : "=r"(v16.raw.x), "=r"(v16.raw.y), "=r"(v16.raw.z), "=r"(v16.raw.w)
                   : "r"(addr));
      store16(o_ptr + (long long)qrows.token(R) * p.o_stride_row +
                  qrows.head(R) * p.o_stride_head + ch * 8,
              v16);
    }
  }
  if (p.lse != nullptr && t4 == 0) {
    float* lse_ptr = static_cast<float*>(p.lse) + b * p.lse_stride_batch +
                     (long long)qr.start * p.lse_stride_row;
#pragma unroll
    for (int mt = 0; mt < Tr::M_TILES; ++mt) {
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {
        const int R = m0 + warp * Tr::WARP_M + mt * 16 + g + hr * 8;
        if (R < num_rows) {
          lse_ptr[(long long)qrows.token(R) * p.lse_stride_row +
                  qrows.head(R) * p.lse_stride_head] = rows.lse[mt][hr];
        }
      }
    }
  }
}

// Grid: (ceil(max_seqlen_q / BLOCK_M), num_heads, batch * num_splits), block: (NUM_WARPS * 32),
// dynamic shared memory: Tr::SMEM_BYTES. PACK_GQA: (ceil(max_seqlen_q * head_group /
// BLOCK_M), num_heads / head_group, batch * num_splits).
// Block (x, y, z) computes row tile (gridDim.x - 1 - x) of head y (PACK_GQA: of the query
// heads of KV head y), batch z / num_splits, over the key tiles of split z % num_splits.
// SPLIT: writes normalised fp32 partial outputs and their lse to oaccum / lseaccum (merged,
// with the sinks, by flash_fwd_combine_kernel); otherwise writes out (and lse).
template <typename Tr>
__device__ void flash_fwd_kernel(const FlashFwdParams& p) {
  using T = typename Tr::T;
  constexpr int M_TILES = Tr::M_TILES;
  constexpr int D_CHUNKS = Tr::D_CHUNKS;
  constexpr int STAGES = Tr::STAGES;

  extern __shared__ __align__(128) unsigned char smem[];
  const u32 smem_q = smem_addr(smem);
  const u32 smem_kv = smem_q + Tr::Q_BYTES;

  const int tid = threadIdx.x;
  const int warp = tid / 32;
  const int lane = tid % 32;
  const int g = lane / 4;   // mma group: fragment rows g and g + 8
  const int t4 = lane % 4;  // thread in group: fragment columns 2 t4, 2 t4 + 1

  // ---- Phase 0: which rows, which keys ---------------------------------------------------
  const int m_block = gridDim.x - 1 - blockIdx.x;   // longest causal tiles are scheduled first
  const int b = Tr::SPLIT ? blockIdx.z / p.num_splits : blockIdx.z;
  const int split = Tr::SPLIT ? blockIdx.z % p.num_splits : 0;
  const int kvh = Tr::PACK_GQA ? blockIdx.y : blockIdx.y / p.head_group;
  const QueryRows<Tr::PACK_GQA> qrows{
      Tr::PACK_GQA ? kvh * p.head_group : static_cast<int>(blockIdx.y),
      Tr::PACK_GQA ? p.head_group : 1};
  const SeqRange qr = seq_range(p.cu_seqlens_q, b, p.seqlen_q);
  const SeqRange kr = key_range<Tr::PAGED>(p, b);
  const int sq = qr.len, sk = kr.len;
  const int num_rows = sq * qrows.group;
  const int m0 = m_block * Tr::BLOCK_M;
  if (m0 >= num_rows) return;
  const int m_last = min(m0 + Tr::BLOCK_M, num_rows) - 1;   // last valid row of the tile
  const typename Tr::Mask mask(sq, sk, p.window_left, p.window_right);
  const int head_dim_chunks = p.head_dim / 8;

  const T* q_ptr = static_cast<const T*>(p.q) + b * p.q_stride_batch +
                   (long long)qr.start * p.q_stride_row;
  using C = typename Tr::C;
  const C* k_rows = static_cast<const C*>(p.k) + kvh * p.k_stride_head;
  const C* v_rows = static_cast<const C*>(p.v) + kvh * p.v_stride_head;
  const int* block_table = nullptr;
  if constexpr (Tr::PAGED) {
    block_table = paged_table(p, b);
  } else {
    k_rows += b * p.k_stride_batch + (long long)kr.start * p.k_stride_row;
    v_rows += b * p.v_stride_batch + (long long)kr.start * p.v_stride_row;
  }
  const KVSource<Tr> kv(p, k_rows, v_rows, block_table, sk, tid);
  const KeyTiles tiles = key_tiles<Tr>(mask, qrows.token(m0), qrows.token(m_last), sk, split,
                                       p.num_splits);
  const int n_steps = tiles.n_steps;
  auto stage_base = [&](int n) { return smem_kv + (n % STAGES) * Tr::STAGE_BYTES; };

  // ---- Phase 1: start the loads: this warp's Q rows, then the first STAGES-1 K/V tiles ----
  {
    const int row0 = warp * Tr::WARP_M;
#pragma unroll
    for (int it = 0; it < Tr::Q_LOADS_PER_LANE; ++it) {
      const int c = it * 32 + lane;
      const int r = row0 + c / D_CHUNKS, ch = c % D_CHUNKS;
      const int R = m0 + r;
      const bool ok = R < num_rows && ch < head_dim_chunks;
      const T* src = ok ? q_ptr + (long long)qrows.token(R) * p.q_stride_row +
                              qrows.head(R) * p.q_stride_head + ch * 8
                        : q_ptr;
      cp_async_16(smem_q + swizzled_offset<D_CHUNKS>(r, ch), src, ok ? 16 : 0);
    }
    cp_async_commit();
  }
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if constexpr (Tr::KV_SPLIT) {
      if (s < n_steps) kv.load(stage_base(s), tiles.tile_of(s), true, false);
      cp_async_commit();
      if (s < n_steps) kv.load(stage_base(s), tiles.tile_of(s), false, true);
      cp_async_commit();
    } else {
      if (s < n_steps) kv.load(stage_base(s), tiles.tile_of(s));
      cp_async_commit();   // always commit: every thread counts the same groups
    }
  }

  // ---- Phase 2: Q fragments into registers for the whole key loop --------------------------
  // (Q_IN_REGS false: the fragments are re-read from this warp's rows of the Q tile at every
  // k16 step instead.)
  cp_async_wait<Tr::KV_GROUPS * (STAGES - 1)>();   // the Q group (the oldest) has landed
  __syncwarp();
  // Q (A of S = Q K^T, x4 = rows 0-7 / 8-15 x chunks 2s, 2s+1): lane l reads row
  // (l % 8) + ((l / 8) % 2) * 8 of each m16 tile, chunk 2 s + l / 16.
  const int q_row = warp * Tr::WARP_M + (lane % 8) + ((lane / 8) % 2) * 8;
  const SwizzledSteps<D_CHUNKS, (Tr::Q_SMEM >= 2)> q_steps(q_row, lane / 16);
  const u32 q_lane = smem_q + q_row * D_CHUNKS * 16;
  constexpr int Q_REG_STEPS = Tr::Q_IN_REGS ? Tr::QK_K_STEPS : 1;
  u32 q_frag[M_TILES][Q_REG_STEPS][4];
  if constexpr (Tr::Q_IN_REGS) {
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt) {
#pragma unroll
      for (int ks = 0; ks < Tr::QK_K_STEPS; ++ks) {
        ldmatrix_x4(q_frag[mt][ks], q_lane + mt * 16 * D_CHUNKS * 16 + q_steps.at(ks));
      }
    }
  }

  float o_acc[M_TILES][Tr::O_N_TILES][4];
#pragma unroll
  for (int mt = 0; mt < M_TILES; ++mt) {
#pragma unroll
    for (int nt = 0; nt < Tr::O_N_TILES; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) o_acc[mt][nt][e] = 0.f;
    }
  }
  // fp8 caches whose K scale is in device memory: this KV head's scale joins the softmax
  // scale here (the host folds a Python float into p's constants; then k_unit is 1).
  const float k_unit = Tr::FP8 ? kv_head_scale(p.k_scales, p.k_scales_stride, kvh) : 1.f;
  WarpSoftmax<Tr> softmax(p.scale_log2 * k_unit);
  // This thread's rows (mt, hr): their tokens (the mask's row index; PACK_GQA: kept, one
  // division each) and logits hooks.
  auto row_of = [&](int mt, int hr) { return m0 + warp * Tr::WARP_M + mt * 16 + g + hr * 8; };
  int packed_tok[M_TILES][2];
  typename Tr::Logits hook[M_TILES][2];
#pragma unroll
  for (int mt = 0; mt < M_TILES; ++mt) {
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const int R = row_of(mt, hr);
      packed_tok[mt][hr] = qrows.token(R);
      float slope = 0.f;
      if constexpr (Tr::ALIBI) {
        slope = static_cast<const float*>(
                    p.alibi_slopes)[b * p.alibi_stride_batch + qrows.head(min(R, m_last))] *
                (p.softmax_scale_inv / k_unit);
      }
      hook[mt][hr] = typename Tr::Logits(slope, p.softcap_in * k_unit, p.softcap_out / k_unit);
    }
  }
  // ldmatrix lane patterns. K (B of S = Q K^T, x4 = keys 0-7 / 8-15 x chunks 2s, 2s+1):
  // lane l reads key row (l % 8) + (l / 16) * 8, chunk 2 s + (l / 8) % 2.
  // V (.trans, B of P V, x4 = keys 0-7 / 8-15 x chunks 2s, 2s+1 of head dim):
  // lane l reads key row (l % 8) + ((l / 8) % 2) * 8, chunk 2 s + l / 16.
  const int k_row = (lane % 8) + (lane / 16) * 8;
  const int v_row = (lane % 8) + ((lane / 8) % 2) * 8;
  const SwizzledSteps<D_CHUNKS, (Tr::Q_SMEM >= 2)> k_steps(k_row, (lane / 8) % 2);
  const SwizzledSteps<D_CHUNKS, (Tr::Q_SMEM >= 2)> v_steps(v_row, lane / 16);
  // V_BY_DIM ([dim][8-key chunk] tile, B of P V without .trans, x4 = dims 0-7 / 8-15 x key
  // chunks 2kk, 2kk+1): lane l reads dim row (l % 8) + (l / 16) * 8, chunk 2 kk + (l / 8) % 2.
  constexpr int VTC = Tr::V_BY_DIM ? Tr::VT_CHUNKS : 4;
  const SwizzledSteps<VTC> vt_steps(k_row, (lane / 8) % 2);

  // ---- Phase 3: one key tile: S = Q K^T, (hook, mask), online softmax, O += P V ------------
  // With SEPARATE_MASK_LOOP, `masked` is a literal at each of the two call sites below and
  // the step is inlined into each loop, so the unmasked loop carries no mask code at all.
  auto step = [&](int n, bool masked) {
    const int tile = tiles.tile_of(n);
    // 3a. wait for this tile (KV_SPLIT: its K only), then refill the stage every warp
    // finished with last step
    cp_async_wait<Tr::KV_WAIT_K>();
    __syncthreads();
    if constexpr (Tr::KV_SPLIT) {
      const bool more = n + STAGES - 1 < n_steps;
      if (more) kv.load(stage_base(n + STAGES - 1), tiles.tile_of(n + STAGES - 1), true, false);
      cp_async_commit();
      if (more) kv.load(stage_base(n + STAGES - 1), tiles.tile_of(n + STAGES - 1), false, true);
      cp_async_commit();
    } else {
      if (n + STAGES - 1 < n_steps) {
        kv.load(stage_base(n + STAGES - 1), tiles.tile_of(n + STAGES - 1));
      }
      cp_async_commit();
    }
    if constexpr (Tr::FP8) {   // every thread's raw bytes of tile n have landed: widen them
      kv.widen(smem + Tr::Q_BYTES + (n % STAGES) * Tr::STAGE_BYTES);
      __syncthreads();
    }
    const u32 sk_base = stage_base(n);
    const u32 k_lane = sk_base + k_row * D_CHUNKS * 16;
    const u32 v_lane = sk_base + Tr::KV_TILE_BYTES +
                       (Tr::V_BY_DIM ? k_row * VTC : v_row * D_CHUNKS) * 16;

    // 3b. S = Q K^T: ldmatrix x4 gives the B fragments of two n8 tiles of keys
    float s[M_TILES][Tr::S_N_TILES][4];
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt) {
#pragma unroll
      for (int nt = 0; nt < Tr::S_N_TILES; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) s[mt][nt][e] = 0.f;
      }
    }
#pragma unroll
    for (int ks = 0; ks < Tr::QK_K_STEPS; ++ks) {
      if constexpr (!Tr::Q_IN_REGS) {
#pragma unroll
        for (int mt = 0; mt < M_TILES; ++mt) {
          ldmatrix_x4(q_frag[mt][0], q_lane + mt * 16 * D_CHUNKS * 16 + q_steps.at(ks));
        }
      }
#pragma unroll
      for (int np = 0; np < Tr::S_N_TILES / 2; ++np) {
        u32 kf[4];
        ldmatrix_x4(kf, k_lane + np * 16 * D_CHUNKS * 16 + k_steps.at(ks));
#pragma unroll
        for (int mt = 0; mt < M_TILES; ++mt) {
          const int qs = Tr::Q_IN_REGS ? ks : 0;
          mma_m16n8k16<T>(s[mt][2 * np], q_frag[mt][qs], kf[0], kf[1]);
          mma_m16n8k16<T>(s[mt][2 * np + 1], q_frag[mt][qs], kf[2], kf[3]);
        }
      }
    }

    // 3c. the logits hook, then (boundary tiles only) -inf for keys past the sequence or
    // outside the band
    hook_and_mask<Tr>(
        s, masked, tile * Tr::BLOCK_N, t4, mask, sk,
        [&](int mt, int hr) { return Tr::PACK_GQA ? packed_tok[mt][hr] : row_of(mt, hr); },
        [&](int mt, int hr) -> const typename Tr::Logits& { return hook[mt][hr]; });

    // 3d. online softmax in the exp2 domain (new row max by quad shuffles; O and the sums
    // rescaled; P = exp2(S * scale_log2 - base))
    u32 p_pack[M_TILES][Tr::EARLY_PACK ? Tr::PV_K_STEPS : 1][4];
    softmax.template update<!(Tr::EARLY_PACK && !Tr::Mask::BAND)>(s, o_acc, p_pack);

    // 3e. O += P V: the S accumulators of two n8 tiles, packed to T, are the A operand of
    // one k16 step; ldmatrix .trans of V gives the B fragments of two n8 tiles of head dim
    if constexpr (Tr::KV_SPLIT) {   // V_n: this thread's copies, then everyone's
      cp_async_wait<Tr::KV_WAIT_V>();
      __syncthreads();
    }
#pragma unroll
    for (int kk = 0; kk < Tr::PV_K_STEPS; ++kk) {
      u32 pf[M_TILES][4];
#pragma unroll
      for (int mt = 0; mt < M_TILES; ++mt) {
        if constexpr (Tr::EARLY_PACK) {
#pragma unroll
          for (int i = 0; i < 4; ++i) pf[mt][i] = p_pack[mt][kk][i];
        } else {
          WarpSoftmax<Tr>::pack_p(pf[mt], s, mt, kk);
        }
      }
#pragma unroll
      for (int dp = 0; dp < Tr::O_N_TILES / 2; ++dp) {
        u32 vf[4];
        if constexpr (Tr::V_BY_DIM) {
          ldmatrix_x4(vf, v_lane + dp * 16 * VTC * 16 + vt_steps.at(kk));
        } else {
          ldmatrix_x4_trans(vf, v_lane + kk * 16 * D_CHUNKS * 16 + v_steps.at(dp));
        }
#pragma unroll
        for (int mt = 0; mt < M_TILES; ++mt) {
          mma_m16n8k16<T>(o_acc[mt][2 * dp], pf[mt], vf[0], vf[1]);
          mma_m16n8k16<T>(o_acc[mt][2 * dp + 1], pf[mt], vf[2], vf[3]);
        }
      }
    }
  };

  // Boundary tiles (window's left edge, causal / window diagonal, partial last tile), then
  // the unmasked middle.
  if constexpr (Tr::SEPARATE_MASK_LOOP) {
    for (int n = 0; n < tiles.n_masked; ++n) step(n, true);
    for (int n = tiles.n_masked; n < n_steps; ++n) step(n, false);
  } else {
    for (int n = 0; n < n_steps; ++n) step(n, n < tiles.n_masked);   // uniform branch per tile
  }
  cp_async_wait<0>();   // nothing may still be writing shared memory when the block exits

  // ---- Phase 4: whole rows, then the epilogue -------------------------------------------------
  // The sinks join the rows here, or (SPLIT) once, in the combine.
  constexpr bool FINISH_SINKS = Tr::SINKS && !Tr::SPLIT;
  float sink[M_TILES][2];
#pragma unroll
  for (int mt = 0; mt < M_TILES; ++mt) {
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const int R = min(row_of(mt, hr), m_last);
      sink[mt][hr] = FINISH_SINKS
                         ? static_cast<const float*>(p.sinks)[qrows.head(R)] *
                               (p.softmax_scale_inv / k_unit)
                         : 0.f;
    }
  }
  auto rows = softmax.template finish<FINISH_SINKS>(sink);
  if constexpr (Tr::FP8) {   // V was widened unscaled: O = v_scale x P V
    const float v_scale = p.v_scale * kv_head_scale(p.v_scales, p.v_scales_stride, kvh);
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt) {
      rows.inv_sum[mt][0] *= v_scale;
      rows.inv_sum[mt][1] *= v_scale;
    }
  }
  if constexpr (Tr::SPLIT) {
    store_partials<Tr>(p, rows, o_acc, b, qrows, num_rows, split, qr, m0, warp, g, t4,
                       head_dim_chunks);
  } else {
    store_output<Tr>(p, rows, o_acc, smem_q, b, qrows, num_rows, qr, m0, warp, lane, g, t4,
                     head_dim_chunks);
  }
}

// The split-KV combine's knobs: one warp per (token, head) row, NUM_THREADS per block.
template <typename T_, int HEAD_DIM_, int NUM_THREADS_, bool SINKS_>
struct FlashCombineTraits {
  using T = T_;
  static constexpr int HEAD_DIM = HEAD_DIM_;
  static constexpr int NUM_THREADS = NUM_THREADS_;
  static constexpr bool SINKS = SINKS_;   // each head's sink joins the merged state, once
  static constexpr int ROWS_PER_BLOCK = NUM_THREADS / 32;
  static constexpr int PASSES = (HEAD_DIM + 127) / 128;   // 4 columns per lane per pass
  static_assert(NUM_THREADS % 32 == 0, "whole warps");
};

// Grid: (ceil(total_q * num_heads / ROWS_PER_BLOCK)), block: (NUM_THREADS).
// Split-KV combine: one warp merges the num_splits fp32 partial rows of one (token, head)
// by their lse (the SoftmaxState merge in natural-log units: m = max lse_s, w_s = exp(lse_s
// - m), out = sum w_s o_s / sum w_s, lse = m + log(sum w_s)), writes the row in T at its
// place in out, and the lse when asked. Splits that saw no key (lse = -inf) weigh 0; a row no
// split saw gives zeros and -inf. Varlen rows outside every sequence (no split wrote their
// partials) are not written.
template <typename Tr>
__device__ void flash_fwd_combine_kernel(const FlashFwdParams& p) {
  using T = typename Tr::T;
  const int lane = threadIdx.x % 32;
  const long long row = (long long)blockIdx.x * Tr::ROWS_PER_BLOCK + threadIdx.x / 32;
  if (row >= (long long)p.total_q * p.num_heads) return;
  const long long tok = row / p.num_heads;
  const int h = static_cast<int>(row % p.num_heads);
  if (p.cu_seqlens_q != nullptr) {
    const int* cu = static_cast<const int*>(p.cu_seqlens_q);
    if (tok < cu[0] || tok >= cu[p.batch]) return;
  }
  const float* lacc = static_cast<const float*>(p.lseaccum);
  const float* oacc = static_cast<const float*>(p.oaccum);

  // Phase 1: the largest partial lse (and sink: a state {sink, 1} of no value).
  SoftmaxState st = SoftmaxState::empty();
  const float sink = Tr::SINKS ? static_cast<const float*>(p.sinks)[h] : 0.f;
  if (Tr::SINKS) st.max = sink;
  for (int s = 0; s < p.num_splits; ++s) {
    st.max = fmaxf(st.max, lacc[((long long)s * p.num_heads + h) * p.total_q + tok]);
  }
  const float base = SoftmaxState::base(st.max, kLog2e);
  if (Tr::SINKS) st.sum = SoftmaxState::weight(sink, kLog2e, base);
  // Phase 2: weighted sum, 4 columns per lane per pass.
  float acc[Tr::PASSES][4];
#pragma unroll
  for (int it = 0; it < Tr::PASSES; ++it) acc[it][0] = acc[it][1] = acc[it][2] = acc[it][3] = 0.f;
  for (int s = 0; s < p.num_splits; ++s) {
    const float w = SoftmaxState::weight(lacc[((long long)s * p.num_heads + h) * p.total_q + tok],
                                         kLog2e, base);
    if (w == 0.f) continue;
    st.sum += w;
    const float* orow = oacc + (((long long)s * p.total_q + tok) * p.num_heads + h) * p.head_dim;
#pragma unroll
    for (int it = 0; it < Tr::PASSES; ++it) {
      const int col = it * 128 + lane * 4;
      if (col < p.head_dim) {
        const float4 x = *reinterpret_cast<const float4*>(orow + col);
        acc[it][0] += w * x.x;
        acc[it][1] += w * x.y;
        acc[it][2] += w * x.z;
        acc[it][3] += w * x.w;
      }
    }
  }
  // Phase 3: normalise and store at the row's place in out (fixed length: batch-major).
  const float inv = st.inv_sum();
  const long long b = tok / p.seqlen_q;   // varlen: seqlen_q = total_q, so b = 0
  const long long i = tok - b * p.seqlen_q;
  T* orow = static_cast<T*>(p.out) + b * p.o_stride_batch + i * p.o_stride_row +
            h * p.o_stride_head;
#pragma unroll
  for (int it = 0; it < Tr::PASSES; ++it) {
    const int col = it * 128 + lane * 4;
    if (col < p.head_dim) {
      uint2 packed;
      packed.x = pack_pair<T>(acc[it][0] * inv, acc[it][1] * inv);
      packed.y = pack_pair<T>(acc[it][2] * inv, acc[it][3] * inv);
      *reinterpret_cast<uint2*>(orow + col) = packed;
    }
  }
  if (lane == 0 && p.lse != nullptr) {
    static_cast<float*>(p.lse)[b * p.lse_stride_batch + h * p.lse_stride_head +
                               i * p.lse_stride_row] = st.lse(kLog2e);
  }
}

}  // namespace cuattn
