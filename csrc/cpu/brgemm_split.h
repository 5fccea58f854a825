// float16 on the bfloat16 matrix units (issue 39): the forward's column form
// with every float16 operand split exactly into two bfloat16s.
//
// Why: a Xeon with AMX-BF16 but not AMX-FP16 (Sapphire Rapids, Emerald
// Rapids) multiplies float16 only on its FMA units, in float32, at 1/16 of
// the tile rate; SDPA does the same there. A float16 x is 11 significant
// bits; hi = bfloat16(x) keeps 8 and lo = bfloat16(x - hi) the other 3 or
// fewer, so x = hi + lo exactly (x - hi is exact in float32, and needs no
// more than bfloat16's 8 bits). Then, for two float16 operands,
//   a . b = ah.bh + al.bh + ah.bl + al.bl
// exactly, each product summed in float32 by the tile units: the scores are
// PyTorch's float32 scores of the float16 inputs. All four terms are kept
// for the scores (dropping al.bl, below 2^-16 of each product, cost the log-
// sum-exp its float32 accuracy: 1.2e-5 against PyTorch's 1.6e-7 in
// test_nonfinite). P (float32 from the softmax) splits the same way into 16
// bits, more than the float16 P that PyTorch's float16 attention rounds to,
// and P.V keeps three terms (the fourth is 2^-18 of an output rounded to 2^-11).
//   S^T  (nk x ncols) = [Kh | Kl | Kh' | Kl] (nk x 4Dp) . [Qh ; Qh' ; Ql ; Ql] (4Dp x ncols)   one call
// (' : infinities made 0 in the copy that meets the other's lo: finite16).
//   O^T (Dv x ncols) += Vh^T . Ph + Vl^T . Ph + Vh^T . Pl                        three calls
// The three P.V calls share one kernel (same shape), so they pay no tile
// reconfiguration between them. K' = [Kh | Kl | Kh' | Kl] and the two halves of
// V^T are built once per call (four and two times the size of K and V in
// bfloat16: O(N)), Q' per query block. Measured on the AMX Xeon: see
// docs/benchmarks.md ("float16 as bfloat16 pairs").
#pragma once

#include "brgemm_cols.h"
#include "common.h"
#include "matrix_units.h"
#include "transpose16.h"

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

