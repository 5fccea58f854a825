// The post's first kernel, generalized: one query row per thread, keys and
// values read straight from device memory. Every thread walks the keys its
// row may see one at a time, keeping its own running max, sum and
// accumulator. Simple, and memory-bound: the 32 threads of a group each read
// the same K and V rows separately.
#pragma once

#include "../common/attention_common.h"

namespace flash_metal {

// T: element type of q, k, v and the output (float, half or bfloat).
// DMAX: head_dim bucket; sizes the per-thread query row and accumulator
// (head_dim <= DMAX) and bounds every loop over a row.
// THREADS: threads per threadgroup, i.e. query rows per group.
template <typename T, int DMAX, int THREADS>
[[kernel]] [[max_total_threads_per_threadgroup(kPostMaxThreads)]] void flash_attention_untiled(
    device const T* q [[buffer(0)]],
    device const T* k [[buffer(1)]],
    device const T* v [[buffer(2)]],
    device T* o [[buffer(3)]],
    device float* lse [[buffer(4)]],
    constant AttentionParams& p [[buffer(5)]],
    uint3 group [[threadgroup_position_in_grid]],
    uint lane [[thread_index_in_threadgroup]]) {
  static_assert(THREADS <= kPostMaxThreads, "the declared threadgroup limit (params.h)");
  const int row = int(group.x) * THREADS + int(lane);
  if (row >= p.q_len) return;  // no barrier in this kernel, so an early exit is safe
  const HeadOffsets h = head_offsets(p, group.z, group.y);
  const int D = p.head_dim;

  // The query row, pre-multiplied by scale * log2(e) (float32, as every
  // product below), and the accumulator: DMAX lanes, zero past head_dim, so
  // that every index below is a compile-time constant and both arrays can
  // live in registers (see "Registers, not stack" in attention_common.h).
  float qrow[DMAX];
  float acc[DMAX];
  load_query_row<DMAX>(q, p, h, row, qrow, acc);

  OnlineSoftmax sm;  // "no key yet"
  const int n_keys = visible_keys(p, row);  // the causal loop simply ends early
  for (int j = 0; j < n_keys; ++j) {
    device const T* kp = k + h.k + int64_t(j) * p.k_row_stride;
    float score = 0.0f;
    FM_UNROLL for (int c = 0; c < DMAX; ++c) score += qrow[c] * (c < D ? float(kp[int64_t(c) * p.k_dim_stride]) : 0.0f);
    float w;
    const float alpha = sm.update(score, &w);
    device const T* vp = v + h.v + int64_t(j) * p.v_row_stride;
    FM_UNROLL for (int c = 0; c < DMAX; ++c) {
      acc[c] = acc[c] * alpha + w * (c < D ? float(vp[int64_t(c) * p.v_dim_stride]) : 0.0f);
    }
  }

  store_output_row<DMAX>(o, lse, p, h, row, acc, sm);
}

}  // namespace flash_metal
