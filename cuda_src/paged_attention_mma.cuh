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
// Multi-token decode (paged_prefill with a few new tokens per sequence: speculative
// verification): the N columns are the QTOK tokens x GROUP heads of a sequence, column c =
// (token c / GROUP, head c % GROUP), NT n8 tiles of them, each token with its own causal /
// window bounds; every K/V byte is still read once for all of them.
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

// Every knob of the tensor-core form (cuattn.keys.PagedMmaVariant) and every size derived
// from them. A warp step is TILE = 16 tokens (one m16 tile; 32-token tiles lost 3-20 points
// of read bandwidth at v2, bench/NOTES.md paged round 3).
//   SOFTCAP, ALIBI: the logits hook; SINKS: each head's sink joins v1's denominator (v2:
//   the reduce's); NHD: the NHD cache layout (params/paged.cuh), any power-of-two block.
//   QTOK: query tokens per sequence (1: decode; > 1: the rows of p.cu_seqlens_q).
template <typename T_, int HEAD_SIZE_, int BLOCK_SIZE_, int GROUP_, int PARTITION_SIZE_,
          bool ALIBI_, int NUM_WARPS_, int STAGES_, bool SOFTCAP_, bool SINKS_, bool NHD_,
          int QTOK_>
struct PagedMmaTraits {
  using T = T_;
  using Logits = LogitsHook<SOFTCAP_, ALIBI_>;           // the logits hook
  static constexpr bool ALIBI = ALIBI_;
  static constexpr bool SINKS = SINKS_;
  static constexpr bool NHD = NHD_;
  static constexpr int HEAD_SIZE = HEAD_SIZE_;
  static constexpr int BLOCK_SIZE = BLOCK_SIZE_;
  static constexpr int GROUP = GROUP_;                   // query heads per block, <= 8
  static constexpr int QTOK = QTOK_;
  static constexpr int COLS = QTOK * GROUP;              // the N columns (token, head)
  static constexpr int NT = (COLS + 7) / 8;              // n8 tiles of columns
  static constexpr int PARTITION_SIZE = PARTITION_SIZE_; // 0: v1
  static constexpr bool V2 = PARTITION_SIZE > 0;
  static constexpr int NUM_WARPS = NUM_WARPS_;
  static constexpr int STAGES = STAGES_;                 // tiles in each warp's cp.async ring
  static constexpr int TILE = 16;
  static_assert(HEAD_SIZE % 16 == 0, "k16 / m16 steps over the head dims");
  static_assert(GROUP >= 1 && GROUP <= 8 && QTOK >= 1, "columns");
  static_assert(!V2 || PARTITION_SIZE % TILE == 0, "partitions of whole tiles");
  static_assert(NHD || BLOCK_SIZE % 8 == 0, "a V chunk (8 tokens) never crosses a cache block");
  static_assert((BLOCK_SIZE & (BLOCK_SIZE - 1)) == 0 && BLOCK_SIZE <= 512, "block size");
  static constexpr int MT = TILE / 16;                    // token m-tiles (S^T) = PV k-steps
  static constexpr int KS = HEAD_SIZE / 16;               // QK k-steps = PV dim m-tiles
  static_assert(NT * KS <= 32, "O^T (NT x KS x 4 floats a lane) fits the registers");
  static constexpr int CHUNKS = HEAD_SIZE * TILE / 8;     // 16-byte chunks of K (and of V) per tile
  static_assert(CHUNKS % 32 == 0, "whole warps of chunks");
  static constexpr int CHUNKS_PER_LANE = CHUNKS / 32;
  static constexpr int VCH = TILE / 8;                    // V chunks per dim row of a tile
  static constexpr int TILE_BYTES = HEAD_SIZE * TILE * 2;            // K (or V) of one tile
  static constexpr int WARP_BYTES = STAGES * 2 * TILE_BYTES;         // a warp's ring
  // Epilogue: each warp's O^T, scaled to the block max, [warp][column][dim], in the rings'
  // shared memory; rows padded by 4 floats so that the 4 column pairs of a store land in
  // different banks.
  static constexpr int MERGE_ROW = HEAD_SIZE + 4;
  // With 4 n-tiles and more (8 new tokens x group 4), each column's normaliser is computed
  // once instead of at each of its elements, and the output loop reads 4 dims a thread:
  // 0.97x the call at 8 new tokens and 4k contexts. With fewer n-tiles the same epilogue
  // measured 1.01-1.03x (decode) and 1.11-1.28x (4 new tokens), its main loop compiled
  // differently, so they keep the per-element form (bench/NOTES.md, session 15).
  static constexpr bool NORM_ONCE = NT >= 4;
  // Lazy rescale (FlashAttention-4's rule), with 4 n-tiles and more: a column's max moves
  // only when a logit of the tile passes it by more than RESCALE_SLACK (log2 units), so most
  // tiles skip the shuffles and the O^T rescale; the weights stay <= 2^8, far inside fp32,
  // bf16 and fp16. 0.90-0.94x the 8-token call under a sustained load; with fewer n-tiles
  // it cost registers (4 new tokens: 3 blocks an SM, 1.09-1.13x; bench/NOTES.md, sessions
  // 16 and 17).
  static constexpr bool LAZY_RESCALE = NT >= 4;
  static constexpr float RESCALE_SLACK = 8.f;
  static constexpr int MERGE_BYTES = NUM_WARPS * 8 * NT * MERGE_ROW * 4;
  // More than one n-tile: Q^T waits in shared memory after the rings, [column][dim] rows
  // padded by 16 bytes (ldmatrix's 8 rows in 8 bank groups), n-tiles in pairs (ldmatrix
  // x4), and is re-read each k-step, so that its registers go to O^T.
  static constexpr bool Q_SMEM = NT > 1;
  static constexpr int Q_NT = (NT + 1) / 2 * 2;
  static constexpr int Q_ROW = HEAD_SIZE + 8;
  static constexpr int RING_BYTES = NUM_WARPS * WARP_BYTES;
  static constexpr int Q_BYTES = Q_SMEM ? 8 * Q_NT * Q_ROW * 2 : 0;
  static constexpr int SMEM_BYTES = RING_BYTES + Q_BYTES > MERGE_BYTES ? RING_BYTES + Q_BYTES
                                                                       : MERGE_BYTES;
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
  constexpr int QTOK = Tr::QTOK, COLS = Tr::COLS, NT = Tr::NT;
  constexpr bool V2 = Tr::V2;
  constexpr int MT = Tr::MT, KS = Tr::KS, VCH = Tr::VCH, CPL = Tr::CHUNKS_PER_LANE;

