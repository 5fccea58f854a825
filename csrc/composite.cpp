// The composite path (see composite.h): per chunk of query rows, the scores
// as one batched matmul in float32, the options and an online-free softmax
// (the chunk holds whole rows), then P.V; the backward recomputes P from lse
// chunk by chunk, as FlashAttention's backward does, with dK and dV summed
// over the chunks. Every operation is an ATen op on the inputs' device.
#include "composite.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace flash_metal {

bool composite_route(const AttentionProblem& p, KernelRequest requested, MetalPass pass, std::string* why) {
  const char* pass_name = pass == MetalPass::Backward ? "backward" : "forward";
  if (requested == KernelRequest::Composite) {
    *why = std::string("composite (") + pass_name + "): requested by the caller (impl='composite'); chunked ATen "
           "matmuls and softmax, memory O(chunk x Nk), not a flash kernel";
    return true;
  }
  if (requested != KernelRequest::Auto) return false;
  const int64_t widest = kFastHeadDimBuckets.back();
  // (Decode, Nq <= 8, takes dims up to 576 fused: decode_takes_wide_dims;
  // the split-D forward takes causal D = 512 and MLA's pairs where its model
  // says, and impl='prefill' the split-D backward: splitd_takes.)
  std::string splitd_why;
  if ((p.head_dim > widest || p.head_dim_v > widest) && !decode_takes_wide_dims(p, requested, pass) &&
      !splitd_takes(p, requested, pass, &splitd_why)) {
    *why = std::string("composite (") + pass_name + "): head dims " + std::to_string(p.head_dim) + " / " +
           std::to_string(p.head_dim_v) + " exceed the widest fused bucket (" + std::to_string(widest) +
           ") but decode's (" + std::to_string(kDecodeHeadDimBuckets.back()) + ": Nq <= " +
           std::to_string(kMaxDecodeRows) + ", at most 16 query rows per kv head, forward only, "
           "benchmarks/model/families/decode_wide.py) and the split-D kernels' (forward (512, 512), (576, 512), "
           "(256, 512); backward (512, 512)), which do not take this "
           "call: " + splitd_why + ". (The FA2 template at D = 512, 8 x 8 blocks, is predicted 2-3x slower than "
           "unfused: benchmarks/model/families/d512.py, a model, not a measurement.) So this runs the unfused plan in "
           "chunks of query rows: ATen matmuls and softmax on the MPS stream, memory O(chunk x Nk), not a flash "
           "kernel";
    return true;
  }
  // D_qk != D_v within 256 (MLA-style, issue 20 section 2): the fused
  // kernels, forward and backward, take head_dim_v (the wider dim's bucket).
  return false;
}

