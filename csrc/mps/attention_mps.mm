// flash_metal::attention_forward and attention_backward for MPS tensors: turn
// the portable plans (csrc/metal/plan.h) into Metal calls on PyTorch's own
// MPS stream, through one encoding function (encode_plan).
//
// The encoding follows the pattern of PyTorch's own Attention.mm and its
// test/cpp_extensions/mps_extension.mm (idea credited, code not copied):
// inside dispatch_sync on the stream's
// serial queue, take the stream's shared compute encoder, bind, dispatch, and
// leave committing to PyTorch. The rules, checked on Linux by
// tests/mps/test_mps_host.py:
//   - never open an encoder of our own, never end the shared one, never commit;
//   - stream->commandEncoder() only inside dispatch_sync(stream->queue(), ...);
//   - nothing inside the block can throw, and no PyTorch MPS op runs there:
//     validation, allocation and pipeline lookup all happen before it;
//   - manual retain/release (no ARC).
// The launch is visible to torch.mps.profiler: it is bracketed with PyTorch's
// MPS profiler calls the way PyTorch's own Metal kernels do (see
// profile_begin below).
#include "attention_ops.h"
#include "checks.h"
#include "composite.h"
#include "kvcache.h"
#include "metal/plan.h"
#include "library.h"

#include <ATen/ATen.h>
#include <ATen/mps/MPSDevice.h>
#include <ATen/mps/MPSProfiler.h>
#include <ATen/mps/MPSStream.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <string>
#include <tuple>
#include <vector>

