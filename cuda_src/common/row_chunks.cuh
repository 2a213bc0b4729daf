// How the threads of a tile copy share its 16-byte chunks, the scheme of the flash kernels'
// loaders (flash_fwd.cuh KVSource, flash_fwd_sm90.cuh copy_tile, flash_bwd.cuh load_tile).
#pragma once

namespace cuattn {

// A tile of rows of D_CHUNKS 16-byte chunks, copied by THREADS threads: in pass `it`, thread t
// copies chunk it x THREADS + t of the tile (row-major). Where THREADS covers whole rows (EVEN),
// a thread's chunks are one column, every ROWS_PER_PASS-th row from its first: one source
// pointer stepped by a stride, or offsets from its first row, serve every pass.
// The walks over the passes stay with each loader, where they differ on purpose: KVSource
// unrolls fully (a K/V tile takes few passes; K and V share each one) and walks a paged cache
// its own way (NHD: consecutive rows, one block-table read per tile; vLLM's: keys-major);
// copy_tile rolls its loops (the producer warpgroup keeps few registers) into 128-byte-swizzled
// column blocks; load_tile unrolls by 4 (the offsets of more passes, held at once, spilled).
template <int THREADS, int D_CHUNKS>
struct RowChunks {
  static constexpr bool EVEN = THREADS % D_CHUNKS == 0;
  static constexpr int ROWS_PER_PASS = EVEN ? THREADS / D_CHUNKS : 1;
  // The passes over a tile of ROWS rows (the last one may be partial).
  template <int ROWS>
  static constexpr __host__ __device__ int passes() {
    return EVEN ? (ROWS + ROWS_PER_PASS - 1) / ROWS_PER_PASS
                : (ROWS * D_CHUNKS + THREADS - 1) / THREADS;
  }

  int index;     // the chunk's index in the tile
  int row, ch;   // its row, and its chunk in the row

  // Thread t's chunk of pass `it` (pass 0: an EVEN thread's first row and its column).
  static __device__ __forceinline__ RowChunks at(int it, int t) {
    const int c = it * THREADS + t;
    return {c, c / D_CHUNKS, c % D_CHUNKS};
  }
};

}  // namespace cuattn
