// FlashAttention-2 forward: out = softmax(scale * Q K^T + mask) V per (batch, head), never
// materialising the scores, plus the natural-log log-sum-exp of each row. The algorithm is
// Dao 2023, "FlashAttention-2" (online softmax over K/V tiles, each warp owning its query
// rows); split-KV (Flash-Decoding) writes fp32 partial results merged by the combine kernel.
#pragma once
#include "common/types.cuh"
#include "common/softmax.cuh"
#include "common/mma.cuh"

namespace cuattn {

// Mirrored by cuattn.flash.PARAMS (a static_assert in every entry point checks the sizes).
// Strides are in elements. Fixed-length: cu_seqlens_* are null and row i of batch b is at
// b * stride_batch + i * stride_row. Varlen: stride_batch is 0, seqlen_q = total_q, and
// the rows of batch b start at cu_seqlens_*[b].
struct FlashFwdParams {
  const void* q;              // [batch, seqlen_q, num_heads, head_dim] T (varlen: [total_q, num_heads, head_dim])
  const void* k;              // [batch, seqlen_k, num_heads_kv, head_dim] T (varlen: [total_k, ...])
  const void* v;              // [batch, seqlen_k, num_heads_kv, head_dim] T (varlen: [total_k, ...])
  const void* out;            // [batch, seqlen_q, num_heads, head_dim] T, written (varlen: [total_q, ...])
  const void* lse;            // [batch, num_heads, seqlen_q] float, written; null = not asked (varlen: [num_heads, total_q])
  const void* oaccum;         // [num_splits, total_q, num_heads, head_dim] float, split-KV partial outputs (else null)
  const void* lseaccum;       // [num_splits, num_heads, total_q] float, split-KV partial lse (else null)
  const void* cu_seqlens_q;   // [batch + 1] int32 prefix sums (null = fixed length)
  const void* cu_seqlens_k;   // [batch + 1] int32 prefix sums (null = fixed length)
  long long q_stride_batch, q_stride_row, q_stride_head;
  long long k_stride_batch, k_stride_row, k_stride_head;
  long long v_stride_batch, v_stride_row, v_stride_head;
  long long o_stride_batch, o_stride_row, o_stride_head;
  long long lse_stride_batch, lse_stride_head, lse_stride_row;
  int batch;
  int num_heads;
  int head_group;             // num_heads / num_heads_kv: query head h reads kv head h / head_group
  int seqlen_q;               // fixed length (varlen: total_q)
  int seqlen_k;               // fixed length (varlen: unused)
  int total_q;                // rows of oaccum / lseaccum: batch * seqlen_q, or total_q
  int head_dim;               // actual head dim (multiple of 8, <= HEAD_DIM)
  int window_left;            // keys j >= i + sk - sq - window_left (a huge value = unbounded)
  int window_right;           // keys j <= i + sk - sq + window_right (a huge value = unbounded)
  int num_splits;             // split-KV: key tiles are divided among this many blocks
  float scale_log2;           // softmax_scale * log2(e)
};

// Every tile constant, derived from the knobs Python chose (cuattn/tuning.py).
template <typename T, int HEAD_DIM, int BLOCK_M, int BLOCK_N, int NUM_WARPS, int STAGES,
          bool Q_SMEM = false>
struct FlashFwdTraits {
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
  static constexpr int STAGE_BYTES = 2 * KV_TILE_BYTES;  // K tile then V tile
  static constexpr int SMEM_BYTES = Q_BYTES + STAGES * STAGE_BYTES;
  static constexpr int KV_CHUNKS = BLOCK_N * D_CHUNKS;
  static constexpr int KV_LOADS_PER_THREAD = (KV_CHUNKS + THREADS - 1) / THREADS;
  static constexpr int Q_LOADS_PER_LANE = WARP_M * D_CHUNKS / 32;
  // Two inlined copies of the key-loop body (boundary tiles with the mask, the middle
  // without) when registers allow; above head dim 128 ptxas spills with two copies, so one
  // loop skips the mask code with a block-uniform branch instead. Q_SMEM takes the one
  // loop too: at 32 rows per warp (O + S = 160-192 accumulator registers) the second copy
  // tips ptxas into spills (hd128 128x32: 20-24 bytes with two copies, none with one).
  static constexpr bool SEPARATE_MASK_LOOP = HEAD_DIM <= 128 && !Q_SMEM;
  // Q fragments stay in registers for the whole key loop unless Q + O fragments alone
  // would take more than 96 of the 255 registers (hd 128 at 16 rows per warp: 32 + 64 = 96;
  // larger head dims leave too little room for S, addresses and load scheduling).
  // Q_SMEM (knob q_smem) re-reads Q from shared memory at every k16 step whatever the
  // head dim: the price of 32 query rows per warp (BLOCK_M = 32 x NUM_WARPS) without spills.
  static constexpr bool Q_IN_REGS =
      !Q_SMEM && M_TILES * (QK_K_STEPS * 4 + O_N_TILES * 4) <= 96;