namespace flash_metal {
namespace cpu {
namespace fwd {
namespace {

using B16 = c10::BFloat16;

// x = hi + lo, both bfloat16, exactly for any float16 x.
// An infinity is hi = inf, lo = 0 (inf - inf would make lo a NaN); a NaN stays NaN in both.
inline void split16(float x, B16* hi, B16* lo) {
  *hi = static_cast<B16>(x);
  *lo = static_cast<B16>(std::isinf(x) ? 0.0f : x - static_cast<float>(*hi));
}

// n values of a float16 row (contiguous) -> hi[0..n), lo[0..n); zeros in
// [n, np). 16 at a time on AVX-512 BF16 (vcvtph2ps, vcvtneps2bf16, the
// remainder in float32 exactly), else element by element.
template <typename T>
inline void split_row(const T* src, int64_t n, int64_t np, B16* hi, B16* lo) {
  int64_t d = 0;
#if defined(FLASH_METAL_COLS_AVX512_BF16)
  if (std::is_same<T, c10::Half>::value) {
    for (; d < np; d += 16) {
      const int64_t m = std::min<int64_t>(16, np - d), live = std::max<int64_t>(0, std::min<int64_t>(16, n - d));
      const __m512 x = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(static_cast<__mmask16>((1u << live) - 1), src + d));
      const __m256i h = (__m256i)_mm512_cvtneps_pbh(x);
      const __m512 hf = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
      const __mmask16 fin = _mm512_cmp_ps_mask(_mm512_abs_ps(x), _mm512_set1_ps(INFINITY), _CMP_NEQ_UQ);  // not +-inf
      const __m256i l = (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_sub_ps(fin, x, hf));
      const __mmask16 store = static_cast<__mmask16>((1u << m) - 1);
      _mm256_mask_storeu_epi16(hi + d, store, h);
      _mm256_mask_storeu_epi16(lo + d, store, l);
    }
    return;
  }
#endif
  for (; d < np; ++d) {
    hi[d] = lo[d] = B16(0.0f);
    if (d < n) split16(static_cast<float>(src[d]), hi + d, lo + d);
  }
}

// dst[0..n) = src with every infinity made 0. The copy that multiplies the
// other operand's lo: a lo is often exactly 0, and inf * 0 would make the
// score a NaN where a = +-inf, b finite gives +-inf (ah . bh carries it).
inline void finite16(const B16* src, int64_t n, B16* dst) {
  int64_t d = 0;
#if defined(FLASH_METAL_COLS_AVX512_BF16)
  for (; d < n; d += 32) {
    const __mmask32 m = static_cast<__mmask32>(n - d >= 32 ? ~0u : (1u << (n - d)) - 1);
    const __m512i v = _mm512_maskz_loadu_epi16(m, src + d);
    const __mmask32 inf =
        _mm512_cmpeq_epi16_mask(_mm512_and_si512(v, _mm512_set1_epi16(0x7FFF)), _mm512_set1_epi16(0x7F80));
    _mm512_mask_storeu_epi16(dst + d, m, _mm512_maskz_mov_epi16(static_cast<__mmask32>(~inf), v));
  }
#endif
  for (; d < n; ++d) dst[d] = std::isinf(static_cast<float>(src[d])) ? B16(0.0f) : src[d];
}

// The call's split operands: K' rows (B, Hk, Nk, 4Dp), [Kh | Kl | Kh' | Kl] with
// zero pad features (Kh' = Kh with infinities 0: finite16), and V^T's halves (B, Hk, Dv, vt_ld) as build_vt lays V^T.
struct SplitOperands {
  AlignedVec<B16> kx, vth, vtl;
  int64_t kx_ld = 0;  // 4 * Dp
  int64_t k_rows = 0;  // Nk of the K tensor (rows per (b, kv head))
};

template <typename T>
void build_split_operands(const T* k, const int64_t* ks, const T* v, const int64_t* vs, int64_t B, int64_t Hk,
                          int64_t Nk, int64_t D, int64_t Dv, int64_t vt_ld, SplitOperands* so) {
  const int64_t Dp = round_up(D, 2);
  so->kx_ld = 4 * Dp;
  so->k_rows = Nk;
  so->kx.resize(B * Hk * Nk * so->kx_ld, /*zero=*/false);
  so->vth.resize(B * Hk * Dv * vt_ld, /*zero=*/false);
  so->vtl.resize(B * Hk * Dv * vt_ld, /*zero=*/false);
  at::parallel_for(0, B * Hk * Nk, 256, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int64_t bh = r / Nk, j = r % Nk;
      const T* src = k + (bh / Hk) * ks[0] + (bh % Hk) * ks[1] + j * ks[2];
      B16* dst = so->kx.data() + r * so->kx_ld;
      if (ks[3] == 1) {
        split_row(src, D, Dp, dst, dst + Dp);
        finite16(dst, Dp, dst + 2 * Dp);
        std::copy(dst + Dp, dst + 2 * Dp, dst + 3 * Dp);
        continue;
      }
      for (int64_t d = 0; d < Dp; ++d) {
        B16 hi(0.0f), lo(0.0f);
        if (d < D) split16(static_cast<float>(src[d * ks[3]]), &hi, &lo);
        dst[d] = hi;
        dst[Dp + d] = lo;
        dst[2 * Dp + d] = std::isinf(static_cast<float>(hi)) ? B16(0.0f) : hi;
        dst[3 * Dp + d] = lo;
      }
    }
  });
  const int64_t slices = (Dv + 15) / 16;
  at::parallel_for(0, B * Hk * slices, 1, [&](int64_t begin, int64_t end) {
    for (int64_t w = begin; w < end; ++w) {
      const int64_t bh = w / slices, d0 = (w % slices) * 16, d1 = std::min(Dv, d0 + 16);
      const T* src = v + (bh / Hk) * vs[0] + (bh % Hk) * vs[1];
      B16* hi = so->vth.data() + bh * Dv * vt_ld;
      B16* lo = so->vtl.data() + bh * Dv * vt_ld;
#if defined(FLASH_METAL_COLS_AVX512_BF16)
      if (std::is_same<T, c10::Half>::value && vs[3] == 1) {
        // 16 keys x 16 features as float32, transposed in registers, each feature's 16 keys split and stored
        const __mmask16 dm = static_cast<__mmask16>((1u << (d1 - d0)) - 1);
        for (int64_t j0 = 0; j0 < Nk; j0 += 16) {
          const int64_t jn = std::min<int64_t>(16, Nk - j0);
          __m512 r[16];
          for (int64_t i = 0; i < 16; ++i)
            r[i] = i < jn ? _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(dm, src + (j0 + i) * vs[2] + d0)) : _mm512_setzero_ps();
          transpose16x16_ps(r);
          const __mmask16 jm = static_cast<__mmask16>((1u << jn) - 1);
          for (int64_t i = 0; i < d1 - d0; ++i) {
            const __m256i h = (__m256i)_mm512_cvtneps_pbh(r[i]);
            const __m512 hf = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
            _mm256_mask_storeu_epi16(hi + (d0 + i) * vt_ld + j0, jm, h);
            const __mmask16 fin = _mm512_cmp_ps_mask(_mm512_abs_ps(r[i]), _mm512_set1_ps(INFINITY), _CMP_NEQ_UQ);
            _mm256_mask_storeu_epi16(lo + (d0 + i) * vt_ld + j0, jm,
                                     (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_sub_ps(fin, r[i], hf)));
          }
        }
      } else
#endif
        for (int64_t j0 = 0; j0 < Nk; j0 += 16)
          for (int64_t d = d0; d < d1; ++d)
            for (int64_t j = j0; j < std::min(Nk, j0 + 16); ++j)
              split16(static_cast<float>(src[j * vs[2] + d * vs[3]]), hi + d * vt_ld + j, lo + d * vt_ld + j);
      for (int64_t d = d0; d < d1; ++d) {
        std::fill(hi + d * vt_ld + Nk, hi + (d + 1) * vt_ld, B16(0.0f));
        std::fill(lo + d * vt_ld + Nk, lo + (d + 1) * vt_ld, B16(0.0f));
      }
    }
  });
}