namespace {

// The kernels' masked-score rule in natural-log units (flash_metal/reference.py
// MASKED_SCORE = -2^100 ln 2): an additive mask pushing a score to or below
// it masks the key, as -inf does.
constexpr double kMaskedScore = -8.7869812903791e+29;

// One dense problem (a whole call, or one sequence of a varlen call): 4-D
// views (B, Hq, Nq, D) of q, (B, Hkv, Nk, D) of k and v, the mask's
// (B, Hq, Nq, Nk) view or undefined.
struct Dense {
  at::Tensor q, k, v, mask;
  int64_t B, Hq, Hkv, G, Nq, Nk;
};

Dense dense(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& mask) {
  Dense d{q, k, v, mask, q.size(0), q.size(1), k.size(1), q.size(1) / std::max<int64_t>(k.size(1), 1), q.size(2),
          k.size(2)};
  return d;
}

int64_t chunk_rows(const Dense& d) {
  const int64_t per_row = std::max<int64_t>(d.B * d.Hq * d.Nk * 4, 1);
  return std::clamp<int64_t>(kCompositeChunkBytes / per_row, 1, std::max<int64_t>(d.Nq, 1));
}

// Rows [r0, r0 + R) of q as float32 (B, Hkv, G * R, D): a query head's rows
// next to its GQA group's, so one matmul with k (B, Hkv, Nk, D) serves all.
at::Tensor grouped_rows(const Dense& d, const at::Tensor& t, int64_t r0, int64_t R) {
  return t.slice(2, r0, r0 + R).to(at::kFloat).reshape({d.B, d.Hkv, d.G * R, t.size(3)});
}

// The scores the softmax sees for rows [r0, r0 + R): scaled, softcapped,
// masked (-inf), windowed, (B, Hq, R, Nk) float32; *raw gets the scaled
// scores before the softcap (the backward's tanh derivative).
at::Tensor scores(const AttentionProblem& p, const Dense& d, const at::Tensor& qg, const at::Tensor& kf, int64_t r0,
                  int64_t R, at::Tensor* raw) {
  at::Tensor s = at::matmul(qg, kf.transpose(-1, -2)).mul_(p.scale).view({d.B, d.Hq, R, d.Nk});
  if (raw != nullptr) *raw = s;
  if (p.has_softcap()) s = at::tanh(s / p.softcap).mul_(p.softcap);
  const double inf = std::numeric_limits<double>::infinity();
  if (d.mask.defined()) {
    const at::Tensor m = d.mask.slice(2, r0, r0 + R);
    if (p.mask == MaskKind::Bool) {
      s = s.masked_fill(at::logical_not(m), -inf);
    } else {
      s = s + m.to(at::kFloat);
      s = s.masked_fill(s <= kMaskedScore, -inf);
    }
  }
  if (p.window_right >= 0 || p.has_window_left()) {
    const auto idx = at::TensorOptions().dtype(at::kLong).device(s.device());
    const at::Tensor i = at::arange(r0, r0 + R, idx).unsqueeze(1) + (d.Nk - d.Nq);
    const at::Tensor j = at::arange(d.Nk, idx).unsqueeze(0);
    at::Tensor hidden = at::zeros({R, d.Nk}, idx.dtype(at::kBool));
    if (p.window_right >= 0) hidden = hidden.logical_or(j > i + p.window_right);
    if (p.has_window_left()) hidden = hidden.logical_or(j < i - p.window_left);
    s = s.masked_fill(hidden, -inf);
  }
  return s;
}

// (B, Hq, R, 1) float32 sink logits, or undefined.
at::Tensor sink_column(const at::Tensor& sinks, const Dense& d, int64_t R) {
  if (!sinks.defined()) return at::Tensor();
  return sinks.to(at::kFloat).view({1, d.Hq, 1, 1}).expand({d.B, d.Hq, R, 1});
}

void forward_dense(const AttentionProblem& p, const Dense& d, const at::Tensor& sinks, const at::Tensor& out,
                   const at::Tensor& lse) {
  const at::Tensor kf = d.k.to(at::kFloat), vf = d.v.to(at::kFloat);
  const int64_t step = chunk_rows(d);
  for (int64_t r0 = 0; r0 < d.Nq; r0 += step) {
    const int64_t R = std::min(step, d.Nq - r0);
    const at::Tensor s = scores(p, d, grouped_rows(d, d.q, r0, R), kf, r0, R, nullptr);
    const at::Tensor sink = sink_column(sinks, d, R);
    at::Tensor mx = s.amax(-1, true);
    if (sink.defined()) mx = at::maximum(mx, sink);
    // A row that sees nothing (every score and the sink -inf): shift by 0,
    // so its sum is 0, its lse -inf and its output 0.
    const at::Tensor shift = at::where(at::isneginf(mx), at::zeros_like(mx), mx);
    at::Tensor prob = at::exp(s - shift);
    at::Tensor sum = prob.sum(-1, true);
    if (sink.defined()) sum = sum + at::exp(sink - shift);
    prob.mul_(at::where(sum > 0, sum.reciprocal(), at::zeros_like(sum)));
    const at::Tensor o = at::matmul(prob.view({d.B, d.Hkv, d.G * R, d.Nk}), vf);
    out.slice(2, r0, r0 + R).copy_(o.view({d.B, d.Hq, R, vf.size(3)}));
    lse.slice(2, r0, r0 + R).copy_((shift + at::log(sum)).squeeze(-1));
  }
}

// The gradients of one dense problem into dq (B, Hq, Nq, D_qk) and dk, dv
// (B, Hkv, Nk, ...) views; returns grad_sinks' float32 (Hq,) contribution.
at::Tensor backward_dense(const AttentionProblem& p, const Dense& d, const at::Tensor& sinks, const at::Tensor& dout,
                          const at::Tensor& out, const at::Tensor& lse, const at::Tensor& glse, const at::Tensor& dq,
                          const at::Tensor& dk, const at::Tensor& dv) {
  const at::Tensor kf = d.k.to(at::kFloat), vf = d.v.to(at::kFloat);
  at::Tensor dk_acc = at::zeros(kf.sizes(), kf.options()), dv_acc = at::zeros(vf.sizes(), vf.options());
  at::Tensor gsinks = at::zeros({d.Hq}, kf.options());
  // Delta = rowsum(dO * O): the softmax's Jacobian term, per row.
  const at::Tensor delta = (dout.to(at::kFloat) * out.to(at::kFloat)).sum(-1, true);
  const int64_t step = chunk_rows(d);
  for (int64_t r0 = 0; r0 < d.Nq; r0 += step) {
    const int64_t R = std::min(step, d.Nq - r0);
    const at::Tensor qg = grouped_rows(d, d.q, r0, R);
    at::Tensor raw;
    const at::Tensor s = scores(p, d, qg, kf, r0, R, &raw);
    const at::Tensor l = lse.slice(2, r0, r0 + R).unsqueeze(-1).to(at::kFloat);
    const at::Tensor shift = at::where(at::isneginf(l), at::zeros_like(l), l);
    const at::Tensor prob = at::exp(s - shift);  // P, recomputed from lse; 0 where masked
    const at::Tensor dog = grouped_rows(d, dout, r0, R);
    dv_acc.add_(at::matmul(prob.view({d.B, d.Hkv, d.G * R, d.Nk}).transpose(-1, -2), dog));
    at::Tensor coef = delta.slice(2, r0, r0 + R);
    if (glse.defined()) coef = coef - glse.slice(2, r0, r0 + R).unsqueeze(-1).to(at::kFloat);
    const at::Tensor dp = at::matmul(dog, vf.transpose(-1, -2)).view({d.B, d.Hq, R, d.Nk});
    at::Tensor ds = prob * (dp - coef);
    if (p.has_softcap()) ds = ds * (1 - at::tanh(raw / p.softcap).square());
    const at::Tensor dsg = ds.view({d.B, d.Hkv, d.G * R, d.Nk});
    dq.slice(2, r0, r0 + R).copy_(at::matmul(dsg, kf).mul_(p.scale).view({d.B, d.Hq, R, kf.size(3)}));
    dk_acc.add_(at::matmul(dsg.transpose(-1, -2), qg).mul_(p.scale));
    const at::Tensor sink = sink_column(sinks, d, R);
    if (sink.defined()) gsinks.add_((at::exp(sink - shift) * coef.neg()).sum(at::IntArrayRef{0, 2, 3}));
  }
  dk.copy_(dk_acc);
  dv.copy_(dv_acc);
  return gsinks;
}

// Sequence b's [start, end) rows of a varlen call's offsets (read on the host).
std::vector<int64_t> offsets_of(const at::Tensor& cu) {
  const at::Tensor host = cu.to(at::kCPU, at::kLong).contiguous();
  const int64_t* v = host.const_data_ptr<int64_t>();
  return std::vector<int64_t>(v, v + host.numel());
}

}  // namespace

