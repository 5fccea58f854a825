// Input validation shared by every backend (CPU, MPS, and the test-only
// emulated-Metal planner). One helper, one set of messages: every error names
// the argument at fault and what is allowed.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

#include <cstdint>

namespace flash_metal {

// Largest head dimension of q and k (D_qk) the ops accept. Why 576: the
// absorbed-MLA decode of DeepSeek-V2/V3 and Kimi (512 latent + 64 rotary
// features; issue 20). The CPU kernels take any D_qk up to it (their
// per-row staging buffers are sized by it: 2.3 KB of stack); the Metal
// kernels stop at their largest head-dim bucket (256) and refuse more with
// NotImplementedError (csrc/metal/families/table.cpp choose_metal_kernel).
constexpr int64_t kMaxHeadDim = 576;
// Largest head dimension of v (D_v, also out's and grad_v's). Why 512: the
// MLA latent, the widest value any model in issue 20 uses.
constexpr int64_t kMaxHeadDimV = 512;

// The validated problem: sizes, the resolved scale, and nothing else. Tensors
// stay with the caller; kernels read their strides directly (no copies).
// How attn_mask is read (none, or its element type).
enum class MaskKind : uint8_t {
  None,     // no attn_mask
  Bool,     // torch.bool, True = attend (PyTorch's convention); 1 byte per element
  Input,    // additive, in q's dtype
  Float32,  // additive, float32 (with float16 / bfloat16 inputs)
};

// The op's optional arguments, as the caller gave them (before validation).
struct AttentionOptions {
  bool causal = false;
  std::optional<double> scale;
  std::optional<at::Tensor> attn_mask;
  int64_t window_left = -1;   // keys before the diagonal a query may see; -1: unbounded
  int64_t window_right = -1;  // keys after the diagonal; -1: unbounded
  double softcap = 0.0;       // 0: off
  // Attention sinks (gpt-oss): one logit per query head for a virtual key
  // whose value is zero; None: no sink.
  std::optional<at::Tensor> sinks;
};

struct AttentionProblem {
  int64_t batch = 0;     // B (varlen: the number of sequences)
  int64_t q_heads = 0;   // Hq
  int64_t kv_heads = 0;  // Hkv (Hq % Hkv == 0)
  int64_t q_len = 0;     // Nq (varlen: max_seqlen_q)
  int64_t kv_len = 0;    // Nk (varlen: max_seqlen_k)
  int64_t head_dim = 0;    // D_qk: q's and k's head dim (QK^T, dQ, dK; the default scale 1/sqrt(D_qk))
  int64_t head_dim_v = 0;  // D_v: v's head dim, out's and grad_v's (== head_dim except in MLA-style calls)
  // Keys are bounded above: query i sees keys j <= i + causal_offset(). Set
  // by the causal flag (window_right = 0) or by a right window
  // (window_right >= 0); every kernel's causal code path serves both.
  bool causal = false;
  double scale = 0.0;    // resolved softmax scale (1/sqrt(D) when None)
  c10::ScalarType dtype = c10::ScalarType::Float;
  // Sliding window, flash-attn's convention, bottom-right aligned: query i
  // sees keys i + (Nk - Nq) - window_left <= j <= i + (Nk - Nq) + window_right.
  // -1 is unbounded. Normalized: causal makes window_right 0 (as flash-attn
  // does), so window_right >= 0 exactly when `causal` is set.
  int64_t window_left = -1;
  int64_t window_right = -1;
  double softcap = 0.0;  // scores become softcap * tanh(s / softcap) when > 0
  MaskKind mask = MaskKind::None;
  // Attention sinks: the softmax of each row runs over [scores, sinks[h]]
  // and the sink's probability is dropped (its value is zero); lse includes
  // it. The sink logit is in natural-log units of the scaled scores and is
  // neither softcapped nor masked.
  bool sinks = false;
  // Variable length (attention_varlen_*): q, k, v are packed (total, H, D)
  // tensors seen as (1, H, total, D); sequence b owns rows
  // [cu_seqlens[b], cu_seqlens[b+1]); q_len and kv_len are the maxima.
  bool varlen = false;
  int64_t total_q = 0;   // rows of the packed q (otherwise q_len)
  int64_t total_k = 0;   // rows of the packed k and v (otherwise kv_len)
  // A paged KV cache (attention_kvcache, csrc/kvcache.cpp): k and v are the
  // caches seen as (num_blocks, Hkv, page_size, D), sequence b's key j is
  // row j % page_size of block block_table[b, j / page_size], and kv_len is
  // the table's capacity (max_blocks * page_size); each sequence's own key
  // count is cache_seqlens[b], read on the device (the decode kernels'
  // fc_paged). batch is q's.
  bool paged = false;
  int64_t page_size = 0;     // keys per block
  int64_t table_stride = 0;  // int32 entries between rows of block_table (its entries are contiguous)
  // k's and v's strides along the head dim, in elements (1 for packed rows):
  // the tensor-op kernels read k and v as Metal tensors, whose innermost
  // stride must be 1 (csrc/metal/families/tensor_ops.cpp routes or refuses).
  int64_t k_dim_stride = 1;
  int64_t v_dim_stride = 1;
  // A quantized KV cache (attention_kvcache, issue 44; csrc/kvcache_quant.h):
  // each side's format (KvFormat's values: 0 in q's dtype, 1 int8, 2 4-bit,
  // 3 fp8), its 4-bit scales' dtype and group size, and the bytes of one
  // element of its codes tensor (k / v strides count those): the quantized
  // decode kernels (shaders/decode/attention_decode_quant.h) read it in place.
  int k_format = 0, v_format = 0;
  c10::ScalarType k_scale_dtype = c10::ScalarType::Float, v_scale_dtype = c10::ScalarType::Float;
  int64_t k_group = 0, v_group = 0;
  int64_t k_code_bytes = 0, v_code_bytes = 0;

