// FlashAttention-2 forward on mma.sync (sm_80+): out = softmax(scale * Q K^T + mask) V per
// (batch, head), never materialising the scores, plus the natural-log log-sum-exp of each row.
// The algorithm is Dao 2023, "FlashAttention-2" (online softmax over K/V tiles, each warp
// owning its query rows); split-KV (Flash-Decoding) writes fp32 partial results merged by the
// combine kernel (flash_combine.cuh). This header holds the kernel, its traits and its K/V
// tile source (KVSource: dense, or a paged cache in either layout, for paged_prefill); the
// parts it shares with the Hopper forward are under flash/: the rows of a block (QueryRows,
// flash/seqlen.cuh), the key tiles it visits under its mask (KeyTiles, flash/key_tiles.cuh),
// the logits hook and the mask on a tile of scores (flash/hook_and_mask.cuh), the online
// softmax of the warp's rows (WarpSoftmax, flash/softmax.cuh) and the end of a row tile
// (WarpSoftmax::finish, then one of the two epilogues, flash/epilogue.cuh).
#pragma once
#include "common/types.cuh"
#include "common/mask.cuh"
#include "common/mma.cuh"
#include "common/row_chunks.cuh"
#include "params/flash_fwd.cuh"
#include "flash/features.cuh"
#include "flash/seqlen.cuh"
#include "flash/key_tiles.cuh"
#include "flash/hook_and_mask.cuh"
#include "flash/softmax.cuh"
#include "flash/epilogue.cuh"

namespace cuattn {

// Every knob of one forward kernel (cuattn.keys.FlashFwdVariant, chosen by
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
//   FP8_CACHE a paged cache of fp8 e4m3 bytes, the math in T: each stage also holds its
//             tile's raw bytes, copied by cp.async and widened to T (exactly: every e4m3
//             value is one) in shared memory once the stage has landed (KVSource::widen),
//             before any warp reads it. k_scale is in the softmax scale (the host's),
//             v_scale multiplies each row's normaliser. (Not the Hopper kernel's E4M3,
//             whose GEMMs take e4m3 operands.)
template <bool FP8_CACHE, typename T> struct CacheElem { using type = T; };
template <typename T> struct CacheElem<true, T> { using type = unsigned char; };

template <typename T_, int HEAD_DIM_, int BLOCK_M_, int BLOCK_N_, int NUM_WARPS_, int STAGES_,
          int MASK_, bool SPLIT_, int Q_SMEM_, bool KV_SPLIT_, int SOFTMAX_, int KV_,
          int FEATURES_, bool FP8_CACHE_>
struct FlashFwdTraits : FlashFeatures<FEATURES_> {
  using T = T_;
  using OutT = T_;                                      // the output's element
  static constexpr int P_SHIFT = 0;                     // P = 2^P_SHIFT exp(S - max): WarpSoftmax
  static constexpr bool FP8_CACHE = FP8_CACHE_;
  using C = typename CacheElem<FP8_CACHE, T>::type;           // an element of the K/V source
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
  static constexpr int FP8_TILE_BYTES = FP8_CACHE ? BLOCK_N * HEAD_DIM : 0;   // raw K (or V) bytes
  static constexpr int STAGE_BYTES = 2 * KV_TILE_BYTES + 2 * FP8_TILE_BYTES;  // K, V (, K8, V8)
  static constexpr int SMEM_BYTES = Q_BYTES + STAGES * STAGE_BYTES;
  static constexpr int KV_CHUNKS = BLOCK_N * D_CHUNKS;   // of K, and of V either way
  static constexpr int VT_CHUNKS = BLOCK_N / 8;         // V_BY_DIM: chunks (8 keys) per dim row
  static constexpr int Q_LOADS_PER_LANE = WARP_M * D_CHUNKS / 32;
  // K/V copies (KVSource::load_16bit): the block's threads share a K or V tile's chunks as
  // common/row_chunks.cuh lays out; EVEN_ROWS: each thread copies one column chunk of every
  // ROWS_PER_PASS-th row.
  using KVChunks = RowChunks<THREADS, D_CHUNKS>;
  static constexpr bool EVEN_ROWS = KVChunks::EVEN;
  static constexpr int ROWS_PER_PASS = KVChunks::ROWS_PER_PASS;
  static constexpr int KV_LOADS_PER_THREAD = KVChunks::template passes<BLOCK_N>();
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
  static_assert(!FP8_CACHE || (PAGED && !KV_SPLIT && HEAD_DIM % 16 == 0),
                "fp8: a paged cache, widened once the whole stage has landed");
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
        ld_row(Tr::EVEN_ROWS ? Tr::KVChunks::at(0, thread).row : 0),
        ld_ch(Tr::EVEN_ROWS ? Tr::KVChunks::at(0, thread).ch : 0),
        ld_ch_ok(ld_ch < head_dim_chunks) {}

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

  // FP8_CACHE: the tile's raw bytes into the stage's K8 / V8 areas, unswizzled: K (and
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

  // FP8_CACHE: widen the landed raw bytes of a stage (generic pointer `stage`) into its K and V
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
    if constexpr (Tr::FP8_CACHE) {
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
      // (unrolled: a tile takes few passes, and K and V share each pass's row and offset)
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
        const auto at = Tr::KVChunks::at(it, tid);
        if (Tr::KV_CHUNKS % Tr::THREADS == 0 || at.index < Tr::KV_CHUNKS) {
          const int r = at.row, ch = at.ch;
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
  const float k_unit = Tr::FP8_CACHE ? kv_head_scale(p.k_scales, p.k_scales_stride, kvh) : 1.f;
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
    if constexpr (Tr::FP8_CACHE) {   // every thread's raw bytes of tile n have landed: widen them
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
  // (the sink logits in raw-score units; FP8_CACHE: V was widened unscaled, so O = v_scale x P V)
  float sink[M_TILES][2];
#pragma unroll
  for (int mt = 0; mt < M_TILES; ++mt) {
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const int R = min(row_of(mt, hr), m_last);
      sink[mt][hr] = WarpSoftmax<Tr>::WITH_SINKS
                         ? static_cast<const float*>(p.sinks)[qrows.head(R)] *
                               (p.softmax_scale_inv / k_unit)
                         : 0.f;
    }
  }
  const auto rows = softmax.template finish<Tr::FP8_CACHE>(
      sink, [&] { return p.v_scale * kv_head_scale(p.v_scales, p.v_scales_stride, kvh); });
  if constexpr (Tr::SPLIT) {
    store_partials<Tr>(p, rows, o_acc, b, qrows, num_rows, split, qr, m0, warp, g, t4,
                       head_dim_chunks);
  } else {
    store_output<Tr>(p, rows, o_acc, smem_q, b, qrows, num_rows, qr, m0, warp, lane, g, t4,
                     head_dim_chunks);
  }
}

}  // namespace cuattn
