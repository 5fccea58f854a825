// Pieces shared by every attention kernel: the function constants, tensor
// addressing through AttentionParams, and the online-softmax state.
//
// MSL subset: this code must compile with Apple's metal compiler and, as C++,
// in the test suite's emulator (tests/metal_emulator/README.md lists the
// rules). No address-space overloads, no Apple-internal builtins.
#pragma once

#include <metal_stdlib>
#include "params.h"

using namespace metal;

namespace flash_metal {

// [[function_constant(0)]]: causal masking, bottom-right aligned (query i sees
// keys j <= i + params.causal_offset). A function constant rather than a
// runtime flag so the non-causal pipeline carries no masking code at all.
constant bool fc_causal [[function_constant(0)]];

// Element offsets of the (batch, head) slices a threadgroup works on.
struct HeadOffsets {
  int64_t q;    // into q, for query head `head`
  int64_t k;    // into k, for the kv head that query head reads
  int64_t v;    // into v, likewise
  int64_t o;    // into the output
  int64_t lse;  // into lse
};

inline HeadOffsets head_offsets(constant AttentionParams& p, uint batch, uint head) {
  const uint kv_head = head / uint(p.gqa_ratio);  // GQA: gqa_ratio query heads share one kv head
  HeadOffsets h;
  h.q = int64_t(batch) * p.q_batch_stride + int64_t(head) * p.q_head_stride;
  h.k = int64_t(batch) * p.k_batch_stride + int64_t(kv_head) * p.k_head_stride;
  h.v = int64_t(batch) * p.v_batch_stride + int64_t(kv_head) * p.v_head_stride;
  h.o = int64_t(batch) * p.o_batch_stride + int64_t(head) * p.o_head_stride;
  h.lse = int64_t(batch) * p.lse_batch_stride + int64_t(head) * p.lse_head_stride;
  return h;
}

// Number of keys query `row` may attend: all of them, or under causal
// masking those with j <= row + causal_offset (possibly none).
inline int visible_keys(constant AttentionParams& p, int row) {
  if (!fc_causal) return p.kv_len;
  return clamp(row + p.causal_offset + 1, 0, p.kv_len);
}

// Fast math. Apple's compiler defaults to fast math, whose contract is that
// no value is ever infinite or NaN: it may fold `x == -INFINITY` to false,
// treat an infinite operand as undefined, and even treat +-FLT_MAX as
// infinities in min/max (LLVM folds max(x, -FLT_MAX) to x when infinities are
// assumed away). So the softmax below never starts from, compares with, or
// computes an infinity. Its only infinity is the lse = -inf stored for a row
// that saw no key, made from bits (see store_output_row). MLX's finite_min
// sentinel is the model; unlike MLX, a masked score here gets weight 0 by an
// explicit test, not through exp(-inf) = 0.
//
// kMaskedScore: base-2 scores at or below it count as masked (weight 0), and
// the running max starts there ("no key yet"). Why -2^100: (1) far below any
// real score (|q.k * scale * log2(e)| of real activations is many orders of
// magnitude smaller), so no real key is lost; (2) far enough inside float32's
// range that fast math cannot confuse it with -inf (unlike -FLT_MAX); (3) small
// enough that subtracting any finite score from it stays finite: 2^100 is below
// half an ulp of FLT_MAX (2^103), so kMaskedScore - FLT_MAX rounds to -FLT_MAX,
// never to -inf. Note a -inf score from the inputs (a -inf in k, or a q.k that
// overflows float32) is still produced by the hardware as -inf: the first
// thing update() does is map it to kMaskedScore with a comparison, which the
// compiler cannot fold because kMaskedScore is finite.
// Written in decimal (exactly -2^100): a hexadecimal float literal is C++17,
// and MSL 3.1's base language is C++14.
constant float kMaskedScore = -1267650600228229401496703205376.0f;
// Bits of float -inf (IEEE 754 binary32: sign 1, exponent all ones, mantissa 0).
constant uint kNegInfBits = 0xff800000u;

// Online softmax for one query row, in base 2: scores arrive already
// multiplied by scale * log2(e), so exp(s - m) becomes exp2(s - m). (Base-2
// scores: an idea from FlashAttention-2 and metal-flash-attention.)
//
// State: m is the running max, kMaskedScore while no key has counted ("no key
// yet"); l is the running sum of exp2(score - m), 0 exactly until the first
// unmasked key and at least 1 after it (the max key itself adds exp2(0) = 1),
// so `l > 0` is the explicit "saw a key" test of the empty-row path.
struct OnlineSoftmax {
  float m = kMaskedScore;  // running maximum of the base-2 scores seen so far
  float l = 0.0f;          // running sum of exp2(score - m)

