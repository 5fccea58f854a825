// The decode kernels over a quantized KV cache (issue 44): the same one-pass
// and split-KV kernels as attention_decode.h (the same decode_attend loop,
// launch, GQA sharing, sinks, window, softcap and paged cache), with K and V
// read as codes plus scales and dequantized in registers, one lane's slice
// of a row at a time, inside the online softmax: no dequantized K or V is
// ever written. The split pass's partials go to the native
// flash_decode_merge (they are float32, whatever the cache).
//
// Formats, per side (K and V independently, as llama.cpp's -ctk / -ctv),
// by function constants (MLX's style: one kernel per dtype and bucket,
// specialized at pipeline creation); layouts as csrc/kvcache_quant.h:
//   none set  the cache in q's dtype (element strides, as attention_decode.h)
//   int8      value = code * scale[token, kv head]
//   4-bit     MLX's affine (mx.quantize, bits 4): element c is the nibble c % 2
//             (low first) of byte c / 2, value = code * scale[g] + bias[g],
//             g = c >> group_shift; uint32 or uint8 packing are the same bytes
//   fp8       float8_e4m3fn, value = fp8(code) * descale[sequence, kv head]
//             (or one descale for the tensor)
// The ideas come from llama.cpp's flash_attn_ext_vec (q8_0 / q4_0 blocks
// dequantized per thread in the vector kernel) and MLX's quantized kernels
// (affine groups, scale and bias per group); the code is this project's own.
//
// Names (csrc/metal/launch.cpp builds them; shaders/attention.metal):
//   flash_decode_quant_<dtype>_d<DMAX>         one pass, launched as flash_decode
//   flash_decode_quant_split_<dtype>_d<DMAX>   split pass 1, as flash_decode_split
// Bindings: flash_decode's (split: flash_decode_split's), plus k_scale (21),
// k_bias (22), v_scale (23), v_bias (24) and KvQuantParams (25, setBytes);
// a slot without its tensor gets another buffer, never read.
#pragma once

#include "attention_decode.h"

namespace flash_metal {

// K's format (one of the three, or none: K in q's dtype), then V's; then the
// 4-bit scales' dtype per side (neither: float32).
constant bool fc_k_int8 [[function_constant(15)]];
constant bool fc_k_q4 [[function_constant(16)]];
constant bool fc_k_fp8 [[function_constant(17)]];
constant bool fc_v_int8 [[function_constant(18)]];
constant bool fc_v_q4 [[function_constant(19)]];
constant bool fc_v_fp8 [[function_constant(20)]];
constant bool fc_k_scale_half [[function_constant(21)]];
constant bool fc_k_scale_bf16 [[function_constant(22)]];
constant bool fc_v_scale_half [[function_constant(23)]];
constant bool fc_v_scale_bf16 [[function_constant(24)]];

// float8_e4m3fn as float: the bits moved into a half (sign; exponent and
// mantissa shifted by 7), whose exponent bias exceeds e4m3's by 8, so the
// half is the value times 2^-8, subnormals included (exact; the CPU's
// fp8_e4m3fn_scaled, csrc/cpu/kv_dequant.h, is the same rule); 0x7F / 0xFF
// is NaN. The caller folds the 2^8 into its descale.
FM_INLINE float fp8_e4m3fn_scaled(uint b) {
  const ushort h = ushort(((b & 0x80u) << 8) | ((b & 0x7Fu) << 7));
  return (b & 0x7Fu) == 0x7Fu ? as_type<float>(0x7FC00000u) : float(as_type<half>(h));
}

// One element of a 4-bit side's scale (or bias) row, in its dtype.
FM_INLINE float decode_quant_scale(device const uchar* s, int64_t i, bool is_half, bool is_bf16) {
  if (is_half) return float(reinterpret_cast<device const half*>(s)[i]);
  if (is_bf16) return float(reinterpret_cast<device const bfloat*>(s)[i]);
  return reinterpret_cast<device const float*>(s)[i];
}

// A K (SIDE 0) or V (SIDE 1) cache in any format, one row at a time: the
// DecodeRows interface (attention_decode.h), dequantizing in registers.
template <typename T, int DMAX, int SIDE>
struct DecodeQuantRows {
  device const uchar* codes;  // the kv head's base (fc_paged: page 0's; else the batch's)
  device const uchar* scale;  // likewise for int8 / 4-bit scales
  device const uchar* bias;   // 4-bit biases (same strides as the scales)
  int64_t batch_stride, row_stride;      // codes: bytes (quantized) or elements of T (native)
  int64_t scale_batch, scale_row;        // scales: elements of their dtype
  float descale;                         // fp8: the sequence's descale times 2^8
  int D, group_shift;

  static FM_INLINE bool int8() { return SIDE == 0 ? fc_k_int8 : fc_v_int8; }
  static FM_INLINE bool q4() { return SIDE == 0 ? fc_k_q4 : fc_v_q4; }
  static FM_INLINE bool fp8() { return SIDE == 0 ? fc_k_fp8 : fc_v_fp8; }
  static FM_INLINE bool scale_half() { return SIDE == 0 ? fc_k_scale_half : fc_v_scale_half; }
  static FM_INLINE bool scale_bf16() { return SIDE == 0 ? fc_k_scale_bf16 : fc_v_scale_bf16; }

