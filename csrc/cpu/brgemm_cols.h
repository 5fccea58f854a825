// The forward's column form on the matrix units (issue 39): the brgemm path
// for query blocks of at least kColMinQueries columns. Measured on the AMX
// Xeon (csrc/cpu/phase_clock.h), the row form of brgemm_tiles.h spent 31% of
// its time around its products (the P^T transpose alone 15%, the scaled
// softmax in 8-lane vectors 16%) and its products ran at half of brgemm's
// attainable rate: four calls per 96 x 96 block, each a different kernel,
// and every switch between kernels costs about 2,500 cycles of tile
// reconfiguration (measured: a 16 x 16 x 32 product alone 426 ticks a call,
// alternating with a second shape 3,343).
//
// The column form keeps the transposed scores (keys x queries, so the masks,
// windows and softcap of common.h apply unchanged) and turns the second
// product around:
//   ST  (nk x ncols)  = K_blk (nk x D) . QT (D x ncols)       one call
//   O^T (Dv x ncols) += V^T_blk (Dv x nk) . P (nk x ncols)    one call
// P, the probabilities of the transposed block, is already in the layout the
// second product's B operand needs once each pair of key rows is interleaved
// (the plain VNNI layout, matrix_units.h), so the softmax writes it straight
// from registers, rounded to T, with no transpose. V^T is built once per call
// and kv head (the cost of one pass over V), and Q^T once per query block, both
// packed by this file (any width up to kPlainVnniMaxLd), so each key block is
// one call of each kernel on blocks of up to mx_block_k() keys.
// PyTorch's CPU flash attention packs K and V once per head and runs large
// blocks too (FlashAttentionKernel.cpp); the transposed block with P as the
// B operand is this kernel's own.
#pragma once

#include "common.h"
#include "forward_tiles.h"
#include "matrix_units.h"
#include "simd.h"
#include "transpose16.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define FLASH_METAL_COLS_AVX512_BF16 1
#endif