  extern __shared__ __align__(16) unsigned char smem[];
  __shared__ SoftmaxState state_s[NUM_WARPS][8 * NT];   // per warp and column: its state

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;   // fragment row / column pair
  const int seq = blockIdx.y;
  const int part = V2 ? blockIdx.z : 0;
  const int head0 = blockIdx.x * GROUP;
  const int kv_head = head0 / p.gqa_ratio;
  // The sequence's query rows [row0, row0 + q_len) (decode: one, row seq).
  int row0 = seq, q_len = 1;
  if constexpr (QTOK > 1) {
    const int* cu_q = static_cast<const int*>(p.cu_seqlens_q);
    row0 = cu_q[seq];
    q_len = min(cu_q[seq + 1] - row0, QTOK);
    if (q_len <= 0) return;
  }

  const PagedRange range = paged_range<BLOCK_SIZE, Tr::PARTITION_SIZE>(p, seq, part);
  if (V2 && range.start >= range.seq_len) return;   // the reduce never reads this partition
  const int end_tok = range.end;
  // Column c is query token c / GROUP at position seq_len - q_len + c / GROUP; it sees keys
  // [pos - window_left, pos + window_right] of the range (decode: right is 0). A column past
  // the sequence's tokens sees none.
  auto q_pos = [&](int c) { return range.seq_len - q_len + c / GROUP; };
  // The window's first key over all columns; tiles start at a multiple of TILE below it (V
  // chunks are 8 tokens of one block) and the select below masks the keys before each
  // column's bound.
  const int win_start = max(0, q_pos(0) - p.window_left);
  const int start_tok = max(range.start, win_start / TILE * TILE);
  const int num_tiles = (end_tok - start_tok + TILE - 1) / TILE;
  const int my_tiles = num_tiles > warp ? (num_tiles - warp + NUM_WARPS - 1) / NUM_WARPS : 0;
  const int* block_table = static_cast<const int*>(p.block_tables) + seq * p.bt_stride_seq;