  // Takes one score; returns the factor by which the caller must rescale its
  // accumulator, and sets *weight to the new score's exp2(score - m).
  inline float update(float score, thread float* weight) {
    // A masked score (-inf, overflowed, or below the floor) changes nothing:
    // weight 0, m kept, alpha = exp2(0) = 1. It is replaced by the finite
    // floor before any arithmetic, and its weight is 0 by this test, not by
    // exp2(-inf) = 0 (FlashAttention-2 instead guards exp2(-inf - -inf)).
    // A NaN score is not masked: under IEEE rules it still turns the row
    // NaN, as in the CPU kernel and the float64 oracle.
    const bool masked = score <= kMaskedScore;
    const float s = masked ? kMaskedScore : score;
    const float m_new = max(m, s);           // finite; equals m for a masked key
    const float alpha = exp2(m - m_new);     // finite argument <= 0; 0 at the first key (l = 0 anyway)
    *weight = masked ? 0.0f : exp2(s - m_new);
    l = l * alpha + *weight;
    m = m_new;
    return alpha;
  }

  // True once an unmasked key has counted; false for an empty row.
  inline bool has_key() const { return l > 0.0f; }
  // Natural-log log-sum-exp of the raw scaled scores, (m + log2 l) * ln 2;
  // only meaningful when has_key().
  inline float lse() const { return (m + log2(l)) * M_LN2_F; }
  // 1/l, or 0 for a row that saw no key, so its output is all zeros.
  inline float inv_sum() const { return has_key() ? 1.0f / l : 0.0f; }
};

// Registers, not stack. Each thread keeps its query row and its output
// accumulator in float arrays of the compile-time bucket DMAX (qrow[DMAX],
// acc[DMAX]). A GPU keeps a private array in registers only if every index
// into it is known at compile time; an index that depends on a runtime value,
// such as a loop to p.head_dim, forces the whole array into per-thread stack
// memory, and every access becomes a memory round trip. So every loop over a
// row runs to DMAX and is fully unrolled (FM_UNROLL), making each index a
// constant: lanes c >= head_dim hold exact zeros, which add nothing to a dot
// product and stay zero in the accumulator, and every read or write of
// memory at c >= head_dim is skipped by a `c < D` test (uniform across the
// group, so it costs no divergence). qrow and acc take 2 * DMAX floats: for
// DMAX 32 and 64 that fits Apple's per-thread register budget; at 128 and 256
// the compiler will still spill some, which only splitting D across a
// SIMD-group would avoid. None of this changes a result, and the emulator
// cannot time it; what it can check is LLVM's view (Apple's compiler is
// LLVM-based): tests/metal_emulator_tests/test_emu_registers.py asserts that
// no kernel keeps qrow or acc as an array in memory once optimized. (Full
// unrolling with _Pragma("clang loop unroll(full)"), as MLX's kernels do.)
#define FM_UNROLL _Pragma("clang loop unroll(full)")
// The helpers that take qrow or acc by pointer must be inlined into the
// kernel: an array whose address is passed to a real call has to live in
// memory. always_inline makes that a guarantee rather than a heuristic (the
// unrolled bodies are large enough that a compiler may decline otherwise);
// MLX marks its kernel helpers the same way.
#define FM_INLINE inline __attribute__((always_inline))

// Loads query row `row` as float32, pre-multiplied by scale * log2(e) and
// zero-padded to DMAX, and zeroes the matching accumulator: every kernel's
// first step. Never reads q past head_dim.
template <int DMAX, typename T>
FM_INLINE void load_query_row(device const T* q, constant AttentionParams& p, thread const HeadOffsets& h, int row,
                           thread float* qrow, thread float* acc) {
  device const T* qp = q + h.q + int64_t(row) * p.q_row_stride;
  const int D = p.head_dim;
  FM_UNROLL for (int c = 0; c < DMAX; ++c) {
    qrow[c] = c < D ? float(qp[int64_t(c) * p.q_dim_stride]) * p.scale_log2 : 0.0f;
    acc[c] = 0.0f;
  }
}

// Writes acc / l to output row `row` (in T) and the row's log-sum-exp: every
// kernel's last step. A row that saw no key stores zeros and -inf. Loops to
// DMAX (constant indices into acc) but writes only the head_dim real lanes.
template <int DMAX, typename T>
FM_INLINE void store_output_row(device T* o, device float* lse, constant AttentionParams& p, thread const HeadOffsets& h,
                             int row, thread const float* acc, thread const OnlineSoftmax& sm) {
  const float inv = sm.inv_sum();
  device T* op = o + h.o + int64_t(row) * p.o_row_stride;
  const int D = p.head_dim;
  FM_UNROLL for (int c = 0; c < DMAX; ++c) {
    if (c < D) op[int64_t(c) * p.o_dim_stride] = static_cast<T>(acc[c] * inv);
  }
  // The row's lse, or -inf for a row that saw no key: README's contract and
  // the CPU kernel's. Under fast math the compiler may assume no float is
  // ever infinite, so a -INFINITY literal, or a float select with one, could
  // be folded into anything; the -inf is instead made from its bits and
  // chosen by an integer select, which no floating-point assumption touches.
  // It is only stored, never computed with.
  const uint bits = sm.has_key() ? as_type<uint>(sm.lse()) : kNegInfBits;
  lse[h.lse + int64_t(row) * p.lse_row_stride] = as_type<float>(bits);
}

}  // namespace flash_metal