  static_assert(sizeof(T) == 2, "fp16 / bf16 only");
  static_assert(HEAD_DIM % 32 == 0 && HEAD_DIM <= 256, "compiled head dim: a multiple of 32");
  static_assert(BLOCK_M % (16 * NUM_WARPS) == 0, "each warp owns a multiple of 16 query rows");
  static_assert(BLOCK_N % 16 == 0, "BLOCK_N: a multiple of 16");
  static_assert(STAGES >= 2, "at least double buffering");
  static_assert((WARP_M * D_CHUNKS) % 32 == 0, "Q rows of a warp split evenly over lanes");
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

// Grid: (ceil(max_seqlen_q / BLOCK_M), num_heads, batch * num_splits), block: (NUM_WARPS * 32),
// dynamic shared memory: FlashFwdTraits::SMEM_BYTES.
// Block (x, h, z) computes query tile (gridDim.x - 1 - x) of head h, batch z / num_splits,
// over the key tiles of split z % num_splits. SPLIT: writes normalised fp32 partial outputs
// and their lse to oaccum / lseaccum (merged by flash_fwd_combine_kernel); otherwise writes
// out (and lse).
// Performance knobs (cuattn.flash.FlashFwdVariant; all off = the first measured kernel):
//   Q_SMEM    >= 1: Q fragments re-read from shared memory at every k16 step (see the
//             traits), for 32 query rows per warp within 255 registers; with it, the
//             register-lean forms of the rest: one key loop, a rolled output-store loop.
//             2: also the compact ldmatrix step offsets (SwizzledSteps COMPACT). ptxas at
//             255 registers tips either way on each: hd64 128x128 fits only with 2,
//             hd128 128x32 only with 1.
//   KV_SPLIT  K and V of a tile are separate cp.async groups: S = Q K^T of tile n waits
//             only for K_n (one barrier), O += P V waits for V_n (a second barrier), so
//             the first GEMM and the softmax overlap V_n's flight.
//   SOFTMAX   bit 0: branch-free rescale (O *= alpha every tile, alpha = 1 when the row
//             max stays) instead of a divergent branch per row; bit 1: P packed to T
//             right after its exp2, no -inf guard without a band (registers: see 3d).
template <typename T, int HEAD_DIM, int BLOCK_M, int BLOCK_N, int NUM_WARPS, int STAGES,
          bool IS_CAUSAL, bool HAS_WINDOW, bool SPLIT, int Q_SMEM = 0,
          bool KV_SPLIT = false, int SOFTMAX = 0>
__device__ void flash_fwd_kernel(const FlashFwdParams& p) {
  using Tr = FlashFwdTraits<T, HEAD_DIM, BLOCK_M, BLOCK_N, NUM_WARPS, STAGES, (Q_SMEM > 0)>;
  static_assert(!(IS_CAUSAL && HAS_WINDOW), "causal with a window is passed as a window");
  constexpr bool BAND = IS_CAUSAL || HAS_WINDOW;
  constexpr int M_TILES = Tr::M_TILES;
  constexpr int D_CHUNKS = Tr::D_CHUNKS;

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
  const int h = blockIdx.y;
  const int b = SPLIT ? blockIdx.z / p.num_splits : blockIdx.z;
  const int split = SPLIT ? blockIdx.z % p.num_splits : 0;
  const SeqRange qr = seq_range(p.cu_seqlens_q, b, p.seqlen_q);
  const SeqRange kr = seq_range(p.cu_seqlens_k, b, p.seqlen_k);
  const int sq = qr.len, sk = kr.len;
  const int m0 = m_block * BLOCK_M;
  if (m0 >= sq) return;
  const int m_last = min(m0 + BLOCK_M, sq) - 1;     // last valid query row of the tile
  const int diag = sk - sq;                          // bottom-right alignment
  const int left = HAS_WINDOW ? p.window_left : 0;
  const int right = IS_CAUSAL ? 0 : (HAS_WINDOW ? p.window_right : 0);
  const int head_dim_chunks = p.head_dim / 8;
  const int kvh = h / p.head_group;

  const T* q_ptr = static_cast<const T*>(p.q) + b * p.q_stride_batch +
                   (long long)qr.start * p.q_stride_row + h * p.q_stride_head;
  const T* k_ptr = static_cast<const T*>(p.k) + b * p.k_stride_batch +
                   (long long)kr.start * p.k_stride_row + kvh * p.k_stride_head;
  const T* v_ptr = static_cast<const T*>(p.v) + b * p.v_stride_batch +
                   (long long)kr.start * p.v_stride_row + kvh * p.v_stride_head;

  // Key tiles this block visits: the band of rows [m0, m_last], cut to this split.
  // Tiles in [full_lo, full_hi) need no mask (every key visible to every valid row).
  int n_begin = 0, n_end = sk;
  int full_lo_key = 0, full_hi_key = sk;
  if (BAND) {
    n_end = min(sk, m_last + diag + right + 1);
    full_hi_key = max(0, min(sk, m0 + diag + right + 1));
  }
  if (HAS_WINDOW) {
    n_begin = max(0, m0 + diag - left);
    full_lo_key = max(0, m_last + diag - left);
  }
  const int t_lo = n_begin / BLOCK_N;
  const int t_hi = n_end > n_begin ? (n_end + BLOCK_N - 1) / BLOCK_N : t_lo;
  int s_lo = t_lo, s_hi = t_hi;
  if (SPLIT) {
    const int per_split = (t_hi - t_lo + p.num_splits - 1) / p.num_splits;
    s_lo = min(t_hi, t_lo + split * per_split);
    s_hi = min(t_hi, s_lo + per_split);
  }
  const int full_lo = min(max((full_lo_key + BLOCK_N - 1) / BLOCK_N, s_lo), s_hi);
  const int full_hi = min(max(full_hi_key / BLOCK_N, full_lo), s_hi);
  // Visiting order: the boundary tiles first (left ones, then right ones: the diagonal
  // sets the row max early), then the unmasked middle. Step n visits tile_of(n).
  const int n_left = full_lo - s_lo;
  const int n_masked = n_left + (s_hi - full_hi);
  const int n_steps = s_hi - s_lo;
  auto tile_of = [&](int n) {
    return n < n_left ? s_lo + n : (n < n_masked ? full_hi + (n - n_left)
                                                 : full_lo + (n - n_masked));
  };

  // ---- Phase 1: start the loads: this warp's Q rows, then the first STAGES-1 K/V tiles ----
  {
    const int row0 = warp * Tr::WARP_M;
#pragma unroll
    for (int it = 0; it < Tr::Q_LOADS_PER_LANE; ++it) {
      const int c = it * 32 + lane;
      const int r = row0 + c / D_CHUNKS, ch = c % D_CHUNKS;
      const int i = m0 + r;
      const bool ok = i < sq && ch < head_dim_chunks;
      const T* src = ok ? q_ptr + (long long)i * p.q_stride_row + ch * 8 : q_ptr;
      cp_async_16(smem_q + swizzled_offset<D_CHUNKS>(r, ch), src, ok ? 16 : 0);
    }
    cp_async_commit();
  }

  // One K/V tile into a pipeline stage; keys past the sequence and columns past head_dim
  // are zero-filled (a zero V row keeps 0 * garbage out of P V).
  // Each thread copies a fixed 16-byte column chunk of every ROWS_PER_PASS-th row when the
  // chunks of a row divide the block evenly (one running pointer each for K and V);
  // otherwise chunk c of the tile goes to thread c % THREADS.
  constexpr bool EVEN_ROWS = Tr::THREADS % D_CHUNKS == 0;
  constexpr int ROWS_PER_PASS = EVEN_ROWS ? Tr::THREADS / D_CHUNKS : 1;
  const int ld_row = EVEN_ROWS ? tid / D_CHUNKS : 0;
  const int ld_ch = EVEN_ROWS ? tid % D_CHUNKS : 0;
  const bool ld_ch_ok = ld_ch < head_dim_chunks;
  auto load_kv = [&](int tile, int stage, bool do_k = true, bool do_v = true) {
    const u32 sk_base = smem_kv + stage * Tr::STAGE_BYTES;
    const u32 sv_base = sk_base + Tr::KV_TILE_BYTES;
    if constexpr (EVEN_ROWS) {
      const int key0 = tile * BLOCK_N + ld_row;
      const T* ks = k_ptr + (long long)key0 * p.k_stride_row + ld_ch * 8;
      const T* vs = v_ptr + (long long)key0 * p.v_stride_row + ld_ch * 8;
      const long long k_step = (long long)ROWS_PER_PASS * p.k_stride_row;
      const long long v_step = (long long)ROWS_PER_PASS * p.v_stride_row;
#pragma unroll
      for (int it = 0; it < BLOCK_N / ROWS_PER_PASS; ++it) {
        const int r = it * ROWS_PER_PASS + ld_row;
        const bool ok = ld_ch_ok && key0 + it * ROWS_PER_PASS < sk;
        const u32 off = swizzled_offset<D_CHUNKS>(r, ld_ch);
        if (do_k) cp_async_16(sk_base + off, ok ? ks : k_ptr, ok ? 16 : 0);
        if (do_v) cp_async_16(sv_base + off, ok ? vs : v_ptr, ok ? 16 : 0);
        ks += k_step;
        vs += v_step;
      }
    } else {
#pragma unroll
      for (int it = 0; it < Tr::KV_LOADS_PER_THREAD; ++it) {
        const int c = it * Tr::THREADS + tid;
        if (Tr::KV_CHUNKS % Tr::THREADS == 0 || c < Tr::KV_CHUNKS) {
          const int r = c / D_CHUNKS, ch = c % D_CHUNKS;
          const int key = tile * BLOCK_N + r;
          const bool ok = key < sk && ch < head_dim_chunks;
          const u32 off = swizzled_offset<D_CHUNKS>(r, ch);
          const T* ks = ok ? k_ptr + (long long)key * p.k_stride_row + ch * 8 : k_ptr;
          const T* vs = ok ? v_ptr + (long long)key * p.v_stride_row + ch * 8 : v_ptr;
          if (do_k) cp_async_16(sk_base + off, ks, ok ? 16 : 0);
          if (do_v) cp_async_16(sv_base + off, vs, ok ? 16 : 0);
        }
      }
    }
  };

  // Groups in commit order: Q, then per tile K+V (KV_SPLIT: K, V). Every thread commits
  // the same groups, empty or not, so the wait counts below hold everywhere.
  // KV_GROUPS groups per tile. At the top of step n, once tile n's K has landed, the
  // KV_WAIT_K younger groups may still fly (V_n with KV_SPLIT, and tiles n+1 .. n+STAGES-2);
  // before O += P V (KV_SPLIT), once V_n has landed, KV_WAIT_V may (tiles n+1 .. n+STAGES-1).
  constexpr int KV_GROUPS = KV_SPLIT ? 2 : 1;
  constexpr int KV_WAIT_K = KV_SPLIT ? 2 * STAGES - 3 : STAGES - 2;
  constexpr int KV_WAIT_V = 2 * STAGES - 2;   // KV_SPLIT only
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if constexpr (KV_SPLIT) {
      if (s < n_steps) load_kv(tile_of(s), s, true, false);
      cp_async_commit();
      if (s < n_steps) load_kv(tile_of(s), s, false, true);
      cp_async_commit();
    } else {
      if (s < n_steps) load_kv(tile_of(s), s);
      cp_async_commit();   // always commit: every thread counts the same groups
    }
  }

