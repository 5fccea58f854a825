// The CPU backward's register-tiled micro-kernel and packing routines
// (moved from attention_backward_cpu.cpp, which keeps the driver: work
// items, the recomputed softmax, the GQA sums and the thread fan-out).
// Internal to that file. The packing routines take the width they pack (D_qk
// for Q and K, D_v for V, dO and O; issue 20 §2), not the call's geometry.
#pragma once

#include "common.h"
#include "simd.h"

#include <algorithm>
#include <cstdint>

namespace flash_metal {
namespace cpu {
namespace bwd {
// Anonymous within: the one file that includes this header compiles these
// with internal linkage and no `inline` hint, as when they lived in it (the
// compiler's inlining choices, and so the measured speed, stay the same).
namespace {

// The products' vector type is simd.h's MVec (16-lane zmm with AVX-512, see
// there); the element-wise passes keep simd.h's Vec.

// Register tile: kRows rows x kVecs vectors. 6 x 2 on AVX2 (12 accumulators +
// 2 loaded vectors + 1 broadcast of 16 ymm registers, the forward's tile);
// 6 x 4 with 32 registers (AVX-512 zmm, NEON): 24 accumulators + 4 + 1.
constexpr int kRows = 6;
#if defined(__AVX512F__) || defined(FLASH_METAL_SIMD_NEON)
constexpr int kVecs = 4;
#else
constexpr int kVecs = 2;
#endif
constexpr int kCols = kVecs * kMW;
// Column granularity of every packed operand: one micro-kernel vector (a
// multiple of simd.h's kW, so the element-wise passes divide it too).
constexpr int64_t kG = kMW;
static_assert(kG % kW == 0, "micro-kernel vectors must hold whole Vecs");

// Queries and keys per block. Why 96 x 96: multiples of the 6-row tile and of
// the 16-float panel, as in the forward; the two score blocks are 36 KB each
// and one block's operands (K, V rows, Q, dO in two layouts, dK/dV/dQ slices)
// stay within the 2 MB L2.
#ifndef FLASH_METAL_CPU_BWD_BLOCK_Q
#define FLASH_METAL_CPU_BWD_BLOCK_Q 96
#endif
#ifndef FLASH_METAL_CPU_BWD_BLOCK_K
#define FLASH_METAL_CPU_BWD_BLOCK_K 96
#endif
constexpr int64_t kBlockQ = FLASH_METAL_CPU_BWD_BLOCK_Q;
constexpr int64_t kBlockK = FLASH_METAL_CPU_BWD_BLOCK_K;
static_assert(kBlockQ % kG == 0, "query block must be a whole number of vectors");
// Row padding of packed row-major operands (floats). Why 16: a power-of-two
// head dim would otherwise put every row of a block in the same few L1 sets
// (the forward measured this on K); 16 floats keeps rows 64-byte aligned.
constexpr int64_t kRowPad = 16;

// ---------------------------------------------------------------- micro-kernel
// C[r][0 .. NV*kMW) (+)= sum_k A(r, k) * B[k][0 .. NV*kMW)   for r < MR.
// A(r, k) = a[r * lda + k] (row-major) or a[k * lda + r] (ATrans); B rows are
// ldb apart and read as vectors. With Acc the block's product is summed from
// zero and added to C once (a blocked sum, as the forward's O += P.V): C is
// rounded once per block, not once per row of A's K dimension, which
// continuing the fma chain from C's old value would do.
template <int MR, int NV, bool ATrans, bool Acc>
inline void mm_tile(const float* a, int64_t lda, const float* b, int64_t ldb, int64_t K, float* c, int64_t ldc) {
  MVec acc[MR][NV];
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v] = MVec::zero();
  for (int64_t k = 0; k < K; ++k) {
    MVec bv[NV];
    for (int v = 0; v < NV; ++v) bv[v] = MVec::load(b + k * ldb + v * kMW);
    for (int r = 0; r < MR; ++r) {
      const MVec x = MVec::broadcast(ATrans ? a[k * lda + r] : a[r * lda + k]);
      for (int v = 0; v < NV; ++v) acc[r][v] = fmadd(x, bv[v], acc[r][v]);
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < NV; ++v) {
      float* cp = c + r * ldc + v * kMW;
      (Acc ? MVec::load(cp) + acc[r][v] : acc[r][v]).store(cp);
    }
}

// All M rows of one column panel of NV vectors.
template <int NV, bool ATrans, bool Acc>
inline void mm_panel(const float* a, int64_t lda, const float* b, int64_t ldb, int64_t K, int64_t M, float* c,
                     int64_t ldc) {
  const int64_t row_step = ATrans ? 1 : lda;  // A's offset from one row to the next
  int64_t r = 0;
  for (; r + kRows <= M; r += kRows)
    mm_tile<kRows, NV, ATrans, Acc>(a + r * row_step, lda, b, ldb, K, c + r * ldc, ldc);
  const float* ar = a + r * row_step;
  float* cr = c + r * ldc;
  switch (M - r) {
    case 5: mm_tile<5, NV, ATrans, Acc>(ar, lda, b, ldb, K, cr, ldc); break;
    case 4: mm_tile<4, NV, ATrans, Acc>(ar, lda, b, ldb, K, cr, ldc); break;
    case 3: mm_tile<3, NV, ATrans, Acc>(ar, lda, b, ldb, K, cr, ldc); break;
    case 2: mm_tile<2, NV, ATrans, Acc>(ar, lda, b, ldb, K, cr, ldc); break;
    case 1: mm_tile<1, NV, ATrans, Acc>(ar, lda, b, ldb, K, cr, ldc); break;
    default: break;
  }
}

// C (M x ncols) (+)= A (M x K) . B (K x ncols), ncols a multiple of kMW.
// Column panels outermost: one B panel (K x 16 floats, 6 KB at K = 96) stays
// in L1 while A's rows stream past it.
template <bool ATrans, bool Acc>
void matmul(const float* a, int64_t lda, const float* b, int64_t ldb, int64_t K, int64_t M, int64_t ncols, float* c,
            int64_t ldc) {
  int64_t x = 0;
  for (; x + kCols <= ncols; x += kCols) mm_panel<kVecs, ATrans, Acc>(a, lda, b + x, ldb, K, M, c + x, ldc);
  switch ((ncols - x) / kMW) {
    case 3: mm_panel<3, ATrans, Acc>(a, lda, b + x, ldb, K, M, c + x, ldc); break;
    case 2: mm_panel<2, ATrans, Acc>(a, lda, b + x, ldb, K, M, c + x, ldc); break;
    case 1: mm_panel<1, ATrans, Acc>(a, lda, b + x, ldb, K, M, c + x, ldc); break;
    default: break;
  }
}

// ---------------------------------------------------------------- packing
// One head-dim side of the call: the width D, rounded up to whole vectors
// (Dp), and the packed rows' stride ld = Dp + kRowPad.
struct Width {
  int64_t D = 0, Dp = 0, ld = 0;
  Width() = default;
  explicit Width(int64_t d) : D(d), Dp(round_up(d, kG)), ld(round_up(d, kG) + kRowPad) {}
};

// Rows [0, n) of a (B, H, N, D) head -> float32 rows w.ld apart, zero-padded to w.Dp.
template <typename T>
void pack_rows(const T* src, const int64_t* st, int64_t n, const Width& w, float* dst) {
  for (int64_t j = 0; j < n; ++j) {
    float* out = dst + j * w.ld;
    convert_row(src + j * st[2], st[3], w.D, out);
    std::fill(out + w.D, out + w.Dp, 0.0f);
  }
}

// Rows [0, n) -> transposed float32 block dst[d * kBlockQ + i] = mul * x[i][d],
// columns n .. round_up(n, kG) zero.
template <typename T>
void pack_transposed(const T* src, const int64_t* st, int64_t n, float mul, const Width& w, float* dst) {
  float row[kMaxHeadDim];
  for (int64_t i = 0; i < n; ++i) {
    convert_row(src + i * st[2], st[3], w.D, row);
    for (int64_t d = 0; d < w.D; ++d) dst[d * kBlockQ + i] = row[d] * mul;
  }
  const int64_t ncols = round_up(n, kG);
  for (int64_t d = 0; d < w.D; ++d) std::fill(dst + d * kBlockQ + n, dst + d * kBlockQ + ncols, 0.0f);
}

}  // namespace
}  // namespace bwd
}  // namespace cpu
}  // namespace flash_metal