namespace flash_metal::mps {
namespace {

constexpr const char* kForwardOp = "flash_metal.attention_forward";
constexpr const char* kBackwardOp = "flash_metal.attention_backward";
constexpr const char* kKvCacheOp = kKvCacheOpName;

// The MTLBuffer behind an MPS tensor: PyTorch's MPS allocator hands out the
// buffer object itself as the storage's data pointer (the same cast as
// ATen's getMTLBufferStorage, which is internal API, hence this copy of the
// idea). Bind it at the tensor's storage offset, in bytes.
// __builtin_bit_cast rather than std::bit_cast: it needs no C++20.
id<MTLBuffer> buffer_of(const at::Tensor& t) { return __builtin_bit_cast(id<MTLBuffer>, t.storage().data()); }
NSUInteger byte_offset_of(const at::Tensor& t) {
  return static_cast<NSUInteger>(t.storage_offset() * t.element_size());
}

// PyTorch's MPS profiler (torch.mps.profiler; os_signpost intervals in
// Instruments), called as PyTorch's own Metal kernels call it (its sort,
// GroupNorm and indexing kernels): begin after taking the stream's encoder,
// end after the dispatch, both inside the dispatch_sync block, keyed by the
// pipeline state. Reachable from an extension: MPSProfiler.h ships in the
// macOS wheels, and at::mps::getMPSProfiler(), beginProfileKernel(const void*,
// const std::string&, TensorList) and endProfileKernel(const void*, SyncType)
// are exported by libtorch_cpu.dylib in torch 2.4.0 and 2.14.1 (checked with
// llvm-nm and the dylib's export trie). Both return at once unless profiling
// is on. They could still throw (allocation, internal asserts), and nothing
// may throw inside the block, so these wrappers swallow: a failed profiler
// call must cost a trace entry, never the process.
void profile_begin(id<MTLComputePipelineState> state, const std::string& kernel,
                   const std::vector<at::Tensor>& inputs) noexcept {
  try {
    at::mps::getMPSProfiler().beginProfileKernel(state, kernel, inputs);
  } catch (...) {
  }
}

void profile_end(id<MTLComputePipelineState> state) noexcept {
  try {
    at::mps::getMPSProfiler().endProfileKernel(state);
  } catch (...) {
  }
}

std::array<int64_t, 4> strides4(const at::Tensor& t) { return {t.stride(0), t.stride(1), t.stride(2), t.stride(3)}; }

// The GPU the plans are sized for (GpuSpec in csrc/metal/plan.h), from the
// device's name. The name is autoreleased, and this runs on the caller's
// thread, which may have no pool: hence our own, with the name copied out
// before it drains. Computed once per process (PyTorch drives a single MPS
// device); whether this process can run the tensor-op kernels is asked per
// call (the switch may change; the library is loaded once, library.mm).
// forced (impl='tensor_ops'): the switch, which only keeps Auto off them,
// does not count.
GpuSpec gpu_spec_of(id<MTLDevice> device, bool forced = false) {
  static const GpuSpec cached = [&] {
    std::string name;
    @autoreleasepool {
      NSString* ns = [device name];
      if (ns != nil) name = [ns UTF8String];
    }
    return gpu_from_device_name(name);
  }();
  GpuSpec spec = cached;
  // The rule is portable (csrc/metal/plan.h); metal_device_info reports the same.
  // On a GPU that is no candidate for Auto the MSL 4 library is not even loaded.
  spec.tensor_ops_missing =
      tensor_ops_problem(spec.family, forced, [device] { return tensor_ops_library_problem(device); });
  return spec;
}

// Checks, before any encoding, that the device and the pipeline can run the
// launch as planned; Metal would otherwise fail (or corrupt) at dispatch.
void check_launch_fits(const MetalLaunch& launch, const Pipeline& pipeline, id<MTLDevice> device, const char* op) {
  const uint64_t threads =
      uint64_t{launch.threadgroup[0]} * launch.threadgroup[1] * launch.threadgroup[2];
  TORCH_CHECK(pipeline.max_threads_per_threadgroup >= threads, op, ": kernel ", launch.kernel_name, " needs ",
              threads, " threads per threadgroup but its pipeline allows at most ",
              pipeline.max_threads_per_threadgroup, " on this GPU; use impl='tiled' or report this");
  const uint64_t memory = uint64_t{launch.threadgroup_memory} + pipeline.static_threadgroup_memory;
  const uint64_t limit = [device maxThreadgroupMemoryLength];
  TORCH_CHECK(memory <= limit, op, ": kernel ", launch.kernel_name, " needs ", memory,
              " bytes of threadgroup memory but this GPU has ", limit);
}

// One dispatch, resolved to plain values before the encoding block (which
// must not throw or call into PyTorch): pipeline, sizes, params, and the
// binding table turned into (buffer, byte offset, index) triples.
struct ResolvedLaunch {
  id<MTLComputePipelineState> state = nil;
  std::string kernel_name;  // for the profiler
  AttentionParams params{};
  MTLSize grid{}, group{};
  NSUInteger threadgroup_memory = 0, threadgroup_memory_index = 0, params_index = 0;
  KvQuantParams quant_params{};   // the quantized decode's second block (quant_params_index > 0)
  NSUInteger quant_params_index = 0;
  std::vector<id<MTLBuffer>> buffers;
  std::vector<NSUInteger> offsets, indices;
};

using LaunchTensors = std::array<const at::Tensor*, kLaunchTensorCount>;  // indexed by LaunchTensor

// Encodes every launch of `plan`, in order, on the current stream's shared
// encoder, binding each launch's tensors from `tensors` by its binding
// table. First everything that can throw (pipelines, limits, bindings),
// then the dispatch_sync block, which cannot. attention_forward and
// attention_backward both encode through here.
void encode_plan(const MetalPlan& plan, const LaunchTensors& tensors, id<MTLDevice> device,
                 const std::vector<at::Tensor>& profiled_inputs, const char* op) {
  std::vector<ResolvedLaunch> launches;
  for (const MetalLaunch& launch : plan.launches) {
    const Pipeline pipeline = get_pipeline(device, launch.kernel_name, launch.function_constants);
    check_launch_fits(launch, pipeline, device, op);
    ResolvedLaunch r;
    r.state = pipeline.state;
    r.kernel_name = launch.kernel_name;
    r.params = launch.params;
    r.grid = MTLSizeMake(launch.grid[0], launch.grid[1], launch.grid[2]);
    r.group = MTLSizeMake(launch.threadgroup[0], launch.threadgroup[1], launch.threadgroup[2]);
    r.threadgroup_memory = launch.threadgroup_memory;
    r.threadgroup_memory_index = launch.threadgroup_memory_index;
    r.params_index = launch.params_index;
    r.quant_params = launch.quant_params;
    r.quant_params_index = launch.quant_params_index;
    for (const BufferBinding& b : launch.buffers) {
      const at::Tensor* t = tensors[static_cast<size_t>(b.tensor)];
      TORCH_CHECK(t != nullptr && t->defined(), op, ": internal error: ", launch.kernel_name,
                  " binds a tensor this op does not have");
      r.buffers.push_back(buffer_of(*t));
      r.offsets.push_back(byte_offset_of(*t));
      r.indices.push_back(b.index);
    }
    launches.push_back(std::move(r));
  }

  // --- Encoding: no throw, no PyTorch op, no own encoder, no commit. ---
  // The launches go on the stream, in order, and run serially, so each sees
  // the previous one's writes (the split-KV merge pass the partials, the
  // backward's dK/dV kernel the Delta of its dQ kernel). The encoder is
  // fetched again for every launch, and every launch binds all it uses:
  // with profiling on (torch.mps.profiler, PYTORCH_MPS_LOG_PROFILE_INFO),
  // PyTorch's endProfileKernel synchronizes the stream, which ends the shared
  // encoder, so the next launch needs the new one (and an encoder starts
  // with no bindings). Without profiling, commandEncoder() returns the same
  // coalesced encoder each time.
  at::mps::MPSStream* stream = at::mps::getCurrentMPSStream();
  dispatch_sync(stream->queue(), ^{
    @autoreleasepool {
      for (const ResolvedLaunch& r : launches) {
        id<MTLComputeCommandEncoder> encoder = stream->commandEncoder();
        profile_begin(r.state, r.kernel_name, profiled_inputs);
        [encoder setComputePipelineState:r.state];
        for (size_t i = 0; i < r.buffers.size(); ++i) {
          [encoder setBuffer:r.buffers[i] offset:r.offsets[i] atIndex:r.indices[i]];
        }
        [encoder setBytes:&r.params length:sizeof(r.params) atIndex:r.params_index];
        if (r.quant_params_index != 0) {
          [encoder setBytes:&r.quant_params length:sizeof(r.quant_params) atIndex:r.quant_params_index];
        }
        if (r.threadgroup_memory != 0) {
          [encoder setThreadgroupMemoryLength:r.threadgroup_memory atIndex:r.threadgroup_memory_index];
        }
        [encoder dispatchThreadgroups:r.grid threadsPerThreadgroup:r.group];
        profile_end(r.state);
      }
    }
  });
}

// Float32 scratch on the stream, like any MPS tensor; it lives until the
// calling op returns, after the encoding (PyTorch's allocator keeps freed
// storage usable for work already on the stream).
at::Tensor scratch(const at::Tensor& like, int64_t n) {
  return at::empty({std::max<int64_t>(n, 1)}, like.options().dtype(at::kFloat));
}

// The tensors of a plan's binding table: the options' inputs, or q in
// their slots when absent (declared buffers are always bound; the kernel's
// function constants keep them unread).
// sinks32: the sinks as the kernels read them (sinks_as_float32), undefined without sinks.
void put_options(const AttentionCall& c, const at::Tensor& sinks32, LaunchTensors* tensors) {
  const auto put = [&](LaunchTensor slot, const at::Tensor& t) { (*tensors)[static_cast<size_t>(slot)] = &t; };
  put(LaunchTensor::Mask, c.mask.defined() ? c.mask : c.q);
  put(LaunchTensor::CuSeqlensQ, c.p.varlen ? c.cu_seqlens_q : c.q);
  put(LaunchTensor::CuSeqlensK, c.p.varlen ? c.cu_seqlens_k : c.q);
  put(LaunchTensor::Sinks, sinks32.defined() ? sinks32 : c.q);
  put(LaunchTensor::BlockTable, c.q);  // the paged cache (decode, prefill): attention_kvcache binds it (encode_forward)
  put(LaunchTensor::CacheSeqlens, c.q);
}

// The sinks as every kernel reads them: float32, contiguous (Hq floats); the
// tensor itself when it already is (no PyTorch op runs then).
at::Tensor sinks_as_float32(const AttentionCall& c) {
  return c.p.sinks ? c.sinks.to(at::kFloat).contiguous() : at::Tensor();
}

LaunchStrides launch_strides(const AttentionCall& c, const at::Tensor& out4, const at::Tensor& lse3) {
  LaunchStrides s{strides4(c.q), strides4(c.k), strides4(c.v), strides4(out4),
                  {lse3.stride(0), lse3.stride(1), lse3.stride(2)}};
  if (c.mask.defined()) s.mask = strides4(c.mask);
  s.offsets = {c.q.storage_offset(), c.k.storage_offset(), c.v.storage_offset(), -1};  // fc_dense's alignment
  return s;
}

// attention_forward and attention_varlen_forward on MPS: plan, then encode.
// With kc (attention_kvcache's table route: decode or prefill): c is kc->c, k and v its
// (num_blocks, Hkv, page_size, D) views of the caches, and the table and
// lengths are bound at their slots (the plan sets fc_paged, page_size and
// table_stride: csrc/metal/launch.cpp).
void encode_forward(const AttentionCall& c, const AttentionOutputs& o, const std::string& impl, const KvCacheCall* kc,
                    const char* op) {
  // --- Everything that can throw or touch PyTorch happens here, first. ---
  const KernelRequest request = parse_kernel_request(impl);
  id<MTLDevice> device = at::mps::MPSDevice::getInstance()->device();
  const bool forced_tensor_ops = request == KernelRequest::TensorOps;
  const GpuSpec gpu = gpu_spec_of(device, forced_tensor_ops);
  // Forced tensor ops where this process cannot run them: say why rather
  // than fail at pipeline lookup (Auto never picks them then).
  TORCH_CHECK_NOT_IMPLEMENTED(!forced_tensor_ops || gpu.tensor_ops_missing.empty(), op,
                              ": impl='tensor_ops' cannot run in this process: ", gpu.tensor_ops_missing);
  LaunchStrides strides = launch_strides(c, o.out4, o.lse3);
  if (kc != nullptr && kc->quant.quantized()) {  // the scales' strides (KvQuantParams)
    strides.k_scale = kv_scale_strides(kc->quant.k);
    strides.v_scale = kv_scale_strides(kc->quant.v);
  }
  const MetalPlan plan = plan_metal_attention(c.p, strides, request, gpu);

  // The split-KV decode's float32 scratch.
  const at::Tensor partial_out = scratch(c.q, plan.partial_out_elements);
  const at::Tensor partial_stats = scratch(c.q, plan.partial_stats_elements);
  LaunchTensors tensors{};
  const auto put = [&](LaunchTensor slot, const at::Tensor& t) { tensors[static_cast<size_t>(slot)] = &t; };
  put(LaunchTensor::Q, c.q);
  put(LaunchTensor::K, c.k);
  put(LaunchTensor::V, c.v);
  put(LaunchTensor::Out, o.out4);
  put(LaunchTensor::Lse, o.lse3);
  put(LaunchTensor::PartialOut, partial_out);
  put(LaunchTensor::PartialStats, partial_stats);
  const at::Tensor sinks32 = sinks_as_float32(c);
  put_options(c, sinks32, &tensors);
  if (kc != nullptr) {
    put(LaunchTensor::BlockTable, kc->block_table);
    put(LaunchTensor::CacheSeqlens, kc->cache_seqlens);
    // A quantized cache's scales and biases (a side without one: its scale, or q; never read).
    const KvSide& ks = kc->quant.k;
    const KvSide& vs = kc->quant.v;
    put(LaunchTensor::KScale, ks.scale.defined() ? ks.scale : c.q);
    put(LaunchTensor::KBias, ks.bias.defined() ? ks.bias : ks.scale.defined() ? ks.scale : c.q);
    put(LaunchTensor::VScale, vs.scale.defined() ? vs.scale : c.q);
    put(LaunchTensor::VBias, vs.bias.defined() ? vs.bias : vs.scale.defined() ? vs.scale : c.q);
  }
  encode_plan(plan, tensors, device, {c.q, c.k, c.v}, op);
}

// Where no fused kernel serves (composite_route: head dims above 256, or an
// explicit impl='composite'), the composite path's ATen ops run on the MPS
// stream instead of a kernel of ours (csrc/composite.h).
void forward_kernel(const AttentionCall& c, const AttentionOutputs& o, const std::string& impl) {
  std::string why;
  if (composite_route(c.p, parse_kernel_request(impl), MetalPass::Forward, &why)) return composite_forward(c, o);
  encode_forward(c, o, impl, nullptr, kForwardOp);
}

// attention_backward and attention_varlen_backward: the two kernels of
// shaders/backward/attention_backward.h (dQ and Delta, then dK/dV), planned by
// plan_metal_attention_backward. Inputs are read in place with their own
// strides; the gradients are packed.
void backward_kernel(const AttentionCall& c, const BackwardTensors& t, const AttentionGradients& g,
                     const std::string& impl) {
  const KernelRequest request = parse_kernel_request(impl);
  std::string why;
  if (composite_route(c.p, request, MetalPass::Backward, &why)) return composite_backward(c, t, g);
  // Without grad_lse, lse is bound in its slot (the kernel's has_grad_lse
  // constant is false, so it is never read): every declared buffer bound.
  const bool has_grad_lse = t.grad_lse3.defined();
  const at::Tensor& glse = has_grad_lse ? t.grad_lse3 : t.lse3;
  id<MTLDevice> device = at::mps::MPSDevice::getInstance()->device();
  // As the forward: forced tensor ops where this process cannot run them say why.
  const bool forced_tensor_ops = request == KernelRequest::TensorOps;
  const GpuSpec gpu = gpu_spec_of(device, forced_tensor_ops);
  TORCH_CHECK_NOT_IMPLEMENTED(!forced_tensor_ops || gpu.tensor_ops_missing.empty(), kBackwardOp,
                              ": impl='tensor_ops' cannot run in this process: ", gpu.tensor_ops_missing);
  LaunchStrides strides = launch_strides(c, t.out4, t.lse3);
  strides.grad_out = strides4(t.grad_out4);
  strides.offsets[3] = t.grad_out4.storage_offset();
  strides.grad_lse = {glse.stride(0), glse.stride(1), glse.stride(2)};
  const MetalPlan plan = plan_metal_attention_backward(c.p, strides, has_grad_lse, request, gpu);

  const at::Tensor delta = scratch(c.q, plan.delta_elements);
  LaunchTensors tensors{};
  const auto put = [&](LaunchTensor slot, const at::Tensor& x) { tensors[static_cast<size_t>(slot)] = &x; };
  put(LaunchTensor::Q, c.q);
  put(LaunchTensor::K, c.k);
  put(LaunchTensor::V, c.v);
  put(LaunchTensor::Out, t.out4);
  put(LaunchTensor::Lse, t.lse3);
  put(LaunchTensor::GradOut, t.grad_out4);
  put(LaunchTensor::GradQ, g.grad_q4);
  put(LaunchTensor::GradK, g.grad_k4);
  put(LaunchTensor::GradV, g.grad_v4);
  put(LaunchTensor::GradLse, glse);
  put(LaunchTensor::Delta, delta);
  // With sinks, flash_sinks_grad writes float32 grad_sinks: straight into
  // g.grad_sinks when that is float32 (it is allocated packed), else into
  // scratch converted after the encoding (a PyTorch op, queued on the same
  // stream after the kernels).
  const at::Tensor sinks32 = sinks_as_float32(c);
  const bool direct = c.p.sinks && g.grad_sinks.scalar_type() == at::kFloat;
  const at::Tensor grad_sinks32 = direct ? g.grad_sinks : c.p.sinks ? scratch(c.q, c.p.q_heads) : at::Tensor();
  if (c.p.sinks) put(LaunchTensor::GradSinks, grad_sinks32);
  put_options(c, sinks32, &tensors);
  encode_plan(plan, tensors, device, {t.grad_out4, c.q, c.k, c.v}, kBackwardOp);
  if (c.p.sinks && !direct) g.grad_sinks.copy_(grad_sinks32);
}

FLASH_METAL_DEFINE_OPS(forward_kernel, backward_kernel)

// attention_kvcache on MPS: the decode kernels (Nq <= 8) or the prefill read
// the table (kvcache_reads_table, csrc/metal/families/paged.cpp); otherwise (head
// dims past 256) the rows in use are gathered (PyTorch MPS ops, before any
// encoding) for the varlen plan.
std::tuple<at::Tensor, at::Tensor> attention_kvcache_impl(
    const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& cache_seqlens,
    const std::optional<at::Tensor>& block_table, bool causal, std::optional<double> scale, int64_t window_left,
    int64_t window_right, double softcap, const std::optional<at::Tensor>& sinks, c10::string_view impl,
    const std::optional<at::Tensor>& cu_seqlens_q, int64_t max_seqlen_q, const std::optional<at::Tensor>& k_scale,
    const std::optional<at::Tensor>& k_bias, const std::optional<at::Tensor>& v_scale,
    const std::optional<at::Tensor>& v_bias, c10::string_view k_format, c10::string_view v_format) {
  // Quantized caches (issue 44) are validated as on CPU and read in place by
  // the quantized decode kernels (the planner's "quantized decode" row,
  // which refuses what they cannot serve); a 4-bit side's scale and bias
  // are made contiguous only where their strides differ (scales_for_metal).
  const bool varlen = cu_seqlens_q.has_value() && cu_seqlens_q->defined();
  const int64_t batch = varlen ? cu_seqlens_q->size(0) - 1 : (q.dim() > 0 ? q.size(0) : 0);
  KvQuant kq = check_kv_quant(kKvCacheOp, q, k_cache, v_cache, k_scale, k_bias, v_scale, v_bias,
                              std::string(k_format), std::string(v_format), batch);
  scales_for_metal(&kq);
  const KvCacheCall kc = check_kvcache_inputs(
      q, k_cache, v_cache, cache_seqlens, block_table,
      make_options(causal, scale, std::nullopt, window_left, window_right, softcap, sinks), cu_seqlens_q,
      max_seqlen_q, kq.quantized() ? &kq : nullptr);
  std::string why;
  if (!kvcache_reads_table(kc.c.p, parse_kernel_request(std::string(impl)), &why)) {
    return run_kvcache_gather(kc, forward_kernel);
  }
  return run_forward_op(kc.c, impl, [&](const AttentionCall& c, const AttentionOutputs& o, const std::string& i) {
    encode_forward(c, o, i, &kc, kKvCacheOp);
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(flash_metal, MPS, m) {
  FLASH_METAL_REGISTER_OPS(m);
  m.impl("attention_kvcache", &attention_kvcache_impl);
}

}  // namespace flash_metal::mps
