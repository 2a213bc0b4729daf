// Paged-attention decode on tensor cores, for 16-bit caches and head sizes that are multiples
// of 16 (every GQA group: measured faster than the CUDA-core form even at group 1, see
// cuattn.tuning.paged_form). Same params, grid and outputs as the CUDA-core form
// (paged_attention.cuh; the range and the epilogue are paged_common.cuh's, the v2 reduce is
// paged_reduce.cuh); only the inner loops differ, and v1 keeps no logits (no length limit).
//
// Why: with GROUP query heads per KV head, the CUDA-core kernel does GROUP dot products per
// K/V element it loads, and at GROUP 4 its instruction issue, not HBM, set the pace (76-85%
// of the read bandwidth). Here the group's heads are the N side of mma.sync m16n8k16:
//   S^T [tokens x heads] = K [tokens x dims] . Q^T [dims x heads]     (A = K from smem)
//   O^T [dims x heads]  += V^T [dims x tokens] . P^T [tokens x heads] (A = V from smem)
// K and V enter the A operand straight from their cache layouts: a 16-byte x-vector of K is
// one ldmatrix row (8 dims of a token), and 16 bytes of a V row are 8 tokens of one dim. P^T
// goes from the S^T accumulator to the B operand with movmatrix (an 8x8 transpose in
// registers). Heads past GROUP are zero columns of Q^T whose outputs are dropped.
//
// Each warp runs its own cp.async pipeline (STAGES tiles of TILE tokens, K and V) over the
// tiles warp, warp + NUM_WARPS, ... of the block's range, with its own online softmax; the
// warps merge through shared memory at the end. No block-wide barrier in the main loop.
#pragma once
#include "common/mma.cuh"
#include "common/softmax.cuh"
#include "common/logits.cuh"
#include "paged_common.cuh"