namespace flash_metal {
namespace cpu {
namespace fwd {
namespace {

// Query columns from which an item takes the column form. Why 32: below it
// (decode, short GQA groups) the P^T transpose of the row form is small and
// the per-call V^T build (a pass over V) would cost as much as the products.
constexpr int64_t kColMinQueries = 32;
// Keys per block of the column form, at most (buffers are sized for it).
constexpr int64_t kColBlockKMax = 256;

// Keys per block: FLASH_METAL_CPU_MX_BLOCK_K (a tuning aid, read at every
// call: an even count in [32, 256]; anything else is an error) or the
// default. Why 128: each block is one call of each kernel, so two tile
// reconfigurations per block, and larger blocks amortise them; but the
// scores block (keys x 96 floats) leaves L1 beyond ~128 keys. On the AMX Xeon
// (issue 39, 2 threads, ratio to SDPA in the same process) 128 gave the best
// geomean of 96 / 128 / 192 / 256 over four shapes (0.92 against 0.79-0.80),
// from a run whose four block sizes shared the machine: a weak measurement,
// docs/benchmarks.md says so.
inline int64_t mx_block_k() {
  const char* e = std::getenv("FLASH_METAL_CPU_MX_BLOCK_K");
  if (e == nullptr || *e == '\0') return 128;
  char* end = nullptr;
  const long v = std::strtol(e, &end, 10);
  TORCH_CHECK_VALUE(*end == '\0' && v >= 32 && v <= kColBlockKMax && v % 2 == 0,
                    "FLASH_METAL_CPU_MX_BLOCK_K must be an even key count in [32, ", kColBlockKMax, "]; got '", e, "'");
  return v;
}

// Per-thread buffers of the column form, in the input dtype T.
template <typename T>
struct ColBuffers {
  int64_t Dp;          // D_qk rounded up to even
  AlignedVec<T> qv;   // max_sub x (Dp x kBlockQ): each sub-block's Q^T, plain VNNI, ldb kBlockQ
  AlignedVec<T> pp;   // max_sub x (kColBlockKMax x kBlockQ): each sub-block's P, plain VNNI, ldb kBlockQ
  FloatBuffer st;      // max_sub x (kColBlockKMax x kBlockQ): each sub-block's scores (keys x queries)
  // split (brgemm_split.h): Q' (4Dp rows) and P's two halves, in bfloat16, in place of qv and pp
  AlignedVec<c10::BFloat16> qs, ph, pl, stage;  // stage: one sub-block's split Q rows (3 x kBlockQ x Dp)
  ColBuffers(int64_t max_sub, int64_t D, bool split = false) : Dp(round_up(D, 2)) {
    const int64_t nq = max_sub * Dp * kBlockQ, np = max_sub * kColBlockKMax * kBlockQ;
    if (split) {
      qs.resize(4 * nq);
      stage.resize(3 * kBlockQ * Dp);
      ph.resize(np);
      pl.resize(np);
    } else {
      qv.resize(nq);
      pp.resize(np);
    }
    st.resize(max_sub * kColBlockKMax * kBlockQ);
  }
};

// Q^T of one sub-block in the plain VNNI layout: element (d, c) at
// dst[(d / 2) * 2 * kBlockQ + 2 * c + d % 2] = q(c, d), unscaled; columns
// [nrows, ncols) and the odd-D pad row zero. q_off(c): element offset of
// query column c's row.
template <typename T, typename QOff>
void col_load_q(const T* q, int64_t d_stride, const QOff& q_off, int64_t nrows, int64_t ncols, int64_t D, int64_t Dp,
                T* dst, Vnni vnni) {
  poison_if_emulated(dst, Dp * kBlockQ, vnni);
  for (int64_t p = 0; p < Dp / 2; ++p) std::fill(dst + p * 2 * kBlockQ + 2 * nrows, dst + p * 2 * kBlockQ + 2 * ncols, T(0.0f));
#if defined(FLASH_METAL_COLS_AVX512_BF16)
  // Contiguous features of a 16-bit dtype, D even: a pair of features is one
  // 32-bit lane, so the pack is a transpose of (query rows x feature pairs)
  // lanes into dst32[pair * kBlockQ + c], 16 x 16 lanes at a time.
  if (sizeof(T) == 2 && d_stride == 1 && D % 2 == 0) {
    const int64_t pairs = D / 2;
    float* d32 = reinterpret_cast<float*>(dst);  // 32-bit lanes moved as floats, never computed on
    for (int64_t c0 = 0; c0 < nrows; c0 += 16) {
      const int64_t cn = std::min<int64_t>(16, nrows - c0);
      const __mmask16 cmask = static_cast<__mmask16>((1u << cn) - 1);
      for (int64_t p0 = 0; p0 < pairs; p0 += 16) {
        const int64_t pn = std::min<int64_t>(16, pairs - p0);
        const __mmask16 pmask = static_cast<__mmask16>((1u << pn) - 1);
        __m512 r[16];
        for (int64_t i = 0; i < 16; ++i)
          r[i] = i < cn ? _mm512_maskz_loadu_ps(pmask, reinterpret_cast<const float*>(q + q_off(c0 + i)) + p0)
                        : _mm512_setzero_ps();
        transpose16x16_ps(r);
        for (int64_t i = 0; i < pn; ++i) _mm512_mask_storeu_ps(d32 + (p0 + i) * kBlockQ + c0, cmask, r[i]);
      }
    }
    return;
  }
#endif
  for (int64_t c = 0; c < nrows; ++c) {
    const T* src = q + q_off(c);
    T* col = dst + 2 * c;
    for (int64_t d = 0; d < D; ++d) col[(d / 2) * 2 * kBlockQ + d % 2] = src[d * d_stride];
    if (Dp > D) col[(D / 2) * 2 * kBlockQ + 1] = T(0.0f);
  }
}

// V^T of every (batch row, kv head): vt[((b * Hk + h) * Dv + d) * vt_ld + j]
// = v[b, h, j, d] for j < Nk, zero for j in [Nk, vt_ld). Parallel over heads
// and 16-feature slices; 16 x 16 blocks keep both sides' lines in cache.
template <typename T>
void build_vt(const T* v, const int64_t* vs, int64_t B, int64_t Hk, int64_t Nk, int64_t Dv, int64_t vt_ld, T* vt) {
  const int64_t slices = (Dv + 15) / 16;
  at::parallel_for(0, B * Hk * slices, 1, [&](int64_t begin, int64_t end) {
    for (int64_t w = begin; w < end; ++w) {
      const int64_t bh = w / slices, d0 = (w % slices) * 16, d1 = std::min(Dv, d0 + 16);
      const T* src = v + (bh / Hk) * vs[0] + (bh % Hk) * vs[1];
      T* dst = vt + bh * Dv * vt_ld;
      for (int64_t j0 = 0; j0 < Nk; j0 += 16)
        for (int64_t d = d0; d < d1; ++d)
          for (int64_t j = j0; j < std::min(Nk, j0 + 16); ++j) dst[d * vt_ld + j] = src[j * vs[2] + d * vs[3]];
      for (int64_t d = d0; d < d1; ++d) std::fill(dst + d * vt_ld + Nk, dst + (d + 1) * vt_ld, T(0.0f));
    }
  });
}

// The online softmax of one transposed block, column by column (one column
// per query), written as the second product's B operand. st: nk x ncols raw
// scores (row stride kBlockQ) whose base-2 logits are st * sc (sc > 0: the
// caller passes 1 after scaling the block itself). Updates m (running max,
// base 2) and l (running sum of the float32 probabilities), writes alpha
// (each column's rescale of O) and P rounded to T into pp, pair of key rows
// p at pp + p * 2 * kBlockQ, interleaved (the plain VNNI layout); an odd nk
// gets a zero partner row. l sums the float32 probabilities (for lse), lr the
// probabilities as P.V multiplies them, rounded to T: the output divides by
// lr, so the weights it applies sum to 1 exactly (divided by l, a row of
// equal scores came out up to 2^-9 off, one bfloat16 ulp of its output:
// test_nonfinite's "huge" keys on the AMX Xeon). With pl, also P's
// remainders P - T(P), rounded to T (the split float16 forward of
// brgemm_split.h), and lr sums P itself, which hi + lo carries to 16 bits. Returns false when every
// alpha is 1 (O^T needs no rescale); this generic version always rescales.
template <typename T>
bool col_softmax_pack(const float* st, int64_t nk, int64_t ncols, float sc, float* m, float* l, float* lr, float* alpha,
                      T* pp, T* pl = nullptr) {
  const int64_t nkp = round_up(nk, 2);
  const float ninf = -std::numeric_limits<float>::infinity();
  for (int64_t x = 0; x < ncols; x += kW) {
    Vec mx = Vec::broadcast(ninf);
    for (int64_t j = 0; j < nk; ++j) mx = vmax(mx, Vec::load(st + j * kBlockQ + x));
    const Vec m_old = Vec::load(m + x);
    const Vec m_new = vmax(m_old, mx * Vec::broadcast(sc));
    // A column that has seen only masked keys keeps m = -inf; exponentiate against 0 so no NaN appears.
    const Vec m_use = select_eq(m_new, Vec::broadcast(ninf), Vec::zero(), m_new);
    const Vec neg = Vec::zero() - m_use, s = Vec::broadcast(sc);
    Vec sum = Vec::zero(), sum_r = Vec::zero();
    float p0[kW], p1[kW];
    for (int64_t j = 0; j < nkp; j += 2) {
      const Vec a = exp2_approx(fmadd(Vec::load(st + j * kBlockQ + x), s, neg));
      const Vec b = j + 1 < nk ? exp2_approx(fmadd(Vec::load(st + (j + 1) * kBlockQ + x), s, neg)) : Vec::zero();
      a.store(p0);
      b.store(p1);
      T* dst = pp + (j / 2) * 2 * kBlockQ + 2 * x;
      for (int i = 0; i < kW; ++i) {
        dst[2 * i] = static_cast<T>(p0[i]);
        dst[2 * i + 1] = static_cast<T>(p1[i]);
      }
      sum = sum + a + b;
      if (pl == nullptr) {  // lr sums the P that P.V multiplies (rounded to T)
        for (int i = 0; i < kW; ++i) {
          p0[i] = static_cast<float>(dst[2 * i]);
          p1[i] = static_cast<float>(dst[2 * i + 1]);
        }
        sum_r = sum_r + Vec::load(p0) + Vec::load(p1);
      }
      if (pl != nullptr) {  // the remainders (brgemm_split.h): P = hi + lo to 16 bits
        T* lo = pl + (j / 2) * 2 * kBlockQ + 2 * x;
        for (int i = 0; i < kW; ++i) {
          lo[2 * i] = static_cast<T>(p0[i] - static_cast<float>(dst[2 * i]));
          lo[2 * i + 1] = static_cast<T>(p1[i] - static_cast<float>(dst[2 * i + 1]));
        }
      }
    }
    const Vec a = exp2_approx(m_old - m_use);
    fmadd(a, Vec::load(l + x), sum).store(l + x);
    fmadd(a, Vec::load(lr + x), pl != nullptr ? sum : sum_r).store(lr + x);
    m_new.store(m + x);
    a.store(alpha + x);
  }
  return true;
}

#if defined(FLASH_METAL_COLS_AVX512_BF16)
// 2^x for 16 lanes, x <= 0 (a score minus its column's running max), to
// about 3e-6 relative error: P is rounded to bfloat16 next (2^-9), so the
// float32 polynomial of exp2_approx (simd.h, degree 6, two more FMAs and a
// four-instruction exponent build) buys nothing here. The exponent goes on
// with one vscalefps. Below -125 (a masked key is x = -inf) the lane is an
// exact 0, by the zeroing mask: letting vscalefps underflow instead costs a
// floating-point assist per lane, which made causal blocks three times slower
// (measured on the AMX Xeon, issue 39). The degree-4 coefficients fit 2^f on
// [-1/2, 1/2] with p(0) = 1 exactly (a column's max key gets probability 1),
// relative error weighted; fitted by this project (iteratively reweighted
// least squares), not taken from a library.
inline __m512 exp2_16(__m512 x) {
  const __mmask16 live = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-125.0f), _CMP_GE_OQ);
  x = _mm512_max_ps(x, _mm512_set1_ps(-125.0f));
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(0.009582853f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.055906426f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.24024099f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.69312418f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_maskz_scalef_ps(live, p, n);
}

// How far (base 2) a column's block max may pass its running max before the
// max is raised: below it, probabilities are taken against the stale max (at
// most 2^8, exact in float32 and as exact in bfloat16 as any other value),
// and O^T, l and the max stay as they are. The result is the same softmax:
// out = O / l and lse = m + log2(l) use one max, whichever it is. So after
// the first key block a column's O^T is rarely rescaled and one pass over the
// scores usually does (FlashAttention-4 rescales lazily, with a threshold,
// for the same reason; this is that idea on the CPU).
constexpr float kLazyRescale = 8.0f;

// bfloat16 on AVX-512 BF16: 16 columns at a time; each pair of rows is
// rounded by one cvtne2ps (round to nearest even, as c10 rounds) and
// interleaved by one 16-bit permute. Where a chunk's running max is finite,
// one pass takes the probabilities against it and finds the block max on
// the way; only if that max passes it by more than kLazyRescale (rare after
// the first block) does a second pass redo the chunk against the new max.
// alpha is exactly 1 where the max stayed, and the return says whether any
// column moved (else O^T needs no rescale).
template <>
inline bool col_softmax_pack<c10::BFloat16>(const float* st, int64_t nk, int64_t ncols, float sc, float* m, float* l,
                                            float* lr, float* alpha, c10::BFloat16* pp, c10::BFloat16* pl) {
  const int64_t nkp = round_up(nk, 2);
  const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity()), s = _mm512_set1_ps(sc);
  const __m512 lazy = _mm512_set1_ps(kLazyRescale), one = _mm512_set1_ps(1.0f);
  // lane 2i takes element i of the first row (the low half), lane 2i + 1 element i of the second
  alignas(64) static const uint16_t kMix[32] = {0,  16, 1,  17, 2,  18, 3,  19, 4,  20, 5,  21, 6,  22, 7,  23,
                                                8,  24, 9,  25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512i mix = _mm512_load_si512(kMix);
  static_assert(kG % 16 == 0, "score blocks are whole 16-column vectors with AVX-512");
  // One pass of probabilities against m_use (finite; 0 for a column with no max yet), summed, and the
  // raw block max found on the way.
  // The exponent is clamped to kLazyRescale: past it only by rounding, at logits so large (|s| ~ 1e12,
  // where an ulp is 2^18) that the max itself rounds; a stale max's larger exponents are redone below.
  // Where a max is past 2^20 (an ulp of 1/8 or more), the exponent is s * score rounded, then minus
  // the max, as the max itself was formed, so the max's own key gets exactly 2^0 = 1 (with one fma,
  // at 1e10 its rounding error alone would take every key of the row to 0).
  // (vmulps with an explicit rounding mode: GCC contracts a plain multiply and add into an fma.)
  const __m512 big = _mm512_set1_ps(1048576.0f);
  const auto mul_rn = [](__m512 a, __m512 b) { return _mm512_mul_round_ps(a, b, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); };
  const auto pass = [&](int64_t x, __m512 m_use, __m512* sum, __m512* sum_r, __m512* mx, __m512* top) {
    const __m512 neg = _mm512_sub_ps(_mm512_setzero_ps(), m_use);
    const bool exact = _mm512_cmp_ps_mask(_mm512_abs_ps(m_use), big, _CMP_GT_OQ) != 0;
    __m512 acc = _mm512_setzero_ps(), acc_r = _mm512_setzero_ps(), hi = ninf, hx = ninf;
    for (int64_t j = 0; j < nkp; j += 2) {
      const __m512 ra = _mm512_loadu_ps(st + j * kBlockQ + x);
      const __m512 rb = j + 1 < nk ? _mm512_loadu_ps(st + (j + 1) * kBlockQ + x) : ninf;
      hi = _mm512_max_ps(hi, _mm512_max_ps(ra, rb));
      const __m512 xa = exact ? _mm512_add_ps(mul_rn(ra, s), neg) : _mm512_fmadd_ps(ra, s, neg);
      const __m512 xb = exact ? _mm512_add_ps(mul_rn(rb, s), neg) : _mm512_fmadd_ps(rb, s, neg);
      hx = _mm512_max_ps(hx, _mm512_max_ps(xa, xb));
      const __m512 a = exp2_16(_mm512_min_ps(xa, lazy));
      const __m512 b = exp2_16(_mm512_min_ps(xb, lazy));  // the odd block's partner row: -inf, so 0
      const __m512i ab = (__m512i)_mm512_cvtne2ps_pbh(b, a);  // low half row j, high half row j + 1
      _mm512_storeu_si512(pp + (j / 2) * 2 * kBlockQ + 2 * x, _mm512_permutexvar_epi16(mix, ab));
      const __m512 ha = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(ab)), 16));
      const __m512 hb = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(ab, 1)), 16));
      if (pl != nullptr) {  // remainders: a - float(bf16(a)), exact in float32, rounded to bfloat16
        const __m512i lo = (__m512i)_mm512_cvtne2ps_pbh(_mm512_sub_ps(b, hb), _mm512_sub_ps(a, ha));
        _mm512_storeu_si512(pl + (j / 2) * 2 * kBlockQ + 2 * x, _mm512_permutexvar_epi16(mix, lo));
      } else {
        acc_r = _mm512_add_ps(_mm512_add_ps(acc_r, ha), hb);  // the P that P.V multiplies (see col_softmax_pack)
      }
      acc = _mm512_add_ps(_mm512_add_ps(acc, a), b);
    }
    *sum = acc;
    *sum_r = pl != nullptr ? acc : acc_r;  // P to 16 bits (split): the float32 sum is its own
    *mx = hi;
    *top = hx;
  };
  __mmask16 moved = 0;
  for (int64_t x = 0; x < ncols; x += 16) {
    const __m512 m_old = _mm512_loadu_ps(m + x);
    const __mmask16 had = _mm512_cmp_ps_mask(m_old, ninf, _CMP_NEQ_OQ);  // columns with a running max
    __m512 sum, sum_r, mx, top;
    if (had == 0xFFFF) {
      pass(x, m_old, &sum, &sum_r, &mx, &top);
      if (_mm512_cmp_ps_mask(top, lazy, _CMP_GT_OQ) == 0) {  // no exponent past the threshold: done
        _mm512_storeu_ps(l + x, _mm512_add_ps(_mm512_loadu_ps(l + x), sum));
        _mm512_storeu_ps(lr + x, _mm512_add_ps(_mm512_loadu_ps(lr + x), sum_r));
        _mm512_storeu_ps(alpha + x, one);
        continue;
      }
    } else {
      mx = ninf;
      for (int64_t j = 0; j < nk; ++j) mx = _mm512_max_ps(mx, _mm512_loadu_ps(st + j * kBlockQ + x));
    }
    // Raise the max where the block's passes it by more than kLazyRescale, or where there was none.
    const __m512 bmax = mul_rn(mx, s);
    const __mmask16 raise = _mm512_cmp_ps_mask(bmax, _mm512_add_ps(m_old, lazy), _CMP_GT_OQ);
    const __m512 m_new = _mm512_mask_blend_ps(raise, m_old, bmax);
    const __m512 m_use = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(m_new, ninf, _CMP_EQ_OQ), m_new, _mm512_setzero_ps());
    pass(x, m_use, &sum, &sum_r, &mx, &top);
    // alpha = 1 where the max stayed, or where there was none (O^T and l are still 0 there)
    const __mmask16 rescaled = raise & had;
    moved |= rescaled;
    const __m512 al = _mm512_mask_blend_ps(rescaled, one, exp2_16(_mm512_sub_ps(m_old, m_new)));
    _mm512_storeu_ps(l + x, _mm512_fmadd_ps(al, _mm512_loadu_ps(l + x), sum));
    _mm512_storeu_ps(lr + x, _mm512_fmadd_ps(al, _mm512_loadu_ps(lr + x), sum_r));
    _mm512_storeu_ps(m + x, m_new);
    _mm512_storeu_ps(alpha + x, al);
  }
  return moved != 0;
}
#endif

