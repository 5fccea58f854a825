// The options every fast kernel family (prefill, decode, backward) serves
// beyond plain causal attention: an attention mask, a sliding window,
// logit softcapping and packed variable-length sequences. Each is a
// function constant, so a pipeline built without it carries no code for it.
//
// The contract (docs/usage.md, "Masks, sliding windows, softcapping, packed sequences"; the float64
// oracle flash_metal/reference.py spells the same rules):
//   score  s   = scale * q.k                       (kernels keep it in base 2:
//                                                   s2 = s * log2(e), q pre-scaled)
//   softcap s  = softcap * tanh(s / softcap)        (fc_softcap; Gemma 2's order:
//                                                   the cap comes before the mask)
//   mask    s  = s + mask[b, h, i, j]                (additive, fc_has_mask)
//           key j dropped where mask[b, h, i, j] is False (bool mask)
//   window  key j dropped unless i + lower <= j      (fc_window_left)
//                         and j <= i + upper         (fc_causal: causal or a right window)
// A key whose final base-2 score is at or below kMaskedScore (-2^100: -inf,
// or an additive value such as float32's finfo.min) counts as masked, so a
// row whose every key is masked gives zeros and lse = -inf, never NaN.
//
// MSL subset: as attention_common.h (the emulator compiles this as C++).
#pragma once

#include "attention_common.h"