namespace cuattn {

// Every knob of the tensor-core form (cuattn.variants.PagedMmaVariant) and every size derived
// from them. A warp step is TILE = 16 tokens (one m16 tile; 32-token tiles lost 3-20 points
// of read bandwidth at v2, bench/NOTES.md paged round 3).
//   SOFTCAP, ALIBI: the logits hook; SINKS: each head's sink joins v1's denominator (v2:
//   the reduce's); NHD: the NHD cache layout (params/paged.cuh), any power-of-two block.
template <typename T_, int HEAD_SIZE_, int BLOCK_SIZE_, int GROUP_, int PARTITION_SIZE_,
          bool ALIBI_, int NUM_WARPS_, int STAGES_, bool SOFTCAP_, bool SINKS_, bool NHD_>
struct PagedMmaTraits {
  using T = T_;
  using Logits = LogitsHook<SOFTCAP_, ALIBI_>;           // the logits hook
  static constexpr bool ALIBI = ALIBI_;
  static constexpr bool SINKS = SINKS_;
  static constexpr bool NHD = NHD_;
  static constexpr int HEAD_SIZE = HEAD_SIZE_;
  static constexpr int BLOCK_SIZE = BLOCK_SIZE_;
  static constexpr int GROUP = GROUP_;                   // query heads: the N columns, <= 8
  static constexpr int PARTITION_SIZE = PARTITION_SIZE_; // 0: v1
  static constexpr bool V2 = PARTITION_SIZE > 0;
  static constexpr int NUM_WARPS = NUM_WARPS_;
  static constexpr int STAGES = STAGES_;                 // tiles in each warp's cp.async ring
  static constexpr int TILE = 16;
  static_assert(HEAD_SIZE % 16 == 0, "k16 / m16 steps over the head dims");
  static_assert(GROUP >= 1 && GROUP <= 8, "one n8 tile of query heads");
  static_assert(!V2 || PARTITION_SIZE % TILE == 0, "partitions of whole tiles");
  static_assert(NHD || BLOCK_SIZE % 8 == 0, "a V chunk (8 tokens) never crosses a cache block");
  static_assert((BLOCK_SIZE & (BLOCK_SIZE - 1)) == 0 && BLOCK_SIZE <= 256, "block size");
  static constexpr int MT = TILE / 16;                    // token m-tiles (S^T) = PV k-steps
  static constexpr int KS = HEAD_SIZE / 16;               // QK k-steps = PV dim m-tiles
  static constexpr int CHUNKS = HEAD_SIZE * TILE / 8;     // 16-byte chunks of K (and of V) per tile
  static_assert(CHUNKS % 32 == 0, "whole warps of chunks");
  static constexpr int CHUNKS_PER_LANE = CHUNKS / 32;
  static constexpr int VCH = TILE / 8;                    // V chunks per dim row of a tile
  static constexpr int TILE_BYTES = HEAD_SIZE * TILE * 2;            // K (or V) of one tile
  static constexpr int WARP_BYTES = STAGES * 2 * TILE_BYTES;         // a warp's ring
  static constexpr int SMEM_BYTES = NUM_WARPS * WARP_BYTES;
  // Epilogue: each warp's O^T, scaled to the block max, [warp][head][dim]; rows padded by 4
  // floats so that the 4 head pairs of a store land in different banks.
  static constexpr int MERGE_ROW = HEAD_SIZE + 4;
  static_assert(NUM_WARPS * 8 * MERGE_ROW * 4 <= SMEM_BYTES, "merge buffer reuses the ring");
};

// V tile [dim][VCH chunks of 8 tokens], chunk index XOR-swizzled by dim so that ldmatrix's 8
// rows (8 dims of one chunk column) and cp.async's 8 consecutive chunks hit 8 bank groups.
// (NHD: V tiles are laid out like K tiles, [dim chunk][token], and read with .trans.)
template <int VCH>
__device__ __forceinline__ u32 v_chunk_offset(int dim, int chunk) {
  return static_cast<u32>((dim * VCH + (chunk ^ ((dim / (8 / VCH)) % VCH))) * 16);
}

// Grid: (num_heads / GROUP, num_seqs, 1 (v1) or max_parts (v2)), block: (32 * NUM_WARPS),
// dynamic shared memory: Tr::SMEM_BYTES.
// K/V copies carry an L2 evict-first policy: they are read once (measured: tuning.py).
template <typename Tr>
__device__ void paged_attention_mma_kernel(const PagedParams& p) {
  using T = typename Tr::T;
  constexpr int HEAD_SIZE = Tr::HEAD_SIZE, BLOCK_SIZE = Tr::BLOCK_SIZE, GROUP = Tr::GROUP;
  constexpr int NUM_WARPS = Tr::NUM_WARPS, STAGES = Tr::STAGES, TILE = Tr::TILE;
  constexpr bool V2 = Tr::V2;
  constexpr int MT = Tr::MT, KS = Tr::KS, VCH = Tr::VCH, CPL = Tr::CHUNKS_PER_LANE;

  extern __shared__ __align__(16) unsigned char smem[];
  __shared__ SoftmaxState state_s[NUM_WARPS][8];   // per warp and head: its row state

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;   // fragment row / column pair
  const int seq = blockIdx.y;
  const int part = V2 ? blockIdx.z : 0;
  const int head0 = blockIdx.x * GROUP;
  const int kv_head = head0 / p.gqa_ratio;

  const PagedRange range = paged_range<BLOCK_SIZE, Tr::PARTITION_SIZE>(p, seq, part);
  if (V2 && range.start >= range.seq_len) return;   // the reduce never reads this partition
  // The window's first key; tiles start at a multiple of TILE below it (V chunks are 8
  // tokens of one block) and the select below masks the keys before it.
  const int win_start = max(0, range.seq_len - 1 - p.window_left);
  const int start_tok = max(range.start, win_start / TILE * TILE), end_tok = range.end;
  const int num_tiles = (end_tok - start_tok + TILE - 1) / TILE;
  const int my_tiles = num_tiles > warp ? (num_tiles - warp + NUM_WARPS - 1) / NUM_WARPS : 0;
  const int* block_table = static_cast<const int*>(p.block_tables) + seq * p.bt_stride_seq;

  // ---- Q^T as the B operand, once: (dims 16 ks + 2t.., head g), zero columns past GROUP ----
  u32 qb[KS][2];
  {
    // 2-byte loads: q's head stride may be odd
    const unsigned short* q = static_cast<const unsigned short*>(p.q) + seq * p.q_stride_seq +
                              (head0 + g) * p.q_stride_head;
#pragma unroll
    for (int ks = 0; ks < KS; ++ks) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int d = 16 * ks + 8 * half + 2 * t;
        qb[ks][half] = g < GROUP ? u32(q[d]) | (u32(q[d + 1]) << 16) : 0u;
      }
    }
  }
  // The logits hooks of this lane's two head columns (2t, 2t+1); ALiBi slopes in log2 units.
  using Logits = typename Tr::Logits;
  Logits hook[2] = {Logits(0.f, p.softcap_in, p.softcap_out),
                     Logits(0.f, p.softcap_in, p.softcap_out)};
  if constexpr (Tr::ALIBI) {
#pragma unroll
    for (int j = 0; j < 2; ++j)
      if (2 * t + j < GROUP)
        hook[j].slope = static_cast<const float*>(p.alibi_slopes)[head0 + 2 * t + j] * kLog2e;
  }

  // ---- the warp's cp.async ring: tile n of this warp lands in stage n % STAGES ------------
  // K chunk i = lane + 32 j of a tile is (dim chunk i / TILE, token i % TILE): a lane always
  // copies the same token. V chunk i is (dim i / VCH, tokens 8 (i % VCH) ..): a lane always
  // copies the same 8-token column. So one block-table entry per lane per tile for each.
  unsigned char* ring = smem + warp * Tr::WARP_BYTES;
  const u32 ring_addr = smem_addr(ring);
  const T* k_base = static_cast<const T*>(p.k_cache);
  const T* v_base = static_cast<const T*>(p.v_cache);
  const T* k_head = k_base + kv_head * p.k_stride_head;
  const T* v_head = v_base + kv_head * p.v_stride_head;
  const int k_tok = lane % TILE;          // token of this lane's K chunks within a tile
  const int v_col = lane % VCH;           // 8-token column of this lane's V chunks
  // Block-table entries of the next tile to issue, read one tile ahead (-1: past the
  // range, zero fill).
  struct TileSrc { int k_phys, v_phys, k_tok, v_tok; };
  auto lookup = [&](int n) {
    TileSrc r;
    const int t0 = start_tok + (warp + n * NUM_WARPS) * TILE;
    r.k_tok = t0 + k_tok;
    r.v_tok = t0 + 8 * v_col;
    r.k_phys = n < my_tiles && r.k_tok < end_tok ? __ldg(block_table + r.k_tok / BLOCK_SIZE) : -1;
    if constexpr (Tr::NHD) {   // V chunks are K's: the same token
      r.v_tok = r.k_tok;
      r.v_phys = r.k_phys;
    } else {
      r.v_phys = n < my_tiles && r.v_tok < end_tok ? __ldg(block_table + r.v_tok / BLOCK_SIZE) : -1;
    }
    return r;
  };
  TileSrc next = lookup(0);
  const unsigned long long policy = l2_evict_first_policy();
  auto issue = [&](int n) {
    if (n < my_tiles) {
      const u32 k_dst = ring_addr + (n % STAGES) * 2 * Tr::TILE_BYTES;
      const u32 v_dst = k_dst + Tr::TILE_BYTES;
      const bool k_ok = next.k_phys >= 0, v_ok = next.v_phys >= 0;
      const T* k_src = k_ok ? k_head + (long long)next.k_phys * p.k_stride_block +
                                  (next.k_tok % BLOCK_SIZE) * p.k_stride_token
                            : k_base;
      const T* v_src = !v_ok ? v_base
                       : Tr::NHD ? v_head + (long long)next.v_phys * p.v_stride_block +
                                       (next.v_tok % BLOCK_SIZE) * p.v_stride_token
                                 : v_head + (long long)next.v_phys * p.v_stride_block +
                                       next.v_tok % BLOCK_SIZE;
      // V: zero-fill the tokens past the range, so that P = 0 never meets a NaN.
      const int v_bytes = !v_ok ? 0 : Tr::NHD ? 16 : 2 * min(8, end_tok - next.v_tok);
#pragma unroll
      for (int j = 0; j < CPL; ++j) {
        const int i = lane + 32 * j;
        cp_async_16(k_dst + i * 16, k_src + (k_ok ? (i / TILE) * p.k_stride_x : 0),
                    k_ok ? 16 : 0, policy);
        if constexpr (Tr::NHD) {   // chunk i = (dim chunk i / TILE, token i % TILE), as K
          cp_async_16(v_dst + i * 16, v_src + (v_ok ? (i / TILE) * 8 : 0), v_bytes, policy);
        } else {
          const int d = i / VCH;
          cp_async_16(v_dst + v_chunk_offset<VCH>(d, v_col),
                      v_src + (v_ok ? d * p.v_stride_dim : 0), v_bytes, policy);
        }
      }
      next = lookup(n + 1);   // overlaps the math of this step
    }
    cp_async_commit();   // an empty group past the end keeps the wait count uniform
  };

  // ---- main loop: per tile S^T = K Q^T, online softmax, O^T += V^T P^T ------------------
  float o[KS][4];   // O^T: (dim 16 m + g, heads 2t..) and (dim 16 m + g + 8, heads 2t..)
