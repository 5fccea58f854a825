// Input validation shared by every backend (CPU, MPS, and the test-only
// emulated-Metal planner). One helper, one set of messages: every error names
// the argument at fault and what is allowed.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

#include <cstdint>

namespace flash_metal {

// Largest head dimension any kernel supports. Why 256: it covers every common
// model (64, 80, 96, 128, 192, 256), and a 256-wide float32 accumulator is the
// most one GPU thread can keep in registers in the post's one-query-per-thread
// kernels.
constexpr int64_t kMaxHeadDim = 256;

// The validated problem: sizes, the resolved scale, and nothing else. Tensors
// stay with the caller; kernels read their strides directly (no copies).
struct AttentionProblem {
  int64_t batch = 0;     // B
  int64_t q_heads = 0;   // Hq
  int64_t kv_heads = 0;  // Hkv (Hq % Hkv == 0)
  int64_t q_len = 0;     // Nq
  int64_t kv_len = 0;    // Nk
  int64_t head_dim = 0;  // D
  bool causal = false;   // bottom-right aligned causal mask
  double scale = 0.0;    // resolved softmax scale (1/sqrt(D) when None)
  c10::ScalarType dtype = c10::ScalarType::Float;

  int64_t gqa_ratio() const { return q_heads / kv_heads; }
  // With causal masking, query i sees keys j <= i + causal_offset().
  int64_t causal_offset() const { return kv_len - q_len; }
  // scale * log2(e), as float32: every kernel keeps scores in base 2 so that
  // exp(x) becomes exp2(x) (the FlashAttention-2 trick).
  float scale_log2() const { return static_cast<float>(scale * 1.4426950408889634); }
};

// Validates q, k, v (B,H,N,D layout, any strides) and the scalar options.
// Throws c10::Error (ValueError/TypeError in Python) naming the argument.
AttentionProblem check_attention_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                        bool causal, std::optional<double> scale);

// Validates attention_backward's inputs: q, k, v and the options as above,
// then out and grad_out (q's shape, dtype and device, any strides), lse
// ((B, Hq, Nq) float32) and the optional grad_lse (the same as lse).
// Messages name flash_metal.attention_backward and the argument at fault.
AttentionProblem check_backward_inputs(const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k,
                                       const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse,
                                       const std::optional<at::Tensor>& grad_lse, bool causal,
                                       std::optional<double> scale);

// Allocates the gradients: grad_q, grad_k, grad_v packed, with the shapes
// and dtype of q, k and v, on q's device.
std::tuple<at::Tensor, at::Tensor, at::Tensor> allocate_gradients(const at::Tensor& q, const at::Tensor& k,
                                                                  const AttentionProblem& p);

// Allocates the outputs: out like q but packed (B,Hq,Nq,D) in q's dtype, and
// lse (B,Hq,Nq) float32, both on q's device.
std::tuple<at::Tensor, at::Tensor> allocate_outputs(const at::Tensor& q, const AttentionProblem& p);

}  // namespace flash_metal