namespace flash_metal {

// [[function_constant(4)]]: an attn_mask is bound at [[buffer(14)]].
constant bool fc_has_mask [[function_constant(4)]];
// [[function_constant(5)]]: the mask is bool (1 byte per element, nonzero = attend).
constant bool fc_mask_bool [[function_constant(5)]];
// [[function_constant(6)]]: an additive mask is float32 (else it is in the input dtype T).
constant bool fc_mask_float32 [[function_constant(6)]];
// [[function_constant(7)]]: keys are bounded below (window_left >= 0).
constant bool fc_window_left [[function_constant(7)]];
// [[function_constant(8)]]: logit softcapping.
constant bool fc_softcap [[function_constant(8)]];
// [[function_constant(9)]]: packed variable-length sequences; cu_seqlens_q
// and cu_seqlens_k (int32, batch + 1 entries) at [[buffer(15)]] and [[buffer(16)]].
constant bool fc_varlen [[function_constant(9)]];
// [[function_constant(11)]] (10 is fc_dense, attention_prefill.h): attention
// sinks (gpt-oss); one float32 logit per query head at [[buffer(17)]], for a
// virtual key whose value is zero (seed_sink below).
constant bool fc_has_sinks [[function_constant(11)]];
// [[function_constant(12)]] (the decode kernels and the prefill): a paged KV
// cache. K/V are read through block_table ([[buffer(19)]], int32 (B,
// table_stride)) and each sequence has its own key count, cache_seqlens[b]
// ([[buffer(20)]], int32 (B,)): attention_decode_paged.h,
// attention_prefill_paged.h.
constant bool fc_paged [[function_constant(12)]];

// One sequence of the batch, as a threadgroup sees it: its lengths, where
// its rows start in the packed tensors, and its window bounds.
struct SeqView {
  int q_len;       // query rows of this sequence (Nq, or cu_seqlens_q[b + 1] - cu_seqlens_q[b])
  int kv_len;      // keys of this sequence
  int64_t q_row0;  // first row of the sequence on the row axis of q, o, lse, grad_q, Delta (0 unless varlen)
  int64_t k_row0;  // first row on the row axis of k, v, grad_k, grad_v (0 unless varlen)
  int upper;       // fc_causal: query i sees keys j <= i + upper
  int lower;       // fc_window_left: query i sees keys j >= i + lower
};

// s with its window offsets (upper, lower) set from its own lengths.
inline SeqView with_window_bounds(SeqView s, constant AttentionParams& p) {
  // The op accepts windows up to 2^31 - 1, so Nk - Nq +- window could
  // overflow int32. A right window of Nq or more already shows every row
  // all keys (row + upper >= Nk - 1), and so does a left window of Nk or
  // more (row + lower <= 0): clamping to those changes no visible key and
  // keeps upper in [-Nq, Nk] and lower in [-Nq, Nk], so row + upper + 1 and
  // row + lower stay far from overflow.
  s.upper = s.kv_len - s.q_len + min(p.window_right, s.q_len);
  s.lower = s.kv_len - s.q_len - min(p.window_left, s.kv_len);
  return s;
}

// The view of sequence `batch`. Without fc_varlen every sequence is the
// whole (Nq, Nk) problem. Windows are bottom-right aligned per sequence
// (flash-attn's convention), so the offsets use the sequence's own lengths.
inline SeqView sequence_view(constant AttentionParams& p, device const int* cu_seqlens_q,
                             device const int* cu_seqlens_k, uint batch) {
  SeqView s;
  if (fc_varlen) {
    s.q_row0 = cu_seqlens_q[batch];
    s.k_row0 = cu_seqlens_k[batch];
    s.q_len = cu_seqlens_q[batch + 1] - int(s.q_row0);
    s.kv_len = cu_seqlens_k[batch + 1] - int(s.k_row0);
  } else {
    s.q_row0 = 0;
    s.k_row0 = 0;
    s.q_len = p.q_len;
    s.kv_len = p.kv_len;
  }
  return with_window_bounds(s, p);
}

// First key query `row` may see (0 without a left window), and one past
// its last (Nk without an upper bound); empty when first >= end.
inline int first_visible_key(thread const SeqView& s, int row) {
  return fc_window_left ? clamp(row + s.lower, 0, s.kv_len) : 0;
}
inline int visible_key_end(thread const SeqView& s, int row) {
  return fc_causal ? clamp(row + s.upper + 1, 0, s.kv_len) : s.kv_len;
}
// Whether key `key` lies inside query `row`'s window (bounds only; the
// caller handles key >= kv_len).
inline bool key_in_window(thread const SeqView& s, int row, int key) {
  return (!fc_causal || key <= row + s.upper) && (!fc_window_left || key >= row + s.lower);
}

// Element offset of the mask slice of (batch, query head) (an additive
// mask's or a bool mask's own elements).
inline int64_t mask_head_offset(constant AttentionParams& p, uint batch, uint head) {
  return int64_t(batch) * p.mask_batch_stride + int64_t(head) * p.mask_head_stride;
}

// Attention sinks: the softmax of each row runs over [scores, sink] and the
// sink's probability is dropped, so a row's online-softmax state starts as
// if the sink were its first key: m = sink in base 2 (sink * log2 e; neither
// softcapped nor masked), l = exp2(0) = 1, and an accumulator of zeros (the
// sink's value). lse then includes the sink, and a row whose every key is
// masked gives out = 0 and lse = sink. A sink at or below kMaskedScore (-inf)
// is no sink: the state stays "no key yet". Only one state per row may be
// seeded: the decode kernels seed key group 0 (of split 0), since their
// merges add the partial sums. NaN is not caught (it turns the row NaN, as
// on the CPU). (MLX's sdpa_vector takes sinks behind a function constant
// too; this code is the project's own.)
inline void seed_sink(thread float& m, thread float& l, device const float* sinks, int head) {
  const float s = sinks[head] * M_LOG2E_F;
  if (!(s <= kMaskedScore)) {
    m = s;
    l = 1.0f;
  }
}

// Softcapping of a base-2 score: softcap * tanh(s / softcap), in base 2
// (s2 = s * log2 e, so the cap is softcap * log2 e). Returns tanh's value
// through *t for the backward's derivative, 1 - t^2.
inline float softcap_score(constant AttentionParams& p, float s2, thread float* t) {
  *t = tanh(s2 * p.inv_softcap_log2);
  return p.softcap_log2 * *t;
}

// The mask's contribution to the base-2 score of key `key` of query `row`:
// an additive value times log2(e), or kMaskedScore's worth for a bool False
// (returned as a flag: the caller replaces the score, so no infinity is
// computed with). `mask` points at the slice's first element
// (mask_head_offset); it is bound as bytes and read in its own type.
template <typename T>
inline float mask_term(constant AttentionParams& p, device const uchar* mask, int64_t slice, int row, int key,
                       thread bool* drop) {
  const int64_t at = slice + int64_t(row) * p.mask_row_stride + int64_t(key) * p.mask_col_stride;
  *drop = false;
  if (fc_mask_bool) {
    *drop = mask[at] == 0;
    return 0.0f;
  }
  if (fc_mask_float32) return ((device const float*)mask)[at] * M_LOG2E_F;
  return float(((device const T*)mask)[at]) * M_LOG2E_F;
}

// Softcap, then the mask, of one base-2 score (q.k * scale * log2 e) of key
// `key` of query `row`, without the window test: for kernels that test
// window and sequence bounds themselves, and only where a block straddles
// one. `keep` false means the caller already dropped the key (past the
// sequence, outside the window, or a row past the sequence): the mask is
// then not read at all, and the result is kMaskedScore. A bool mask's False
// also gives kMaskedScore; an additive -inf gives -inf (callers map every
// score <= kMaskedScore to it, so it is never computed with).
template <typename T>
inline float option_score(constant AttentionParams& p, device const uchar* mask, int64_t mask_slice, int row, int key,
                          float s2, bool keep) {
  if (fc_softcap) {
    float t;
    s2 = softcap_score(p, s2, &t);
  }
  if (fc_has_mask && keep) {
    bool drop;
    s2 += mask_term<T>(p, mask, mask_slice, row, key, &drop);
    if (drop) keep = false;
  }
  return keep ? s2 : kMaskedScore;
}

// Every option applied to one base-2 score (q.k * scale * log2 e) of key
// `key` (< kv_len) of query `row`: softcap, then mask, then window.
// Returns the final base-2 score, kMaskedScore for a dropped key. The mask
// is read only for keys inside the window.
template <typename T>
inline float feature_score(constant AttentionParams& p, thread const SeqView& s, device const uchar* mask,
                           int64_t mask_slice, int row, int key, float s2) {
  const bool in_window = !(fc_causal || fc_window_left) || key_in_window(s, row, key);
  return option_score<T>(p, mask, mask_slice, row, key, s2, in_window);
}

}  // namespace flash_metal
