// The one parameter block shared by the Metal shaders and the C++ host.
//
// The host (csrc/metal/launch.cpp, make_params) fills it and binds it with setBytes; the
// kernels read it from the constant address space. Every field is fixed
// width, and every stride is counted in elements, never bytes (the
// FlashAttention convention), so one struct serves all three dtypes.
// Tensor layouts, as the op sees them:
//   q   (batch, q_heads,  q_len,  head_dim)
//   k   (batch, kv_heads, kv_len, head_dim)
//   v   (batch, kv_heads, kv_len, head_dim_v)
//   o   (batch, q_heads,  q_len,  head_dim_v)
// (head_dim_v == head_dim except in MLA-style calls, issue 20 section 2.)
//   lse (batch, q_heads,  q_len)            always float32
// and, for the backward (shaders/backward/attention_backward.h):
//   grad_out (batch, q_heads, q_len, head_dim), any strides (the do_* fields)
//   grad_lse (batch, q_heads, q_len), float32, any strides (the glse_* fields)
//   grad_q, grad_k, grad_v and the Delta scratch: packed, so no strides here
//   (their row counts are total_q / total_k below)
// A varlen call (attention_varlen_*) passes its packed (total, H, D) tensors
// as (1, H, total, D) views (batch strides unused); q_len and kv_len are then
// max_seqlen_q and max_seqlen_k, and each sequence's own lengths and first
// rows come from the cu_seqlens buffers (shaders/common/attention_features.h).
#pragma once

#ifdef __METAL_VERSION__
#include <metal_stdlib>
#else
#include <cstdint>
#endif

