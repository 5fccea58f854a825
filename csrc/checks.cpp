#include "checks.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <limits>

namespace flash_metal {
namespace {

bool supported_dtype(c10::ScalarType t) {
  return t == at::kFloat || t == at::kHalf || t == at::kBFloat16;
}

// Every per-tensor rule, applied the same way to q, k and v. `rank` is 4
// for the dense op ((batch, heads, seq_len, head_dim)) and 3 for varlen
// ((total, heads, head_dim)).
void check_one(const char* kOp, const at::Tensor& t, const char* name, const at::Tensor& q, int64_t rank) {
  TORCH_CHECK_VALUE(t.defined(), kOp, ": ", name, " is undefined (None)");
  TORCH_CHECK_TYPE(supported_dtype(t.scalar_type()), kOp, ": ", name,
                   " must have dtype float32, float16 or bfloat16; got ", t.scalar_type());
  TORCH_CHECK_TYPE(t.scalar_type() == q.scalar_type(), kOp, ": ", name, " has dtype ", t.scalar_type(),
                   " but q has dtype ", q.scalar_type(), "; q, k and v must share one dtype");
  TORCH_CHECK_VALUE(t.device() == q.device(), kOp, ": ", name, " is on device ", t.device(),
                    " but q is on device ", q.device(), "; q, k and v must be on the same device");
  TORCH_CHECK_VALUE(t.dim() == rank, kOp, ": ", name, " must be ", rank,
                    rank == 4 ? "-D (batch, heads, seq_len, head_dim)" : "-D (total_tokens, heads, head_dim)",
                    "; got a ", t.dim(), "-D tensor of shape ", t.sizes());
  for (int64_t d = 0; d < rank; ++d) {
    // Kernels index rows and heads with 32-bit counts and 64-bit strides.
    TORCH_CHECK_VALUE(t.size(d) <= std::numeric_limits<int32_t>::max(), kOp, ": ", name, " dimension ", d,
                      " has size ", t.size(d), "; sizes must be below 2^31");
  }
  // Heads and head_dim can never be 0; batch and sequence lengths can (an
  // empty problem, answered as SDPA answers it).
  TORCH_CHECK_VALUE(t.size(1) >= 1 && t.size(rank - 1) >= 1, kOp, ": ", name,
                    " must have at least one head and head_dim >= 1; got shape ", t.sizes());
}

// q, k, v as 4-D (B, H, N, D) tensors (varlen: the (1, H, total, D) views).
AttentionProblem check_qkv(const char* kOp, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  AttentionProblem p;
  p.batch = q.size(0);
  p.q_heads = q.size(1);
  p.q_len = q.size(2);
  p.head_dim = q.size(3);
  p.head_dim_v = v.size(3);
  p.kv_heads = k.size(1);
  p.kv_len = k.size(2);
  p.dtype = q.scalar_type();
  p.total_q = p.q_len;
  p.total_k = p.kv_len;
  p.k_dim_stride = k.size(3) == 1 ? 1 : k.stride(3);  // a single feature has no stride to speak of
  p.v_dim_stride = v.size(3) == 1 ? 1 : v.stride(3);

  TORCH_CHECK_VALUE(p.head_dim <= kMaxHeadDim, kOp, ": head_dim (last dimension of q) must be between 1 and ",
                    kMaxHeadDim, "; got ", p.head_dim);
  TORCH_CHECK_VALUE(k.size(0) == p.batch, kOp, ": k has batch size ", k.size(0), " but q has batch size ",
                    p.batch, "; they must match");
  TORCH_CHECK_VALUE(k.size(3) == p.head_dim, kOp, ": k has head_dim ", k.size(3), " but q has head_dim ",
                    p.head_dim, "; k must have q's head dim (D_qk = ", p.head_dim, "); v may have its own (D_v)");
  TORCH_CHECK_VALUE(v.sizes().slice(0, 3) == k.sizes().slice(0, 3), kOp,
                    ": v must have k's batch, heads and seq_len ", k.sizes().slice(0, 3),
                    " (its head_dim D_v may differ from q's and k's); got shape ", v.sizes());
  TORCH_CHECK_VALUE(p.head_dim_v <= kMaxHeadDimV, kOp, ": v's head_dim (D_v, last dimension of v) must be between 1 and ",
                    kMaxHeadDimV, "; got ", p.head_dim_v);
  TORCH_CHECK_VALUE(p.q_heads % p.kv_heads == 0, kOp, ": the number of query heads (", p.q_heads,
                    ") must be a multiple of the number of key/value heads (", p.kv_heads,
                    ") for grouped-query attention");
  return p;
}

// The scalar options: scale, causal, window and softcap.
void apply_options(const char* kOp, const AttentionOptions& o, AttentionProblem* p) {
  if (o.scale.has_value()) {
    TORCH_CHECK_VALUE(std::isfinite(*o.scale), kOp, ": scale must be a finite number or None; got ", *o.scale);
    p->scale = *o.scale;
  } else {
    p->scale = 1.0 / std::sqrt(static_cast<double>(p->head_dim));
  }
  constexpr int64_t kMaxWindow = std::numeric_limits<int32_t>::max();
  TORCH_CHECK_VALUE(o.window_left >= -1 && o.window_left <= kMaxWindow, kOp,
                    ": window_left must be -1 (unbounded) or a number of keys >= 0 below 2^31; got ", o.window_left);
  TORCH_CHECK_VALUE(o.window_right >= -1 && o.window_right <= kMaxWindow, kOp,
                    ": window_right must be -1 (unbounded) or a number of keys >= 0 below 2^31; got ",
                    o.window_right);
  TORCH_CHECK_VALUE(std::isfinite(o.softcap) && o.softcap >= 0.0, kOp,
                    ": softcap must be 0 (off) or a finite positive number; got ", o.softcap);
  p->window_left = o.window_left;
  // causal is window_right = 0 (flash-attn: causal overrides the right window).
  p->window_right = o.causal ? 0 : o.window_right;
  p->causal = p->window_right >= 0;
  p->softcap = o.softcap;
}

// attn_mask: bool or additive (q's dtype or float32), on q's device,
// broadcastable to (B, Hq, Nq, Nk) from the right as in SDPA. Returns the
// expanded 4-D view (stride 0 where it broadcasts; nothing is copied).
at::Tensor check_mask(const char* kOp, const at::Tensor& mask, const AttentionProblem& p, const at::Tensor& q,
                      MaskKind* kind) {
  const c10::ScalarType t = mask.scalar_type();
  if (t == at::kBool) {
    *kind = MaskKind::Bool;
  } else if (t == p.dtype) {
    *kind = MaskKind::Input;
  } else if (t == at::kFloat) {
    *kind = MaskKind::Float32;
  } else {
    TORCH_CHECK_TYPE(false, kOp, ": attn_mask must be bool (True = attend) or an additive float mask in q's dtype (",
                     p.dtype, ") or float32; got ", t);
  }
  TORCH_CHECK_VALUE(mask.device() == q.device(), kOp, ": attn_mask is on device ", mask.device(),
                    " but q is on device ", q.device());
  const std::vector<int64_t> full = {p.batch, p.q_heads, p.q_len, p.kv_len};
  bool ok = mask.dim() >= 1 && mask.dim() <= 4;
  for (int64_t d = 0; ok && d < mask.dim(); ++d) {
    const int64_t want = full[4 - mask.dim() + d];
    ok = mask.size(d) == want || mask.size(d) == 1;
  }
  TORCH_CHECK_VALUE(ok, kOp, ": attn_mask must broadcast to (batch, q_heads, q_len, kv_len) = ",
                    at::IntArrayRef(full), " (1 to 4 dimensions, each of size 1 or the full size); got shape ",
                    mask.sizes());
  return mask.expand(full);
}

// sinks: (Hq,), float32 or q's dtype, on q's device, any stride. Returned as given.
at::Tensor check_sinks(const char* kOp, const at::Tensor& sinks, const AttentionProblem& p, const at::Tensor& q) {
  TORCH_CHECK_TYPE(sinks.scalar_type() == at::kFloat || sinks.scalar_type() == p.dtype, kOp,
                   ": sinks must be float32 or q's dtype (", p.dtype, "); got ", sinks.scalar_type());
  TORCH_CHECK_VALUE(sinks.device() == q.device(), kOp, ": sinks is on device ", sinks.device(),
                    " but q is on device ", q.device());
  TORCH_CHECK_VALUE(sinks.dim() == 1 && sinks.size(0) == p.q_heads, kOp,
                    ": sinks must be 1-D of shape (q_heads,) = (", p.q_heads,
                    ",), one logit per query head; got shape ", sinks.sizes());
  return sinks;
}

// lse and grad_lse: float32 with the forward's lse shape, on q's device, any strides.
void check_row_stats(const char* kOp, const at::Tensor& t, const char* name, const at::Tensor& q,
                     at::IntArrayRef want) {
  TORCH_CHECK_VALUE(t.defined(), kOp, ": ", name, " is undefined (None)");
  TORCH_CHECK_TYPE(t.scalar_type() == at::kFloat, kOp, ": ", name,
                   " must be float32 (the forward returns lse in float32); got ", t.scalar_type());
  TORCH_CHECK_VALUE(t.device() == q.device(), kOp, ": ", name, " is on device ", t.device(), " but q is on device ",
                    q.device());
  TORCH_CHECK_VALUE(t.sizes() == want, kOp, ": ", name, " must have shape ", want, " (the forward's lse); got ",
                    t.sizes());
}

// out and grad_out: q's shape with v's head dim D_v, q's dtype and device, any strides.
void check_like_q(const char* kOp, const at::Tensor& t, const char* name, const at::Tensor& q, int64_t head_dim_v) {
  TORCH_CHECK_VALUE(t.defined(), kOp, ": ", name, " is undefined (None)");
  TORCH_CHECK_TYPE(t.scalar_type() == q.scalar_type(), kOp, ": ", name, " has dtype ", t.scalar_type(),
                   " but q has dtype ", q.scalar_type(), "; they must match");
  TORCH_CHECK_VALUE(t.device() == q.device(), kOp, ": ", name, " is on device ", t.device(), " but q is on device ",
                    q.device());
  std::vector<int64_t> want = q.sizes().vec();
  want.back() = head_dim_v;
  TORCH_CHECK_VALUE(t.sizes() == at::IntArrayRef(want), kOp, ": ", name, " must have shape ", at::IntArrayRef(want),
                    " (q's, with v's head_dim D_v = ", head_dim_v, "); got ", t.sizes());
}

void check_cu_seqlens(const char* kOp, const at::Tensor& cu, const char* name, const at::Tensor& q) {
  TORCH_CHECK_VALUE(cu.defined(), kOp, ": ", name, " is undefined (None)");
  TORCH_CHECK_TYPE(cu.scalar_type() == at::kInt, kOp, ": ", name, " must be int32 (as in flash-attn); got ",
                   cu.scalar_type());
  TORCH_CHECK_VALUE(cu.device() == q.device(), kOp, ": ", name, " is on device ", cu.device(),
                    " but q is on device ", q.device());
  TORCH_CHECK_VALUE(cu.dim() == 1 && cu.size(0) >= 1, kOp, ": ", name,
                    " must be 1-D of shape (batch + 1,) holding each sequence's start and the total; got shape ",
                    cu.sizes());
}

// On CPU: cu[0] = 0, non-decreasing, cu[B] = total, every length <= max.
void check_offsets(const char* kOp, const at::Tensor& cu, const char* name, int64_t total, int64_t max_len,
                   const char* max_name) {
  const at::Tensor c = cu.contiguous();
  const int32_t* d = c.const_data_ptr<int32_t>();
  const int64_t n = c.size(0);
  TORCH_CHECK_VALUE(d[0] == 0, kOp, ": ", name, "[0] must be 0; got ", d[0]);
  for (int64_t b = 0; b + 1 < n; ++b) {
    const int64_t len = int64_t{d[b + 1]} - d[b];
    TORCH_CHECK_VALUE(len >= 0, kOp, ": ", name, " must be non-decreasing; ", name, "[", b + 1, "] = ", d[b + 1],
                      " < ", name, "[", b, "] = ", d[b]);
    TORCH_CHECK_VALUE(len <= max_len, kOp, ": sequence ", b, " has length ", len, " (from ", name, ") but ",
                      max_name, " is ", max_len, "; it must be at least every sequence's length");
  }
  TORCH_CHECK_VALUE(d[n - 1] == total, kOp, ": ", name, "[-1] must equal the number of packed rows (", total,
                    "); got ", d[n - 1]);
}

}  // namespace

// For attention_kvcache's checks (csrc/kvcache.cpp): the same rules, the same messages.
void check_tensor(const char* op, const at::Tensor& t, const char* name, const at::Tensor& q, int64_t rank) {
  check_one(op, t, name, q, rank);
}
void apply_scalar_options(const char* op, const AttentionOptions& o, AttentionProblem* p) { apply_options(op, o, p); }
at::Tensor checked_sinks(const char* op, const at::Tensor& sinks, const AttentionProblem& p, const at::Tensor& q) {
  return check_sinks(op, sinks, p, q);
}

AttentionCall check_attention_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                     const AttentionOptions& options, const char* kOp) {
  TORCH_CHECK_VALUE(q.defined(), kOp, ": q is undefined (None)");
  check_one(kOp, q, "q", q, 4);
  check_one(kOp, k, "k", q, 4);
  check_one(kOp, v, "v", q, 4);
  AttentionCall c;
  c.p = check_qkv(kOp, q, k, v);
  apply_options(kOp, options, &c.p);
  c.q = q;
  c.k = k;
  c.v = v;
  if (options.attn_mask.has_value() && options.attn_mask->defined()) {
    c.mask = check_mask(kOp, *options.attn_mask, c.p, q, &c.p.mask);
  }
  if (options.sinks.has_value() && options.sinks->defined()) {
    c.sinks = check_sinks(kOp, *options.sinks, c.p, q);
    c.p.sinks = true;
  }
  return c;
}

