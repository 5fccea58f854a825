// The backward's five tile products on the block GEMM (issue 22; the path,
// its choice and the VNNI modes are described in matrix_units.h). Internal
// to attention_backward_cpu.cpp, which keeps the driver and the softmax
// pass; these routines replace its float32 micro-kernel calls for 16-bit
// inputs, per query block (queries i) and key block (keys j):
//   ST  (nk x ncols) = K_blk . QT         reduction D_qk
//   dPT (nk x ncols) = V_blk . dOT        reduction D_v
//   dV  += PT . dO    (nk x D_v)          reduction nq
//   dK  += dST . Q    (nk x D_qk)         reduction nq
//   dQ  += dS . K_blk (nq x D_qk)         reduction nk
// P and dS rounded to the input dtype first (FlashAttention's choice), QT
// unscaled (the scale goes on the float32 scores after, as in the forward).
//
// With VNNI (Aten on AMX, or Emulated, the test seam) every B operand is
// packed pair-interleaved once where it is reused: QT, dOT, Q and dO once
// per query block (for all its key blocks), the K block once per key block
// (for dQ). Every reduction dim is padded to even with zeros on both sides,
// as the forward does: B gets zero rows (QT / dOT rows past an odd D, a zero
// Q / dO row past an odd nq, a zero K row past an odd nk) and A a zero
// column (K / V copied with a zero column when D_qk / D_v is odd; PT / dST a
// zero column at an odd nq, dS at an odd nk). Both sides, so that neither a
// stale value nor an Inf in a buffer can leak into a product; emulated, the
// staging buffers are NaN-poisoned before each fill (matrix_units.h), so a
// pad the code forgets to zero shows in the tests.
// Without VNNI (Off) the operands are read in place where their features
// are contiguous (no pads), as before.
#pragma once

#include "backward_tiles.h"
#include "matrix_units.h"
#include "round_tiles.h"
#include "simd.h"

#include <algorithm>
#include <cstdint>
#include <vector>

namespace flash_metal {
namespace cpu {
namespace bwd {
namespace {

// Why: an odd row count of a block (nq < kBlockQ, nk < kBlockK) is padded
// to even inside the block's buffers, whose leading dims are the block sizes.
static_assert(kBlockQ % 2 == 0 && kBlockK % 2 == 0, "the VNNI pads live inside the blocks");
// Why: packed QT / dOT (N = ncols <= kBlockQ) take round_up(ncols, 16)
// columns (matrix_units.h's column blocks), which must fit their slots.
static_assert(kBlockQ % 16 == 0, "packed QT / dOT blocks are padded to 16 columns");

// The 16-bit operands of one thread (bfloat16 and float16 are both 2 bytes:
// stored as uint16_t, read as T by the templated members).
struct MxBackward {
  // An operand: rows ld elements apart (packed: pair p of rows at p * 2 * ld).
  struct Op {
    const uint16_t* p = nullptr;
    int64_t ld = 0;
  };
  Vnni vnni = Vnni::Off;
  int64_t D = 0, Dv = 0;     // D_qk, D_v
  int64_t Dq2 = 0, Dv2 = 0;  // the score products' reduction dims (D, Dv; rounded to even with VNNI)
  AlignedVec<uint16_t> qt, dot;     // Dq2 x kBlockQ, Dv2 x kBlockQ: QT, dOT (VNNI: before packing)
  AlignedVec<uint16_t> qr, dor;     // kBlockQ x D, kBlockQ x Dv: Q, dO rows when copied
  AlignedVec<uint16_t> kb, vb;      // kBlockK x Dq2, kBlockK x Dv2: K, V block rows when copied
  AlignedVec<uint16_t> qtp, dotp;   // VNNI: QT, dOT packed (N = ncols)
  AlignedVec<uint16_t> qp, dop, kp;  // VNNI: Q, dO, K block packed (N = D, Dv, D; packed_elems)
  AlignedVec<uint16_t> pt, dst, ds;  // kBlockK x kBlockQ: PT, dST rounded; kBlockQ x kBlockK: dS
  Op a_k, a_v, b_qt, b_dot, b_q, b_do, b_k;  // the current blocks' operands

