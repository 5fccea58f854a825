// The float32 backward's P, rebuilt to PyTorch's precision (issue 40).
//
// What was wrong: float32 dQ, dK and dV of flash-attn's varlen backward test
// (softcap 50, its q scaled by the softcap, so capped scores near 50; D 256)
// came out at up to 3.4x, 3.6x and 2.6x the error of PyTorch's float32
// backward against the float64 oracle. Four terms PyTorch's softmax backward
// does not have, the first two growing with the scores' magnitude:
//  * P = exp2(s2 - lse2) is rebuilt from the forward's float32 lse, so every
//    P of a row carries lse's rounding (half an ulp of |lse|: 1.9e-6 at
//    |lse| ~ 50) and whatever the forward's and the backward's scores
//    differ by, as one factor; PyTorch divides by the row's own sum.
//  * Softcap in base 2 (scores times log2 e, 66 to 72 at these logits):
//    cap2 * tanh rounds at that magnitude (3.8e-6), and tanh_approx's
//    error (up to 1.1e-7, about 2 ulps) comes out 72 times larger; PyTorch
//    rounds 50 * tanh once, at half that ulp.
//  * Delta = rowsum(dO o O) takes O from the forward, whose P differs from
//    the one rebuilt here by both kernels' roundings; dS = P (dP - Delta)
//    subtracts it from dP, where PyTorch's softmax backward subtracts
//    rowsum(P o dP) of its own P and dP (measured on the worst row: dQ's
//    error 3.3e-6 with the forward's O, 6.8e-7 with its own sums).
//  * The score products summed in one fma chain over all 256 features
//    (blocked_scores below).
// The fix, float32 only (16-bit inputs round far above these terms):
//  * a first pass over each query block's keys (attention_backward_cpu.cpp,
//    renormalize_rows: K . Q^T and V . dO^T again, the scores exactly as the
//    main loop makes them) sums each row's P and P * dP (and the sink's P);
//    log2 of the first joins the row's lse2lo, which carries it at full
//    precision (both are tiny), and Delta becomes the second over the first;
//  * softcap_precise: tanh as a quotient whose roundings are carried in a
//    second float (Fast2Sum for 1 - e and 1 + e, the division's exact
//    remainder by fma), cap2 * tanh as hi (the score block) + lo (slo, the
//    product's remainder by fma), so P = exp2(((hi - lse2) + lo) - lse2lo)
//    rounds nowhere at the score's magnitude; and 1 - tanh^2 as 4e / (1 + e)^2,
//    with no cancellation where tanh saturates;
//  * blocked_scores: the score products as sums of 64-feature blocks.
// Measured on tests/api/test_flash_attn_varlen_backward.py's grid (D 192, 256;
// softcap 50 or none; window (78, 301) or none), max error over the batch
// against float64 as a multiple of PyTorch's float32 backward's: before, up
// to 4.5x (dQ), 4.5x (dK), 3.5x (dV); after, 0.3-1.1x. The price: the
// first pass, two of the backward's five products again, ~40% of the
// float32 backward's time (one thread: 0.106 -> 0.150 s at B 1, H 8,
// N 2048, D 128, causal).
#pragma once

#include "backward_tiles.h"
#include "common.h"
#include "simd.h"

#include <algorithm>
#include <cmath>