AttentionCall check_varlen_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                  const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k,
                                  int64_t max_seqlen_q, int64_t max_seqlen_k, const AttentionOptions& options,
                                  const char* kOp) {
  TORCH_CHECK_VALUE(q.defined(), kOp, ": q is undefined (None)");
  check_one(kOp, q, "q", q, 3);
  check_one(kOp, k, "k", q, 3);
  check_one(kOp, v, "v", q, 3);
  TORCH_CHECK_VALUE(!(options.attn_mask.has_value() && options.attn_mask->defined()), kOp,
                    ": attn_mask is not supported with packed variable-length sequences (as in flash-attn); use "
                    "causal, window_left/window_right or a padded batch with attention_forward");
  check_cu_seqlens(kOp, cu_seqlens_q, "cu_seqlens_q", q);
  check_cu_seqlens(kOp, cu_seqlens_k, "cu_seqlens_k", q);
  TORCH_CHECK_VALUE(cu_seqlens_q.size(0) == cu_seqlens_k.size(0), kOp, ": cu_seqlens_q has ", cu_seqlens_q.size(0),
                    " entries but cu_seqlens_k has ", cu_seqlens_k.size(0), "; both are (batch + 1,)");
  TORCH_CHECK_VALUE(max_seqlen_q >= 0 && max_seqlen_q <= std::numeric_limits<int32_t>::max(), kOp,
                    ": max_seqlen_q must be in [0, 2^31); got ", max_seqlen_q);
  TORCH_CHECK_VALUE(max_seqlen_k >= 0 && max_seqlen_k <= std::numeric_limits<int32_t>::max(), kOp,
                    ": max_seqlen_k must be in [0, 2^31); got ", max_seqlen_k);
  AttentionCall c;
  c.q = as_kernel_view4(q, true);
  c.k = as_kernel_view4(k, true);
  c.v = as_kernel_view4(v, true);
  c.p = check_qkv(kOp, c.q, c.k, c.v);
  apply_options(kOp, options, &c.p);
  c.p.varlen = true;
  c.p.batch = cu_seqlens_q.size(0) - 1;
  c.p.total_q = q.size(0);
  c.p.total_k = k.size(0);
  c.p.q_len = max_seqlen_q;
  c.p.kv_len = max_seqlen_k;
  if (q.device().is_cpu()) {
    check_offsets(kOp, cu_seqlens_q, "cu_seqlens_q", c.p.total_q, max_seqlen_q, "max_seqlen_q");
    check_offsets(kOp, cu_seqlens_k, "cu_seqlens_k", c.p.total_k, max_seqlen_k, "max_seqlen_k");
  }
  c.cu_seqlens_q = cu_seqlens_q;
  c.cu_seqlens_k = cu_seqlens_k;
  if (options.sinks.has_value() && options.sinks->defined()) {
    c.sinks = check_sinks(kOp, *options.sinks, c.p, q);
    c.p.sinks = true;
  }
  return c;
}