void composite_forward(const AttentionCall& c, const AttentionOutputs& o) {
  if (!c.p.varlen) {
    forward_dense(c.p, dense(c.q, c.k, c.v, c.mask), c.sinks, o.out4, o.lse3);
    return;
  }
  const std::vector<int64_t> cq = offsets_of(c.cu_seqlens_q), ck = offsets_of(c.cu_seqlens_k);
  for (size_t b = 0; b + 1 < cq.size(); ++b) {
    const int64_t q0 = cq[b], q1 = cq[b + 1], k0 = ck[b], k1 = ck[b + 1];
    if (q1 == q0) continue;
    const at::Tensor out = o.out4.slice(2, q0, q1), lse = o.lse3.slice(2, q0, q1);
    if (k1 == k0) {  // no key: zeros, and lse the sink (or -inf), as fill_empty_outputs answers
      out.zero_();
      if (c.sinks.defined()) {
        lse.copy_(c.sinks.to(at::kFloat).view({1, -1, 1}).expand(lse.sizes()));
      } else {
        lse.fill_(-std::numeric_limits<double>::infinity());
      }
      continue;
    }
    forward_dense(c.p, dense(c.q.slice(2, q0, q1), c.k.slice(2, k0, k1), c.v.slice(2, k0, k1), at::Tensor()),
                  c.sinks, out, lse);
  }
}

