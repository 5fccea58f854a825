// The prefill's pack GQA (issue 20 section 4): its function constant and the
// loader of its Q tile, whose rows come from the GQA group's G query heads.
// Included by attention_prefill.h after fc_dense and kDenseLoadBytes.
#pragma once

namespace flash_metal {

// [[function_constant(13)]] (11 and 12 are attention_features.h's): pack
// GQA (issue 20 section 4). A threadgroup serves one (batch, kv head) and
// BQ packed rows of its group: packed row m is query row m / G of query
// head kv * G + m % G (G = gqa_ratio), so the group's G heads share every
// K/V tile the threadgroup loads. Each threadgroup still reads the keys its
// rows see once, so K/V traffic follows the threadgroup count: ceil(Nq * G
// / BQ) * Hkv instead of ceil(Nq / BQ) * Hq (G times less when Nq * G <=
// BQ: each K/V byte read once per GQA group). Masks, block bounds, sinks
// and the stores use each packed row's own (head, row). The host (csrc/
// metal_routing.cpp, prefill_pack_gqa) sets it when G > 1; the grid is then
// (ceil(Nq * G / BQ), Hkv, B). (An idea of FlashAttention-3's and
// FlashInfer's "pack GQA"; this code is the project's own.) False: one
// query head per threadgroup, the kernel's G is 1 and its code folds to
// the unpacked kernel.
constant bool fc_pack_gqa [[function_constant(13)]];

// The Q tile under fc_pack_gqa: tile row r is packed row m = first + r,
// i.e. row m / G of head m % G, `src` pointing at the group's first head
// (row 0). Rows >= valid_rows are past the sequence's packed rows: zero-
// filled, not read. Under fc_dense as 16-byte chunks (the host's dense
// check covers q's head stride too), else per element; either way a row's
// address takes a runtime division by G, which is why this loader runs once
// per threadgroup (the Q tile) and never in the key loop, and its offsets
// are 64-bit (a group's rows span G heads).
template <int ROWS, int DMAX, int LD, int THREADS, typename T>
FM_INLINE void prefill_load_q_packed(threadgroup T* tile, device const T* src, int64_t row_stride,
                                     int64_t head_stride, int64_t dim_stride, int first, int G, int D,
                                     int valid_rows, uint tid) {
  if (fc_dense) {
    constexpr int VEC = kDenseLoadBytes / int(sizeof(T));  // elements per chunk
    static_assert(DMAX % VEC == 0 && LD % VEC == 0, "rows are whole 16-byte chunks");
    constexpr int CPR = DMAX / VEC;  // chunks per row
    constexpr int CHUNKS = ROWS * CPR;
    constexpr int ITERS = (CHUNKS + THREADS - 1) / THREADS;
    FM_UNROLL for (int it = 0; it < ITERS; ++it) {
      const int i = it * THREADS + int(tid);
      if (CHUNKS % THREADS == 0 || i < CHUNKS) {
        const int r = i / CPR;  // constant divisors
        const int c = i % CPR;
        uint4 x = uint4(0u);
        if (r < valid_rows) {
          const int m = first + r;
          x = *reinterpret_cast<device const uint4*>(src + int64_t(m / G) * row_stride + int64_t(m % G) * head_stride +
                                                     c * VEC);
        }
        reinterpret_cast<threadgroup uint4*>(tile + r * LD)[c] = x;
      }
    }
    return;
  }
  constexpr int kElems = ROWS * DMAX;
  static_assert(kElems % THREADS == 0, "every thread loads the same number of elements");
  FM_UNROLL for (int it = 0; it < kElems / THREADS; ++it) {
    const int i = it * THREADS + int(tid);
    const int r = i / DMAX;
    const int c = i % DMAX;
    T x = T(0.0f);
    if (c < D && r < valid_rows) {
      const int m = first + r;
      x = src[int64_t(m / G) * row_stride + int64_t(m % G) * head_stride + int64_t(c) * dim_stride];
    }
    tile[r * LD + c] = x;
  }
}

}  // namespace flash_metal