void check_backward_tensors(const char* kOp, const at::Tensor& user_q, int64_t head_dim_v, const at::Tensor& grad_out,
                            const at::Tensor& out, const at::Tensor& lse, const std::optional<at::Tensor>& grad_lse,
                            bool varlen) {
  check_like_q(kOp, out, "out", user_q, head_dim_v);
  check_like_q(kOp, grad_out, "grad_out", user_q, head_dim_v);
  // The forward's lse: (B, Hq, Nq), or (Hq, total_q) for varlen.
  const std::vector<int64_t> want = varlen ? std::vector<int64_t>{user_q.size(1), user_q.size(0)}
                                           : std::vector<int64_t>{user_q.size(0), user_q.size(1), user_q.size(2)};
  check_row_stats(kOp, lse, "lse", user_q, want);
  if (grad_lse.has_value() && grad_lse->defined()) check_row_stats(kOp, *grad_lse, "grad_lse", user_q, want);
}

at::Tensor as_kernel_view4(const at::Tensor& t, bool varlen) {
  return varlen ? t.unsqueeze(0).transpose(1, 2) : t;
}

at::Tensor as_kernel_view3(const at::Tensor& t, bool varlen) { return varlen ? t.unsqueeze(0) : t; }

AttentionOutputs allocate_outputs(const AttentionCall& c) {
  const AttentionProblem& p = c.p;
  AttentionOutputs o;
  const auto opts = c.q.options();
  if (p.varlen) {
    o.out = at::empty({p.total_q, p.q_heads, p.head_dim_v}, opts);
    o.lse = at::empty({p.q_heads, p.total_q}, opts.dtype(at::kFloat));
  } else {
    o.out = at::empty({p.batch, p.q_heads, p.q_len, p.head_dim_v}, opts);
    o.lse = at::empty({p.batch, p.q_heads, p.q_len}, opts.dtype(at::kFloat));
  }
  o.out4 = as_kernel_view4(o.out, p.varlen);
  o.lse3 = as_kernel_view3(o.lse, p.varlen);
  return o;
}

