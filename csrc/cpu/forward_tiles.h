// The CPU forward's register-tiled micro-kernels and packing routines
// (moved unchanged from attention_cpu.cpp, which keeps the driver: work
// items, the online softmax and the thread fan-out). Internal to that file.
// Q.K^T runs over D_qk (q's and k's head dim) and P.V over D_v (v's): the
// routines take the width they walk as an argument, so one call may use two.
#pragma once

#include "common.h"
#include "simd.h"

#include <algorithm>
#include <cstdint>
#include <type_traits>

namespace flash_metal {
namespace cpu {
namespace fwd {
// Anonymous within: the one file that includes this header compiles these
// with internal linkage and no `inline` hint, as when they lived in it (the
// compiler's inlining choices, and so the measured speed, stay the same).
namespace {

// ---------------------------------------------------------------- tiling
// Register tile of both micro-kernels: kTileRows rows x kTileVecs vectors of
// simd.h's MVec. Why 6 x 2 on AVX2: 12 accumulators + 2 loaded vectors + 1
// broadcast = 15 of the 16 ymm registers, the classic sgemm tile. NEON has 32
// registers of 4 lanes, so 6 x 4 (24 accumulators) keeps the same 16-float
// column width. AVX-512 also has 32 registers, of 16 lanes: 6 x 4 zmm, a
// 64-float column panel (the backward's tile). Measured against the 6 x 2
// ymm tile on this 2-core AVX-512 Xeon (benchmarks.llm --quick, float32
// forward vs torch SDPA, two interleaved runs each, machine shared and
// noisy): 1x8x1024x64 0.64-0.70x -> 1.01x, causal 0.73x -> 1.00x;
// 2x4x512x128 0.76x -> 1.08-1.18x, causal ~1.0x -> 1.25-1.33x; GQA 1x8:2
// 0.67-0.69x -> 1.00x, causal 0.76x -> 1.02-1.05x; half/bfloat16 prefill
// gained as much, decode unchanged or better.
constexpr int kTileRows = 6;
#if defined(FLASH_METAL_SIMD_NEON) || defined(__AVX512F__)
constexpr int kTileVecs = 4;
#else
constexpr int kTileVecs = 2;
#endif
constexpr int kTileCols = kTileVecs * kMW;  // 16 floats on AVX2 and NEON, 64 on AVX-512
// Column granularity of the score block and of the packed V / O rows: one
// micro-kernel vector (kW on AVX2 and NEON, 16 on AVX-512).
constexpr int64_t kG = kMW;

// Queries per query block and keys per key block. Why 96 x 96: both are
// multiples of the 6-row register tile (no 4-row tail tiles in Q.K^T or P.V)
// and 96 is six 16-wide column panels (64 + 32 with AVX-512). The score block is 36 KB, about L1;
// measured single-thread against 64 x 64 on this Zen 3 machine: +5-8% at
// (2048, D=64/128), e.g. 71.9 -> 76.9 GFLOP/s at D = 128 (64 x 72, 96 x 72
// and 48 x 72 fell in between). Override with -DFLASH_METAL_CPU_BLOCK_Q/K
// for tuning on other CPUs.
#ifndef FLASH_METAL_CPU_BLOCK_Q
#define FLASH_METAL_CPU_BLOCK_Q 96
#endif
constexpr int64_t kBlockQ = FLASH_METAL_CPU_BLOCK_Q;
#ifndef FLASH_METAL_CPU_BLOCK_K
#define FLASH_METAL_CPU_BLOCK_K 96
#endif
constexpr int64_t kBlockK = FLASH_METAL_CPU_BLOCK_K;
static_assert(kBlockQ % kG == 0, "query block must be a whole number of vectors");



// ---------------------------------------------------------------- micro-kernels
#if defined(__GNUC__) || defined(__clang__)
#define FLASH_METAL_ALWAYS_INLINE __attribute__((always_inline))
#else
#define FLASH_METAL_ALWAYS_INLINE
#endif

// ST[r][c..c+NV*kMW) = sum_d K[r][d] * QT[d][c..]   for r < MR.
// K is a packed row tile: k[d * ks + r] (ks >= MR: the tile's packed height),
// so the MR broadcasts of one step read consecutive floats. QT: row stride ldq.
// RowMajor: K read in place instead, row r at k + r * ks (decode path).
template <int MR, int NV, bool RowMajor>
inline void qk_tile(const float* k, int64_t ks, const float* qt, int64_t ldq, int64_t D, float* st,
                    int64_t lds) {
  MVec acc[MR][NV];
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v] = MVec::zero();
  for (int64_t d = 0; d < D; ++d) {
    MVec b[NV];
    for (int v = 0; v < NV; ++v) b[v] = MVec::load(qt + d * ldq + v * kMW);
    for (int r = 0; r < MR; ++r) {
      const MVec a = MVec::broadcast(RowMajor ? k[r * ks + d] : k[d * ks + r]);
      for (int v = 0; v < NV; ++v) acc[r][v] = fmadd(a, b[v], acc[r][v]);
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v].store(st + r * lds + v * kMW);
}

// All key rows of one column panel of NV vectors.
// packed_rows: rows in the packed block, or, for RowMajor, K's row stride.
template <int NV, bool RowMajor>
inline void qk_panel(const float* k, int64_t nk, int64_t packed_rows, const float* qt, int64_t ldq, int64_t D,
                     float* st, int64_t lds) {
  const int64_t tile_step = RowMajor ? packed_rows : D;  // floats from one row tile to the next, per row
  int64_t r = 0;
  for (; r + kTileRows <= nk; r += kTileRows)
    qk_tile<kTileRows, NV, RowMajor>(k + r * tile_step, RowMajor ? packed_rows : kTileRows, qt, ldq, D,
                                     st + r * lds, lds);
  const float* kr = k + r * tile_step;
  const int64_t ks = RowMajor ? packed_rows : std::min<int64_t>(kTileRows, packed_rows - r);
  float* sr = st + r * lds;
  switch (nk - r) {
    case 5: qk_tile<5, NV, RowMajor>(kr, ks, qt, ldq, D, sr, lds); break;
    case 4: qk_tile<4, NV, RowMajor>(kr, ks, qt, ldq, D, sr, lds); break;
    case 3: qk_tile<3, NV, RowMajor>(kr, ks, qt, ldq, D, sr, lds); break;
    case 2: qk_tile<2, NV, RowMajor>(kr, ks, qt, ldq, D, sr, lds); break;
    case 1: qk_tile<1, NV, RowMajor>(kr, ks, qt, ldq, D, sr, lds); break;
    default: break;
  }
}

// ST (nk x ncols) = K (nk x D) . QT (D x ncols); ncols a multiple of kG.
// Column panels outermost: one QT panel (D x kTileCols floats, 16 KB at
// D = 256 with 16 columns, 32 KB at D = 128 with AVX-512's 64) stays in L1
// while the key rows stream past it.
template <bool RowMajor>
void qk_block(const float* k, int64_t nk, int64_t packed_rows, const float* qt, int64_t ldq, int64_t ncols, int64_t D,
              float* st, int64_t lds) {
  int64_t c = 0;
  for (; c + kTileCols <= ncols; c += kTileCols) qk_panel<kTileVecs, RowMajor>(k, nk, packed_rows, qt + c, ldq, D, st + c, lds);
  switch ((ncols - c) / kMW) {
#if defined(FLASH_METAL_SIMD_NEON) || defined(__AVX512F__)
    case 3: qk_panel<3, RowMajor>(k, nk, packed_rows, qt + c, ldq, D, st + c, lds); break;
    case 2: qk_panel<2, RowMajor>(k, nk, packed_rows, qt + c, ldq, D, st + c, lds); break;
#endif
    case 1: qk_panel<1, RowMajor>(k, nk, packed_rows, qt + c, ldq, D, st + c, lds); break;
    default: break;
  }
}

// O[r][c..] = alpha[r] * O[r][c..] + sum_j P[j][r] * V[j][c..]   for r < MR, NV vectors of columns.
// P is the transposed probability block (stride ldp), V rows have stride ldv.
// Always inlined: with the issue 11 options (attention_item's two
// instantiations) the compiler stopped inlining it, and the float32 forward
// measured 3-4% slower than before the options (thread CPU time, 1 thread,
// 1 x 8 x 1024 x 64); inlined, within 2% (the noise of this shared machine).
template <int MR, int NV>
FLASH_METAL_ALWAYS_INLINE inline void pv_tile(const float* p, int64_t ldp, int64_t nk, const float* v, int64_t ldv, const float* alpha,
                    float* o, int64_t ldo) {
  MVec acc[MR][NV];
  for (int r = 0; r < MR; ++r) {
    const MVec a = MVec::broadcast(alpha[r]);
    for (int c = 0; c < NV; ++c) acc[r][c] = a * MVec::load(o + r * ldo + c * kMW);
  }
  for (int64_t j = 0; j < nk; ++j) {
    MVec b[NV];
    for (int c = 0; c < NV; ++c) b[c] = MVec::load(v + j * ldv + c * kMW);
    for (int r = 0; r < MR; ++r) {
      const MVec a = MVec::broadcast(p[j * ldp + r]);
      for (int c = 0; c < NV; ++c) acc[r][c] = fmadd(a, b[c], acc[r][c]);
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < NV; ++c) acc[r][c].store(o + r * ldo + c * kMW);
}

// One column panel of NV vectors, all query rows.
template <int NV>
inline void pv_panel(const float* p, int64_t ldp, int64_t nk, int64_t nq, const float* v, int64_t ldv,
                     const float* alpha, float* o, int64_t ldo) {
  int64_t r = 0;
  for (; r + kTileRows <= nq; r += kTileRows)
    pv_tile<kTileRows, NV>(p + r, ldp, nk, v, ldv, alpha + r, o + r * ldo, ldo);
  switch (nq - r) {
    case 5: pv_tile<5, NV>(p + r, ldp, nk, v, ldv, alpha + r, o + r * ldo, ldo); break;
    case 4: pv_tile<4, NV>(p + r, ldp, nk, v, ldv, alpha + r, o + r * ldo, ldo); break;
    case 3: pv_tile<3, NV>(p + r, ldp, nk, v, ldv, alpha + r, o + r * ldo, ldo); break;
    case 2: pv_tile<2, NV>(p + r, ldp, nk, v, ldv, alpha + r, o + r * ldo, ldo); break;
    case 1: pv_tile<1, NV>(p + r, ldp, nk, v, ldv, alpha + r, o + r * ldo, ldo); break;
    default: break;
  }
}

// O (nq x nvec*kMW) = alpha * O + P^T . V   with P (nk x >= nq) transposed probabilities.
// V is packed panel-major (see pack_v): the panel of columns [c, c + w)
// starts at v + c * panel_rows with row stride w; only its first nk rows are used. Column panels outermost: one V panel
// (nk x kTileCols floats: 6 KB at nk = 96 with 16 columns, 24 KB with 64) stays in L1 while every query row tile
// reuses it.
// row_stride > 0: V is read in place instead (rows row_stride apart; decode path).
void pv_block(const float* p, int64_t ldp, int64_t nk, int64_t panel_rows, int64_t nq, const float* v,
              int64_t row_stride, int64_t nvec, const float* alpha, float* o, int64_t ldo) {
  const bool in_place = row_stride > 0;
  int64_t c = 0;
  for (; c + kTileVecs <= nvec; c += kTileVecs)
    pv_panel<kTileVecs>(p, ldp, nk, nq, in_place ? v + c * kMW : v + c * kMW * panel_rows,
                        in_place ? row_stride : kTileCols, alpha, o + c * kMW, ldo);
  const float* vp = in_place ? v + c * kMW : v + c * kMW * panel_rows;
  const int64_t w = in_place ? row_stride : (nvec - c) * kMW;
  switch (nvec - c) {
#if defined(FLASH_METAL_SIMD_NEON) || defined(__AVX512F__)
    case 3: pv_panel<3>(p, ldp, nk, nq, vp, w, alpha, o + c * kMW, ldo); break;
    case 2: pv_panel<2>(p, ldp, nk, nq, vp, w, alpha, o + c * kMW, ldo); break;
#endif
    case 1: pv_panel<1>(p, ldp, nk, nq, vp, w, alpha, o + c * kMW, ldo); break;
    default: break;
  }
}

// ---------------------------------------------------------------- packing
// Outside decode, K and V blocks are always copied (and converted to float32)
// into small per-thread buffers laid out for the micro-kernels. Reading
// float32 K/V in place was measured slower at D = 128: with a 512-byte row
// stride the rows of a block fall into only 8 of L1's 64 sets and evict one
// another (the V load was the hottest instruction of P.V). Packing costs one
// pass over the block per item (up to 4 x 96 queries) and makes every dtype
// and stride take one path.


// K rows [0, nk) -> float32 rows with stride D + kKRowPad (read by the
// RowMajor Q.K^T tile). The pad keeps power-of-two head dims from putting
// every row of the block into the same few L1 sets. Measured against packing
// K into interleaved 6-row tiles (qk_tile's other layout, whose scalar
// scatter was the hottest packing loop): +3-4% at D = 128, a plain vector
// copy instead of a scatter.
constexpr int64_t kKRowPad = 16;
template <typename T>
void pack_k_rows(const T* k, int64_t row_stride, int64_t dim_stride, int64_t nk, int64_t D, float* dst) {
  for (int64_t j = 0; j < nk; ++j) convert_row(k + j * row_stride, dim_stride, D, dst + j * (D + kKRowPad));
}

// V rows [0, nk) -> column panels of kTileCols (the last one narrower):
// the panel of columns [c, c + w) is dst[c * nk + j * w + (col - c)],
// zero-padded from D to Dp columns.
template <typename T>
void pack_v(const T* v, int64_t row_stride, int64_t dim_stride, int64_t nk, int64_t D, int64_t Dp, float* dst) {
  float row[kMaxHeadDim + kTileCols];
  for (int64_t j = 0; j < nk; ++j) {
    const T* src = v + j * row_stride;
    if (dim_stride == 1 && D == Dp) {
      // Contiguous row of whole vectors: convert straight into the panels.
      // A staging row cost a second pass: pack_v<BFloat16> was 4.9% of the
      // bfloat16 forward's samples (perf, 1 x 2 x 3072 x 128, one thread).
      for (int64_t c = 0; c < Dp; c += kTileCols) {
        const int64_t w = std::min<int64_t>(kTileCols, Dp - c);
        float* out = dst + c * nk + j * w;
        for (int64_t x = 0; x < w; x += kW) load_convert(src + c + x).store(out + x);
      }
      continue;
    }
    convert_row(src, dim_stride, D, row);  // strided or padded: through a zero-padded staging row
    for (int64_t d = D; d < Dp; ++d) row[d] = 0.0f;
    for (int64_t c = 0; c < Dp; c += kTileCols) {
      const int64_t w = std::min<int64_t>(kTileCols, Dp - c);
      float* out = dst + c * nk + j * w;
      for (int64_t x = 0; x < w; x += kW) Vec::load(row + c + x).store(out + x);
    }
  }
}

}  // namespace
}  // namespace fwd
}  // namespace cpu
}  // namespace flash_metal