namespace flash_metal {

struct AttentionParams {
  int64_t q_batch_stride;   // elements between consecutive batch entries of q
  int64_t q_head_stride;    // elements between consecutive heads of q
  int64_t q_row_stride;     // elements between consecutive query rows of q
  int64_t q_dim_stride;     // elements between consecutive features of q (1 when packed)
  int64_t k_batch_stride;   // as above, for k
  int64_t k_head_stride;    // elements between consecutive kv heads of k
  int64_t k_row_stride;     // elements between consecutive keys of k
  int64_t k_dim_stride;     // elements between consecutive features of k
  int64_t v_batch_stride;   // as above, for v
  int64_t v_head_stride;    // elements between consecutive kv heads of v
  int64_t v_row_stride;     // elements between consecutive values of v
  int64_t v_dim_stride;     // elements between consecutive features of v
  int64_t o_batch_stride;   // as above, for the output o
  int64_t o_head_stride;    // elements between consecutive heads of o
  int64_t o_row_stride;     // elements between consecutive rows of o
  int64_t o_dim_stride;     // elements between consecutive features of o
  int64_t lse_batch_stride; // elements between consecutive batch entries of lse
  int64_t lse_head_stride;  // elements between consecutive heads of lse
  int64_t lse_row_stride;   // elements between consecutive rows of lse
  int32_t batch;            // B
  int32_t q_heads;          // Hq, a multiple of kv_heads
  int32_t kv_heads;         // Hkv
  int32_t gqa_ratio;        // Hq / Hkv: query head h reads kv head h / gqa_ratio
  int32_t q_len;            // Nq, query rows per head
  int32_t kv_len;           // Nk, keys (and values) per head
  int32_t head_dim;         // D, 1..256
  int32_t causal_offset;    // Nk - Nq: with causal masking, query i sees keys j <= i + causal_offset
                            // (bottom-right alignment, the KV-cache convention)
  float scale;              // softmax scale applied to q.k (default 1/sqrt(D))
  float scale_log2;         // scale * log2(e): scores are kept in base 2 so exp becomes exp2
  int32_t kv_splits;        // split-KV decode: key blocks Nk is cut into (1 for every other kernel)
  int32_t split_keys;       // split-KV decode: keys per block, ceil(Nk / kv_splits) rounded up to a
                            // multiple of 32; block s covers keys [s * split_keys, (s + 1) * split_keys)
  // The backward's two extra inputs, last so every forward field keeps its offset.
  int64_t do_batch_stride;  // backward: as above, for grad_out (the gradient of o)
  int64_t do_head_stride;   // elements between consecutive heads of grad_out
  int64_t do_row_stride;    // elements between consecutive rows of grad_out
  int64_t do_dim_stride;    // elements between consecutive features of grad_out
  int64_t glse_batch_stride;  // backward: as for lse, for grad_lse (the gradient of lse)
  int64_t glse_head_stride;   // elements between consecutive heads of grad_lse
  int64_t glse_row_stride;    // elements between consecutive rows of grad_lse
  // The options of shaders/common/attention_features.h, last so every field above
  // keeps its offset. attn_mask is seen as (batch, q_heads, q_len, kv_len)
  // with stride 0 on every broadcast dimension; strides count elements of
  // the mask's own type (1 byte for bool).
  int64_t mask_batch_stride;  // elements between consecutive batch entries of the mask (0: broadcast)
  int64_t mask_head_stride;   // elements between consecutive query heads of the mask (0: broadcast)
  int64_t mask_row_stride;    // elements between consecutive query rows of the mask (0: broadcast)
  int64_t mask_col_stride;    // elements between consecutive keys of the mask (0: broadcast)
  int32_t window_left;        // fc_window_left: query i sees keys j >= i + (Nk - Nq) - window_left
  int32_t window_right;       // fc_causal: query i sees keys j <= i + (Nk - Nq) + window_right (0: causal)
  float softcap_log2;         // fc_softcap: softcap * log2(e), the cap on base-2 scores
  float inv_softcap_log2;     // fc_softcap: 1 / softcap_log2
  int32_t total_q;            // rows of q's (and grad_q's, lse's, Delta's) packed sequence axis: q_len, or,
                              // for varlen, total_q (sequence b owns rows cu_seqlens_q[b] .. [b + 1])
  int32_t total_k;            // likewise for k, v, grad_k, grad_v: kv_len, or total_k
  int32_t page_size;          // fc_paged (decode): keys per page of the cache; k/v's batch stride is then
                              // the page stride and their row stride the stride within a page (0 otherwise)
  int32_t table_stride;       // fc_paged: int32 entries between consecutive rows of block_table (0 otherwise)
  // v's own head dim (MLA-style D_v != D_qk, issue 20 section 2), last so every field above keeps its offset.
  // head_dim (D_qk) sizes the Q.K^T product and the q/k loads; head_dim_v sizes the v loads, the P.V product,
  // o's stores and the split decode's partials. Both are at most the kernel's bucket. Equal to head_dim otherwise.
  int32_t head_dim_v;         // D_v, 1..256
  int32_t reserved;           // always 0: pads the struct to a multiple of 8 bytes, so it has no implicit padding
};

// 19 int64 + 10 int32 + 2 float (200 bytes, 8-aligned) + 7 int64 = 256
// bytes, + 4 int64 + 4 int32 + 2 float = 312 bytes, + 2 int32 (paging) =
// 320 bytes, + 2 int32 (head_dim_v and its pad) = 328 bytes, with no padding.
// (The forward kernels ignore the backward strides, and kernels without a
// feature its fields; one struct still, so the host fills and binds one
// block for every kernel.)
// The same assertion compiles on the host and in the shader, so a field added
// on one side only cannot go unnoticed.
static_assert(sizeof(AttentionParams) == 328, "AttentionParams layout changed: update host and shaders together");

// The quantized KV cache's second parameter block (issue 44), bound with
// setBytes at its own slot beside AttentionParams by the quantized decode
// kernels only (shaders/decode/attention_decode_quant.h), so every other
// kernel's block is unchanged. With it, a quantized side's k_* / v_*
// strides in AttentionParams count BYTES of its codes (int8, fp8: one byte
// per feature; 4-bit: two features per byte), a side in q's dtype keeps
// element strides. Scale (and bias: the host binds them with the same
// strides) strides count elements of the scale's own dtype:
//   int8   scale float32 (blocks, page, Hkv): one per (token, kv head)
//   4-bit  scale, bias (blocks, page, Hkv, D / group) in float32, float16 or
//          bfloat16 (fc_*_scale_half / _bf16), the group index contiguous
//   fp8    descale float32 (B, Hkv) (batch stride per sequence, row 0) or
//          one element (every stride 0)
// (blocks, page) are (B_cache, seqlen) for a plain cache; unpaged, the
// batch stride is the sequence's.
struct KvQuantParams {
  int64_t k_scale_batch_stride;  // between pages (fp8: sequences) of k's scale
  int64_t k_scale_row_stride;    // between tokens of a page (fp8: 0)
  int64_t k_scale_head_stride;   // between kv heads
  int64_t v_scale_batch_stride;  // as above, for v's scale (and bias)
  int64_t v_scale_row_stride;
  int64_t v_scale_head_stride;
  int32_t k_group_shift;  // 4-bit: log2(group size), 5, 6 or 7 (0 otherwise)
  int32_t v_group_shift;
};
static_assert(sizeof(KvQuantParams) == 56, "KvQuantParams layout changed: update host and shaders together");

// ---- threads per threadgroup --------------------------------------------------
// The most threads each kernel family is ever launched with: the kernels
// declare it as [[max_total_threads_per_threadgroup(N)]] (as MLX's and
// PyTorch's Metal kernels do), and the planner (csrc/metal/launch.cpp) never
// launches more; flash_metal.explain() reports it per dispatch. Why declare
// it: a pipeline's maxTotalThreadsPerThreadgroup falls with the registers
// its kernel uses. An Apple GPU core has about 208 KB of registers (53,248
// 32-bit values; metal-benchmarks, an estimate), 52 per thread at 1,024
// threads, and a thread addresses at most 128 (Dougall Johnson's G13 notes,
// also [I]). With N declared, the compiler allocates registers for N
// threads, so the pipeline admits every launch the planner makes; without
// it, a kernel holding ~100 live values may come back below what the planner
// asked for. Every N below is at most 416 (53,248 / 128), so it fits
// whatever the compiler allocates.
#ifdef __METAL_VERSION__
#define FM_PROGRAM_CONSTANT constant  // MSL: program-scope variables live in the constant address space
#else
#define FM_PROGRAM_CONSTANT
#endif
// The post's two kernels (attention_untiled.h, attention_tiled.h): one
// SIMD-group, one query row per thread (the post's configuration).
FM_PROGRAM_CONSTANT constexpr int kPostMaxThreads = 32;
// The prefill kernel (attention_prefill.h): 4 SIMD-groups of 8 query rows
// (MLX's steel layout), or with feature parts (float32 D = 128 and 256) up
// to 8 SIMD-groups: the routing's block table. Why 8: as the backward's.
FM_PROGRAM_CONSTANT constexpr int kPrefillMaxThreads = 256;
// The split-D prefill for head dim 512 (attention_prefill_splitd.h): 8
// SIMD-groups, one per 64-feature part of 8 query rows. Why 256: its
// planned layout (WM = 8); 208 registers per thread at any allocation, far
// above its ~63 live values per lane.
FM_PROGRAM_CONSTANT constexpr int kPrefillSplitDMaxThreads = 256;
// The decode kernels (attention_decode.h, one pass and split pass 1): 8
// SIMD-groups, 256 threads, leave 208 registers per thread, more than a
// thread can address, so the decode state (at most kDecodeRegisterBudget =
// 72 live values per lane, attention_decode_rows.h) fits at any allocation;
// 512 threads would leave 104: enough too, but no decode plan needs more
// than 8 SIMD-groups. Bigger GQA groups get
// more threadgroups, not fatter ones (csrc/metal/launch.cpp, decode_launches).
FM_PROGRAM_CONSTANT constexpr int kDecodeMaxThreads = 256;
// The split-KV merge: one SIMD-group per output row.
FM_PROGRAM_CONSTANT constexpr int kDecodeMergeMaxThreads = 32;
// The sinks' gradient (attention_sinks.h): one SIMD-group per query head.
FM_PROGRAM_CONSTANT constexpr int kSinksGradMaxThreads = 32;
// Both backward kernels (attention_backward.h): at most 8 SIMD-groups (own
// 8-row groups x feature parts). Why 8: choose_backward's target, 8
// resident SIMD-groups per core (issue 19), in one threadgroup where a
// core's threadgroup memory holds one; 256 threads leave 208 registers per
// thread at any allocation, above the 72-value budget the planner keeps.
FM_PROGRAM_CONSTANT constexpr int kBackwardMaxThreads = 256;

}  // namespace flash_metal
