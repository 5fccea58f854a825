// The four ops on CPU tensors: the common flow of csrc/attention_ops.h over
// the CPU flash kernels (attention_cpu.cpp, attention_backward_cpu.cpp).
#include "kernels.h"

#include "../composite.h"
#include "../kvcache.h"
#include "../metal_plan.h"

#include <torch/library.h>

namespace flash_metal {
namespace cpu {
namespace {

// impl='composite' runs the composite path (csrc/composite.h) on CPU
// tensors: the code the MPS op runs where no fused kernel serves, testable here.
void forward_kernel(const AttentionCall& c, const AttentionOutputs& o, const std::string& impl) {
  const KernelRequest request = parse_kernel_request(impl);
  if (request == KernelRequest::Composite) return composite_forward(c, o);
  TORCH_CHECK_VALUE(request == KernelRequest::Auto, "flash_metal.attention_forward: impl='", impl,
                    "' selects a Metal kernel; tensors on cpu run the CPU flash kernel, so impl must be 'auto' (or "
                    "'composite')");
  attention_forward(c, o);
}

void backward_kernel(const AttentionCall& c, const BackwardTensors& t, const AttentionGradients& g,
                     const std::string& impl) {
  if (impl == "composite") return composite_backward(c, t, g);
  TORCH_CHECK_VALUE(impl == "auto", "flash_metal.attention_backward: impl='", impl,
                    "' is not available for tensors on cpu, which run the CPU flash backward kernel; impl must be "
                    "'auto' (or 'composite')");
  attention_backward(c, t, g);
  if (c.p.sinks) sinks_backward(c, t, g.grad_sinks);
}

FLASH_METAL_DEFINE_OPS(forward_kernel, backward_kernel)

// attention_kvcache on CPU: the rows in use gathered through the table,
// then the varlen flash kernel (csrc/kvcache.h, run_kvcache_gather).
std::tuple<at::Tensor, at::Tensor> attention_kvcache_impl(
    const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& cache_seqlens,
    const std::optional<at::Tensor>& block_table, bool causal, std::optional<double> scale, int64_t window_left,
    int64_t window_right, double softcap, const std::optional<at::Tensor>& sinks, c10::string_view impl,
    const std::optional<at::Tensor>& cu_seqlens_q, int64_t max_seqlen_q) {
  TORCH_CHECK_VALUE(impl == "auto", kKvCacheOpName, ": impl='", impl, "' selects a Metal kernel; tensors on cpu "
                    "gather the rows in use for the CPU flash kernel, so impl must be 'auto'");
  const KvCacheCall kc = check_kvcache_inputs(
      q, k_cache, v_cache, cache_seqlens, block_table,
      make_options(causal, scale, std::nullopt, window_left, window_right, softcap, sinks), cu_seqlens_q,
      max_seqlen_q);
  return run_kvcache_gather(kc, forward_kernel);
}

}  // namespace
}  // namespace cpu
}  // namespace flash_metal

TORCH_LIBRARY_IMPL(flash_metal, CPU, m) {
  using namespace flash_metal::cpu;
  FLASH_METAL_REGISTER_OPS(m);
  m.impl("attention_kvcache", &attention_kvcache_impl);
}
