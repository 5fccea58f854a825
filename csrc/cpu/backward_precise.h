// The float32 backward's P, rebuilt to PyTorch's precision (issue 40).
//
// What was wrong: float32 dQ, dK and dV of flash-attn's varlen backward test
// (softcap 50, its q scaled by the softcap, so capped scores near 50; D 256)
// came out at up to 3.8x, 3.8x and 2.5x the error of PyTorch's float32
// backward against the float64 oracle. Two terms PyTorch's softmax does not
// have, both growing with the scores' magnitude:
//  * P = exp2(s2 - lse2) is rebuilt from the forward's float32 lse, so every
//    P of a row carries lse's rounding (half an ulp of |lse|: 1.9e-6 at
//    |lse| ~ 50) and whatever the forward's and the backward's scores
//    differ by, as one factor; PyTorch divides by the row's own sum.
//  * Softcap in base 2 (scores times log2 e, 66 to 72 at these logits):
//    cap2 * tanh rounds at that magnitude (3.8e-6), and tanh_approx's
//    error (up to 1.1e-7, about 2 ulps) comes out 72 times larger; PyTorch
//    rounds 50 * tanh once, at half that ulp.
// The fix, float32 only (16-bit inputs round far above these terms):
//  * renormalized rows: each row's sum of the rebuilt P is taken first (the
//    scores exactly as the main loop makes them: one more K . Q^T product
//    per key block, plus the sink's P with sinks) and log2 of it joins the
//    row's lse2lo, which carries it at full precision (both are tiny);
//  * softcap_precise: tanh as a quotient whose roundings are carried in a
//    second float (Fast2Sum for 1 - e and 1 + e, the division's exact
//    remainder by fma), cap2 * tanh as hi (the score block) + lo (slo, the
//    product's remainder by fma), so P = exp2(((hi - lse2) + lo) - lse2lo)
//    rounds nowhere at the score's magnitude; and 1 - tanh^2 as 4e / (1 + e)^2,
//    with no cancellation where tanh saturates.
// Measured (tests/test_flash_attn_varlen_grid.py's grid): ...
#pragma once

#include "backward_tiles.h"
#include "common.h"
#include "simd.h"

#include <algorithm>
#include <cmath>

namespace flash_metal {
namespace cpu {
namespace bwd {

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
