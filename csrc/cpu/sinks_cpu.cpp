// Attention sinks on the CPU (gpt-oss's definition: a virtual key per query
// head with logit sinks[h] and value zero; the softmax runs over [scores,
// sink] and the sink's probability is dropped). The forward needs only each
// row's initial running max and sum (attention_cpu.cpp seeds m = sink,
// l = 1); the q, k, v gradients need nothing new, since lse already includes
// the sink and the sink adds nothing to out. This file has the rest:
// the sinks in base-2 units, and their gradient.
//
// grad_sinks: with P_sink = exp(sink - lse_i) and D_i = rowsum(dO_i * O_i),
//   d out_i / d sink = -P_sink * out_i   and   d lse_i / d sink = P_sink,
// so dL/dsink = sum over rows i of P_sink * (grad_lse_i - D_i): the sink's
// dS = P (dP - D + grad_lse) with dP = 0 (its value is zero). Summed over
// every row of every batch entry (varlen: every packed row) of the head.
#include "kernels.h"
#include "common.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <atomic>
#include <cmath>
#include <vector>

namespace flash_metal {
namespace cpu {

std::vector<float> sinks_base2(const AttentionCall& c) {
  const at::Tensor s = c.sinks.to(at::kFloat).contiguous();
  const float* d = s.const_data_ptr<float>();
  std::vector<float> out(static_cast<size_t>(c.p.q_heads));
  // float32 product, as scale_log2 is formed: the forward's lse of a row
  // that sees only its sink, ln 2 * (sink * log2 e), is then sink to an ulp.
  for (int64_t h = 0; h < c.p.q_heads; ++h) out[static_cast<size_t>(h)] = d[h] * kLog2eF;
  return out;
}

namespace {

// Head h's sum, over rows in a fixed order (batch, then row): deterministic
// whatever the thread count. Each row's D_i is a float32 dot product, as the
// backward kernel's Delta; the rows' terms are added in double, so a head's
// B * N terms cost one float32 rounding at the end instead of one each.
template <typename T>
double head_sum(const BackwardTensors& t, int64_t h, float sink) {
  if (sink == -std::numeric_limits<float>::infinity()) return 0.0;  // no sink: no gradient
  const at::Tensor &go = t.grad_out4, &o = t.out4, &lse = t.lse3;
  const T* gop = go.const_data_ptr<T>();
  const T* op = o.const_data_ptr<T>();
  const float* lp = lse.const_data_ptr<float>();
  const float* glp = t.grad_lse3.defined() ? t.grad_lse3.const_data_ptr<float>() : nullptr;
  const int64_t B = o.size(0), N = o.size(2), D = o.size(3);
  double sum = 0.0;
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t i = 0; i < N; ++i) {
      const float l = lp[b * lse.stride(0) + h * lse.stride(1) + i * lse.stride(2)];
      if (l == -std::numeric_limits<float>::infinity()) continue;  // not a forward lse with this sink
      const T* gr = gop + b * go.stride(0) + h * go.stride(1) + i * go.stride(2);
      const T* orow = op + b * o.stride(0) + h * o.stride(1) + i * o.stride(2);
      float delta = 0.0f;
      for (int64_t d = 0; d < D; ++d)
        delta += static_cast<float>(gr[d * go.stride(3)]) * static_cast<float>(orow[d * o.stride(3)]);
      float term = -delta;
      if (glp != nullptr) {
        const at::Tensor& gl = t.grad_lse3;
        term += glp[b * gl.stride(0) + h * gl.stride(1) + i * gl.stride(2)];
      }
      sum += std::exp(static_cast<double>(sink) - static_cast<double>(l)) * static_cast<double>(term);
    }
  }
  return sum;
}

}  // namespace

void sinks_backward(const AttentionCall& c, const BackwardTensors& t, const at::Tensor& grad_sinks) {
  const int64_t H = c.p.q_heads;
  const at::Tensor s = c.sinks.to(at::kFloat).contiguous();
  const float* sp = s.const_data_ptr<float>();
  std::vector<double> sums(static_cast<size_t>(H));
  std::atomic<int64_t> next{0};
  // One head per item: each head's sum is one thread's fixed-order loop.
  run_on_threads(std::min<int64_t>(std::max<int64_t>(1, at::get_num_threads()), H), [&](int64_t) {
    for (int64_t h = next.fetch_add(1); h < H; h = next.fetch_add(1)) {
      double v = 0.0;
      switch (c.q.scalar_type()) {
        case at::kFloat: v = head_sum<float>(t, h, sp[h]); break;
        case at::kHalf: v = head_sum<c10::Half>(t, h, sp[h]); break;
        case at::kBFloat16: v = head_sum<c10::BFloat16>(t, h, sp[h]); break;
        default: break;  // check_attention_inputs admitted only these three
      }
      sums[static_cast<size_t>(h)] = v;
    }
  });
  const at::Tensor f = at::empty({H}, at::kFloat);
  float* fp = f.mutable_data_ptr<float>();
  for (int64_t h = 0; h < H; ++h) fp[h] = static_cast<float>(sums[static_cast<size_t>(h)]);
  grad_sinks.copy_(f);
}

}  // namespace cpu
}  // namespace flash_metal