#pragma unroll
  for (int m = 0; m < KS; ++m) o[m][0] = o[m][1] = o[m][2] = o[m][3] = 0.f;
  // Per head column (log2 units, scale 1): max the same on all 8 lanes of a column, sum
  // this lane's rows only (added over the column at the end).
  SoftmaxState row[2] = {SoftmaxState::empty(), SoftmaxState::empty()};

#pragma unroll
  for (int n = 0; n < STAGES - 1; ++n) issue(n);
  for (int n = 0; n < my_tiles; ++n) {
    __syncwarp();              // every lane is done reading the stage that is refilled next
    issue(n + STAGES - 1);
    cp_async_wait<STAGES - 1>();
    __syncwarp();              // tile n of every lane has landed
    const u32 k_tile = ring_addr + (n % STAGES) * 2 * Tr::TILE_BYTES;
    const u32 v_tile = k_tile + Tr::TILE_BYTES;
    const int t0 = start_tok + (warp + n * NUM_WARPS) * TILE;

    // S^T for MT token m-tiles. ldmatrix x4: matrix q = lane / 8 is (tokens +8 (q & 1),
    // dim chunk +(q >> 1)), row lane % 8: the A fragment of m16n8k16.
    float s[MT][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      s[mt][0] = s[mt][1] = s[mt][2] = s[mt][3] = 0.f;
      const int tok = 16 * mt + (lane % 8) + 8 * ((lane / 8) & 1);
#pragma unroll
      for (int ks = 0; ks < KS; ++ks) {
        u32 a[4];
        ldmatrix_x4(a, k_tile + ((2 * ks + lane / 16) * TILE + tok) * 16);
        mma_m16n8k16<T>(s[mt], a, qb[ks][0], qb[ks][1]);
      }
    }
    // Scale to log2 units, the logits hook, mask the tokens past the range; the tile max.
    float tile_max[2] = {neg_inf(), neg_inf()};
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const int tok = t0 + 16 * mt + g + 8 * (r / 2);
        float x = s[mt][r] * p.scale_log2;
        if (Logits::ACTIVE) x = hook[r % 2](x, range.seq_len - 1, tok);
        // a select: a zero-filled K row, and keys before the window, stay out
        x = tok < end_tok && tok >= win_start ? x : neg_inf();
        s[mt][r] = x;
        tile_max[r % 2] = fmaxf(tile_max[r % 2], x);
      }
    }
    float alpha[2], base[2];
