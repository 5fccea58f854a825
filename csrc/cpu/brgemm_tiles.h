// The forward's tile products on ATen's brgemm (issue 22; the path and its
// choice are described in matrix_units.h). Internal to attention_cpu.cpp,
// which keeps the driver and the online softmax; these routines replace only
// its two float32 micro-kernel calls for 16-bit inputs:
//   ST (nk x ncols) = K_blk (nk x D) . QT (D x ncols)    K read in place,
//       QT the query block in the input dtype, unscaled (the scale goes on
//       the float32 scores after, so Q is not rounded twice);
//   O (nrows x Dv)  = alpha * O + P^T (nrows x nk) . V_blk (nk x Dv)
//       with P rounded to the input dtype (FlashAttention's choice; the
//       softmax's running sum l keeps the float32 probabilities).
// With VNNI (mb.vnni Aten on AMX, or Emulated, the test seam of
// matrix_units.h): QT and V are packed pair-interleaved (pack_b) once per
// item / key block, and the K dimensions of both products are padded to an
// even count with zero rows (D_qk odd: K is copied; nk odd: P gets a zero
// column, which meets the next, finite V row or the zero pad row). Emulated,
// the staging buffers are NaN-poisoned before each fill, so a pad left
// unzeroed shows in the tests' outputs.
// The idea of running FlashAttention's two products through brgemm with a
// scalar softmax between them is ATen's CPU flash attention
// (aten/src/ATen/native/cpu/FlashAttentionKernel.cpp); the layout here is
// this kernel's own (transposed scores, keys x queries).
#pragma once

#include "common.h"
#include "forward_tiles.h"
#include "matrix_units.h"
#include "round_tiles.h"
#include "simd.h"

#include <algorithm>
#include <cstdint>
#include <vector>