  // ---- Phase 2: Q fragments into registers for the whole key loop --------------------------
  // (Q_IN_REGS false, head dims where Q + O fragments would not fit in 255 registers: the
  // fragments are re-read from this warp's rows of the Q tile at every k16 step instead.)
  cp_async_wait<KV_GROUPS * (STAGES - 1)>();   // the Q group (the oldest) has landed
  __syncwarp();
  // Q (A of S = Q K^T, x4 = rows 0-7 / 8-15 x chunks 2s, 2s+1): lane l reads row
  // (l % 8) + ((l / 8) % 2) * 8 of each m16 tile, chunk 2 s + l / 16.
  const int q_row = warp * Tr::WARP_M + (lane % 8) + ((lane / 8) % 2) * 8;
  const SwizzledSteps<D_CHUNKS, (Q_SMEM >= 2)> q_steps(q_row, lane / 16);
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

  // Online-softmax state: rows (mt, g) and (mt, g + 8) of this thread. row_sum is this
  // thread's partial sum (its columns only), reduced over the quad once at the end.
  float o_acc[M_TILES][Tr::O_N_TILES][4];
  float row_max[M_TILES][2], row_sum[M_TILES][2];
#pragma unroll
  for (int mt = 0; mt < M_TILES; ++mt) {
#pragma unroll
    for (int nt = 0; nt < Tr::O_N_TILES; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) o_acc[mt][nt][e] = 0.f;
    }
    row_max[mt][0] = row_max[mt][1] = neg_inf();
    row_sum[mt][0] = row_sum[mt][1] = 0.f;
  }
  const float scale_log2 = p.scale_log2;
  // ldmatrix lane patterns. K (B of S = Q K^T, x4 = keys 0-7 / 8-15 x chunks 2s, 2s+1):
  // lane l reads key row (l % 8) + (l / 16) * 8, chunk 2 s + (l / 8) % 2.
  // V (.trans, B of P V, x4 = keys 0-7 / 8-15 x chunks 2s, 2s+1 of head dim):
  // lane l reads key row (l % 8) + ((l / 8) % 2) * 8, chunk 2 s + l / 16.
  const int k_row = (lane % 8) + (lane / 16) * 8;
  const int v_row = (lane % 8) + ((lane / 8) % 2) * 8;
  const SwizzledSteps<D_CHUNKS, (Q_SMEM >= 2)> k_steps(k_row, (lane / 8) % 2);
  const SwizzledSteps<D_CHUNKS, (Q_SMEM >= 2)> v_steps(v_row, lane / 16);