  MxBackward() = default;
  MxBackward(int64_t d, int64_t dv, Vnni v)
      : vnni(v), D(d), Dv(dv), Dq2(packs(v) ? round_up(d, 2) : d), Dv2(packs(v) ? round_up(dv, 2) : dv) {
    qt.resize(Dq2 * kBlockQ);
    dot.resize(Dv2 * kBlockQ);
    qr.resize(kBlockQ * D);
    dor.resize(kBlockQ * Dv);
    kb.resize(kBlockK * Dq2);
    vb.resize(kBlockK * Dv2);
    if (packs(v)) {
      qtp.resize(qt.size());
      dotp.resize(dot.size());
      qp.resize(packed_elems(kBlockQ, D));
      dop.resize(packed_elems(kBlockQ, Dv));
      kp.resize(packed_elems(kBlockK, D));
    }
    for (auto* b : {&pt, &dst, &ds}) b->resize(kBlockK * kBlockQ);
  }

  template <typename T>
  static T* as(AlignedVec<uint16_t>& b) {
    return reinterpret_cast<T*>(b.data());
  }
  template <typename T>
  static Op op(const T* p, int64_t ld) {
    return {reinterpret_cast<const uint16_t*>(p), ld};
  }
  template <typename T>
  static const T* rd(const Op& o) {
    return reinterpret_cast<const T*>(o.p);
  }

  // Rows [0, n) of width w (strides st[2], st[3]) -> transposed dst[d * kBlockQ + i]
  // (wp x kBlockQ): columns [n, ncols) and rows [w, wp) zero; packed with VNNI.
  template <typename T>
  Op transposed(const T* src, const int64_t* st, int64_t n, int64_t ncols, int64_t w, int64_t wp,
                AlignedVec<uint16_t>& buf, AlignedVec<uint16_t>& packed) {
    T* dst_ = as<T>(buf);
    poison_if_emulated(dst_, wp * kBlockQ, vnni);
    for (int64_t i = 0; i < n; ++i)
      for (int64_t d = 0; d < w; ++d) dst_[d * kBlockQ + i] = src[i * st[2] + d * st[3]];
    for (int64_t d = 0; d < wp; ++d)
      std::fill(dst_ + d * kBlockQ + (d < w ? n : 0), dst_ + d * kBlockQ + ncols, T(0.0f));
    if (!packs(vnni)) return op(dst_, kBlockQ);
    pack_b(wp, ncols, kBlockQ, c10::CppTypeToScalarType<T>::value, dst_, packed.data(), vnni);
    return op(as<T>(packed), ncols);
  }

  // Rows [0, n) of width w as a B operand of reduction n: in place (Off,
  // contiguous features), else copied (rows w apart); with VNNI a zero row
  // at an odd n, then packed.
  template <typename T>
  Op rows_b(const T* src, const int64_t* st, int64_t n, int64_t w, AlignedVec<uint16_t>& buf,
            AlignedVec<uint16_t>& packed) {
    if (!packs(vnni) && st[3] == 1) return op(src, st[2]);
    T* dst_ = as<T>(buf);
    const int64_t n2 = packs(vnni) ? round_up(n, 2) : n;
    poison_if_emulated(dst_, n2 * w, vnni);
    for (int64_t j = 0; j < n; ++j)
      for (int64_t d = 0; d < w; ++d) dst_[j * w + d] = src[j * st[2] + d * st[3]];
    std::fill(dst_ + n * w, dst_ + n2 * w, T(0.0f));
    if (!packs(vnni)) return op(dst_, w);
    pack_b(n2, w, w, c10::CppTypeToScalarType<T>::value, dst_, packed.data(), vnni);
    return op(as<T>(packed), w);
  }

  // Rows [0, n) of width w as an A operand of reduction wp: in place when
  // features are contiguous and w == wp, else copied (rows wp apart, zero
  // columns [w, wp)); `pad_row`: one more zero row at an odd n (VNNI K's
  // rows, packed next as dQ's B).
  template <typename T>
  Op rows_a(const T* src, const int64_t* st, int64_t n, int64_t w, int64_t wp, bool pad_row,
            AlignedVec<uint16_t>& buf) {
    if (!pad_row && st[3] == 1 && w == wp) return op(src, st[2]);
    T* dst_ = as<T>(buf);
    const int64_t n2 = pad_row ? round_up(n, 2) : n;
    poison_if_emulated(dst_, n2 * wp, vnni);
    for (int64_t j = 0; j < n; ++j) {
      for (int64_t d = 0; d < w; ++d) dst_[j * wp + d] = src[j * st[2] + d * st[3]];
      std::fill(dst_ + j * wp + w, dst_ + j * wp + wp, T(0.0f));
    }
    std::fill(dst_ + n * wp, dst_ + n2 * wp, T(0.0f));
    return op(dst_, wp);
  }

