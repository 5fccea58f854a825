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

// Online softmax for one query row, in base 2: scores arrive already
// multiplied by scale * log2(e), so exp(s - m) becomes exp2(s - m). The max
// starts at -inf. A score can itself be -inf (a -inf in k, or a product that
// overflows float32), and while every score so far is -inf the max is -inf
// too; exp2(-inf - (-inf)) would be NaN. FlashAttention-2's guard: measure
// against 0 while the max is -inf, so such keys get exp2(-inf) = 0. (Base-2
// scores: an idea from FlashAttention-2 and metal-flash-attention.)
struct OnlineSoftmax {
  float m;  // running maximum of the base-2 scores seen so far
  float l;  // running sum of exp2(score - m)

  // Takes one score; returns the factor by which the caller must rescale its
  // accumulator, and sets *weight to the new score's exp2(score - m).
  inline float update(float score, thread float* weight) {
    const float m_new = max(m, score);
    const float m_ref = m_new == -INFINITY ? 0.0f : m_new;
    const float alpha = exp2(m - m_ref);
    *weight = exp2(score - m_ref);
    l = l * alpha + *weight;
    m = m_new;
    return alpha;
  }

  // Natural-log log-sum-exp of the raw scaled scores: (m + log2 l) * ln 2;
  // -inf when the row saw no key.
  inline float lse() const { return l > 0.0f ? (m + log2(l)) * M_LN2_F : -INFINITY; }
  // 1/l, or 0 for a row that saw no key, so its output is all zeros.
  inline float inv_sum() const { return l > 0.0f ? 1.0f / l : 0.0f; }
};

// Loads query row `row` as float32, pre-multiplied by scale * log2(e), and
// zeroes the matching accumulator: every kernel's first step.
template <typename T>
inline void load_query_row(device const T* q, constant AttentionParams& p, thread const HeadOffsets& h, int row,
                           thread float* qrow, thread float* acc) {
  device const T* qp = q + h.q + int64_t(row) * p.q_row_stride;
  for (int c = 0; c < p.head_dim; ++c) {
    qrow[c] = float(qp[int64_t(c) * p.q_dim_stride]) * p.scale_log2;
    acc[c] = 0.0f;
  }
}

// Writes acc / l to output row `row` (in T) and the row's log-sum-exp: every
// kernel's last step. A row that saw no key stores zeros and -inf.
template <typename T>
inline void store_output_row(device T* o, device float* lse, constant AttentionParams& p, thread const HeadOffsets& h,
                             int row, thread const float* acc, thread const OnlineSoftmax& sm) {
  const float inv = sm.inv_sum();
  device T* op = o + h.o + int64_t(row) * p.o_row_stride;
  for (int c = 0; c < p.head_dim; ++c) op[int64_t(c) * p.o_dim_stride] = static_cast<T>(acc[c] * inv);
  lse[h.lse + int64_t(row) * p.lse_row_stride] = sm.lse();
}

}  // namespace flash_metal