#pragma unroll
    for (int j = 0; j < 2; ++j) {
#pragma unroll
      for (int off = 4; off < 32; off *= 2)
        tile_max[j] = fmaxf(tile_max[j], __shfl_xor_sync(0xffffffffu, tile_max[j], off));
      const float new_max = fmaxf(row[j].max, tile_max[j]);
      base[j] = SoftmaxState::base(new_max, 1.f);
      alpha[j] = row[j].rescale(new_max, 1.f, base[j]);
    }
#pragma unroll
    for (int m = 0; m < KS; ++m) {
      o[m][0] *= alpha[0]; o[m][1] *= alpha[1];
      o[m][2] *= alpha[0]; o[m][3] *= alpha[1];
    }
    // P = exp2(S - max), packed to T and transposed into the B operand of P V, as P = hi +
    // lo, two T each, so that P V keeps ~16 mantissa bits (a bf16 P alone is off by up to
    // 2^-9 relative, visible when a few tokens dominate); the tensor cores are far from busy
    // here, so the second MMA is free while HBM sets the pace.
    constexpr int NP = 2;
    u32 pb[MT][NP][2];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        s[mt][r] = SoftmaxState::weight(s[mt][r], 1.f, base[r % 2]);
        row[r % 2].sum += s[mt][r];
      }