  // ---- Q^T as the B operand: (dims 16 ks + 2t.., column 8 nt + g), zero columns past the
  // sequence's tokens; in registers once, or (Q_SMEM) in shared memory ----
  const unsigned short* q_rows = static_cast<const unsigned short*>(p.q);  // 2-byte loads:
  auto q_at = [&](int c, int d) -> unsigned short {                        // odd head strides
    const bool valid = c < COLS && c / GROUP < q_len;
    return valid ? q_rows[(row0 + c / GROUP) * p.q_stride_seq + (head0 + c % GROUP) * p.q_stride_head + d]
                 : 0;
  };
  u32 qb[Tr::Q_SMEM ? 1 : KS][NT][2];
  const u32 q_smem = smem_addr(smem + Tr::RING_BYTES);
  if constexpr (Tr::Q_SMEM) {
    // 16-byte copies (paged_prefill, the only caller with more than one n-tile, checks q's
    // address and strides for them), a cp.async group of their own, in flight with the first
    // K/V tiles: one round trip. (Element loads into shared memory waited one round trip per
    // few elements: ~9% of the 8-token call.)
    constexpr int DCH = HEAD_SIZE / 8;   // 16-byte chunks of a column
    for (int i = threadIdx.x; i < 8 * Tr::Q_NT * DCH; i += NUM_WARPS * 32) {
      const int c = i / DCH, d = 8 * (i % DCH);
      const bool valid = c < COLS && c / GROUP < q_len;
      const unsigned short* src =
          valid ? q_rows + (row0 + c / GROUP) * p.q_stride_seq + (head0 + c % GROUP) * p.q_stride_head + d
                : q_rows;
      cp_async_16(q_smem + (c * Tr::Q_ROW + d) * 2, src, valid ? 16 : 0);
    }
    cp_async_commit();
  } else {
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int ks = 0; ks < KS; ++ks)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int c = 8 * nt + g, d = 16 * ks + 8 * half + 2 * t;
          qb[ks][nt][half] = u32(q_at(c, d)) | (u32(q_at(c, d + 1)) << 16);
        }
  }
  // This lane's columns 8 nt + 2t + j: the key bounds [lo, hi] (hi = -1: no key), and the
  // logits hooks (ALiBi slopes in log2 units).
  using Logits = typename Tr::Logits;
  int lo[NT][2], hi[NT][2];
  Logits hook[NT][2];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int c = 8 * nt + 2 * t + j;
      const bool valid = c < COLS && c / GROUP < q_len;
      lo[nt][j] = q_pos(c) - p.window_left;
      hi[nt][j] = valid ? min(end_tok - 1, q_pos(c) + p.window_right) : -1;
      hook[nt][j] = Logits(0.f, p.softcap_in, p.softcap_out);
      if constexpr (Tr::ALIBI) {
        if (valid)
          hook[nt][j].slope =
              static_cast<const float*>(p.alibi_slopes)[seq * p.alibi_stride_seq + head0 + c % GROUP] *
              kLog2e;
      }
    }
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
  float o[KS][NT][4];   // O^T: (dim 16 m + g, columns 8 nt + 2t..) and (dim 16 m + g + 8, ..)