// Step 3 of the column form: output row c = column c of O^T (Dv x nrows,
// row stride kBlockQ) / l[c], rounded to T, for every live column; a column
// with l = 0 (it saw no key) is written as zeros. dst(c): row c's first
// element, features contiguous. The caller writes the log-sum-exp.
template <typename T, typename Dst>
void col_write_out(const float* ot, int64_t nrows, int64_t Dv, const float* l, const Dst& dst) {
  for (int64_t c = 0; c < nrows; ++c) {
    T* row = dst(c);
    const float inv = l[c] > 0.0f ? 1.0f / l[c] : 0.0f;
    for (int64_t d = 0; d < Dv; ++d) row[d] = static_cast<T>(l[c] > 0.0f ? ot[d * kBlockQ + c] * inv : 0.0f);
  }
}

#if defined(FLASH_METAL_COLS_AVX512_BF16)
// 16 columns x 16 features at a time through a register transpose (the
// scalar loop above reads O^T down its columns, a 384-byte stride, and was
// 5-20% of the bfloat16 forward on the AMX Xeon).
inline void store16(c10::BFloat16* p, __mmask16 m, __m512 x) {
  _mm256_mask_storeu_epi16(p, m, (__m256i)_mm512_cvtneps_pbh(x));
}
inline void store16(c10::Half* p, __mmask16 m, __m512 x) {
  _mm256_mask_storeu_epi16(p, m, _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
// O (16-bit T: bfloat16 by vcvtneps2bf16, float16 by vcvtps2ph, both round to nearest even).
template <typename T, typename Dst>
void col_write_out_16(const float* ot, int64_t nrows, int64_t Dv, const float* l, const Dst& dst) {
  for (int64_t c0 = 0; c0 < nrows; c0 += 16) {
    const int64_t cn = std::min<int64_t>(16, nrows - c0);
    const __mmask16 cmask = static_cast<__mmask16>((1u << cn) - 1);
    alignas(64) float inv[16];
    for (int64_t i = 0; i < 16; ++i) inv[i] = i < cn && l[c0 + i] > 0.0f ? 1.0f / l[c0 + i] : 0.0f;
    for (int64_t d0 = 0; d0 < Dv; d0 += 16) {
      const int64_t dn = std::min<int64_t>(16, Dv - d0);
      __m512 r[16];
      for (int64_t i = 0; i < 16; ++i)
        r[i] = i < dn ? _mm512_maskz_loadu_ps(cmask, ot + (d0 + i) * kBlockQ + c0) : _mm512_setzero_ps();
      transpose16x16_ps(r);
      const __mmask16 dmask = static_cast<__mmask16>((1u << dn) - 1);
      for (int64_t i = 0; i < cn; ++i) store16(dst(c0 + i) + d0, dmask, _mm512_mul_ps(r[i], _mm512_set1_ps(inv[i])));
    }
  }
}
#endif

// O^T (Dv x ncols, row stride kBlockQ) += V^T's column of one key times its
// row of P, for the last key of an odd block (see attention_item): vh[d *
// ld] (+ vl[d * ld], the split form's low half) is the key's feature d, and
// p[2 * c] (+ pl[2 * c]) its probability in query column c (the first of
// its VNNI pair, whose partner is the zero pad).
template <typename V, typename P>
void col_last_key(float* o, int64_t Dv, int64_t ncols, const V* vh, const V* vl, int64_t ld, const P* p, const P* pl) {
  alignas(64) float pf[kBlockQ];
  for (int64_t c = 0; c < ncols; ++c)
    pf[c] = static_cast<float>(p[2 * c]) + (pl != nullptr ? static_cast<float>(pl[2 * c]) : 0.0f);
  for (int64_t d = 0; d < Dv; ++d) {
    const Vec vd = Vec::broadcast(static_cast<float>(vh[d * ld]) + (vl != nullptr ? static_cast<float>(vl[d * ld]) : 0.0f));
    float* row = o + d * kBlockQ;
    for (int64_t x = 0; x < ncols; x += kW) fmadd(vd, Vec::load(pf + x), Vec::load(row + x)).store(row + x);
  }
}

// What an item needs for the column form: the thread's buffers and the
// call's V^T (nullptr: the item takes the row form of brgemm_tiles.h).
template <typename T>
struct ColForm {
  ColBuffers<T>* buf = nullptr;
  const T* vt = nullptr;
  int64_t vt_ld = 0;
  int64_t block_k = 0;  // keys per block (mx_block_k)
  // The split float16 form (brgemm_split.h): K' rows, kx_ld apart, k_rows per
  // (b, kv head), and V^T's two bfloat16 halves (vt_ld as vt); vt is null.
  bool split = false;
  const c10::BFloat16* kx = nullptr;
  int64_t kx_ld = 0, k_rows = 0;
  const c10::BFloat16 *vth = nullptr, *vtl = nullptr;
};

// st (nk x ncols, row stride kBlockQ) *= scale, for blocks whose score
// options need the base-2 logits before the softmax.
inline void scale_block(float* st, int64_t nk, int64_t ncols, float scale) {
  const Vec s = Vec::broadcast(scale);
  for (int64_t j = 0; j < nk; ++j)
    for (int64_t x = 0; x < ncols; x += kW) (s * Vec::load(st + j * kBlockQ + x)).store(st + j * kBlockQ + x);
}

// O^T (Dv x ncols, row stride kBlockQ) *= alpha, column by column.
// A chunk of kW columns whose alphas are all 1 is skipped (the lazy rescale
// of col_softmax_pack leaves most of them so).
inline void col_scale_o(float* o, int64_t Dv, int64_t ncols, const float* alpha) {
  for (int64_t x = 0; x < ncols; x += kW) {
    if (std::all_of(alpha + x, alpha + x + kW, [](float a) { return a == 1.0f; })) continue;
    const Vec a = Vec::load(alpha + x);
    for (int64_t d = 0; d < Dv; ++d) (Vec::load(o + d * kBlockQ + x) * a).store(o + d * kBlockQ + x);
  }
}

}  // namespace
}  // namespace fwd
}  // namespace cpu
}  // namespace flash_metal
