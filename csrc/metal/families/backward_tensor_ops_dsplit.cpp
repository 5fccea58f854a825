// The backward at D = 256 (issue 21, item 2): the split-D tensor-op
// backward (shaders/tensor_ops/attention_backward_mpp_dsplit.h), forced by
// impl='tensor_ops' or taken by Auto behind the D <= 128 tensor-op
// backward's gate plus the model's verdict against the simdgroup backward
// at D = 256; the "backward tensor ops split-D" row. Every other head dim
// goes to tensor_ops_backward_route / choose_tensor_ops_backward
// (backward_tensor_ops.cpp).
#include "metal/families/family.h"

namespace flash_metal::plan_detail {

namespace {

// The model's verdict (benchmarks/model/families/accel.py, dsplit_backward_
// against_simdgroup; a model, not a measurement): on every M5-family GPU, at
// 1 x 32 (8 KV) x 4096 x 256 float16, causal and not, the split-D tensor-op
// backward against the simdgroup backward at D = 256.
// tests/model/test_metal_model_accel.py recomputes it and fails if this constant
// disagrees with the model.
constexpr bool kDsplitBackwardModelWins = true;
constexpr const char* kDsplitBackwardModelNote =
    "the model (benchmarks/model/families/accel.py, from the kernels' emulated counts: a model, not a measurement) "
    "predicts it ahead of the simdgroup backward at D = 256 on every M5-family GPU (1 x 32 (8) x 4096 x 256 "
    "float16, causal and not)";
constexpr const char* kDsplitBackwardModelAgainst =
    "the model (benchmarks/model/families/accel.py: a model, not a measurement) does not predict the split-D "
    "tensor-op backward ahead of the simdgroup backward at D = 256 on the M5 family.";

}  // namespace

bool tensor_ops_backward_route_all_d(const AttentionProblem& p, const GpuSpec& gpu, std::string* why_not) {
  if (p.head_dim != kTensorOpsDsplitHeadDim) return tensor_ops_backward_route(p, gpu, why_not);
  if (gpu.family < kTensorOpsMinFamily) return false;
  if (p.paged) {
    *why_not = "a paged KV cache (the tensor-op kernels do not read the block table; the simdgroup prefill does)";
  } else if (!tensor_ops_stride_gap(p).empty()) {
    *why_not = tensor_ops_stride_gap(p);
  } else if (p.dtype != c10::ScalarType::Half && p.dtype != c10::ScalarType::BFloat16) {
    *why_not = "float32 stays on simdgroup matrices (the tensor-op kernels take float16 / bfloat16)";
  } else if (p.head_dim_v != p.head_dim) {
    *why_not = "a v head dim of its own (MLA-style) (the tensor-op backward takes equal q/k and v head dims; the "
               "simdgroup backward takes both)";
  } else if (!gpu.tensor_ops_missing.empty()) {
    *why_not = gpu.tensor_ops_missing;
  } else if (!kDsplitBackwardModelWins) {
    *why_not = kDsplitBackwardModelAgainst;
  } else {
    return true;
  }
  return false;
}

void choose_tensor_ops_backward_all_d(const AttentionProblem& p, bool forced, const GpuSpec& gpu, KernelChoice* c) {
  constexpr const char* kBwd = "flash_metal.attention_backward";
  check_tensor_ops_strides(p, kBwd);
  if (is_tensor_ops_mla(p)) {  // the MLA pair (192, 128): the D <= 128 kernels' template
    choose_tensor_ops_backward(p, forced, gpu, c);
    return;
  }
  TORCH_CHECK_TYPE(p.dtype == c10::ScalarType::Half || p.dtype == c10::ScalarType::BFloat16, kBwd,
                   ": impl='tensor_ops' takes float16 or bfloat16 q, k, v; got ", dtype_name(p.dtype),
                   " (float32 runs on impl='auto')");
  TORCH_CHECK_VALUE(p.head_dim == 64 || p.head_dim == 96 || p.head_dim == 128 || p.head_dim == kTensorOpsDsplitHeadDim,
                    kBwd, ": impl='tensor_ops' takes head_dim 64, 96, 128 or 256 (its instantiations, unpadded; 256 "
                    "split along D), or the MLA pair q/k 192 with v 128; got ", p.head_dim, " (use impl='auto')");
  if (p.head_dim != kTensorOpsDsplitHeadDim) {
    choose_tensor_ops_backward(p, forced, gpu, c);
    return;
  }
  TORCH_CHECK_VALUE(p.head_dim_v == p.head_dim, kBwd, ": impl='tensor_ops' takes every option but a v head dim of "
                    "its own (MLA-style) yet (the simdgroup backward, impl='auto', takes it); got head dims ",
                    p.head_dim, " / ", p.head_dim_v);
  const uint32_t elem = dtype_bytes(p.dtype);
  c->kind = KernelRequest::TensorOps;
  c->bucket = kTensorOpsDsplitHeadDim;
  c->simdgroups = kTensorOpsDsplitHalves;  // dQ: one pair
  c->block_q = kTensorOpsDsplitBackwardBlock;
  c->block_k = kTensorOpsBackwardBlock;
  c->dkv_simdgroups = kTensorOpsDsplitBackwardPairs * kTensorOpsDsplitHalves;
  c->dkv_block_k = 16 * kTensorOpsDsplitBackwardPairs;
  c->dkv_block_q = kTensorOpsDsplitBackwardBlock;
  c->reason = (forced ? std::string("forced: tensor_ops (impl='tensor_ops'); ")
                      : "tensor ops: an Apple " + std::to_string(gpu.family) +
                            " GPU with macOS 26.2 and the MSL 4 library, float16 / bfloat16, equal q/k and v dims "
                            "(FLASH_METAL_DISABLE_TENSOR_OPS=1 turns this off), and at D = 256 " +
                            kDsplitBackwardModelNote + "; ") +
              "backward (split-D tensor ops): FlashAttention-2 with recomputation on Metal 4 tensor ops (MPP "
              "matmul2d, the MSL 4 library), the atomics-free split (dQ and Delta over query blocks, then dK/dV "
              "over key blocks; deterministic), split along D: pairs of simdgroups share rows (dQ) or keys (dK/dV), "
              "each half owning 128 features, partial S and dP summed through threadgroup memory; dQ kernel: " +
              std::to_string(c->block_q) + " queries x " + std::to_string(c->block_k) + " keys on one pair, " +
              kib(tensor_ops_dsplit_backward_bytes(false, elem, c->bucket)) + "; dK/dV kernel: " +
              std::to_string(c->dkv_block_k) + " keys on " + std::to_string(kTensorOpsDsplitBackwardPairs) +
              " pairs x " + std::to_string(c->dkv_block_q) + " queries per Q / dO block (staged once per "
              "threadgroup), " + kib(tensor_ops_dsplit_backward_bytes(true, elem, c->bucket)) +
              "; P and dS rounded to the input dtype before their products, float32 accumulators; options "
              "(masks, windows, softcap, varlen, sinks) by attention_features.h's helpers, as the simdgroup "
              "backward.";
}

}  // namespace flash_metal::plan_detail

namespace flash_metal {

namespace {

WhyNot backward_tensor_ops_dsplit_takes(const RouteContext& ctx) {
  return plan_detail::backward_tensor_ops_candidate(ctx, true);
}

}  // namespace

extern const FamilyRow kBackwardTensorOpsDsplitFamily = {
    "backward tensor ops split-D", MetalPass::Backward,
    "backward; float16, bfloat16; head dims 256 / 256 (split along D); every option; any Nq; unit feature strides "
    "of k and v; impl 'auto' where the model puts it ahead, or 'tensor_ops' at head_dim 256; an Apple 10 GPU (M5) "
    "with macOS 26.2 and the MSL 4 library (any family when forced)",
    "flash_backward_mpp_dsplit_*,flash_sinks_grad",
    backward_tensor_ops_dsplit_takes, plan_detail::backward_tensor_ops_plan};

}  // namespace flash_metal