  int64_t gqa_ratio() const { return q_heads / kv_heads; }
  bool kv_quantized() const { return k_format != 0 || v_format != 0; }
  bool has_window_left() const { return window_left >= 0; }
  bool has_softcap() const { return softcap > 0.0; }
  // Keys bounded above: query i sees keys j <= i + causal_offset() (for a
  // varlen problem, per sequence: Nk_b - Nq_b + window_right).
  int64_t causal_offset() const { return kv_len - q_len + (window_right > 0 ? window_right : 0); }
  // Keys bounded below (has_window_left()): query i sees keys j >= i + lower_offset().
  int64_t lower_offset() const { return kv_len - q_len - window_left; }
  // Nothing to compute: B, Nq or Nk (or, for varlen, total_q or total_k) is 0.
  bool empty() const { return batch == 0 || q_len == 0 || kv_len == 0 || total_q == 0 || total_k == 0; }
  // scale * log2(e), as float32: every kernel keeps scores in base 2 so that
  // exp(x) becomes exp2(x) (the FlashAttention-2 trick).
  float scale_log2() const { return static_cast<float>(scale * 1.4426950408889634); }
};

// A validated call, in the one form every backend's kernels take: 4-D
// (B, H, N, D) views of q, k, v (a varlen call's packed (total, H, D)
// tensors seen as (1, H, total, D), no copy), the mask expanded to
// (B, Hq, Nq, Nk) as a view (stride 0 where it broadcasts, never
// materialized), and the varlen offsets.
struct AttentionCall {
  AttentionProblem p;
  at::Tensor q, k, v;
  at::Tensor mask;                    // undefined when p.mask == MaskKind::None
  at::Tensor cu_seqlens_q, cu_seqlens_k;  // int32 (B + 1,), varlen only
  at::Tensor sinks;                   // (Hq,) float32 or q's dtype, any stride; undefined without sinks
};

// Validates attention_forward's inputs: q, k, v (B, H, N, D, any strides),
// the scalar options, and attn_mask (bool, or additive in q's dtype or
// float32, broadcastable to (B, Hq, Nq, Nk)). B, Nq and Nk may be 0 (an
// empty problem: see AttentionProblem::empty). Throws c10::Error
// (ValueError/TypeError in Python) naming the argument.
AttentionCall check_attention_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                     const AttentionOptions& options,
                                     const char* op = "flash_metal.attention_forward");