namespace flash_metal {
namespace cpu {
namespace fwd {
namespace {

// Leading dimension of the rounded P^T block (one row per query, one column
// per key). Why kBlockK rounded up to even: the VNNI path pads an odd key
// count to even, and no other constraint applies (192 bytes at 96 keys).
constexpr int64_t kPtLd = (kBlockK + 1) / 2 * 2;
// Why: a packed QT of ncols <= kBlockQ columns takes Dp x round_up(ncols, 16)
// elements (matrix_units.h), which must fit the Dp x kBlockQ slot.
static_assert(kBlockQ % 16 == 0, "packed QT blocks are padded to 16 columns");

// Per-thread buffers of the brgemm path, in the input dtype T (value-
// initialised: zero, so the pads are zero).
template <typename T>
struct MxBuffers {
  Vnni vnni;
  int64_t Dp;            // D_qk, rounded up to even with VNNI
  AlignedVec<T> qt;     // kMaxSub x Dp x kBlockQ: each sub-block's QT (plain, or VNNI with N = ncols)
  AlignedVec<T> stage;  // Dp x kBlockQ: QT before its VNNI pack
  AlignedVec<T> kb;     // max(kBlockK, 256) x Dp: K rows when they cannot be read in place (256: the
                         // column form's largest block, brgemm_cols.h)
  AlignedVec<T> vb;     // (kBlockK + 1) x Dv: V rows when they cannot be read in place (+1: the even pad)
  AlignedVec<T> vp;     // the same, VNNI-packed (column blocks of <= 64, matrix_units.h)
  AlignedVec<T> pt;     // kBlockQ x kPtLd: P^T rounded to T
  MxBuffers(int64_t max_sub, int64_t D, int64_t Dv, Vnni vnni_)
      : vnni(vnni_), Dp(packs(vnni_) ? round_up(D, 2) : D), qt(max_sub * Dp * kBlockQ),
        stage(packs(vnni_) ? Dp * kBlockQ : 0), kb(std::max<int64_t>(kBlockK, 256) * Dp), vb((kBlockK + 1) * Dv),
        vp(packs(vnni_) ? packed_elems(kBlockK + 1, Dv) : 0), pt(kBlockQ * kPtLd) {}
};

// One sub-block's query rows -> QT (Dp x ncols) in T, unscaled: column c is
// row c % nq of head h0 + c / nq (q_off(c) gives its element offset);
// columns [nrows, ncols) and rows [D, Dp) zero. With vnni, packed into dst.
template <typename T, typename QOff>
void mx_load_q(const T* q, int64_t d_stride, const QOff& q_off, int64_t nrows, int64_t ncols, int64_t D,
               MxBuffers<T>& mb, T* dst) {
  T* qt = packs(mb.vnni) ? mb.stage.data() : dst;
  poison_if_emulated(qt, mb.Dp * kBlockQ, mb.vnni);
  for (int64_t d = 0; d < mb.Dp; ++d) std::fill(qt + d * kBlockQ + nrows, qt + d * kBlockQ + ncols, T(0.0f));
  for (int64_t d = D; d < mb.Dp; ++d) std::fill(qt + d * kBlockQ, qt + d * kBlockQ + nrows, T(0.0f));
  for (int64_t c = 0; c < nrows; ++c) {
    const T* src = q + q_off(c);
    for (int64_t d = 0; d < D; ++d) qt[d * kBlockQ + c] = src[d * d_stride];
  }
  if (packs(mb.vnni)) pack_b(mb.Dp, ncols, kBlockQ, c10::CppTypeToScalarType<T>::value, qt, dst, mb.vnni);
}

// The K block's A operand: in place when its features are contiguous (and,
// with vnni, D is even), else copied into mb.kb (rows Dp apart, zero pad).
template <typename T>
const T* mx_k_operand(const T* k, int64_t row_stride, int64_t d_stride, int64_t nk, int64_t D, MxBuffers<T>& mb,
                      int64_t* lda) {
  if (d_stride == 1 && D == mb.Dp) {
    *lda = row_stride;
    return k;
  }
  poison_if_emulated(mb.kb.data(), static_cast<int64_t>(mb.kb.size()), mb.vnni);
  for (int64_t j = 0; j < nk; ++j) {
    T* dst = mb.kb.data() + j * mb.Dp;
    for (int64_t d = 0; d < D; ++d) dst[d] = k[j * row_stride + d * d_stride];
    std::fill(dst + D, dst + mb.Dp, T(0.0f));
  }
  *lda = mb.Dp;
  return mb.kb.data();
}

// The V block's B operand: in place without vnni when its features are
// contiguous; else copied (nk rows, one zero row after them when nk is
// odd) and, with vnni, packed.
template <typename T>
const T* mx_v_operand(const T* v, int64_t row_stride, int64_t d_stride, int64_t nk, int64_t Dv, MxBuffers<T>& mb,
                      int64_t* ldv) {
  if (!packs(mb.vnni) && d_stride == 1) {
    *ldv = row_stride;
    return v;
  }
  // Packed straight from V's rows (the pack reads any ld_in >= N, matrix_units.h): no staging copy,
  // which was a scalar copy of every K/V block for every query item (issue 39's AMX profile).
  // An odd nk needs the zero pad row, so it is staged below.
  if (d_stride == 1 && nk % 2 == 0) {
    *ldv = Dv;
    pack_b(nk, Dv, row_stride, c10::CppTypeToScalarType<T>::value, v, mb.vp.data(), mb.vnni);
    return mb.vp.data();
  }
  poison_if_emulated(mb.vb.data(), static_cast<int64_t>(mb.vb.size()), mb.vnni);
  for (int64_t j = 0; j < nk; ++j)
    for (int64_t d = 0; d < Dv; ++d) mb.vb[j * Dv + d] = v[j * row_stride + d * d_stride];
  const int64_t nkp = round_up(nk, 2);
  if (nkp > nk) std::fill(mb.vb.data() + nk * Dv, mb.vb.data() + nkp * Dv, T(0.0f));
  *ldv = Dv;
  if (!packs(mb.vnni)) return mb.vb.data();
  pack_b(nkp, Dv, Dv, c10::CppTypeToScalarType<T>::value, mb.vb.data(), mb.vp.data(), mb.vnni);
  return mb.vp.data();
}

// ST (nk x ncols, row stride kBlockQ) = scale * K . QT, in base-2 units.
template <typename T>
void mx_scores(const T* k, int64_t lda, const T* qt, int64_t nk, int64_t ncols, int64_t D, float scale_log2,
               const MxBuffers<T>& mb, float* st) {
  const bool vnni = packs(mb.vnni);
  tile_gemm(nk, ncols, vnni ? mb.Dp : D, lda, vnni ? ncols : kBlockQ, kBlockQ, /*add_c=*/false, k, qt, st, mb.vnni);
  const Vec s = Vec::broadcast(scale_log2);
  for (int64_t j = 0; j < nk; ++j) {
    float* row = st + j * kBlockQ;
    for (int64_t c = 0; c < ncols; c += kW) (s * Vec::load(row + c)).store(row + c);
  }
}

// O (nrows x Dv, row stride ldo) = alpha * O + round_T(P)^T . V, P the
// transposed float32 probabilities (nk x >= nrows, row stride kBlockQ), in
// two steps (the phase clock times them apart): mx_pv_round rounds and
// transposes P and scales O, mx_pv_product adds the product.
template <typename T>
void mx_pv_round(const float* p, int64_t nk, int64_t nrows, int64_t Dv, const float* alpha, float* o, int64_t ldo,
                 MxBuffers<T>& mb) {
  const int64_t nkp = packs(mb.vnni) ? round_up(nk, 2) : nk;
  T* pt = mb.pt.data();
  poison_if_emulated(pt, nrows * kPtLd, mb.vnni);
  transpose_round(p, kBlockQ, nk, nrows, pt, kPtLd);  // rows >= nrows may be written, never read
  for (int64_t r = 0; r < nrows; ++r) {
    T* row = pt + r * kPtLd;
    if (nkp > nk) row[nk] = T(0.0f);
    const float a = alpha[r];
    float* orow = o + r * ldo;
    for (int64_t d = 0; d < Dv; ++d) orow[d] *= a;
  }
}
template <typename T>
void mx_pv_product(int64_t nk, int64_t nrows, const T* v, int64_t ldv, int64_t Dv, float* o, int64_t ldo,
                   MxBuffers<T>& mb) {
  const int64_t nkp = packs(mb.vnni) ? round_up(nk, 2) : nk;
  tile_gemm(nrows, Dv, nkp, kPtLd, ldv, ldo, /*add_c=*/true, mb.pt.data(), v, o, mb.vnni);
}

}  // namespace
}  // namespace fwd
}  // namespace cpu
}  // namespace flash_metal