  // ---- Phase 3: one key tile: S = Q K^T, (mask), online softmax, O += P V ---------------------
  // With SEPARATE_MASK_LOOP, `masked` is a literal at each of the two call sites below and
  // the step is inlined into each loop, so the unmasked loop carries no mask code at all.
  auto step = [&](int n, bool masked) {
    const int tile = tile_of(n);
    // 3a. wait for this tile (KV_SPLIT: its K only), then refill the stage every warp
    // finished with last step
    cp_async_wait<KV_WAIT_K>();
    __syncthreads();
    if constexpr (KV_SPLIT) {
      const bool more = n + STAGES - 1 < n_steps;
      if (more) load_kv(tile_of(n + STAGES - 1), (n + STAGES - 1) % STAGES, true, false);
      cp_async_commit();
      if (more) load_kv(tile_of(n + STAGES - 1), (n + STAGES - 1) % STAGES, false, true);
      cp_async_commit();
    } else {
      if (n + STAGES - 1 < n_steps) load_kv(tile_of(n + STAGES - 1), (n + STAGES - 1) % STAGES);
      cp_async_commit();
    }
    const u32 sk_base = smem_kv + (n % STAGES) * Tr::STAGE_BYTES;
    const u32 k_lane = sk_base + k_row * D_CHUNKS * 16;
    const u32 v_lane = sk_base + Tr::KV_TILE_BYTES + v_row * D_CHUNKS * 16;

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

    // 3c. boundary tiles only: keys past the sequence or outside the band get -inf
    if (masked) {
#pragma unroll
      for (int mt = 0; mt < M_TILES; ++mt) {
#pragma unroll
        for (int nt = 0; nt < Tr::S_N_TILES; ++nt) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int i = m0 + warp * Tr::WARP_M + mt * 16 + g + (e / 2) * 8;
            const int j = tile * BLOCK_N + nt * 8 + 2 * t4 + (e % 2);
            bool visible = j < sk;
            if (BAND) visible = visible && j <= i + diag + right;
            if (HAS_WINDOW) visible = visible && j >= i + diag - left;
            if (!visible) s[mt][nt][e] = neg_inf();
          }
        }
      }
    }

    // 3d. online softmax in the exp2 domain: new row max (quad shuffles), rescale O and the
    // running sum only when the max moved, P = exp2(S * scale_log2 - max * scale_log2)
    // SOFTMAX bit 1: P of each m16 tile packed to T as soon as its two row halves are done
    // (half the registers of the fp32 S from there to O += P V), not in 3e; and no -inf
    // guard on the row max without a band (below).
    constexpr bool EARLY_PACK = (SOFTMAX & 2) != 0;
    u32 p_pack[M_TILES][EARLY_PACK ? Tr::PV_K_STEPS : 1][4];
    auto pack_p = [&](u32 (&pf)[4], int mt, int kk) {
      pf[0] = pack_pair<T>(s[mt][2 * kk][0], s[mt][2 * kk][1]);
      pf[1] = pack_pair<T>(s[mt][2 * kk][2], s[mt][2 * kk][3]);
      pf[2] = pack_pair<T>(s[mt][2 * kk + 1][0], s[mt][2 * kk + 1][1]);
      pf[3] = pack_pair<T>(s[mt][2 * kk + 1][2], s[mt][2 * kk + 1][3]);
    };
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt) {
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {
        float mx = row_max[mt][hr];
#pragma unroll
        for (int nt = 0; nt < Tr::S_N_TILES; ++nt) {
          mx = fmaxf(mx, fmaxf(s[mt][nt][2 * hr], s[mt][nt][2 * hr + 1]));
        }
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        // A row with no visible key so far keeps max -inf: exp2(-inf - 0) = 0, not NaN.
        // (EARLY_PACK without a band skips the guard, one register less: then every tile
        // this block visits holds a key < seqlen_k, so each row max is finite from the
        // first tile on.)
        const float max_scaled = (EARLY_PACK && !BAND) ? mx * scale_log2
                                                       : (mx == neg_inf() ? 0.f : mx * scale_log2);
        if constexpr (SOFTMAX & 1) {
          // alpha = 1 exactly when the max stayed (same product twice); 0 from -inf.
          const float alpha = exp2f(fmaf(row_max[mt][hr], scale_log2, -max_scaled));
          row_sum[mt][hr] *= alpha;
#pragma unroll
          for (int nt = 0; nt < Tr::O_N_TILES; ++nt) {
            o_acc[mt][nt][2 * hr] *= alpha;
            o_acc[mt][nt][2 * hr + 1] *= alpha;
          }
          row_max[mt][hr] = mx;
        } else if (mx != row_max[mt][hr]) {   // moved: from -inf or up; never back to -inf
          const float alpha = exp2f((row_max[mt][hr] - mx) * scale_log2);
          row_sum[mt][hr] *= alpha;
#pragma unroll
          for (int nt = 0; nt < Tr::O_N_TILES; ++nt) {
            o_acc[mt][nt][2 * hr] *= alpha;
            o_acc[mt][nt][2 * hr + 1] *= alpha;
          }
          row_max[mt][hr] = mx;
        }
        float sum = 0.f;
#pragma unroll
        for (int nt = 0; nt < Tr::S_N_TILES; ++nt) {
#pragma unroll
          for (int e = 2 * hr; e < 2 * hr + 2; ++e) {
            const float pe = exp2f(fmaf(s[mt][nt][e], scale_log2, -max_scaled));
            s[mt][nt][e] = pe;
            sum += pe;
          }
        }
        row_sum[mt][hr] += sum;
      }
      if constexpr (EARLY_PACK) {
#pragma unroll
        for (int kk = 0; kk < Tr::PV_K_STEPS; ++kk) pack_p(p_pack[mt][kk], mt, kk);
      }
    }

    // 3e. O += P V: the S accumulators of two n8 tiles, packed to T, are the A operand of
    // one k16 step; ldmatrix .trans of V gives the B fragments of two n8 tiles of head dim
    if constexpr (KV_SPLIT) {   // V_n: this thread's copies, then everyone's
      cp_async_wait<KV_WAIT_V>();
      __syncthreads();
    }