#pragma unroll
  for (int m = 0; m < KS; ++m)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) o[m][nt][0] = o[m][nt][1] = o[m][nt][2] = o[m][nt][3] = 0.f;
  // Per column (log2 units, scale 1): max the same on all 8 lanes of a column, sum this
  // lane's rows only (added over the column at the end).
  SoftmaxState row[NT][2];
  float base[NT][2];   // SoftmaxState::base of each column's max (0 while it is -inf)
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    row[nt][0] = row[nt][1] = SoftmaxState::empty();
    if constexpr (Tr::LAZY_RESCALE) base[nt][0] = base[nt][1] = 0.f;
  }

#pragma unroll
  for (int n = 0; n < STAGES - 1; ++n) issue(n);
  if constexpr (Tr::Q_SMEM) {   // Q^T's group, the oldest, has landed for every warp
    cp_async_wait<STAGES - 1>();
    __syncthreads();
  }
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
    float s[MT][NT][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) s[mt][nt][0] = s[mt][nt][1] = s[mt][nt][2] = s[mt][nt][3] = 0.f;
      const int tok = 16 * mt + (lane % 8) + 8 * ((lane / 8) & 1);
#pragma unroll
      for (int ks = 0; ks < KS; ++ks) {
        u32 a[4];
        ldmatrix_x4(a, k_tile + ((2 * ks + lane / 16) * TILE + tok) * 16);
        if constexpr (Tr::Q_SMEM) {
          // ldmatrix x4: matrix q is (n-tile 2 np + (q >> 1), dims +8 (q & 1)), row lane % 8
#pragma unroll
          for (int np = 0; np < Tr::Q_NT / 2; ++np) {
            u32 b[4];
            ldmatrix_x4(b, q_smem + ((16 * np + 8 * (lane / 16) + lane % 8) * Tr::Q_ROW +
                                     16 * ks + 8 * ((lane / 8) & 1)) * 2);
            mma_m16n8k16<T>(s[mt][2 * np], a, b[0], b[1]);
            if (2 * np + 1 < NT) mma_m16n8k16<T>(s[mt][2 * np + 1], a, b[2], b[3]);
          }
        } else {
#pragma unroll
          for (int nt = 0; nt < NT; ++nt) mma_m16n8k16<T>(s[mt][nt], a, qb[ks][nt][0], qb[ks][nt][1]);
        }
      }
    }
    // Scale to log2 units, the logits hook, each column's key bounds (which also keep a
    // zero-filled K row out); the tile max.
    float tile_max[NT][2];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) tile_max[nt][0] = tile_max[nt][1] = neg_inf();
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          const int tok = t0 + 16 * mt + g + 8 * (r / 2), j = r % 2;
          float x = s[mt][nt][r] * p.scale_log2;
          if (Logits::ACTIVE) x = hook[nt][j](x, q_pos(8 * nt + 2 * t + j), tok);
          x = tok >= lo[nt][j] && tok <= hi[nt][j] ? x : neg_inf();
          s[mt][nt][r] = x;
          tile_max[nt][j] = fmaxf(tile_max[nt][j], x);
        }
      }
    }
    // LAZY_RESCALE: the maxes move only when a logit of the tile passes its column's max by
    // more than RESCALE_SLACK on some lane (a vote, no shuffles); else base stays that of
    // the old max, and the weights below stay <= 2^RESCALE_SLACK.
    bool moves = true;
    if constexpr (Tr::LAZY_RESCALE) {
      bool grows = false;
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int j = 0; j < 2; ++j) grows |= tile_max[nt][j] > row[nt][j].max + Tr::RESCALE_SLACK;
      moves = __any_sync(0xffffffffu, grows);
    }
    if (moves) {
      float alpha[NT][2];
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
        for (int j = 0; j < 2; ++j) {
#pragma unroll
          for (int off = 4; off < 32; off *= 2)
            tile_max[nt][j] = fmaxf(tile_max[nt][j], __shfl_xor_sync(0xffffffffu, tile_max[nt][j], off));
          const float new_max = fmaxf(row[nt][j].max, tile_max[nt][j]);
          base[nt][j] = SoftmaxState::base(new_max, 1.f);
          alpha[nt][j] = row[nt][j].rescale(new_max, 1.f, base[nt][j]);
        }
      }
