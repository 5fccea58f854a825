// The backward's launches on Metal (csrc/metal/launch.cpp has the
// forward's): from the backward's KernelChoice (csrc/metal/families/table.cpp,
// choose_backward) to the dQ and dK/dV dispatches of the simdgroup-matrix
// backward or of the tensor-op one, and flash_sinks_grad with sinks.
#include "metal/launch_detail.h"

namespace flash_metal {

using namespace plan_detail;

namespace {

// grad_sinks from Delta (written by the dQ kernel) and lse: one SIMD-group
// per query head (shaders/backward/attention_sinks.h, in the MSL 3.1 library), after
// either backward's dQ and dK/dV kernels; `dq` gives the params and bindings.
void sinks_grad_launch(const AttentionProblem& p, const MetalLaunch& dq, const GpuSpec& gpu, MetalPlan* plan) {
  MetalLaunch sg = dq;
  sg.kernel_name = "flash_sinks_grad";
  sg.grid = {static_cast<uint32_t>(p.q_heads), 1, 1};
  sg.threadgroup = {32, 1, 1};
  sg.max_threads_per_threadgroup = kSinksGradMaxThreads;
  sg.threadgroup_memory = 0;
  sg.function_constants = std::vector<bool>(kFunctionConstantCount, false);
  sg.function_constants[kVarlenFunctionConstant] = p.varlen;
  sg.buffers = kSinksGradBuffers;
  sg.estimate = estimate_launch(sg, kSinksGradLiveRegisters, gpu);
  plan->launches.push_back(sg);
  plan->reason += " Sinks: grad_sinks summed per query head from Delta and lse (flash_sinks_grad, one "
                  "SIMD-group per head, in a fixed order).";
}

// The tensor-op backward's two launches (shaders/tensor_ops/attention_backward_mpp.h):
// dQ and Delta over query blocks, then dK/dV over key blocks, each
// SIMD-group 16 rows (the dK/dV kernel's share each streamed Q / dO block).
// Function constants: the simdgroup backward's (fc_causal, fc_has_grad_lse,
// the options'), align / dense false (the MSL 4 library declares none).
// Sinks: flash_sinks_grad after them, as the simdgroup backward
// (sinks_grad_launch).
void tensor_ops_backward_launches(const AttentionProblem& p, const LaunchStrides& s, bool has_grad_lse,
                                  const KernelChoice& c, const std::string& suffix, const GpuSpec& gpu,
                                  MetalPlan* plan) {
  const uint32_t elem = dtype_bytes(p.dtype), batch = static_cast<uint32_t>(p.batch);
  const uint32_t dv = static_cast<uint32_t>(p.head_dim_v);  // c.bucket but for the MLA pair (192, 128)
  const std::string dims = tensor_ops_suffix(p, suffix);
  // The kernels' tensors index a head's q, k, v and grad_out in int32, as the forward's.
  const auto head_span = [](const std::array<int64_t, 4>& st, int64_t rows, int64_t cols) {
    return (rows - 1) * st[2] + (cols - 1) * st[3];
  };
  TORCH_CHECK_VALUE(head_span(s.q, p.q_len, p.head_dim) < (int64_t{1} << 31) &&
                        head_span(s.k, p.kv_len, p.head_dim) < (int64_t{1} << 31) &&
                        head_span(s.v, p.kv_len, p.head_dim_v) < (int64_t{1} << 31) &&
                        head_span(s.grad_out, p.q_len, p.head_dim_v) < (int64_t{1} << 31),
                    "flash_metal.attention_backward: impl='tensor_ops' indexes one head in int32: a head spans more "
                    "than 2^31 elements here (use impl='auto')");
  // D = 256: the split-D kernels (attention_backward_mpp_dsplit.h), pairs of
  // SIMD-groups each owning half the features: their names, bytes, and per
  // lane half the accumulator width.
  const bool dsplit = c.bucket == kTensorOpsDsplitHeadDim;
  const std::string family = dsplit ? "flash_backward_mpp_dsplit_" : "flash_backward_mpp_";
  const std::string wn = dsplit ? "_wn" + std::to_string(kTensorOpsDsplitHalves) : "";
  const uint32_t width = dsplit ? c.bucket / kTensorOpsDsplitHalves : c.bucket;
  MetalLaunch dq;
  dq.params = make_params(p, s, 1);
  dq.params_index = kAttentionParamsIndex;
  dq.threadgroup_memory_index = kAttentionThreadgroupIndex;
  dq.kernel_name = family + "dq_" + dims + "_bq" + std::to_string(c.block_q) + "_bk" +
                   std::to_string(c.block_k) + wn;
  dq.grid = {ceil_div(p.q_len, c.block_q), static_cast<uint32_t>(p.q_heads), batch};
  dq.threadgroup = {32 * c.simdgroups, 1, 1};
  dq.max_threads_per_threadgroup = kTensorOpsMaxThreads;
  dq.threadgroup_memory = dsplit ? tensor_ops_dsplit_backward_bytes(false, elem, c.bucket)
                                 : tensor_ops_backward_bytes(false, elem, c.bucket, dv, c.simdgroups);
  dq.function_constants = feature_constants(p, false, false, has_grad_lse);
  dq.buffers = with_features(kBackwardDqBuffers);
  // Live values per lane (a model): dQ's 16 x D floats, S's and dP's 16 x 32
  // over the 32 lanes, and the usual overhead (dO's width does not count).
  dq.estimate = estimate_launch(dq, 16 * (width + 2 * c.block_k) / 32 + kLiveOverhead, gpu);
  plan->launches.push_back(dq);

  MetalLaunch dkv = dq;
  dkv.kernel_name = family + "dkdv_" + dims + "_bk" + std::to_string(c.dkv_block_k) + "_bq" +
                    std::to_string(c.dkv_block_q) + wn;
  dkv.grid = {ceil_div(p.kv_len, c.dkv_block_k), static_cast<uint32_t>(p.kv_heads), batch};
  dkv.threadgroup = {32 * c.dkv_simdgroups, 1, 1};
  dkv.threadgroup_memory = dsplit ? tensor_ops_dsplit_backward_bytes(true, elem, c.bucket)
                                  : tensor_ops_backward_bytes(true, elem, c.bucket, dv, c.dkv_simdgroups);
  dkv.function_constants = feature_constants(p, false, false, false);
  dkv.buffers = with_features(kBackwardDkdvBuffers);
  // dK's 16 x D and dV's 16 x D_v floats (half of each at D = 256, split), S^T's and dP^T's 16 x 32.
  dkv.estimate = estimate_launch(dkv, 16 * (width + (dsplit ? width : dv) + 2 * c.dkv_block_q) / 32 + kLiveOverhead, gpu);
  plan->launches.push_back(dkv);
  if (p.sinks) sinks_grad_launch(p, dq, gpu, plan);
}

// The split-D backward's two launches at D = 512 (shaders/backward/attention_backward_splitd.h,
// csrc/metal/families/backward_splitd.cpp): dQ and Delta over 8-row query blocks,
// then dK/dV over 8-key blocks, 256 threads each. Function constants: the
// feature kernels' (fc_causal, fc_has_grad_lse on dQ, the options); the
// alignment and dense-loader ones are false (no tile loader: every operand
// is read per part from device memory, rows past the sequence as zeros).
void splitd_backward_launches(const AttentionProblem& p, const LaunchStrides& s, bool has_grad_lse,
                              const KernelChoice& c, const std::string& suffix, const GpuSpec& gpu, MetalPlan* plan) {
  const uint32_t batch = static_cast<uint32_t>(p.batch);
  MetalLaunch dq;
  dq.params = make_params(p, s, 1);
  dq.params_index = kAttentionParamsIndex;
  dq.threadgroup_memory_index = kAttentionThreadgroupIndex;
  dq.kernel_name = "flash_backward_splitd_dq_" + suffix + "_bq" + std::to_string(c.block_q) + "_bk" +
                   std::to_string(c.block_k) + "_wm" + std::to_string(c.simdgroups);
  dq.grid = {ceil_div(p.q_len, c.block_q), static_cast<uint32_t>(p.q_heads), batch};
  dq.threadgroup = {32 * c.simdgroups, 1, 1};
  dq.max_threads_per_threadgroup = kBackwardMaxThreads;
  dq.threadgroup_memory = splitd_backward_threadgroup_bytes(false);
  dq.function_constants = feature_constants(p, false, false, has_grad_lse);
  dq.buffers = with_features(kBackwardDqBuffers);
  dq.estimate = estimate_launch(dq, splitd_backward_live_registers(false), gpu);
  plan->launches.push_back(dq);

  MetalLaunch dkv = dq;
  dkv.kernel_name = "flash_backward_splitd_dkdv_" + suffix + "_bq" + std::to_string(c.dkv_block_q) + "_bk" +
                    std::to_string(c.dkv_block_k) + "_wm" + std::to_string(c.dkv_simdgroups);
  dkv.grid = {ceil_div(p.kv_len, c.dkv_block_k), static_cast<uint32_t>(p.kv_heads), batch};
  dkv.threadgroup = {32 * c.dkv_simdgroups, 1, 1};
  dkv.threadgroup_memory = splitd_backward_threadgroup_bytes(true);
  dkv.function_constants = feature_constants(p, false, false, false);
  dkv.buffers = with_features(kBackwardDkdvBuffers);
  dkv.estimate = estimate_launch(dkv, splitd_backward_live_registers(true), gpu);
  plan->launches.push_back(dkv);
}

}  // namespace

MetalPlan plan_metal_attention_backward(const AttentionProblem& p, const LaunchStrides& s, bool has_grad_lse,
                                        KernelRequest requested, const GpuSpec& gpu) {
  const KernelChoice c = choose_metal_kernel(p, requested, gpu, MetalPass::Backward);
  MetalPlan plan;
  plan.reason = c.reason;
  // Delta (B * Hq * Nq, or Hq * total_q), then, float32, the dQ kernel's log2 row sums of P for the dK/dV
  // kernel (the renormalized rows, shaders/backward/attention_backward.h: backward_renorm_offset).
  plan.delta_elements = (p.varlen ? p.q_heads * p.total_q : p.batch * p.q_heads * p.q_len) *
                        (p.dtype == c10::ScalarType::Float ? 2 : 1);
  const std::string suffix = std::string(dtype_name(p.dtype)) + "_d" + std::to_string(c.bucket);
  const uint32_t batch = static_cast<uint32_t>(p.batch);
  if (c.kind == KernelRequest::TensorOps) {
    tensor_ops_backward_launches(p, s, has_grad_lse, c, suffix, gpu, &plan);
    for (MetalLaunch& launch : plan.launches) launch.family = c.family;
    check_launch_limits(plan);
    return plan;
  }
  const bool splitd = c.reason.rfind("backward (split-D)", 0) == 0;
  if (splitd) {
    splitd_backward_launches(p, s, has_grad_lse, c, suffix, gpu, &plan);
  } else {
    MetalLaunch dq;
    dq.params = make_params(p, s, 1);
    dq.params_index = kAttentionParamsIndex;
    dq.threadgroup_memory_index = kAttentionThreadgroupIndex;
    dq.kernel_name = "flash_backward_dq_" + suffix + "_bq" + std::to_string(c.block_q) + "_bk" +
                     std::to_string(c.block_k) + "_wm" + std::to_string(c.simdgroups) + "_ds" +
                     std::to_string(c.dq_feature_split);
    dq.grid = {ceil_div(p.q_len, c.block_q), static_cast<uint32_t>(p.q_heads), batch};
    dq.threadgroup = {32 * c.simdgroups, 1, 1};
    dq.max_threads_per_threadgroup = kBackwardMaxThreads;
    dq.threadgroup_memory = backward_threadgroup_memory(c.block_q, c.block_k, c.bucket, p.dtype, c.dq_feature_split);
    // Indices kCausalFunctionConstant, kAlignQ..., kAlignK..., kHasGradLse...
    std::string why;
    const bool dense = dense_loader(p, s, c.bucket, true, &why);
    plan.reason += loader_reason(dense, why);
    // fc_has_sinks on the float32 dQ kernel: its first pass, which renormalizes each row's P to sum to one,
    // is skipped with sinks (the sink's share is part of the row's sum; shaders/backward/attention_backward.h). The
    // 16-bit kernels do not read it: left off, so they keep one pipeline with and without sinks.
    const bool dq_sinks = p.sinks && p.dtype == c10::ScalarType::Float;
    dq.function_constants = with_dense(
        feature_constants(p, p.q_len % c.block_q == 0, p.kv_len % c.block_k == 0, has_grad_lse, dq_sinks), dense);
    dq.buffers = with_features(kBackwardDqBuffers);
    dq.estimate = estimate_launch(dq, dq_live_floats(c.bucket, c.block_k, c.dq_feature_split) + kLiveOverhead, gpu);
    plan.launches.push_back(dq);

    MetalLaunch dkv = dq;
    dkv.kernel_name = "flash_backward_dkdv_" + suffix + "_bq" + std::to_string(c.dkv_block_q) + "_bk" +
                      std::to_string(c.dkv_block_k) + "_wm" + std::to_string(c.dkv_simdgroups) + "_ds" +
                      std::to_string(c.dkv_feature_split);
    dkv.grid = {ceil_div(p.kv_len, c.dkv_block_k), static_cast<uint32_t>(p.kv_heads), batch};
    dkv.threadgroup = {32 * c.dkv_simdgroups, 1, 1};
    dkv.threadgroup_memory = backward_threadgroup_memory(c.dkv_block_k, c.dkv_block_q, c.bucket, p.dtype,
                                                       c.dkv_feature_split);
    dkv.function_constants =
        with_dense(feature_constants(p, p.q_len % c.dkv_block_q == 0, p.kv_len % c.dkv_block_k == 0, false), dense);
    dkv.buffers = with_features(kBackwardDkdvBuffers);
    dkv.estimate =
        estimate_launch(dkv, dkdv_live_floats(c.bucket, c.dkv_block_q, c.dkv_feature_split) + kLiveOverhead, gpu);
    plan.launches.push_back(dkv);
  }
  if (p.sinks) sinks_grad_launch(p, plan.launches.front(), gpu, &plan);  // the dQ launch: its params
  for (MetalLaunch& launch : plan.launches) launch.family = c.family;
  check_launch_limits(plan);
  return plan;
}

}  // namespace flash_metal