#pragma unroll
    for (int kk = 0; kk < Tr::PV_K_STEPS; ++kk) {
      u32 pf[M_TILES][4];
#pragma unroll
      for (int mt = 0; mt < M_TILES; ++mt) {
        if constexpr (EARLY_PACK) {
#pragma unroll
          for (int i = 0; i < 4; ++i) pf[mt][i] = p_pack[mt][kk][i];
        } else {
          pf[mt][0] = pack_pair<T>(s[mt][2 * kk][0], s[mt][2 * kk][1]);
          pf[mt][1] = pack_pair<T>(s[mt][2 * kk][2], s[mt][2 * kk][3]);
          pf[mt][2] = pack_pair<T>(s[mt][2 * kk + 1][0], s[mt][2 * kk + 1][1]);
          pf[mt][3] = pack_pair<T>(s[mt][2 * kk + 1][2], s[mt][2 * kk + 1][3]);
        }
      }
#pragma unroll
      for (int dp = 0; dp < Tr::O_N_TILES / 2; ++dp) {
        u32 vf[4];
        ldmatrix_x4_trans(vf, v_lane + kk * 16 * D_CHUNKS * 16 + v_steps.at(dp));
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
    for (int n = 0; n < n_masked; ++n) step(n, true);
    for (int n = n_masked; n < n_steps; ++n) step(n, false);
  } else {
    for (int n = 0; n < n_steps; ++n) step(n, n < n_masked);   // uniform branch per tile
  }
  cp_async_wait<0>();   // nothing may still be writing shared memory when the block exits

  // ---- Phase 4: finish the rows: quad-sum, one division, lse --------------------------------
  float inv_sum[M_TILES][2], lse[M_TILES][2];
#pragma unroll
  for (int mt = 0; mt < M_TILES; ++mt) {
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      float l = row_sum[mt][hr];
      l += __shfl_xor_sync(0xffffffffu, l, 1);
      l += __shfl_xor_sync(0xffffffffu, l, 2);
      const bool any = l > 0.f;   // a row that saw no key: zeros and lse = -inf
      inv_sum[mt][hr] = any ? 1.f / l : 0.f;
      lse[mt][hr] = any ? (row_max[mt][hr] * scale_log2 + __log2f(l)) * kLn2 : neg_inf();
    }
  }

  if constexpr (SPLIT) {
    // ---- Phase 5 (split): normalised fp32 partial rows and their lse -------------------------
    const long long row_base = (p.cu_seqlens_q == nullptr ? (long long)b * p.seqlen_q : 0) +
                               qr.start;
    float* oacc = static_cast<float*>(const_cast<void*>(p.oaccum));
    float* lacc = static_cast<float*>(const_cast<void*>(p.lseaccum));
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt) {
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {
        const int i = m0 + warp * Tr::WARP_M + mt * 16 + g + hr * 8;
        if (i >= sq) continue;
        const long long tok = row_base + i;
        float* orow = oacc + (((long long)split * p.total_q + tok) * p.num_heads + h) * p.head_dim;
#pragma unroll
        for (int nt = 0; nt < Tr::O_N_TILES; ++nt) {
          if (nt < head_dim_chunks) {
            float2 v2 = make_float2(o_acc[mt][nt][2 * hr] * inv_sum[mt][hr],
                                    o_acc[mt][nt][2 * hr + 1] * inv_sum[mt][hr]);
            *reinterpret_cast<float2*>(orow + nt * 8 + 2 * t4) = v2;
          }
        }
        if (t4 == 0) lacc[((long long)split * p.num_heads + h) * p.total_q + tok] = lse[mt][hr];
      }
    }
  } else {
    // ---- Phase 5: O -> T in this warp's own rows of the Q tile, then 16-byte stores ----------
    // The warp's last ldmatrix of Q read these rows (in the key loop, or in Phase 2 when the
    // loop ran no tile and so no barrier came between): order those reads before the writes.
    // (compute-sanitizer racecheck flagged the missing barrier on rows that see no key.)
    __syncwarp();
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt) {
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {
        const int r = warp * Tr::WARP_M + mt * 16 + g + hr * 8;
#pragma unroll
        for (int nt = 0; nt < Tr::O_N_TILES; ++nt) {
          const u32 packed = pack_pair<T>(o_acc[mt][nt][2 * hr] * inv_sum[mt][hr],
                                               o_acc[mt][nt][2 * hr + 1] * inv_sum[mt][hr]);
          const u32 addr = smem_q + swizzled_offset<D_CHUNKS>(r, nt) + t4 * 4;
          asm volatile("st.shared.u32 [%0], %1;\n" :: "r"(addr), "r"(packed));
        }
      }
    }
    __syncwarp();
    T* o_ptr = static_cast<T*>(const_cast<void*>(p.out)) + b * p.o_stride_batch +
               (long long)qr.start * p.o_stride_row + h * p.o_stride_head;
    const int row0 = warp * Tr::WARP_M;
    // With 32 rows per warp (Q_SMEM) the loop stays rolled, or ptxas hoists all the 16-byte
    // loads and spills around the end of the key loop (hd128 128x64: 184 bytes -> 20).
    constexpr int STORE_UNROLL = Q_SMEM == 0 ? Tr::Q_LOADS_PER_LANE : 1;
