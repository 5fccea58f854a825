// The tensor-op forward's decision at head dim 256 (issue 21, item 1): the
// split-D kernel (shaders/attention_prefill_mpp_dsplit.h), forced by
// impl='tensor_ops' or taken by Auto behind the same gate as the D <= 128
// tensor-op forward plus the model's verdict against the simdgroup prefill.
// Every other head dim goes to tensor_ops_route / choose_tensor_ops
// (metal_routing_tensor_ops.cpp), which the backward shares: the backward has
// no D = 256 kernel, so those two keep refusing 256.
#include "metal_plan_detail.h"

namespace flash_metal::plan_detail {

namespace {

// The model's verdict (benchmarks/metal_model_accel.py, dsplit_against_
// simdgroup; a model, not a measurement): on every M5-family GPU, at
// 1 x 32 (8 KV) x 4096 x 256 float16, causal and not, the split-D tensor-op
// forward against the simdgroup prefill at D = 256.
// tests/test_metal_model_accel.py recomputes it and fails if this constant
// disagrees with the model.
constexpr bool kDsplitModelWins = true;
constexpr const char* kDsplitModelNote =
    "the model (benchmarks/metal_model_accel.py, from the kernel's emulated counts: a model, not a measurement) "
    "predicts it ahead of the simdgroup prefill at D = 256 on every M5-family GPU (1 x 32 (8) x 4096 x 256 "
    "float16, causal and not)";
constexpr const char* kDsplitModelAgainst =
    "the model (benchmarks/metal_model_accel.py: a model, not a measurement) does not predict the split-D "
    "tensor-op forward ahead of the simdgroup prefill at D = 256 on the M5 family";

bool is_dsplit(const AttentionProblem& p) {
  return p.head_dim == kTensorOpsDsplitHeadDim && p.head_dim_v == kTensorOpsDsplitHeadDim;
}

}  // namespace

bool tensor_ops_forward_route(const AttentionProblem& p, const GpuSpec& gpu, std::string* why_not) {
  if (!is_dsplit(p)) return tensor_ops_route(p, gpu, why_not);
  if (gpu.family < kTensorOpsMinFamily) return false;
  if (p.paged) {
    *why_not = "a paged KV cache (the tensor-op kernels do not read the block table; the simdgroup prefill does)";
  } else if (p.dtype != c10::ScalarType::Half && p.dtype != c10::ScalarType::BFloat16) {
    *why_not = "float32 stays on simdgroup matrices (the tensor-op kernels take float16 / bfloat16)";
  } else if (!gpu.tensor_ops_missing.empty()) {
    *why_not = gpu.tensor_ops_missing;
  } else if (!kDsplitModelWins) {
    *why_not = kDsplitModelAgainst;
  } else {
    return true;
  }
  return false;
}

void choose_tensor_ops_forward(const AttentionProblem& p, bool forced, const GpuSpec& gpu, KernelChoice* c) {
  if (is_tensor_ops_mla(p)) {  // the MLA pair (192, 128): the D <= 128 kernel's template (metal_routing_tensor_ops.cpp)
    choose_tensor_ops(p, forced, gpu, c);
    return;
  }
  TORCH_CHECK_TYPE(p.dtype == c10::ScalarType::Half || p.dtype == c10::ScalarType::BFloat16, kOp,
                   ": impl='tensor_ops' takes float16 or bfloat16 q, k, v; got ", dtype_name(p.dtype),
                   " (float32 runs on impl='prefill' or 'auto')");
  // The forward's head dims, named here (choose_tensor_ops's refusal is the backward's too, which has no 256).
  TORCH_CHECK_VALUE(p.head_dim == 64 || p.head_dim == 96 || p.head_dim == 128 || p.head_dim == kTensorOpsDsplitHeadDim,
                    kOp, ": impl='tensor_ops' takes head_dim 64, 96, 128 or 256 (its instantiations, unpadded; 256 "
                    "split along D); got ", p.head_dim, " (use impl='prefill' or 'auto')");
  if (p.head_dim != kTensorOpsDsplitHeadDim) {
    choose_tensor_ops(p, forced, gpu, c);
    return;
  }
  TORCH_CHECK_VALUE(p.head_dim_v == p.head_dim, kOp, ": impl='tensor_ops' at head_dim 256 takes v's head dim 256 "
                    "too; got ", p.head_dim_v, " (use impl='prefill' or 'auto')");
  c->bucket = kTensorOpsDsplitHeadDim;
  c->block_q = kTensorOpsDsplitBlockQ;
  c->block_k = kTensorOpsBlockK;
  c->simdgroups = kTensorOpsDsplitBlockQ / 16 * kTensorOpsDsplitHalves;
  c->reason = forced ? std::string("forced: tensor_ops (impl='tensor_ops'); ")
                     : "tensor ops: an Apple " + std::to_string(gpu.family) +
                           " GPU (a neural accelerator in every core) with macOS 26.2 and the MSL 4 library, "
                           "float16 / bfloat16 (FLASH_METAL_DISABLE_TENSOR_OPS=1 turns this off), and at D = 256 " +
                           kDsplitModelNote + "; ";
  c->reason += "FlashAttention-2 on Metal 4 tensor ops (MPP matmul2d, the MSL 4 library), split along D: blocks of " +
               std::to_string(c->block_q) + " queries x " + std::to_string(c->block_k) + " keys on " +
               std::to_string(c->simdgroups) + " simdgroups, pairs of them sharing 16 rows with 128 features each "
               "(partial scores summed through threadgroup memory, both halves run the softmax), Q slices read "
               "from device memory once, " +
               kib(tensor_ops_dsplit_threadgroup_bytes(dtype_bytes(p.dtype), c->bucket)) +
               " of threadgroup memory";
}

}  // namespace flash_metal::plan_detail