void composite_backward(const AttentionCall& c, const BackwardTensors& t, const AttentionGradients& g) {
  const auto glse = [&](int64_t q0, int64_t q1) {
    return t.grad_lse3.defined() ? t.grad_lse3.slice(2, q0, q1) : at::Tensor();
  };
  at::Tensor gsinks;
  if (!c.p.varlen) {
    gsinks = backward_dense(c.p, dense(c.q, c.k, c.v, c.mask), c.sinks, t.grad_out4, t.out4, t.lse3,
                            glse(0, c.p.q_len), g.grad_q4, g.grad_k4, g.grad_v4);
  } else {
    g.grad_q4.zero_();  // rows of empty sequences, and keys no query sees
    g.grad_k4.zero_();
    g.grad_v4.zero_();
    gsinks = at::zeros({c.p.q_heads}, c.q.options().dtype(at::kFloat));
    const std::vector<int64_t> cq = offsets_of(c.cu_seqlens_q), ck = offsets_of(c.cu_seqlens_k);
    for (size_t b = 0; b + 1 < cq.size(); ++b) {
      const int64_t q0 = cq[b], q1 = cq[b + 1], k0 = ck[b], k1 = ck[b + 1];
      if (q1 == q0) continue;
      if (k1 == k0) {  // the rows attend to the sink only: its gradient, nothing else
        if (c.sinks.defined()) {
          at::Tensor coef = (t.grad_out4.slice(2, q0, q1).to(at::kFloat) * t.out4.slice(2, q0, q1).to(at::kFloat))
                                .sum(-1);
          if (t.grad_lse3.defined()) coef = coef - t.grad_lse3.slice(2, q0, q1);
          const at::Tensor l = t.lse3.slice(2, q0, q1);
          const at::Tensor pr = at::where(at::isneginf(l), at::zeros_like(l),
                                          at::exp(c.sinks.to(at::kFloat).view({1, -1, 1}) - l));
          gsinks.add_((pr * coef.neg()).sum(at::IntArrayRef{0, 2}));
        }
        continue;
      }
      gsinks.add_(backward_dense(c.p,
                                 dense(c.q.slice(2, q0, q1), c.k.slice(2, k0, k1), c.v.slice(2, k0, k1), at::Tensor()),
                                 c.sinks, t.grad_out4.slice(2, q0, q1), t.out4.slice(2, q0, q1),
                                 t.lse3.slice(2, q0, q1), glse(q0, q1), g.grad_q4.slice(2, q0, q1),
                                 g.grad_k4.slice(2, k0, k1), g.grad_v4.slice(2, k0, k1)));
    }
  }
  if (c.p.sinks) g.grad_sinks.copy_(gsinks);
}

}  // namespace flash_metal