#pragma unroll (STORE_UNROLL)
    for (int it = 0; it < Tr::Q_LOADS_PER_LANE; ++it) {
      const int c = it * 32 + lane;
      const int r = row0 + c / D_CHUNKS, ch = c % D_CHUNKS;
      const int i = m0 + r;
      if (i < sq && ch < head_dim_chunks) {
        Vec16 v16;
        const u32 addr = smem_q + swizzled_offset<D_CHUNKS>(r, ch);
        asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                     : "=r"(v16.raw.x), "=r"(v16.raw.y), "=r"(v16.raw.z), "=r"(v16.raw.w)
                     : "r"(addr));
        store16(o_ptr + (long long)i * p.o_stride_row + ch * 8, v16);
      }
    }
    if (p.lse != nullptr && t4 == 0) {
      float* lse_ptr = static_cast<float*>(const_cast<void*>(p.lse)) + b * p.lse_stride_batch +
                       h * p.lse_stride_head + (long long)qr.start * p.lse_stride_row;
#pragma unroll
      for (int mt = 0; mt < M_TILES; ++mt) {
#pragma unroll
        for (int hr = 0; hr < 2; ++hr) {
          const int i = m0 + warp * Tr::WARP_M + mt * 16 + g + hr * 8;
          if (i < sq) lse_ptr[(long long)i * p.lse_stride_row] = lse[mt][hr];
        }
      }
    }
  }
}

