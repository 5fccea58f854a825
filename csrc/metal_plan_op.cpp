// flash_metal::metal_plan: the Metal launch attention_forward (or, with
// backward=True, attention_backward) would encode,
// computed by the same code the MPS implementation runs, returned instead of
// dispatched. Device-independent (it reads only metadata), so it is
// registered for CompositeExplicitAutograd and works on CPU tensors too: the
// test suite's emulated-Metal backend feeds its result to the Metal emulator.
#include "checks.h"
#include "metal_plan.h"

#include <ATen/ATen.h>
#include <torch/library.h>

#include <cstring>

namespace flash_metal {
namespace {

std::array<int64_t, 4> strides4(const at::Tensor& t) {
  return {t.stride(0), t.stride(1), t.stride(2), t.stride(3)};
}

std::tuple<std::string, std::vector<int64_t>, std::vector<int64_t>, int64_t, int64_t, c10::List<bool>,
           std::vector<int64_t>, int64_t, at::Tensor, std::string, int64_t, std::vector<int64_t>>
metal_plan(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool causal,
           std::optional<double> scale, c10::string_view kernel, c10::string_view gpu, int64_t dispatch,
           bool backward, const std::optional<at::Tensor>& grad_out, const std::optional<at::Tensor>& out,
           const std::optional<at::Tensor>& lse, const std::optional<at::Tensor>& grad_lse) {
  const AttentionProblem p = check_attention_inputs(q, k, v, causal, scale);
  const KernelRequest request = parse_kernel_request(std::string(kernel));
  const GpuClass gpu_class = parse_gpu_class(std::string(gpu));
  // The outputs attention_forward allocates are packed; describe them so.
  // The backward reads out, lse, grad_out and grad_lse as the caller passes
  // them (any strides): their strides when given, packed when not.
  const int64_t D = p.head_dim, Nq = p.q_len, H = p.q_heads;
  const auto given = [](const std::optional<at::Tensor>& t) { return t.has_value() && t->defined(); };
  const auto strides3 = [](const at::Tensor& t) { return std::array<int64_t, 3>{t.stride(0), t.stride(1), t.stride(2)}; };
  const std::array<int64_t, 4> packed4{H * Nq * D, Nq * D, D, 1};
  const std::array<int64_t, 3> packed3{H * Nq, Nq, 1};
  LaunchStrides s{strides4(q), strides4(k), strides4(v), packed4, packed3};
  MetalPlan plan;
  if (backward) {
    if (given(out)) s.o = strides4(*out);
    if (given(lse)) s.lse = strides3(*lse);
    s.grad_out = given(grad_out) ? strides4(*grad_out) : packed4;
    s.grad_lse = given(grad_lse) ? strides3(*grad_lse) : s.lse;  // lse stands in, unread, when there is none
    plan = plan_metal_attention_backward(p, s, given(grad_lse), request, gpu_class);
  } else {
    plan = plan_metal_attention(p, s, request, gpu_class);
  }
  const int64_t count = static_cast<int64_t>(plan.launches.size());
  TORCH_CHECK_VALUE(0 <= dispatch && dispatch < count, "flash_metal.metal_plan: dispatch must be in [0, ", count,
                    ") for this plan; got ", dispatch);
  const MetalLaunch& launch = plan.launches[static_cast<size_t>(dispatch)];

  at::Tensor params = at::empty({static_cast<int64_t>(sizeof(AttentionParams))}, at::kByte);
  std::memcpy(params.data_ptr(), &launch.params, sizeof(AttentionParams));
  c10::List<bool> constants;
  for (bool c : launch.function_constants) constants.push_back(c);
  // buffer_indices[t] is the [[buffer(n)]] of LaunchTensor t (q, k, v, out,
  // lse, partial_out, partial_stats, grad_out, grad_q, grad_k, grad_v,
  // grad_lse, delta), -1 where this dispatch binds no such tensor.
  std::vector<int64_t> buffer_indices(kLaunchTensorCount, -1);
  for (const BufferBinding& b : launch.buffers) buffer_indices[static_cast<size_t>(b.tensor)] = b.index;
  return {launch.kernel_name,
          {launch.grid.begin(), launch.grid.end()},
          {launch.threadgroup.begin(), launch.threadgroup.end()},
          launch.threadgroup_memory,
          launch.threadgroup_memory_index,
          constants,
          buffer_indices,
          launch.params_index,
          params,
          plan.reason,
          count,
          {plan.partial_out_elements, plan.partial_stats_elements, plan.delta_elements}};
}

}  // namespace

TORCH_LIBRARY_IMPL(flash_metal, CompositeExplicitAutograd, m) { m.impl("metal_plan", &metal_plan); }

}  // namespace flash_metal