  FM_INLINE void load(thread float* x, thread const PageCursor& c, int key, uint lane) const {
    constexpr int DPL = (DMAX + 31) / 32;
    const int64_t at = fc_paged ? page_offset(c, batch_stride, row_stride) : int64_t(key) * row_stride;
    if (!int8() && !q4() && !fp8()) {  // in q's dtype: the native slice (fc_dense's runs when the host set it)
      decode_slice_device<DMAX, DPL>(x, reinterpret_cast<device const T*>(codes) + at, 1, D, lane);
      return;
    }
    device const uchar* row = codes + at;
    const int64_t sat = fc_paged ? page_offset(c, scale_batch, scale_row) : int64_t(key) * scale_row;
    // int8: one scale per token (a scalar load per key, the same for every lane).
    const float s8 = int8() ? reinterpret_cast<device const float*>(scale)[sat] : 0.0f;
    FM_UNROLL for (int i = 0; i < DPL; ++i) {
      const int f = decode_feature<DPL>(i, lane, fc_dense);
      float v = 0.0f;
      if (f < D) {
        if (int8()) {
          v = float(reinterpret_cast<device const char*>(row)[f]) * s8;
        } else if (q4()) {
          const uint b = row[f >> 1];
          const float code = float((f & 1) ? (b >> 4) : (b & 0xFu));
          const int64_t g = sat + (f >> group_shift);
          v = fma(code, decode_quant_scale(scale, g, scale_half(), scale_bf16()),
                  decode_quant_scale(bias, g, scale_half(), scale_bf16()));
        } else {
          v = fp8_e4m3fn_scaled(row[f]) * descale;
        }
      }
      x[i] = v;
    }
  }
};

// Side SIDE's reader for the threadgroup's (batch, kv head).
template <typename T, int DMAX, int SIDE>
FM_INLINE DecodeQuantRows<T, DMAX, SIDE> decode_quant_rows(device const uchar* codes, device const uchar* scale,
                                                           device const uchar* bias, constant AttentionParams& p,
                                                           constant KvQuantParams& qp, int batch, int kv_head) {
  DecodeQuantRows<T, DMAX, SIDE> r;
  const int64_t bs = SIDE == 0 ? p.k_batch_stride : p.v_batch_stride;
  const int64_t hs = SIDE == 0 ? p.k_head_stride : p.v_head_stride;
  const int64_t sbs = SIDE == 0 ? qp.k_scale_batch_stride : qp.v_scale_batch_stride;
  const int64_t shs = SIDE == 0 ? qp.k_scale_head_stride : qp.v_scale_head_stride;
  const bool native = !r.int8() && !r.q4() && !r.fp8();
  // A native side's strides count elements of T; a quantized side's bytes.
  const int64_t unit = native ? int64_t(sizeof(T)) : 1;
  r.codes = codes + ((fc_paged ? 0 : int64_t(batch) * bs) + int64_t(kv_head) * hs) * unit;
  r.batch_stride = bs;
  r.row_stride = SIDE == 0 ? p.k_row_stride : p.v_row_stride;
  r.scale_batch = sbs;
  r.scale_row = SIDE == 0 ? qp.k_scale_row_stride : qp.v_scale_row_stride;
  r.D = SIDE == 0 ? p.head_dim : p.head_dim_v;
  r.group_shift = SIDE == 0 ? qp.k_group_shift : qp.v_group_shift;
  const int64_t selt = r.q4() && (r.scale_half() || r.scale_bf16()) ? 2 : 4;  // bytes per scale element
  const int64_t sbase = ((fc_paged ? 0 : int64_t(batch) * sbs) + int64_t(kv_head) * shs) * selt;
  r.scale = scale + sbase;
  r.bias = bias + sbase;
  // fp8: the descale is the sequence's (paged or not), read once.
  r.descale = r.fp8() ? reinterpret_cast<device const float*>(scale)[int64_t(batch) * sbs + int64_t(kv_head) * shs] *
                            256.0f
                      : 0.0f;
  return r;
}

// One pass over a quantized cache: flash_decode's body with DecodeQuantRows.
template <typename T, int DMAX>
[[kernel]] [[max_total_threads_per_threadgroup(kDecodeMaxThreads)]] void flash_decode_quant(
    device const T* q [[buffer(0)]],
    device const uchar* k [[buffer(1)]],
    device const uchar* v [[buffer(2)]],
    device T* o [[buffer(3)]],
    device float* lse [[buffer(4)]],
    constant AttentionParams& p [[buffer(5)]],
    device const uchar* mask [[buffer(14)]],
    device const int* cu_seqlens_q [[buffer(15)]],
    device const int* cu_seqlens_k [[buffer(16)]],
    device const float* sinks [[buffer(17)]],
    device const int* block_table [[buffer(19)]],
    device const int* cache_seqlens [[buffer(20)]],
    device const uchar* k_scale [[buffer(21)]],
    device const uchar* k_bias [[buffer(22)]],
    device const uchar* v_scale [[buffer(23)]],
    device const uchar* v_bias [[buffer(24)]],
    constant KvQuantParams& qp [[buffer(25)]],
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
  const int R = p.gqa_ratio * p.q_len;
  const SeqView seq = fc_paged ? paged_sequence_view(p, cache_seqlens, uint(batch))
                               : sequence_view(p, cu_seqlens_q, cu_seqlens_k, uint(batch));
  device const int* table = block_table + (fc_paged ? int64_t(batch) * p.table_stride : 0);
  const int key_begin = first_visible_key(seq, 0);
  const int key_end = visible_key_end(seq, p.q_len - 1);
  const auto kr = decode_quant_rows<T, DMAX, 0>(k, k_scale, k_bias, p, qp, batch, kv_head);
  const auto vr = decode_quant_rows<T, DMAX, 1>(v, v_scale, v_bias, p, qp, batch, kv_head);
  for (int round = 0; round < sh.rounds; ++round) {
    const int rg = sh.row_group(round);
    const bool live = rg * RS < R;
    DecodeState<DMAX> st;
    decode_init<T, DMAX>(st, q, p, batch, kv_head, rg, lane, sinks, sh.kg == 0);
    decode_attend<T, DMAX>(st, kr, vr, p, seq, mask, table, batch, kv_head, rg, live, key_begin, key_end, sh.kg,
                           sh.KG, lane);
    if (sh.KG > 1) decode_merge_key_groups<DMAX>(st, smem, sh.kg, sh.KG, sh.rgl, sh.RGL, lane);
    if (live && sh.kg == 0) {
      FM_UNROLL for (int r = 0; r < RS; ++r) {
        const int rr = rg * RS + r;
        if (rr < R) {
          OnlineSoftmax sm;
          sm.m = st.m[r];
          sm.l = st.l[r];
          decode_store_row<T, DMAX>(o, lse, p, batch, decode_row(p, kv_head, rr), st.acc[r], sm, lane, fc_dense);
        }
      }
    }
  }
}

// Split pass 1 over a quantized cache: flash_decode_split's body with
// DecodeQuantRows; its partials go to flash_decode_merge_<dtype>_d<DMAX>.
template <typename T, int DMAX>
[[kernel]] [[max_total_threads_per_threadgroup(kDecodeMaxThreads)]] void flash_decode_quant_split(
    device const T* q [[buffer(0)]],
    device const uchar* k [[buffer(1)]],
    device const uchar* v [[buffer(2)]],
    constant AttentionParams& p [[buffer(5)]],
    device float* partial_o [[buffer(6)]],
    device float* partial_stats [[buffer(7)]],
    device const uchar* mask [[buffer(14)]],
    device const int* cu_seqlens_q [[buffer(15)]],
    device const int* cu_seqlens_k [[buffer(16)]],
    device const float* sinks [[buffer(17)]],
    device const int* block_table [[buffer(19)]],
    device const int* cache_seqlens [[buffer(20)]],
    device const uchar* k_scale [[buffer(21)]],
    device const uchar* k_bias [[buffer(22)]],
    device const uchar* v_scale [[buffer(23)]],
    device const uchar* v_bias [[buffer(24)]],
    constant KvQuantParams& qp [[buffer(25)]],
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
  const SeqView seq = fc_paged ? paged_sequence_view(p, cache_seqlens, uint(batch))
                               : sequence_view(p, cu_seqlens_q, cu_seqlens_k, uint(batch));
  device const int* table = block_table + (fc_paged ? int64_t(batch) * p.table_stride : 0);
  const int split_begin = split * p.split_keys;
  const int key_begin = max(split_begin, first_visible_key(seq, 0));
  const int key_end = min(split_begin + p.split_keys, visible_key_end(seq, p.q_len - 1));
  const auto kr = decode_quant_rows<T, DMAX, 0>(k, k_scale, k_bias, p, qp, batch, kv_head);
  const auto vr = decode_quant_rows<T, DMAX, 1>(v, v_scale, v_bias, p, qp, batch, kv_head);
  for (int round = 0; round < sh.rounds; ++round) {
    const int rg = sh.row_group(round);
    const bool live = rg * RS < R;
    DecodeState<DMAX> st;
    decode_init<T, DMAX>(st, q, p, batch, kv_head, rg, lane, sinks, split == 0 && sh.kg == 0);
    decode_attend<T, DMAX>(st, kr, vr, p, seq, mask, table, batch, kv_head, rg, live, key_begin, key_end, sh.kg,
                           sh.KG, lane);
    if (sh.KG > 1) decode_merge_key_groups<DMAX>(st, smem, sh.kg, sh.KG, sh.rgl, sh.RGL, lane);
    if (live && sh.kg == 0) decode_store_partials<DMAX>(st, partial_o, partial_stats, p, batch, kv_head, rg, split, lane);
  }
}

}  // namespace flash_metal
