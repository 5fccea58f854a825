// The ops' common flow, shared by every backend: validate, allocate, answer
// an empty problem as SDPA does, then run the backend's kernel on the one
// validated form (AttentionCall). A backend supplies only its kernels:
//
//   forward kernel:  void(const AttentionCall&, const AttentionOutputs&, const std::string& impl)
//   backward kernel: void(const AttentionCall&, const BackwardTensors&, const AttentionGradients&,
//                         const std::string& impl)
//
// and registers the four ops with the wrappers below (csrc/cpu/,
// csrc/mps/attention_mps.mm), so the schemas' argument lists are spelled
// out once per backend and the flow once here.
#pragma once

#include "checks.h"

#include <ATen/ATen.h>

#include <string>
#include <tuple>

namespace flash_metal {

constexpr const char* kBackwardOpName = "flash_metal.attention_backward";
constexpr const char* kVarlenBackwardOpName = "flash_metal.attention_varlen_backward";

// The backward's extra inputs as the kernels see them: (B, H, N, D) and
// (B, H, N) views (varlen: B = 1, N = total), any strides.
struct BackwardTensors {
  at::Tensor grad_out4, out4, lse3;
  at::Tensor grad_lse3;  // undefined when no gradient flows into lse
};

inline AttentionOptions make_options(bool causal, std::optional<double> scale,
                                     const std::optional<at::Tensor>& attn_mask, int64_t window_left,
                                     int64_t window_right, double softcap,
                                     const std::optional<at::Tensor>& sinks = std::nullopt) {
  AttentionOptions o;
  o.causal = causal;
  o.scale = scale;
  o.attn_mask = attn_mask;
  o.window_left = window_left;
  o.window_right = window_right;
  o.softcap = softcap;
  o.sinks = sinks;
  return o;
}

// grad_sinks of an empty problem (no kernel runs), from the definition with
// device-agnostic ops: P_sink = exp(sink - lse) per row, D = rowsum(dO * O),
// dsink_h = sum over rows of P_sink * (grad_lse - D). A row whose lse is
// -inf (a sink of -inf) contributes nothing.
inline void empty_problem_sinks_gradient(const AttentionCall& c, const BackwardTensors& t, const at::Tensor& grad) {
  if (t.lse3.numel() == 0) {
    grad.zero_();
    return;
  }
  const at::Tensor lse = t.lse3.to(at::kFloat);
  const at::Tensor p = at::where(at::isneginf(lse), at::zeros({}, lse.options()),
                                 at::exp(c.sinks.to(at::kFloat).view({1, -1, 1}) - lse));
  at::Tensor term = -(t.grad_out4.to(at::kFloat) * t.out4.to(at::kFloat)).sum(-1);
  if (t.grad_lse3.defined()) term = term + t.grad_lse3;
  grad.copy_((p * term).sum(at::IntArrayRef{0, 2}));
}

template <typename Kernel>
std::tuple<at::Tensor, at::Tensor> run_forward_op(const AttentionCall& c, c10::string_view impl, Kernel&& kernel) {
  const AttentionOutputs o = allocate_outputs(c);
  if (c.p.empty()) {
    fill_empty_outputs(c, o);
  } else {
    kernel(c, o, std::string(impl));
  }
  return {o.out, o.lse};
}

template <typename Kernel>
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> run_backward_op(const char* op, const AttentionCall& c,
                                                               const at::Tensor& user_q, const at::Tensor& grad_out,
                                                               const at::Tensor& out, const at::Tensor& lse,
                                                               const std::optional<at::Tensor>& grad_lse,
                                                               c10::string_view impl, Kernel&& kernel) {
  check_backward_tensors(op, user_q, c.p.head_dim_v, grad_out, out, lse, grad_lse, c.p.varlen);
  const AttentionGradients g = allocate_gradients(c);
  if (c.p.empty()) {
    // No key (or no query): every gradient is exactly zero (or empty).
    g.grad_q4.zero_();
    g.grad_k4.zero_();
    g.grad_v4.zero_();
  }
  BackwardTensors t;
  t.grad_out4 = as_kernel_view4(grad_out, c.p.varlen);
  t.out4 = as_kernel_view4(out, c.p.varlen);
  t.lse3 = as_kernel_view3(lse, c.p.varlen);
  if (grad_lse.has_value() && grad_lse->defined()) t.grad_lse3 = as_kernel_view3(*grad_lse, c.p.varlen);
  if (c.p.empty()) {
    if (c.p.sinks) empty_problem_sinks_gradient(c, t, g.grad_sinks);
  } else {
    kernel(c, t, g, std::string(impl));  // writes g.grad_sinks too when the call has sinks
  }
  return {g.grad_q, g.grad_k, g.grad_v, g.grad_sinks};
}

// The four ops' argument lists, once: BACKEND_OPS(Forward, Backward) defines
// attention_forward_impl, attention_backward_impl, attention_varlen_forward_impl and
// attention_varlen_backward_impl in the current namespace over the two kernels.
#define FLASH_METAL_DEFINE_OPS(FORWARD_KERNEL, BACKWARD_KERNEL)                                                   \
  std::tuple<at::Tensor, at::Tensor> attention_forward_impl(                                                      \
      const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool causal, std::optional<double> scale,   \
      c10::string_view impl, const std::optional<at::Tensor>& attn_mask, int64_t window_left,                      \
      int64_t window_right, double softcap, const std::optional<at::Tensor>& sinks) {                             \
    const ::flash_metal::AttentionCall c = ::flash_metal::check_attention_inputs(                                 \
        q, k, v, ::flash_metal::make_options(causal, scale, attn_mask, window_left, window_right, softcap, sinks)); \
    return ::flash_metal::run_forward_op(c, impl, FORWARD_KERNEL);                                                 \
  }                                                                                                                \
  std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> attention_backward_impl(                             \
      const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,                  \
      const at::Tensor& out, const at::Tensor& lse, bool causal, std::optional<double> scale,                     \
      const std::optional<at::Tensor>& grad_lse, c10::string_view impl,                                            \
      const std::optional<at::Tensor>& attn_mask, int64_t window_left, int64_t window_right, double softcap,      \
      const std::optional<at::Tensor>& sinks) {                                                                    \
    const ::flash_metal::AttentionCall c = ::flash_metal::check_attention_inputs(                                 \
        q, k, v, ::flash_metal::make_options(causal, scale, attn_mask, window_left, window_right, softcap, sinks), \
        ::flash_metal::kBackwardOpName);                                                                           \
    return ::flash_metal::run_backward_op(::flash_metal::kBackwardOpName, c, q, grad_out, out, lse, grad_lse,     \
                                          impl, BACKWARD_KERNEL);                                                  \
  }                                                                                                                \
  std::tuple<at::Tensor, at::Tensor> attention_varlen_forward_impl(                                               \
      const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cu_seqlens_q,              \
      const at::Tensor& cu_seqlens_k, int64_t max_seqlen_q, int64_t max_seqlen_k, bool causal,                    \
      std::optional<double> scale, int64_t window_left, int64_t window_right, double softcap,                     \
      c10::string_view impl, const std::optional<at::Tensor>& sinks) {                                             \
    const ::flash_metal::AttentionCall c = ::flash_metal::check_varlen_inputs(                                    \
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,                                          \
        ::flash_metal::make_options(causal, scale, std::nullopt, window_left, window_right, softcap, sinks));     \
    return ::flash_metal::run_forward_op(c, impl, FORWARD_KERNEL);                                                 \
  }                                                                                                                \
  std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> attention_varlen_backward_impl(                      \
      const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,                  \
      const at::Tensor& out, const at::Tensor& lse, const at::Tensor& cu_seqlens_q,                               \
      const at::Tensor& cu_seqlens_k, int64_t max_seqlen_q, int64_t max_seqlen_k, bool causal,                    \
      std::optional<double> scale, const std::optional<at::Tensor>& grad_lse, int64_t window_left,               \
      int64_t window_right, double softcap, c10::string_view impl, const std::optional<at::Tensor>& sinks) {     \
    const ::flash_metal::AttentionCall c = ::flash_metal::check_varlen_inputs(                                    \
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,                                          \
        ::flash_metal::make_options(causal, scale, std::nullopt, window_left, window_right, softcap, sinks),      \
        ::flash_metal::kVarlenBackwardOpName);                                                                     \
    return ::flash_metal::run_backward_op(::flash_metal::kVarlenBackwardOpName, c, q, grad_out, out, lse,         \
                                          grad_lse, impl, BACKWARD_KERNEL);                                        \
  }

#define FLASH_METAL_REGISTER_OPS(m)                                          \
  m.impl("attention_forward", &attention_forward_impl);                      \
  m.impl("attention_backward", &attention_backward_impl);                    \
  m.impl("attention_varlen_forward", &attention_varlen_forward_impl);        \
  m.impl("attention_varlen_backward", &attention_varlen_backward_impl)

}  // namespace flash_metal