void fill_empty_outputs(const AttentionCall& c, const AttentionOutputs& o) {
  // SDPA on Nk = 0: softmax over no key is 0/0; SDPA's flash and math paths
  // give zeros, and the log-sum-exp of nothing is -inf. With sinks every row
  // attends to its head's sink alone: out 0 (the sink's value), lse = sink.
  if (o.out.numel() > 0) o.out.zero_();
  if (o.lse.numel() == 0) return;
  if (c.p.sinks) {
    o.lse3.copy_(c.sinks.to(at::kFloat).view({1, -1, 1}).expand_as(o.lse3));
  } else {
    o.lse.fill_(-std::numeric_limits<float>::infinity());
  }
}

AttentionGradients allocate_gradients(const AttentionCall& c) {
  AttentionGradients g;
  g.grad_q4 = at::empty(c.q.sizes(), c.q.options());
  g.grad_k4 = at::empty(c.k.sizes(), c.k.options());
  g.grad_v4 = at::empty(c.v.sizes(), c.v.options());
  if (c.p.varlen) {  // (1, H, total, D) packed, returned as (total, H, D) views
    g.grad_q = g.grad_q4.transpose(1, 2).squeeze(0);
    g.grad_k = g.grad_k4.transpose(1, 2).squeeze(0);
    g.grad_v = g.grad_v4.transpose(1, 2).squeeze(0);
  } else {
    g.grad_q = g.grad_q4;
    g.grad_k = g.grad_k4;
    g.grad_v = g.grad_v4;
  }
  g.grad_sinks = c.p.sinks ? at::empty({c.p.q_heads}, c.sinks.options())
                           : at::empty({0}, c.q.options().dtype(at::kFloat));
  return g;
}

}  // namespace flash_metal