#pragma unroll
      for (int m = 0; m < KS; ++m) {
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
          o[m][nt][0] *= alpha[nt][0]; o[m][nt][1] *= alpha[nt][1];
          o[m][nt][2] *= alpha[nt][0]; o[m][nt][3] *= alpha[nt][1];
        }
      }
    }
    // P = exp2(S - max), packed to T and transposed into the B operand of P V. With one
    // n-tile as P = hi + lo, two T each, so that P V keeps ~16 mantissa bits (a bf16 P alone
    // is off by up to 2^-9 relative, visible when a few tokens dominate): the tensor cores
    // are far from busy there, so the second MMA is free while HBM sets the pace. With more
    // n-tiles (multi-token decode) P alone, as the flash kernel's: the second MMA is no
    // longer free (8 new tokens x 4 heads: 0.89-0.97x the time with it; bench/NOTES.md).
    constexpr int NP = NT > 1 ? 1 : 2;
    u32 pb[MT][NT][NP][2];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          s[mt][nt][r] = SoftmaxState::weight(s[mt][nt][r], 1.f, base[nt][r % 2]);
          row[nt][r % 2].sum += s[mt][nt][r];
        }
#pragma unroll
        for (int half = 0; half < 2; ++half) {   // tokens 0-7, 8-15 of the m-tile
          const float* x = &s[mt][nt][2 * half];
          const u32 h = pack_pair<T>(x[0], x[1]);
          const float2 hf = unpack_pair<T>(h);
          pb[mt][nt][0][half] = movmatrix_trans(h);
          pb[mt][nt][1][half] = movmatrix_trans(pack_pair<T>(x[0] - hf.x, x[1] - hf.y));
        }
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
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
          for (int k = 0; k < NP; ++k)
            mma_m16n8k16<T>(o[m][nt], a, pb[mt][nt][k][0], pb[mt][nt][k][1]);
      }
    }
  }

  // ---- merge the warps' states (the ring's shared memory is reused) -----------------------
  // Two passes over the warps instead of a chain of merges: the block max first, then every
  // warp's weight against it (SoftmaxState::weight, 0 for a warp that saw nothing).
  cp_async_wait<0>();
#pragma unroll
  for (int nt = 0; nt < NT; ++nt)
#pragma unroll
    for (int j = 0; j < 2; ++j)
#pragma unroll
      for (int off = 4; off < 32; off *= 2)
        row[nt][j].sum += __shfl_xor_sync(0xffffffffu, row[nt][j].sum, off);
  __syncthreads();   // every warp is done with its ring
  if (g == 0) {
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int j = 0; j < 2; ++j) state_s[warp][8 * nt + 2 * t + j] = row[nt][j];
  }
  __syncthreads();
  auto block_max = [&](int c) {
    float m = state_s[0][c].max;
#pragma unroll
    for (int w = 1; w < NUM_WARPS; ++w) m = fmaxf(m, state_s[w][c].max);
    return m;
  };
  float* merge = reinterpret_cast<float*>(smem);   // [NUM_WARPS][8 NT][MERGE_ROW]
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int c = 8 * nt + 2 * t + j;
      const float f = SoftmaxState::weight(row[nt][j].max, 1.f, SoftmaxState::base(block_max(c), 1.f));
      float* out_row = merge + (warp * 8 * NT + c) * Tr::MERGE_ROW;
