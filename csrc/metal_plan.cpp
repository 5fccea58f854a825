#include "metal_plan.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>

namespace flash_metal {
namespace {

constexpr const char* kOp = "flash_metal.attention_forward";

const char* dtype_name(c10::ScalarType t) {
  switch (t) {
    case c10::ScalarType::Float: return "float32";
    case c10::ScalarType::Half: return "float16";
    case c10::ScalarType::BFloat16: return "bfloat16";
    default: TORCH_CHECK_TYPE(false, kOp, ": no Metal kernel for dtype ", t);
  }
}

uint32_t head_dim_bucket(int64_t head_dim) {
  for (uint32_t b : kHeadDimBuckets) {
    if (head_dim <= b) return b;
  }
  TORCH_CHECK_VALUE(false, kOp, ": head_dim ", head_dim, " exceeds the largest bucket ", kHeadDimBuckets.back());
}

uint32_t ceil_div(int64_t a, int64_t b) { return static_cast<uint32_t>((a + b - 1) / b); }

// Bytes of one element of the inputs (the tiled kernel's tiles are stored in it).
uint32_t dtype_bytes(c10::ScalarType t) { return t == c10::ScalarType::Float ? 4 : 2; }

// Threadgroup memory of the tiled kernel (shaders/attention_tiled.h): one K
// tile and one V tile of kPostKeysPerTile rows, each row padded to the
// head-dim bucket so the kernel's inner loops run to a compile-time bound
// (registers, not stack), stored in the input dtype (half the memory for
// float16/bfloat16; converted to float on read). 2 * 16 * bucket * bytes:
// a multiple of 16 (bucket >= 32), as Metal requires, and at most
// 2 * 16 * 256 * 4 = 32 KiB (float32, bucket 256), Metal's limit.
uint32_t tiled_threadgroup_memory(const AttentionProblem& p) {
  return 2 * kPostKeysPerTile * head_dim_bucket(p.head_dim) * dtype_bytes(p.dtype);
}

// The binding slots of every attention kernel: they mirror the [[buffer(n)]]
// and [[threadgroup(n)]] attributes of the kernel templates in shaders/*.h
// (tests/test_metal_kernels.py checks each instantiation's signature against
// this table), in LaunchTensor order.
constexpr std::array<BufferBinding, kLaunchTensorCount> kAttentionBuffers = {{
    {LaunchTensor::Q, 0},
    {LaunchTensor::K, 1},
    {LaunchTensor::V, 2},
    {LaunchTensor::Out, 3},
    {LaunchTensor::Lse, 4},
}};
constexpr uint32_t kAttentionParamsIndex = 5;       // constant AttentionParams& p [[buffer(5)]]
constexpr uint32_t kAttentionThreadgroupIndex = 0;  // the tiled kernel's K/V tiles, [[threadgroup(0)]]

}  // namespace

KernelRequest parse_kernel_request(const std::string& kernel) {
  if (kernel == "auto") return KernelRequest::Auto;
  if (kernel == "untiled") return KernelRequest::Untiled;
  if (kernel == "tiled") return KernelRequest::Tiled;
  TORCH_CHECK_VALUE(false, kOp, ": impl must be one of 'auto', 'untiled', 'tiled'; got '", kernel, "'");
}

KernelRequest choose_metal_kernel(const AttentionProblem& p, KernelRequest requested, std::string* reason) {
  if (requested != KernelRequest::Auto) {
    *reason = requested == KernelRequest::Tiled ? "tiled: requested by the caller (impl='tiled')"
                                                : "untiled: requested by the caller (impl='untiled')";
    return requested;
  }
  // The only rule while the post's two kernels are all we have: the tiled
  // kernel reads each K/V element from device memory once per group of 32
  // queries instead of once per query, and the post measured it faster in 15
  // of 16 configurations. Its threadgroup tile fits every supported head_dim.
  *reason = "tiled: K/V tiles in threadgroup memory are shared by " + std::to_string(kPostThreadsPerGroup) +
            " queries (head_dim " + std::to_string(p.head_dim) + " needs " +
            std::to_string(tiled_threadgroup_memory(p)) +
            " bytes of threadgroup memory, within Metal's 32 KiB)";
  return KernelRequest::Tiled;
}

MetalLaunch plan_metal_attention(const AttentionProblem& p, const LaunchStrides& s, KernelRequest requested) {
  MetalLaunch launch;
  const KernelRequest kind = choose_metal_kernel(p, requested, &launch.reason);
  const uint32_t bucket = head_dim_bucket(p.head_dim);
  const std::string suffix = std::string(dtype_name(p.dtype)) + "_d" + std::to_string(bucket);

  // Both post kernels give each thread one query row, so one threadgroup
  // covers kPostThreadsPerGroup rows of one (batch, head).
  launch.grid = {ceil_div(p.q_len, kPostThreadsPerGroup), static_cast<uint32_t>(p.q_heads),
                 static_cast<uint32_t>(p.batch)};
  launch.threadgroup = {kPostThreadsPerGroup, 1, 1};
  if (kind == KernelRequest::Tiled) {
    // Name format must match the instantiations in shaders/attention.metal.
    launch.kernel_name = "flash_attention_tiled_" + suffix + "_bk" + std::to_string(kPostKeysPerTile) + "_t" +
                         std::to_string(kPostThreadsPerGroup);
    launch.threadgroup_memory = tiled_threadgroup_memory(p);
  } else {
    launch.kernel_name = "flash_attention_untiled_" + suffix + "_t" + std::to_string(kPostThreadsPerGroup);
    launch.threadgroup_memory = 0;
  }
  launch.buffers = kAttentionBuffers;
  launch.params_index = kAttentionParamsIndex;
  launch.threadgroup_memory_index = kAttentionThreadgroupIndex;
  launch.function_constants.assign(kCausalFunctionConstant + 1, false);
  launch.function_constants[kCausalFunctionConstant] = p.causal;

  AttentionParams& a = launch.params;
  a.q_batch_stride = s.q[0]; a.q_head_stride = s.q[1]; a.q_row_stride = s.q[2]; a.q_dim_stride = s.q[3];
  a.k_batch_stride = s.k[0]; a.k_head_stride = s.k[1]; a.k_row_stride = s.k[2]; a.k_dim_stride = s.k[3];
  a.v_batch_stride = s.v[0]; a.v_head_stride = s.v[1]; a.v_row_stride = s.v[2]; a.v_dim_stride = s.v[3];
  a.o_batch_stride = s.o[0]; a.o_head_stride = s.o[1]; a.o_row_stride = s.o[2]; a.o_dim_stride = s.o[3];
  a.lse_batch_stride = s.lse[0]; a.lse_head_stride = s.lse[1]; a.lse_row_stride = s.lse[2];
  a.batch = static_cast<int32_t>(p.batch);
  a.q_heads = static_cast<int32_t>(p.q_heads);
  a.kv_heads = static_cast<int32_t>(p.kv_heads);
  a.gqa_ratio = static_cast<int32_t>(p.gqa_ratio());
  a.q_len = static_cast<int32_t>(p.q_len);
  a.kv_len = static_cast<int32_t>(p.kv_len);
  a.head_dim = static_cast<int32_t>(p.head_dim);
  a.causal_offset = static_cast<int32_t>(p.causal_offset());
  a.scale = static_cast<float>(p.scale);
  a.scale_log2 = p.scale_log2();
  a.kv_splits = 1;
  a.split_keys = static_cast<int32_t>(p.kv_len);
  return launch;
}

std::vector<std::string> all_metal_kernel_names() {
  std::vector<std::string> names;
  for (c10::ScalarType dtype : {c10::ScalarType::Float, c10::ScalarType::Half, c10::ScalarType::BFloat16}) {
    for (uint32_t bucket : kHeadDimBuckets) {
      for (KernelRequest kind : {KernelRequest::Untiled, KernelRequest::Tiled}) {
        AttentionProblem p;
        p.batch = p.q_heads = p.kv_heads = p.q_len = p.kv_len = 1;
        p.head_dim = bucket;
        p.scale = 1.0;
        p.dtype = dtype;
        const LaunchStrides packed{{bucket, bucket, bucket, 1}, {bucket, bucket, bucket, 1},
                                   {bucket, bucket, bucket, 1}, {bucket, bucket, bucket, 1}, {1, 1, 1}};
        std::string name = plan_metal_attention(p, packed, kind).kernel_name;
        if (std::find(names.begin(), names.end(), name) == names.end()) names.push_back(std::move(name));
      }
    }
  }
  return names;
}

}  // namespace flash_metal