#pragma unroll
      for (int half = 0; half < 2; ++half) {   // tokens 0-7, 8-15 of the m-tile
        const u32 hi = pack_pair<T>(s[mt][2 * half], s[mt][2 * half + 1]);
        const float2 h = unpack_pair<T>(hi);
        pb[mt][0][half] = movmatrix_trans(hi);
        pb[mt][1][half] = movmatrix_trans(
            pack_pair<T>(s[mt][2 * half] - h.x, s[mt][2 * half + 1] - h.y));
      }
    }
    // O^T += V^T P^T. ldmatrix x4: matrix q is (dims +8 (q & 1), token chunk +(q >> 1)).
    // NHD (.trans of [dim chunk][token] rows): matrix q is (dim chunk +(q & 1), tokens
    // +8 (q >> 1)).
    const int v_dim = (lane % 8) + 8 * ((lane / 8) & 1);
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
      for (int m = 0; m < KS; ++m) {
        u32 a[4];
        if constexpr (Tr::NHD) {
          const int chunk = 2 * m + ((lane / 8) & 1);
          ldmatrix_x4_trans(a, v_tile + (chunk * TILE + 16 * mt + 8 * (lane / 16) + lane % 8) * 16);
        } else {
          ldmatrix_x4(a, v_tile + v_chunk_offset<VCH>(16 * m + v_dim, 2 * mt + lane / 16));
        }
#pragma unroll
        for (int k = 0; k < NP; ++k) mma_m16n8k16<T>(o[m], a, pb[mt][k][0], pb[mt][k][1]);
      }
    }
  }

  // ---- merge the warps' states (the ring's shared memory is reused) -----------------------
  // Two passes over the warps instead of a chain of merges: the block max first, then every
  // warp's weight against it (SoftmaxState::weight, 0 for a warp that saw nothing).
  cp_async_wait<0>();
#pragma unroll
  for (int j = 0; j < 2; ++j)
#pragma unroll
    for (int off = 4; off < 32; off *= 2) row[j].sum += __shfl_xor_sync(0xffffffffu, row[j].sum, off);
  __syncthreads();   // every warp is done with its ring
  if (g == 0) {
#pragma unroll
    for (int j = 0; j < 2; ++j) state_s[warp][2 * t + j] = row[j];
  }
  __syncthreads();
  auto block_max = [&](int h) {
    float m = state_s[0][h].max;
#pragma unroll
    for (int w = 1; w < NUM_WARPS; ++w) m = fmaxf(m, state_s[w][h].max);
    return m;
  };
  float* merge = reinterpret_cast<float*>(smem);   // [NUM_WARPS][8][MERGE_ROW]
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    const int h = 2 * t + j;
    const float f = SoftmaxState::weight(row[j].max, 1.f, SoftmaxState::base(block_max(h), 1.f));
    float* out_row = merge + (warp * 8 + h) * Tr::MERGE_ROW;
#pragma unroll
    for (int m = 0; m < KS; ++m) {
      out_row[16 * m + g] = o[m][j] * f;
      out_row[16 * m + g + 8] = o[m][2 + j] * f;
    }
  }
  __syncthreads();

  // ---- write: v1 the output and lse, v2 the normalised partial output and its lse ---------
  const PagedOutput<T, HEAD_SIZE, V2> output{p, seq, head0, part};
  for (int i = threadIdx.x; i < GROUP * HEAD_SIZE; i += NUM_WARPS * 32) {
    const int h = i / HEAD_SIZE, d = i % HEAD_SIZE;
    SoftmaxState block{block_max(h), 0.f};
    const float b = SoftmaxState::base(block.max, 1.f);
    float acc = 0.f;
#pragma unroll
    for (int w = 0; w < NUM_WARPS; ++w) {
      block.sum = fmaf(state_s[w][h].sum, SoftmaxState::weight(state_s[w][h].max, 1.f, b), block.sum);
      acc += merge[(w * 8 + h) * Tr::MERGE_ROW + d];
    }
    if constexpr (Tr::SINKS && !V2) {   // (v2: in the reduce)
      acc *= block.add_sink(static_cast<const float*>(p.sinks)[head0 + h] * kLog2e, 1.f);
    }
    output.store(h, d, acc * block.inv_sum());   // an empty sequence (v1) gives zeros
    if (d == 0) output.store_lse(h, block.lse(1.f));
  }
}

}  // namespace cuattn