#pragma unroll
      for (int m = 0; m < KS; ++m) {
        out_row[16 * m + g] = o[m][nt][j] * f;
        out_row[16 * m + g + 8] = o[m][nt][2 + j] * f;
      }
    }
  }
  __syncthreads();

  if constexpr (Tr::NORM_ONCE) {
    // Each column's normaliser, once: the block's sum over the warps' states (v1: and the
    // head's sink) and the lse; the output loop below only adds the warps' rows.
    __shared__ float norm_s[8 * NT];
    for (int c = threadIdx.x; c < q_len * GROUP; c += NUM_WARPS * 32) {
      SoftmaxState block{block_max(c), 0.f};
      const float b = SoftmaxState::base(block.max, 1.f);
#pragma unroll
      for (int w = 0; w < NUM_WARPS; ++w)
        block.sum = fmaf(state_s[w][c].sum, SoftmaxState::weight(state_s[w][c].max, 1.f, b),
                         block.sum);
      float alpha = 1.f;
      if constexpr (Tr::SINKS && !V2) {   // (v2: in the reduce)
        const float sink = static_cast<const float*>(p.sinks)[head0 + c % GROUP] * kLog2e;
        alpha = block.add_sink(sink, 1.f);
      }
      norm_s[c] = alpha * block.inv_sum();   // an empty sequence (v1) gives zeros
      const PagedOutput<T, HEAD_SIZE, V2> output{p, row0 + c / GROUP, head0, part};
      output.store_lse(c % GROUP, block.lse(1.f));
    }
    __syncthreads();

    // ---- write: v1 the output, v2 the normalised partial output; 4 dims a thread ----
    constexpr int D4 = HEAD_SIZE / 4;
    for (int i = threadIdx.x; i < q_len * GROUP * D4; i += NUM_WARPS * 32) {
      const int c = i / D4, d = 4 * (i % D4);
      float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
      for (int w = 0; w < NUM_WARPS; ++w) {
        const float4 x =
            *reinterpret_cast<const float4*>(merge + (w * 8 * NT + c) * Tr::MERGE_ROW + d);
        acc.x += x.x; acc.y += x.y; acc.z += x.z; acc.w += x.w;
      }
      const float f = norm_s[c];
      const PagedOutput<T, HEAD_SIZE, V2> output{p, row0 + c / GROUP, head0, part};
      output.store(c % GROUP, d, acc.x * f);
      output.store(c % GROUP, d + 1, acc.y * f);
      output.store(c % GROUP, d + 2, acc.z * f);
      output.store(c % GROUP, d + 3, acc.w * f);
    }
  } else {
    // ---- write: v1 the output and lse, v2 the normalised partial output and its lse ---
    for (int i = threadIdx.x; i < q_len * GROUP * HEAD_SIZE; i += NUM_WARPS * 32) {
      const int c = i / HEAD_SIZE, d = i % HEAD_SIZE, h = c % GROUP;
      SoftmaxState block{block_max(c), 0.f};
      const float b = SoftmaxState::base(block.max, 1.f);
      float acc = 0.f;
#pragma unroll
      for (int w = 0; w < NUM_WARPS; ++w) {
        block.sum = fmaf(state_s[w][c].sum, SoftmaxState::weight(state_s[w][c].max, 1.f, b),
                         block.sum);
        acc += merge[(w * 8 * NT + c) * Tr::MERGE_ROW + d];
      }
      if constexpr (Tr::SINKS && !V2) {   // (v2: in the reduce)
        acc *= block.add_sink(static_cast<const float*>(p.sinks)[head0 + h] * kLog2e, 1.f);
      }
      const PagedOutput<T, HEAD_SIZE, V2> output{p, row0 + c / GROUP, head0, part};
      output.store(h, d, acc * block.inv_sum());   // an empty sequence (v1) gives zeros
      if (d == 0) output.store_lse(h, block.lse(1.f));
    }
  }
}

}  // namespace cuattn
