// The backward of attention sinks (gpt-oss): the gradient of each query
// head's sink logit, after the backward's dQ kernel (attention_backward.h)
// has written Delta.
//
// The sink is a virtual key of value zero whose probability in row i is
// P_i = exp(sink - lse_i) (lse includes the sink). Its score enters only the
// softmax, so dsink = sum over rows of P_i * (dP_i - Delta'_i) with dP_i = 0
// (the value is zero) and Delta'_i = rowsum(dO_i * O_i) - grad_lse_i, which
// is exactly the Delta the dQ kernel stores per row. Hence
//   grad_sinks[h] = -sum over (batch, row) of exp(sink_h - lse_i) * Delta_i.
// The gradients of q, k and v need nothing new: P of every real key is
// rebuilt from the same lse, which already holds the sink.
//
// Deterministic, no atomics: one SIMD-group per query head; lane j sums rows
// j, j + 32, ... of each sequence in order, then a fixed butterfly of
// shuffles adds the 32 lane sums. The rows are few beside the attention's
// work (B * Nq per head, each read once), so one SIMD-group per head keeps
// it simple.
//
// MSL subset: as attention_common.h.
#pragma once

#include "../common/attention_features.h"

namespace flash_metal {

// Launch: grid (Hq, 1, 1), threadgroup (32, 1, 1), no threadgroup memory;
// function constant fc_varlen (9; the others are unread). Buffers: lse 4
// (the forward's, any strides), params 5, Delta 13 (packed as the dQ kernel
// writes it: (B, Hq, Nq) or, varlen, (Hq, total_q)), cu_seqlens 15 and 16
// (read under fc_varlen only), sinks 17 (float32, Hq), grad_sinks 18
// (float32, Hq, written). A row whose lse is -inf (from its bits: only with
// a sink of -inf) and a sink at or below kMaskedScore contribute 0.
// LANES: lanes per head, one SIMD-group (a template only so that the
// instantiation, like every kernel's, lives in attention.metal).
template <int LANES>
[[kernel]] [[max_total_threads_per_threadgroup(kSinksGradMaxThreads)]] void flash_sinks_grad(
    device const float* lse [[buffer(4)]],
    constant AttentionParams& p [[buffer(5)]],
    device const float* delta [[buffer(13)]],
    device const int* cu_seqlens_q [[buffer(15)]],
    device const int* cu_seqlens_k [[buffer(16)]],
    device const float* sinks [[buffer(17)]],
    device float* grad_sinks [[buffer(18)]],
    uint3 group [[threadgroup_position_in_grid]],
    uint lane [[thread_index_in_simdgroup]]) {
  static_assert(LANES == 32 && LANES <= kSinksGradMaxThreads, "one SIMD-group per head, the shuffles below");
  const int head = int(group.x);
  const float sink = sinks[head];
  const bool has_sink = !(sink * M_LOG2E_F <= kMaskedScore);
  // Delta's rows per head: Nq, or total_q for varlen (one packed batch).
  const int packed_q = fc_varlen ? p.total_q : p.q_len;
  float sum = 0.0f;
  for (int b = 0; b < p.batch && has_sink; ++b) {
    const SeqView sv = sequence_view(p, cu_seqlens_q, cu_seqlens_k, uint(b));
    const uint packed_b = fc_varlen ? 0u : uint(b);
    device const float* lse_row0 = lse + int64_t(b) * p.lse_batch_stride + int64_t(head) * p.lse_head_stride +
                                   sv.q_row0 * p.lse_row_stride;
    device const float* delta_row0 = delta + (int64_t(packed_b) * p.q_heads + head) * packed_q + sv.q_row0;
    for (int i = int(lane); i < sv.q_len; i += LANES) {
      const float l = lse_row0[int64_t(i) * p.lse_row_stride];
      if (as_type<uint>(l) != kNegInfBits) sum = fma(-exp(sink - l), delta_row0[i], sum);
    }
  }
  // Lane sums added in a fixed tree (same order on every run).
  sum += simd_shuffle_xor(sum, 16);
  sum += simd_shuffle_xor(sum, 8);
  sum += simd_shuffle_xor(sum, 4);
  sum += simd_shuffle_xor(sum, 2);
  sum += simd_shuffle_xor(sum, 1);
  if (lane == 0) grad_sinks[head] = sum;
}

}  // namespace flash_metal