// Grid: (ceil(total_q * num_heads / (NUM_THREADS / 32))), block: (NUM_THREADS).
// Split-KV combine: one warp merges the num_splits fp32 partial rows of one (token, head)
// by their lse (m = max lse_s, w_s = exp(lse_s - m), out = sum w_s o_s / sum w_s), writes
// the row in T at its place in out, and lse = m + log(sum w_s) when asked. Splits that
// saw no key (lse = -inf) weigh 0; a row no split saw gives zeros and -inf.
template <typename T, int HEAD_DIM, int NUM_THREADS>
__device__ void flash_fwd_combine_kernel(const FlashFwdParams& p) {
  const int lane = threadIdx.x % 32;
  const long long row = (long long)blockIdx.x * (NUM_THREADS / 32) + threadIdx.x / 32;
  if (row >= (long long)p.total_q * p.num_heads) return;
  const long long tok = row / p.num_heads;
  const int h = static_cast<int>(row % p.num_heads);
  const float* lacc = static_cast<const float*>(p.lseaccum);
  const float* oacc = static_cast<const float*>(p.oaccum);

  // Phase 1: the largest partial lse.
  float m = neg_inf();
  for (int s = 0; s < p.num_splits; ++s) {
    m = fmaxf(m, lacc[((long long)s * p.num_heads + h) * p.total_q + tok]);
  }
  // Phase 2: weighted sum, 4 columns per lane per pass.
  constexpr int PASSES = (HEAD_DIM + 127) / 128;
  float acc[PASSES][4];
#pragma unroll
  for (int it = 0; it < PASSES; ++it) acc[it][0] = acc[it][1] = acc[it][2] = acc[it][3] = 0.f;
  float wsum = 0.f;
  for (int s = 0; s < p.num_splits; ++s) {
    const float w = exp_minus(lacc[((long long)s * p.num_heads + h) * p.total_q + tok], m);
    if (w == 0.f) continue;
    wsum += w;
    const float* orow = oacc + (((long long)s * p.total_q + tok) * p.num_heads + h) * p.head_dim;
#pragma unroll
    for (int it = 0; it < PASSES; ++it) {
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
  const float inv = wsum > 0.f ? 1.f / wsum : 0.f;
  const long long b = tok / p.seqlen_q;   // varlen: seqlen_q = total_q, so b = 0
  const long long i = tok - b * p.seqlen_q;
  T* orow = static_cast<T*>(const_cast<void*>(p.out)) + b * p.o_stride_batch +
            i * p.o_stride_row + h * p.o_stride_head;
#pragma unroll
  for (int it = 0; it < PASSES; ++it) {
    const int col = it * 128 + lane * 4;
    if (col < p.head_dim) {
      uint2 packed;
      packed.x = pack_pair<T>(acc[it][0] * inv, acc[it][1] * inv);
      packed.y = pack_pair<T>(acc[it][2] * inv, acc[it][3] * inv);
      *reinterpret_cast<uint2*>(orow + col) = packed;
    }
  }
  if (lane == 0 && p.lse != nullptr) {
    float* lse = static_cast<float*>(const_cast<void*>(p.lse));
    lse[b * p.lse_stride_batch + h * p.lse_stride_head + i * p.lse_stride_row] =
        wsum > 0.f ? m + __logf(wsum) : neg_inf();
  }
}

}  // namespace cuattn