namespace flash_metal {
namespace cpu {
namespace bwd {

// |lse| (natural log) above which a query block takes the first pass; see query_block.
constexpr float kRenormLse = 12.0f;

// Softcap of a kBlockK x ld block of base-2 scores st (rows [0, nk),
// columns [0, ncols)): st becomes hi, slo the remainder lo, dfac (optional)
// 1 - tanh^2. x = st / cap2 as the forward forms it (o.inv_cap2).
inline void softcap_precise(const CallOptions& o, float* st, float* slo, float* dfac, int64_t ld, int64_t nk,
                            int64_t ncols) {
  const Vec cap = Vec::broadcast(o.cap2), inv = Vec::broadcast(o.inv_cap2), one = Vec::broadcast(1.0f);
  const Vec four = Vec::broadcast(4.0f), edge = Vec::broadcast(0.4f), zero = Vec::zero();
  for (int64_t j = 0; j < nk; ++j) {
    float* row = st + j * ld;
    float* lrow = slo + j * ld;
    float* drow = dfac ? dfac + j * ld : nullptr;
    for (int64_t c = 0; c < ncols; c += kW) {
      const Vec x = Vec::load(row + c) * inv;
      const Vec a = vabs(x);
      // |x| < 0.4: tanh_approx's series, exact to an ulp of t < 0.38 (no
      // cancellation: 1 - t^2 > 0.85; such scores are far below a row's max).
      const Vec ts = tanh_approx(a);
      // |x| >= 0.4: t = n / d, n = 1 - e, d = 1 + e, e = exp(-2|x|).
      const Vec e = exp2_approx(a * Vec::broadcast(-2.8853900817779268f));  // -2 log2(e)
      const Vec n = one - e, d = one + e;
      const Vec rn = (one - n) - e;                 // 1 - e = n + rn exactly (Fast2Sum: 1 >= e)
      const Vec rd = (one - d) + e;                 // 1 + e = d + rd exactly
      const Vec qt = n / d;
      const Vec r = fmadd(zero - qt, d, n);         // n - qt * d exactly
      const Vec tl = ((r + rn) - qt * rd) / d;      // (n + rn) / (d + rd) - qt, to first order
      const Vec thi = select_lt(a, edge, ts, qt);
      const Vec tlo = select_lt(a, edge, zero, tl);
      const Vec sthi = select_lt(x, zero, zero - thi, thi);
      const Vec stlo = select_lt(x, zero, zero - tlo, tlo);
      const Vec hi = cap * sthi;
      (hi).store(row + c);
      (fmadd(cap, sthi, zero - hi) + cap * stlo).store(lrow + c);
      if (drow) select_lt(a, edge, one - ts * ts, (four * e) / (d * d)).store(drow + c);
    }
  }
}

// A score product C = A . B (M x ncols, over K = a head dim) as blocked
// sums of kScoreChunk features: each chunk's fma chain from zero, added to C
// once (matmul's Acc), where one chain through all K features rounds at the
// magnitude of the running sum K times. At D = 256 with large scores (q
// scaled by softcap 50) the one chain put up to 1.4e-4 on a base-2 score,
// 10x its error as a 64-feature blocked sum, and dQ at 3x PyTorch's error;
// PyTorch's GEMM sums in blocks too. Costs one load and add of C per chunk.
constexpr int64_t kScoreChunk = 64;
inline void blocked_scores(const float* a, int64_t lda, const float* b, int64_t ldb, int64_t K, int64_t M,
                           int64_t ncols, float* c, int64_t ldc) {
  for (int64_t k0 = 0; k0 < K; k0 += kScoreChunk) {
    const int64_t kc = std::min(kScoreChunk, K - k0);
    if (k0 == 0)
      matmul<false, false>(a, lda, b, ldb, kc, M, ncols, c, ldc);
    else
      matmul<false, true>(a + k0, lda, b + k0 * ldb, ldb, kc, M, ncols, c, ldc);
  }
}

// The mask part of common.h's apply_score_options (the softcap done above).
template <typename T>
inline void apply_mask_only(const CallOptions& o, float* st, int64_t ld, int64_t nk, int64_t nlive,
                            const int64_t* moff, int64_t j0) {
  switch (o.mask) {
    case MaskKind::Bool: apply_mask_block<bool>(o, st, ld, nk, nlive, moff, j0); break;
    case MaskKind::Input: apply_mask_block<T>(o, st, ld, nk, nlive, moff, j0); break;
    case MaskKind::Float32: apply_mask_block<float>(o, st, ld, nk, nlive, moff, j0); break;
    case MaskKind::None: break;
  }
}

// P of a block row chunk: exp2(((s - lse2) + lo) - lse2lo), lo the softcap's
// remainder (nullptr: none).
inline Vec rebuilt_p(const float* srow, const float* lorow, const float* lse2, const float* lse2lo, int64_t c) {
  Vec x = Vec::load(srow + c) - Vec::load(lse2 + c);
  if (lorow) x = x + Vec::load(lorow + c);
  return exp2_approx(x - Vec::load(lse2lo + c));
}

}  // namespace bwd
}  // namespace cpu
}  // namespace flash_metal
