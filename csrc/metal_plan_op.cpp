// flash_metal::metal_plan: the Metal launch attention_forward (or, with
// backward=True, attention_backward) would encode,
// computed by the same code the MPS implementation runs, returned instead of
// dispatched. Device-independent (it reads only metadata), so it is
// registered for CompositeExplicitAutograd and works on CPU tensors too: the
// test suite's emulated-Metal backend feeds its result to the Metal emulator.
#include "attention_ops.h"
#include "checks.h"
#include "composite.h"
#include "kvcache.h"
#include "kvcache_quant.h"
#include "metal/families/family.h"
#include "metal/plan.h"

#include <ATen/ATen.h>
#include <torch/library.h>

#include <cstring>

namespace flash_metal {
namespace {

std::array<int64_t, 4> strides4(const at::Tensor& t) {
  return {t.stride(0), t.stride(1), t.stride(2), t.stride(3)};
}

std::tuple<std::string, std::vector<int64_t>, std::vector<int64_t>, int64_t, int64_t, c10::List<bool>,
           std::vector<int64_t>, int64_t, at::Tensor, std::string, int64_t, std::vector<int64_t>, int64_t,
           std::vector<int64_t>, std::string, std::string, std::vector<std::string>, int64_t, at::Tensor>
metal_plan(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool causal,
           std::optional<double> scale, c10::string_view kernel, c10::string_view gpu, int64_t dispatch,
           bool backward, const std::optional<at::Tensor>& grad_out, const std::optional<at::Tensor>& out,
           const std::optional<at::Tensor>& lse, const std::optional<at::Tensor>& grad_lse,
           const std::optional<at::Tensor>& attn_mask, int64_t window_left, int64_t window_right, double softcap,
           const std::optional<at::Tensor>& cu_seqlens_q, const std::optional<at::Tensor>& cu_seqlens_k,
           int64_t max_seqlen_q, int64_t max_seqlen_k, const std::optional<at::Tensor>& sinks,
           const std::optional<at::Tensor>& block_table, const std::optional<at::Tensor>& cache_seqlens,
           const std::optional<at::Tensor>& k_scale, const std::optional<at::Tensor>& k_bias,
           const std::optional<at::Tensor>& v_scale, const std::optional<at::Tensor>& v_bias,
           c10::string_view k_format, c10::string_view v_format) {
  const auto given = [](const std::optional<at::Tensor>& t) { return t.has_value() && t->defined(); };
  const AttentionOptions options = make_options(causal, scale, attn_mask, window_left, window_right, softcap, sinks);
  bool varlen = given(cu_seqlens_q) || given(cu_seqlens_k);
  const bool kvcache = given(cache_seqlens);
  // attention_kvcache's packed queries take cu_seqlens_q alone (the key counts are cache_seqlens).
  TORCH_CHECK_VALUE(!varlen || (given(cu_seqlens_q) && (given(cu_seqlens_k) != kvcache)),
                    "flash_metal.metal_plan: give both cu_seqlens_q and cu_seqlens_k (varlen) or neither; with "
                    "cache_seqlens (attention_kvcache), cu_seqlens_q alone (packed queries)");
  KernelRequest request = parse_kernel_request(std::string(kernel));
  // attention_kvcache's plan (cache_seqlens given; k and v are the caches):
  // the paged decode, or the gather path's varlen plan over the gathered
  // rows (which this reads, from CPU tensors), as the op would run them.
  std::string route;
  TORCH_CHECK_VALUE(kvcache || !given(block_table), "flash_metal.metal_plan: block_table needs cache_seqlens");
  TORCH_CHECK_VALUE(!kvcache || !backward, "flash_metal.metal_plan: cache_seqlens (attention_kvcache) has no "
                    "backward");
  AttentionCall call;
  // A quantized cache (issue 44): validated as the op does; its scales' strides go to KvQuantParams.
  KvQuant kq;
  std::array<int64_t, 3> k_scale_strides{}, v_scale_strides{};
  if (kvcache) {
    const int64_t batch = given(cu_seqlens_q) ? cu_seqlens_q->size(0) - 1 : (q.dim() > 0 ? q.size(0) : 0);
    kq = check_kv_quant(kKvCacheOpName, q, k, v, k_scale, k_bias, v_scale, v_bias, std::string(k_format),
                        std::string(v_format), batch);
    scales_for_metal(&kq);
    k_scale_strides = kv_scale_strides(kq.k);
    v_scale_strides = kv_scale_strides(kq.v);
  } else {
    TORCH_CHECK_VALUE(!given(k_scale) && !given(v_scale) && !given(k_bias) && !given(v_bias), "flash_metal.metal_plan: "
                      "k_scale, k_bias, v_scale and v_bias go with cache_seqlens (attention_kvcache)");
  }
  if (kvcache) {
    const KvCacheCall kc = check_kvcache_inputs(q, k, v, *cache_seqlens, block_table, options, cu_seqlens_q,
                                                max_seqlen_q, kq.quantized() ? &kq : nullptr);
    if (kvcache_reads_table(kc.c.p, request, &route)) {
      call = kc.c;
    } else {
      const GatheredKvCache g = gather_kvcache(kc);
      call = check_varlen_inputs(g.q, g.k, g.v, g.cu_seqlens_q, g.cu_seqlens_k, g.max_seqlen_q, g.max_seqlen_k,
                                 options, kKvCacheOpName);
      request = KernelRequest::Auto;
      varlen = true;
    }
  } else {
    call = varlen ? check_varlen_inputs(q, k, v, *cu_seqlens_q, *cu_seqlens_k, max_seqlen_q, max_seqlen_k, options)
                  : check_attention_inputs(q, k, v, options);
  }
  const AttentionProblem& p = call.p;
  const GpuSpec gpu_spec = parse_gpu(std::string(gpu));
  // The composite path launches no kernel of ours: an empty plan (count 0)
  // with the reason (the emulated backend runs it as impl='composite' on CPU).
  // The routing table's verdicts, one line per kernel family (explain()'s table).
  const MetalPass pass = backward ? MetalPass::Backward : MetalPass::Forward;
  std::vector<std::string> families = explain_metal_families(p, request, gpu_spec, pass);
  std::string composite_why;
  if (composite_route(p, request, pass, &composite_why)) {
    families.push_back("composite: took the call (no kernel of ours)");
    return {"", {}, {}, 0, 0, c10::List<bool>(), std::vector<int64_t>(kLaunchTensorCount, -1), 0,
            at::empty({0}, at::kByte), route + composite_why, 0, {0, 0, 0}, 0, {0, 0, 0}, "", gpu_spec.name,
            families, 0, at::empty({0}, at::kByte)};
  }
  families.push_back("composite: no: a kernel family takes the call");
  // The outputs the forward allocates are packed (allocate_outputs); describe
  // them so. The backward reads out, lse, grad_out and grad_lse as the
  // caller passes them (any strides): their strides when given, packed when not.
  TORCH_CHECK_VALUE(!p.empty(), "flash_metal.metal_plan: an empty problem (B, Nq or Nk is 0) launches no kernel; "
                    "the op answers it on the host");
  // allocate_outputs' layouts: (B, Hq, Nq, D_v) and (B, Hq, Nq); varlen
  // (total_q, Hq, D_v) and (Hq, total_q), seen as (1, Hq, total_q, ...).
  // out (and grad_out) have v's head dim D_v (== D_qk unless MLA-style).
  const int64_t D = p.head_dim_v, H = p.q_heads, N = p.varlen ? p.total_q : p.q_len;
  const std::array<int64_t, 4> packed4 = p.varlen ? std::array<int64_t, 4>{N * H * D, D, H * D, 1}
                                                  : std::array<int64_t, 4>{H * N * D, N * D, D, 1};
  const std::array<int64_t, 3> packed3{H * N, N, 1};
  const auto strides3 = [](const at::Tensor& t) { return std::array<int64_t, 3>{t.stride(0), t.stride(1), t.stride(2)}; };
  LaunchStrides s{strides4(call.q), strides4(call.k), strides4(call.v), packed4, packed3};
  if (call.mask.defined()) s.mask = strides4(call.mask);
  s.k_scale = k_scale_strides;
  s.v_scale = v_scale_strides;
  // The loaders' inputs' storage offsets (fc_dense); a grad_out not given is planned packed, at offset 0.
  s.offsets = {call.q.storage_offset(), call.k.storage_offset(), call.v.storage_offset(),
               backward && given(grad_out) ? as_kernel_view4(*grad_out, varlen).storage_offset() : 0};
  // (The gather path's packed buffers are new allocations: offset 0.)
  MetalPlan plan;
  if (backward) {
    if (given(out)) s.o = strides4(as_kernel_view4(*out, varlen));
    if (given(lse)) s.lse = strides3(as_kernel_view3(*lse, varlen));
    s.grad_out = given(grad_out) ? strides4(as_kernel_view4(*grad_out, varlen)) : packed4;
    // lse stands in, unread, when there is no grad_lse.
    s.grad_lse = given(grad_lse) ? strides3(as_kernel_view3(*grad_lse, varlen)) : s.lse;
    plan = plan_metal_attention_backward(p, s, given(grad_lse), request, gpu_spec);
  } else {
    plan = plan_metal_attention(p, s, request, gpu_spec);
  }
  const int64_t count = static_cast<int64_t>(plan.launches.size());
  TORCH_CHECK_VALUE(0 <= dispatch && dispatch < count, "flash_metal.metal_plan: dispatch must be in [0, ", count,
                    ") for this plan; got ", dispatch);
  const MetalLaunch& launch = plan.launches[static_cast<size_t>(dispatch)];

  at::Tensor params = at::empty({static_cast<int64_t>(sizeof(AttentionParams))}, at::kByte);
  std::memcpy(params.data_ptr(), &launch.params, sizeof(AttentionParams));
  at::Tensor quant_params = at::empty({launch.quant_params_index ? int64_t(sizeof(KvQuantParams)) : 0}, at::kByte);
  if (launch.quant_params_index) std::memcpy(quant_params.data_ptr(), &launch.quant_params, sizeof(KvQuantParams));
  c10::List<bool> constants;
  for (bool c : launch.function_constants) constants.push_back(c);
  // buffer_indices[t] is the [[buffer(n)]] of LaunchTensor t (q, k, v, out,
  // lse, partial_out, partial_stats, grad_out, grad_q, grad_k, grad_v,
  // grad_lse, delta, attn_mask, cu_seqlens_q, cu_seqlens_k, sinks, grad_sinks, block_table,
  // cache_seqlens), -1 where this
  // dispatch binds no such tensor.
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
          route + plan.reason,
          count,
          {plan.partial_out_elements, plan.partial_stats_elements, plan.delta_elements},
          launch.max_threads_per_threadgroup,
          {launch.estimate.live_registers, launch.estimate.threadgroups_per_core,
           launch.estimate.simdgroups_per_core},
          launch.estimate.limit,
          gpu_spec.name,
          families,
          launch.quant_params_index,
          quant_params};
}

// The routing tables (csrc/metal/families/table.cpp), for tests and docs:
// each row's pass, name, declaration and kernel patterns, in priority order.
std::tuple<std::vector<std::string>, std::vector<std::string>, std::vector<std::string>, std::vector<std::string>>
metal_routing_table() {
  std::vector<std::string> passes, names, declares, kernels;
  for (MetalPass pass : {MetalPass::Forward, MetalPass::Backward}) {
    for (const FamilyRow* row : metal_family_table(pass)) {
      passes.push_back(pass == MetalPass::Forward ? "forward" : "backward");
      names.push_back(row->name);
      declares.push_back(row->declares);
      kernels.push_back(row->kernels);
    }
  }
  return {passes, names, declares, kernels};
}

// The registry of compiled kernels (all_metal_launches, csrc/metal/registry.cpp):
// each launch's host name and the row that planned it.
std::tuple<std::vector<std::string>, std::vector<std::string>> metal_registry_routes() {
  std::vector<std::string> kernels, families;
  for (const MetalLaunch& l : all_metal_launches()) {
    kernels.push_back(l.kernel_name);
    families.push_back(l.family);
  }
  return {kernels, families};
}

// Tests only: a FamilyRow at address `row` (a test double's, built and
// loaded by the test itself, never part of this library) inserted at
// `position` of its pass's table; row 0 removes every registered one.
void metal_routing_register_family(int64_t row, int64_t position) {
  register_metal_family(reinterpret_cast<const FamilyRow*>(static_cast<intptr_t>(row)), position);
}

}  // namespace

TORCH_LIBRARY_IMPL(flash_metal, CompositeExplicitAutograd, m) { m.impl("metal_plan", &metal_plan); }

TORCH_LIBRARY_IMPL(flash_metal, CompositeExplicitAutograd, m) {
  m.impl("metal_routing_table", &metal_routing_table);
  m.impl("metal_registry_routes", &metal_registry_routes);
  m.impl("metal_routing_register_family", &metal_routing_register_family);
}

}  // namespace flash_metal