  // A query block's operands, once for all its key blocks: QT and dOT
  // (B of the score products), Q and dO rows (B of dK and dV).
  template <typename T>
  void load_query(const T* q, const int64_t* q_st, const T* go, const int64_t* go_st, int64_t nq, int64_t ncols) {
    b_qt = transposed(q, q_st, nq, ncols, D, Dq2, qt, qtp);
    b_dot = transposed(go, go_st, nq, ncols, Dv, Dv2, dot, dotp);
    b_q = rows_b(q, q_st, nq, D, qr, qp);
    b_do = rows_b(go, go_st, nq, Dv, dor, dop);
  }

  // A key block's operands: K and V rows (A of the score products) and,
  // with VNNI, K packed (B of dQ) from its zero-padded copy.
  template <typename T>
  void load_keys(const T* k, const int64_t* k_st, const T* v, const int64_t* v_st, int64_t nk) {
    a_k = rows_a(k, k_st, nk, D, Dq2, packs(vnni), kb);
    a_v = rows_a(v, v_st, nk, Dv, Dv2, false, vb);
    if (!packs(vnni)) {
      b_k = a_k;
      return;
    }
    pack_b(round_up(nk, 2), D, a_k.ld, c10::CppTypeToScalarType<T>::value, rd<T>(a_k), kp.data(), vnni);
    b_k = op(as<T>(kp), D);
  }

  // ST = scale_log2 * K . QT and dPT = V . dOT (nk x ncols, row stride kBlockQ).
  template <typename T>
  void scores(int64_t nk, int64_t ncols, float scale_log2, float* st, float* dpt) const {
    tile_gemm(nk, ncols, Dq2, a_k.ld, b_qt.ld, kBlockQ, /*add_c=*/false, rd<T>(a_k), rd<T>(b_qt), st, vnni);
    tile_gemm(nk, ncols, Dv2, a_v.ld, b_dot.ld, kBlockQ, /*add_c=*/false, rd<T>(a_v), rd<T>(b_dot), dpt, vnni);
    const Vec sc = Vec::broadcast(scale_log2);
    for (int64_t j = 0; j < nk; ++j)
      for (int64_t x = 0; x < ncols; x += kW) (sc * Vec::load(st + j * kBlockQ + x)).store(st + j * kBlockQ + x);
  }

  // P (st) and dS (dsf), float32 nk x >= nq with row stride kBlockQ, rounded
  // to T; then dV += PT . dO, dK += dST . Q, dQ += dS . K (float32 C).
  template <typename T>
  void grads(const float* st, const float* dsf, int64_t nk, int64_t nq, float* dv, int64_t ldv, float* dk,
             int64_t ldk, float* dq, int64_t ldq) {
    const int64_t nq2 = packs(vnni) ? round_up(nq, 2) : nq, nk2 = packs(vnni) ? round_up(nk, 2) : nk;
    T *p = as<T>(pt), *dsr = as<T>(dst), *dsq = as<T>(ds);
    poison_if_emulated(p, kBlockK * kBlockQ, vnni);
    poison_if_emulated(dsr, kBlockK * kBlockQ, vnni);
    poison_if_emulated(dsq, kBlockK * kBlockQ, vnni);
    for (int64_t j = 0; j < nk; ++j) {
      round_row(st + j * kBlockQ, nq, p + j * kBlockQ);
      round_row(dsf + j * kBlockQ, nq, dsr + j * kBlockQ);
      if (nq2 > nq) p[j * kBlockQ + nq] = dsr[j * kBlockQ + nq] = T(0.0f);
    }
    transpose_round(dsf, kBlockQ, nk, nq, dsq, kBlockK);  // rows >= nq may be written, never read
    for (int64_t i = 0; nk2 > nk && i < nq; ++i) dsq[i * kBlockK + nk] = T(0.0f);
    tile_gemm(nk, Dv, nq2, kBlockQ, b_do.ld, ldv, /*add_c=*/true, p, rd<T>(b_do), dv, vnni);     // dV += PT . dO
    tile_gemm(nk, D, nq2, kBlockQ, b_q.ld, ldk, /*add_c=*/true, dsr, rd<T>(b_q), dk, vnni);      // dK += dST . Q
    tile_gemm(nq, D, nk2, kBlockK, b_k.ld, ldq, /*add_c=*/true, dsq, rd<T>(b_k), dq, vnni);      // dQ += dS . K
  }
};

}  // namespace
}  // namespace bwd
}  // namespace cpu
}  // namespace flash_metal