// Q' = [Qh ; Qh' ; Ql ; Ql] (4Dp rows; Qh' = Qh with infinities 0, as it multiplies Kl) of one sub-block in the plain VNNI layout of
// col_load_q: section s's feature d at row s * Dp + d (Dp even, so each
// section starts on a pair).
template <typename T, typename QOff>
void col_load_q_split(const T* q, int64_t d_stride, const QOff& q_off, int64_t nrows, int64_t ncols, int64_t D,
                      int64_t Dp, B16* dst, Vnni vnni, B16* stage) {
#if defined(FLASH_METAL_COLS_AVX512_BF16)
  // Contiguous features: each row split into stage (hi rows, then lo rows, Dp apart), then each
  // section packed by col_load_q's register transposes (section s starts at row s * Dp).
  if (d_stride == 1) {
    for (int64_t c = 0; c < nrows; ++c) {
      split_row(q + q_off(c), D, Dp, stage + c * Dp, stage + (kBlockQ + c) * Dp);
      finite16(stage + c * Dp, Dp, stage + (2 * kBlockQ + c) * Dp);
    }
    const auto hi_off = [&](int64_t c) { return c * Dp; };
    const auto lo_off = [&](int64_t c) { return (kBlockQ + c) * Dp; };
    const auto fin_off = [&](int64_t c) { return (2 * kBlockQ + c) * Dp; };
    col_load_q(stage, 1, hi_off, nrows, ncols, Dp, Dp, dst, vnni);
    col_load_q(stage, 1, fin_off, nrows, ncols, Dp, Dp, dst + Dp * kBlockQ, vnni);
    col_load_q(stage, 1, lo_off, nrows, ncols, Dp, Dp, dst + 2 * Dp * kBlockQ, vnni);
    col_load_q(stage, 1, lo_off, nrows, ncols, Dp, Dp, dst + 3 * Dp * kBlockQ, vnni);
    return;
  }
#endif
  (void)stage;
  const auto at = [&](int64_t row, int64_t c) -> B16& { return dst[(row / 2) * 2 * kBlockQ + 2 * c + row % 2]; };
  poison_if_emulated(dst, 4 * Dp * kBlockQ, vnni);
  for (int64_t p = 0; p < 4 * Dp / 2; ++p)
    std::fill(dst + p * 2 * kBlockQ + 2 * nrows, dst + p * 2 * kBlockQ + 2 * ncols, B16(0.0f));
  for (int64_t c = 0; c < nrows; ++c) {
    const T* src = q + q_off(c);
    for (int64_t d = 0; d < Dp; ++d) {
      B16 hi(0.0f), lo(0.0f);
      if (d < D) split16(static_cast<float>(src[d * d_stride]), &hi, &lo);
      at(d, c) = hi;
      at(Dp + d, c) = std::isinf(static_cast<float>(hi)) ? B16(0.0f) : hi;  // times Kl (see finite16)
      at(2 * Dp + d, c) = lo;
      at(3 * Dp + d, c) = lo;
    }
  }
}

}  // namespace
}  // namespace fwd
}  // namespace cpu
}  // namespace flash_metal
