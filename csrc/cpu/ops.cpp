// The four ops on CPU tensors: the common flow of csrc/attention_ops.h over
// the CPU flash kernels (attention_cpu.cpp, attention_backward_cpu.cpp).
#include "kernels.h"
#include "kvcache_quant_cpu.h"

#include "../composite.h"
#include "../kvcache.h"
#include "../metal/plan.h"

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

// attention_kvcache on CPU: a quantized cache (or impl='direct') runs the
// kernel that reads the cache in place through the table
// (kvcache_quant_cpu.cpp); a native cache otherwise gathers the rows in use
// for the varlen flash kernel (csrc/kvcache.h, run_kvcache_gather).
std::tuple<at::Tensor, at::Tensor> attention_kvcache_impl(
    const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& cache_seqlens,
    const std::optional<at::Tensor>& block_table, bool causal, std::optional<double> scale, int64_t window_left,
    int64_t window_right, double softcap, const std::optional<at::Tensor>& sinks, c10::string_view impl,
    const std::optional<at::Tensor>& cu_seqlens_q, int64_t max_seqlen_q, const std::optional<at::Tensor>& k_scale,
    const std::optional<at::Tensor>& k_bias, const std::optional<at::Tensor>& v_scale,
    const std::optional<at::Tensor>& v_bias, c10::string_view k_format, c10::string_view v_format) {
  TORCH_CHECK_VALUE(impl == "auto" || impl == "direct", kKvCacheOpName, ": impl='", impl, "' selects a Metal "
                    "kernel; for tensors on cpu, impl must be 'auto' (a native cache: the rows in use gathered for the "
                    "CPU flash kernel; a quantized one: read in place) or 'direct' (any cache read in place)");
  TORCH_CHECK_VALUE(q.defined(), kKvCacheOpName, ": q is undefined (None)");
  const bool varlen = cu_seqlens_q.has_value() && cu_seqlens_q->defined();
  const int64_t batch = varlen ? cu_seqlens_q->size(0) - 1 : (q.dim() > 0 ? q.size(0) : 0);
  KvQuant kq = check_kv_quant(kKvCacheOpName, q, k_cache, v_cache, k_scale, k_bias, v_scale, v_bias,
                              std::string(k_format), std::string(v_format), batch);
  const KvCacheCall kc = check_kvcache_inputs(
      q, k_cache, v_cache, cache_seqlens, block_table,
      make_options(causal, scale, std::nullopt, window_left, window_right, softcap, sinks), cu_seqlens_q,
      max_seqlen_q, &kq);
  if (!kq.quantized() && impl == "auto") return run_kvcache_gather(kc, forward_kernel);
  // A native side read in place needs its last dim contiguous (quantized ones were checked).
  for (KvSide* s : {&kq.k, &kq.v}) {
    if (s->format == KvFormat::Native && s->codes.size(3) > 1 && s->codes.stride(3) != 1)
      s->codes = s->codes.contiguous();
  }
  return run_forward_op(kc.c, "auto", [&](const AttentionCall&, const AttentionOutputs& o, const std::string&) {
    kvcache_quant_forward(kc, kq, o);
  });
}

std::vector<int64_t> kvcache_quant_counts_op() { return kvcache_quant_counts(); }

}  // namespace
}  // namespace cpu
}  // namespace flash_metal

TORCH_LIBRARY_IMPL(flash_metal, CPU, m) {
  using namespace flash_metal::cpu;
  FLASH_METAL_REGISTER_OPS(m);
  m.impl("attention_kvcache", &attention_kvcache_impl);
}

TORCH_LIBRARY_FRAGMENT(flash_metal, m) {
  // The quantized-cache CPU kernel's calls so far (csrc/cpu/kvcache_quant_cpu.h):
  // per K storage format (float32, float16, bfloat16, int8, q4, fp8_e4m3), per V
  // format, calls that split the keys, work units.
  m.def("kvcache_quant_counts() -> int[]", &flash_metal::cpu::kvcache_quant_counts_op);
}
