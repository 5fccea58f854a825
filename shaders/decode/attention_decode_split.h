// The split-KV decode pair ("flash decoding"): pass 1, flash_decode_split,
// attends the GQA group's rows to one block of keys and writes unnormalized
// partials with their (max, sum); pass 2, flash_decode_merge, rescales and
// sums them per output row (MLX's sdpa_vector_2pass has the same two
// passes; the code is this project's own). Launch, bindings and scratch:
// the top of attention_decode.h, whose helpers both kernels use.
#pragma once

#include "attention_decode.h"

namespace flash_metal {

// Index of (batch, head, row, split) in the packed partial buffers
// [B][Hq][Nq][kv_splits].
inline int64_t decode_partial_index(constant AttentionParams& p, int batch, DecodeRow dr, int split) {
  return ((int64_t(batch) * p.q_heads + dr.head) * p.q_len + dr.row) * p.kv_splits + split;
}

// The live row group rg's unnormalized partials of split `split` (key
// group 0 after the merge): its slice of acc and, from lane 0, (m, l).
template <int DMAX>
FM_INLINE void decode_store_partials(thread const DecodeState<DMAX>& st, device float* partial_o,
                                     device float* partial_stats, constant AttentionParams& p, int batch, int kv_head,
                                     int rg, int split, uint lane) {
  constexpr int RS = DecodeState<DMAX>::RS;
  constexpr int DPL = DecodeState<DMAX>::DPL;
  const int R = p.gqa_ratio * p.q_len;
  FM_UNROLL for (int r = 0; r < RS; ++r) {
    const int rr = rg * RS + r;
    if (rr < R) {
      const int64_t idx = decode_partial_index(p, batch, decode_row(p, kv_head, rr), split);
      device float* po = partial_o + idx * p.head_dim_v;
      FM_UNROLL for (int i = 0; i < DPL; ++i) {
        const int c = decode_feature<DPL>(i, lane, fc_dense);
        if (c < p.head_dim_v) po[c] = st.acc[r][i];
      }
      if (lane == 0) {
        partial_stats[2 * idx] = st.m[r];
        partial_stats[2 * idx + 1] = st.l[r];
      }
    }
  }
}

// Split pass 1: the threadgroup (batch, kv_head, split) attends the group's
// rows to keys [split * split_keys, min((split + 1) * split_keys, Nk)) (and
// no further than causal masking lets any row see) and writes unnormalized
// partials: partial_o[B][Hq][Nq][kv_splits][head_dim_v] (sum of exp2(s - m) * v, v's width)
// and partial_stats[B][Hq][Nq][kv_splits][2] = (m, l), m the base-2 max and
// l the sum of exp2(s - m). A block no row may see writes m = kMaskedScore,
// l = 0 and zeros (split 0 under fc_has_sinks: m = the sink, l = 1).
// Launch: top of this file.
template <typename T, int DMAX>
[[kernel]] [[max_total_threads_per_threadgroup(kDecodeMaxThreads)]] void flash_decode_split(
    device const T* q [[buffer(0)]],
    device const T* k [[buffer(1)]],
    device const T* v [[buffer(2)]],
    constant AttentionParams& p [[buffer(5)]],
    device float* partial_o [[buffer(6)]],
    device float* partial_stats [[buffer(7)]],
    device const uchar* mask [[buffer(14)]],
    device const int* cu_seqlens_q [[buffer(15)]],
    device const int* cu_seqlens_k [[buffer(16)]],
    device const float* sinks [[buffer(17)]],
    device const int* block_table [[buffer(19)]],
    device const int* cache_seqlens [[buffer(20)]],
    threadgroup float* smem [[threadgroup(0)]],
    uint3 group [[threadgroup_position_in_grid]],
    uint3 groups [[threadgroups_per_grid]],
    uint3 tpos [[thread_position_in_threadgroup]],
    uint3 tsize [[threads_per_threadgroup]],
    uint lane [[thread_index_in_simdgroup]]) {
  constexpr int RS = DecodeState<DMAX>::RS;
  const DecodeShape sh = decode_shape(p, group, groups, tpos, tsize, RS);
  const int kv_head = sh.kv_head;
  const int batch = int(group.y);
  const int split = int(group.z);
  const int R = p.gqa_ratio * p.q_len;
  // never varlen; fc_paged: the batch's cache and table row (flash_decode)
  const SeqView seq = fc_paged ? paged_sequence_view(p, cache_seqlens, uint(batch))
                               : sequence_view(p, cu_seqlens_q, cu_seqlens_k, uint(batch));
  device const int* table = block_table + (fc_paged ? int64_t(batch) * p.table_stride : 0);
  // The split's keys, cut to those some row may see (as flash_decode). A
  // split wholly outside them (key_begin >= key_end: past the causal bound
  // or behind the left window of every row) runs no block and writes the
  // "no key" partial, m = kMaskedScore, l = 0 and zeros, which the merge
  // weighs 0.
  const int split_begin = split * p.split_keys;
  const int key_begin = max(split_begin, first_visible_key(seq, 0));
  const int key_end = min(split_begin + p.split_keys, visible_key_end(seq, p.q_len - 1));
  const auto kr = decode_rows<T, DMAX>(k, p.k_batch_stride, p.k_head_stride, p.k_row_stride, p.k_dim_stride,
                                       p.head_dim, batch, kv_head);
  const auto vr = decode_rows<T, DMAX>(v, p.v_batch_stride, p.v_head_stride, p.v_row_stride, p.v_dim_stride,
                                       p.head_dim_v, batch, kv_head);
  for (int round = 0; round < sh.rounds; ++round) {
    const int rg = sh.row_group(round);
    const bool live = rg * RS < R;
    DecodeState<DMAX> st;
    // a dead row group: zeros, "no key". The sink in split 0's key group 0
    // only: the merges add the partial sums, so any other split carrying it
    // would count it again.
    decode_init<T, DMAX>(st, q, p, batch, kv_head, rg, lane, sinks, split == 0 && sh.kg == 0);
    decode_attend<T, DMAX>(st, kr, vr, p, seq, mask, table, batch, kv_head, rg, live, key_begin, key_end, sh.kg,
                           sh.KG, lane);
    if (sh.KG > 1) decode_merge_key_groups<DMAX>(st, smem, sh.kg, sh.KG, sh.rgl, sh.RGL, lane);
    if (live && sh.kg == 0) decode_store_partials<DMAX>(st, partial_o, partial_stats, p, batch, kv_head, rg, split, lane);
  }
}

// Split pass 2: one SIMD-group per output row (batch, head, row) merges the
// row's kv_splits partials: M = max_s m_s, l = sum_s l_s * exp2(m_s - M),
// out = sum_s partial_s * exp2(m_s - M) / l, lse = (M + log2 l) * ln 2, in
// natural log; zeros and -inf for a row no block saw a key for (every
// m_s = kMaskedScore and l_s = 0, so l = 0). Blocks with no key contribute
// weight exp2(kMaskedScore - M) * 0 = 0 and finite arithmetic throughout.
// Launch: top of this file.
template <typename T, int DMAX>
[[kernel]] [[max_total_threads_per_threadgroup(kDecodeMergeMaxThreads)]] void flash_decode_merge(
    device T* o [[buffer(3)]],
    device float* lse [[buffer(4)]],
    constant AttentionParams& p [[buffer(5)]],
    device const float* partial_o [[buffer(6)]],
    device const float* partial_stats [[buffer(7)]],
    uint3 group [[threadgroup_position_in_grid]],
    uint lane [[thread_index_in_simdgroup]]) {
  constexpr int DPL = (DMAX + 31) / 32;
  const int batch = int(group.z);
  DecodeRow dr;
  dr.head = int(group.y);
  dr.row = int(group.x);
  const int64_t base = decode_partial_index(p, batch, dr, 0);
  const int S = p.kv_splits;
  device const float* stats = partial_stats + 2 * base;

  // The max over splits, lanes striding the splits, then simd_max (MLX's
  // sdpa_vector_2pass_2 reduction).
  float M = kMaskedScore;
  for (int s = int(lane); s < S; s += 32) M = max(M, stats[2 * s]);
  M = simd_max(M);
  float l = 0.0f;
  for (int s = int(lane); s < S; s += 32) l += stats[2 * s + 1] * exp2(stats[2 * s] - M);
  l = simd_sum(l);

  float acc[DPL];
  FM_UNROLL for (int i = 0; i < DPL; ++i) acc[i] = 0.0f;
  for (int s = 0; s < S; ++s) {
    const float f = exp2(stats[2 * s] - M);  // finite argument <= 0
    device const float* po = partial_o + (base + s) * p.head_dim_v;
    FM_UNROLL for (int i = 0; i < DPL; ++i) {
      const int c = i * 32 + int(lane);
      if (c < p.head_dim_v) acc[i] = fma(po[c], f, acc[i]);
    }
  }
  OnlineSoftmax sm;
  sm.m = M;
  sm.l = l;
  decode_store_row<T, DMAX>(o, lse, p, batch, dr, acc, sm, lane, false);  // the strided layout, as acc above
}

}  // namespace flash_metal
