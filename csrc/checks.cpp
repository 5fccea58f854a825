#include "checks.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <limits>

namespace flash_metal {
namespace {

constexpr const char* kForwardOp = "flash_metal.attention_forward";
constexpr const char* kBackwardOp = "flash_metal.attention_backward";

bool supported_dtype(c10::ScalarType t) {
  return t == at::kFloat || t == at::kHalf || t == at::kBFloat16;
}

// Every per-tensor rule, applied the same way to q, k and v.
void check_one(const char* kOp, const at::Tensor& t, const char* name, const at::Tensor& q) {
  TORCH_CHECK_VALUE(t.defined(), kOp, ": ", name, " is undefined (None)");
  TORCH_CHECK_TYPE(supported_dtype(t.scalar_type()), kOp, ": ", name,
                   " must have dtype float32, float16 or bfloat16; got ", t.scalar_type());
  TORCH_CHECK_TYPE(t.scalar_type() == q.scalar_type(), kOp, ": ", name, " has dtype ", t.scalar_type(),
                   " but q has dtype ", q.scalar_type(), "; q, k and v must share one dtype");
  TORCH_CHECK_VALUE(t.device() == q.device(), kOp, ": ", name, " is on device ", t.device(),
                    " but q is on device ", q.device(), "; q, k and v must be on the same device");
  TORCH_CHECK_VALUE(t.dim() == 4, kOp, ": ", name,
                    " must be 4-D (batch, heads, seq_len, head_dim); got a ", t.dim(), "-D tensor of shape ",
                    t.sizes());
  TORCH_CHECK_VALUE(t.numel() > 0, kOp, ": ", name, " must be non-empty; got shape ", t.sizes(),
                    " (every dimension must be at least 1)");
  for (int64_t d = 0; d < 4; ++d) {
    // Kernels index rows and heads with 32-bit counts and 64-bit strides.
    TORCH_CHECK_VALUE(t.size(d) <= std::numeric_limits<int32_t>::max(), kOp, ": ", name, " dimension ", d,
                      " has size ", t.size(d), "; sizes must be below 2^31");
  }
}

}  // namespace

namespace {

AttentionProblem check_inputs(const char* kOp, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                              bool causal, std::optional<double> scale) {
  TORCH_CHECK_VALUE(q.defined(), kOp, ": q is undefined (None)");
  check_one(kOp, q, "q", q);
  check_one(kOp, k, "k", q);
  check_one(kOp, v, "v", q);

  AttentionProblem p;
  p.batch = q.size(0);
  p.q_heads = q.size(1);
  p.q_len = q.size(2);
  p.head_dim = q.size(3);
  p.kv_heads = k.size(1);
  p.kv_len = k.size(2);
  p.causal = causal;
  p.dtype = q.scalar_type();

  TORCH_CHECK_VALUE(p.head_dim <= kMaxHeadDim, kOp, ": head_dim (last dimension of q) must be between 1 and ",
                    kMaxHeadDim, "; got ", p.head_dim);
  TORCH_CHECK_VALUE(k.size(0) == p.batch, kOp, ": k has batch size ", k.size(0), " but q has batch size ",
                    p.batch, "; they must match");
  TORCH_CHECK_VALUE(k.size(3) == p.head_dim, kOp, ": k has head_dim ", k.size(3), " but q has head_dim ",
                    p.head_dim, "; they must match");
  TORCH_CHECK_VALUE(v.sizes() == k.sizes(), kOp, ": v must have the same shape as k ", k.sizes(), "; got ",
                    v.sizes());
  TORCH_CHECK_VALUE(p.q_heads % p.kv_heads == 0, kOp, ": the number of query heads (", p.q_heads,
                    ") must be a multiple of the number of key/value heads (", p.kv_heads,
                    ") for grouped-query attention");

  if (scale.has_value()) {
    TORCH_CHECK_VALUE(std::isfinite(*scale), kOp, ": scale must be a finite number or None; got ", *scale);
    p.scale = *scale;
  } else {
    p.scale = 1.0 / std::sqrt(static_cast<double>(p.head_dim));
  }
  return p;
}

// lse and grad_lse: float32 (B, Hq, Nq) on q's device, any strides.
void check_row_stats(const at::Tensor& t, const char* name, const at::Tensor& q) {
  TORCH_CHECK_VALUE(t.defined(), kBackwardOp, ": ", name, " is undefined (None)");
  TORCH_CHECK_TYPE(t.scalar_type() == at::kFloat, kBackwardOp, ": ", name,
                   " must be float32 (attention_forward returns lse in float32); got ", t.scalar_type());
  TORCH_CHECK_VALUE(t.device() == q.device(), kBackwardOp, ": ", name, " is on device ", t.device(),
                    " but q is on device ", q.device());
  const std::vector<int64_t> want = {q.size(0), q.size(1), q.size(2)};
  TORCH_CHECK_VALUE(t.sizes() == at::IntArrayRef(want), kBackwardOp, ": ", name,
                    " must have shape (batch, q_heads, q_len) = ", at::IntArrayRef(want), "; got ", t.sizes());
}

// out and grad_out: exactly q's shape, dtype and device, any strides.
void check_like_q(const at::Tensor& t, const char* name, const at::Tensor& q) {
  TORCH_CHECK_VALUE(t.defined(), kBackwardOp, ": ", name, " is undefined (None)");
  TORCH_CHECK_TYPE(t.scalar_type() == q.scalar_type(), kBackwardOp, ": ", name, " has dtype ", t.scalar_type(),
                   " but q has dtype ", q.scalar_type(), "; they must match");
  TORCH_CHECK_VALUE(t.device() == q.device(), kBackwardOp, ": ", name, " is on device ", t.device(),
                    " but q is on device ", q.device());
  TORCH_CHECK_VALUE(t.sizes() == q.sizes(), kBackwardOp, ": ", name, " must have q's shape ", q.sizes(), "; got ",
                    t.sizes());
}

}  // namespace

AttentionProblem check_attention_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                        bool causal, std::optional<double> scale) {
  return check_inputs(kForwardOp, q, k, v, causal, scale);
}

AttentionProblem check_backward_inputs(const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k,
                                       const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse,
                                       const std::optional<at::Tensor>& grad_lse, bool causal,
                                       std::optional<double> scale) {
  const AttentionProblem p = check_inputs(kBackwardOp, q, k, v, causal, scale);
  check_like_q(out, "out", q);
  check_like_q(grad_out, "grad_out", q);
  check_row_stats(lse, "lse", q);
  if (grad_lse.has_value() && grad_lse->defined()) check_row_stats(*grad_lse, "grad_lse", q);
  return p;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> allocate_gradients(const at::Tensor& q, const at::Tensor& k,
                                                                  const AttentionProblem& p) {
  at::Tensor grad_q = at::empty({p.batch, p.q_heads, p.q_len, p.head_dim}, q.options());
  at::Tensor grad_k = at::empty({p.batch, p.kv_heads, p.kv_len, p.head_dim}, k.options());
  at::Tensor grad_v = at::empty({p.batch, p.kv_heads, p.kv_len, p.head_dim}, k.options());
  return {grad_q, grad_k, grad_v};
}

std::tuple<at::Tensor, at::Tensor> allocate_outputs(const at::Tensor& q, const AttentionProblem& p) {
  at::Tensor out = at::empty({p.batch, p.q_heads, p.q_len, p.head_dim}, q.options());
  at::Tensor lse = at::empty({p.batch, p.q_heads, p.q_len}, q.options().dtype(at::kFloat));
  return {out, lse};
}

}  // namespace flash_metal