// Validates attention_varlen_forward's inputs: q (total_q, Hq, D), k and v
// (total_k, Hkv, D), int32 cu_seqlens_q / cu_seqlens_k of shape (B + 1,) on
// q's device, max_seqlen_q / max_seqlen_k >= 0, the options (no attn_mask).
// On CPU the offsets are checked too (non-decreasing from 0 to total, each
// sequence within the max); on MPS reading them would cost a device sync,
// so, as in flash-attn, they are the caller's contract there.
AttentionCall check_varlen_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                  const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k,
                                  int64_t max_seqlen_q, int64_t max_seqlen_k, const AttentionOptions& options,
                                  const char* op = "flash_metal.attention_varlen_forward");

// Validates attention_backward's extra inputs against a checked call: out
// and grad_out (q's shape with v's head dim D_v, q's dtype and device, as
// the caller gave q; any strides), lse and the optional grad_lse (float32,
// the forward's lse shape). Messages name `op` and the argument at fault.
void check_backward_tensors(const char* op, const at::Tensor& user_q, int64_t head_dim_v, const at::Tensor& grad_out,
                            const at::Tensor& out, const at::Tensor& lse, const std::optional<at::Tensor>& grad_lse,
                            bool varlen);

// The outputs, as the caller receives them and as the kernels see them.
struct AttentionOutputs {
  at::Tensor out, lse;    // returned: (B, Hq, Nq, D_v) and (B, Hq, Nq); varlen: (total_q, Hq, D_v) and (Hq, total_q)
  at::Tensor out4, lse3;  // the same storage as (B, H, N, D) and (B, H, N) views (varlen: B = 1, N = total_q)
};
// Allocates them on q's device (out in q's dtype, lse float32), packed.
AttentionOutputs allocate_outputs(const AttentionCall& c);
// An empty problem's outputs, filled as SDPA does: nothing to fill for
// B = 0 or Nq = 0; out = 0 and lse = -inf for Nk = 0 (varlen: total_k = 0),
// or, with sinks, lse = the row's head's sink (a row attends to the sink only).
void fill_empty_outputs(const AttentionCall& c, const AttentionOutputs& o);

// The gradients: returned in the caller's shapes (q, k, v as given, packed
// dense; for varlen (total, H, D) views of a packed (1, H, total, D)
// buffer) and as 4-D views matching AttentionCall's q, k, v, packed.
struct AttentionGradients {
  at::Tensor grad_q, grad_k, grad_v;     // returned
  at::Tensor grad_q4, grad_k4, grad_v4;  // packed (B, H, N, D) (varlen: (1, H, total, D))
  // (Hq,) in sinks' dtype when the call has sinks; else an empty (0,) float32
  // tensor (the schema's grad_sinks output is not optional).
  at::Tensor grad_sinks;
};
AttentionGradients allocate_gradients(const AttentionCall& c);

// The per-tensor rules of q, k and v (dtype, device, rank, sizes); the
// scalar options (scale, causal, window, softcap) into p; sinks (Hq,).
// For attention_kvcache's checks (csrc/kvcache.cpp), which share them.
void check_tensor(const char* op, const at::Tensor& t, const char* name, const at::Tensor& q, int64_t rank);
void apply_scalar_options(const char* op, const AttentionOptions& o, AttentionProblem* p);
at::Tensor checked_sinks(const char* op, const at::Tensor& sinks, const AttentionProblem& p, const at::Tensor& q);

// 4-D and 3-D views of a backward input given in the caller's layout
// (varlen: (total, H, D) -> (1, H, total, D); lse (H, total) -> (1, H, total)).
at::Tensor as_kernel_view4(const at::Tensor& t, bool varlen);
at::Tensor as_kernel_view3(const at::Tensor& t, bool varlen);

}  // namespace flash_metal
