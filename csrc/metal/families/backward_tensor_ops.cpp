// The tensor-op backward (shaders/tensor_ops/attention_backward_mpp.h, the MSL 4
// library): FlashAttention-2's backward on Metal 4 tensor ops at head dims
// 64, 96, 128 and the MLA pair (192, 128), behind the forward's gate
// (tensor_ops_route, tensor_ops.cpp) plus what its kernels cover; the
// "backward tensor ops" row. D = 256 is the split-D row's
// (backward_tensor_ops_dsplit.cpp).
#include "metal/families/family.h"

namespace flash_metal::plan_detail {

// What the tensor-op backward (shaders/tensor_ops/attention_backward_mpp.h) does not
// cover, as the sentence that names it ("" when it covers the call): its
// kernels take causal, windows, softcap, bool / additive masks, varlen,
// sinks and GQA (attention_features.h's helpers, as the simdgroup backward),
// and a v head dim of its own at the MLA pair (192, 128) only (choose_tensor_ops
// refuses other pairs).
std::string tensor_ops_backward_gap(const AttentionProblem& p) {
  if (p.head_dim_v != p.head_dim && !is_tensor_ops_mla(p)) return "a v head dim of its own other than (192, 128)";
  return "";
}

// The tensor-op backward, forced (impl='tensor_ops') or by Auto: the
// forward's dtype and head-dim rules (choose_tensor_ops refuses the rest,
// naming the argument), then the options its kernels take.
void choose_tensor_ops_backward(const AttentionProblem& p, bool forced, const GpuSpec& gpu, KernelChoice* c) {
  choose_tensor_ops(p, forced, gpu, c);
  const std::string gap = tensor_ops_backward_gap(p);
  TORCH_CHECK_VALUE(gap.empty(), "flash_metal.attention_backward: impl='tensor_ops' takes every option but ", gap,
                    " yet (the simdgroup backward, impl='auto', takes it)");
  const uint32_t elem = dtype_bytes(p.dtype), d = c->bucket, dv = static_cast<uint32_t>(p.head_dim_v);
  c->kind = KernelRequest::TensorOps;
  c->simdgroups = tensor_ops_backward_simdgroups(false, elem, d, dv);
  c->block_q = 16 * c->simdgroups;
  c->block_k = kTensorOpsBackwardBlock;
  c->dkv_simdgroups = tensor_ops_backward_simdgroups(true, elem, d, dv);
  c->dkv_block_k = 16 * c->dkv_simdgroups;
  c->dkv_block_q = kTensorOpsBackwardBlock;
  c->reason = (forced ? std::string("forced: tensor_ops (impl='tensor_ops'); ")
                      : "tensor ops: an Apple " + std::to_string(gpu.family) +
                            " GPU with macOS 26.2 and the MSL 4 library, float16 / bfloat16 at a head dim the "
                            "kernels serve, " + (is_tensor_ops_mla(p) ? std::string("the MLA pair (192, 128): ") +
                            kMlaModelNote : std::string("equal q/k and v dims")) +
                            " (FLASH_METAL_DISABLE_TENSOR_OPS=1 turns this off); ") +
              "backward: FlashAttention-2 with recomputation on Metal 4 tensor ops (MPP matmul2d, the MSL 4 "
              "library), the atomics-free split (dQ and Delta over query blocks, then dK/dV over key blocks; "
              "deterministic); dQ kernel: " + std::to_string(c->block_q) + " queries x " +
              std::to_string(c->block_k) + " keys on " + std::to_string(c->simdgroups) + " simdgroups of 16 rows, " +
              kib(tensor_ops_backward_bytes(false, elem, d, dv, c->simdgroups)) + "; dK/dV kernel: " +
              std::to_string(c->dkv_block_k) + " keys x " + std::to_string(c->dkv_block_q) + " queries on " +
              std::to_string(c->dkv_simdgroups) + " simdgroups of 16 keys sharing each Q / dO block (staged once per threadgroup), " +
              kib(tensor_ops_backward_bytes(true, elem, d, dv, c->dkv_simdgroups)) +
              (d != dv ? std::string("; q/k 192 and v 128 wide (S = Q.K^T and dP = dO.V^T one matmul2d type with "
                                     "K read from the operands, dQ and dK 192 wide, dV 128)")
                       : std::string()) +
              "; P and dS rounded to the input dtype before their products (matmul2d takes 16-bit operand "
              "pairs), float32 accumulators; options (masks, windows, softcap, varlen, sinks) by "
              "attention_features.h's helpers, as the simdgroup backward.";
}

// Auto's gate for the backward: the forward's (tensor_ops_route) and the
// options its kernels take.
bool tensor_ops_backward_route(const AttentionProblem& p, const GpuSpec& gpu, std::string* why_not) {
  if (!tensor_ops_route(p, gpu, why_not)) return false;
  const std::string gap = tensor_ops_backward_gap(p);
  if (gap.empty()) return true;
  *why_not = gap + " (the tensor-op backward takes equal q/k and v head dims and (192, 128); the simdgroup "
                   "backward takes every pair)";
  return false;
}

}  // namespace flash_metal::plan_detail

namespace flash_metal {

namespace {

using namespace plan_detail;

WhyNot backward_tensor_ops_takes(const RouteContext& ctx) { return backward_tensor_ops_candidate(ctx, false); }

}  // namespace

namespace plan_detail {

// Both tensor-op backward rows' question: impl='tensor_ops' (the row of its
// head_dim), or Auto's gate at every head dim (tensor_ops_backward_route_all_d).
WhyNot backward_tensor_ops_candidate(const RouteContext& ctx, bool dsplit) {
  const AttentionProblem& p = ctx.p;
  if (!within_fast_dims(p)) return past_fast_dims(p);
  if (ctx.requested != KernelRequest::TensorOps && ctx.requested != KernelRequest::Auto) {
    return std::string("impl='") + request_name(ctx.requested) + "' names no backward of this family";
  }
  if ((p.head_dim == kTensorOpsDsplitHeadDim) != dsplit) {
    return std::string(dsplit ? "head_dim " + std::to_string(p.head_dim) + " is not 256 (the backward tensor ops row)"
                              : "head_dim 256 (the backward tensor ops split-D row)");
  }
  if (ctx.requested == KernelRequest::TensorOps) return std::nullopt;
  std::string why_not;
  if (tensor_ops_backward_route_all_d(p, ctx.gpu, &why_not)) return std::nullopt;
  if (why_not.empty()) why_not = tensor_ops_problem(ctx.gpu.family, false, [] { return std::string(); });
  return why_not;
}

// Both plan with the backward's one entry, which picks the kernels by head
// dim (and refuses, naming impl, what a forced call asks past them).
KernelChoice backward_tensor_ops_plan(const RouteContext& ctx) {
  KernelChoice c;
  choose_tensor_ops_backward_all_d(ctx.p, ctx.requested == KernelRequest::TensorOps, ctx.gpu, &c);
  return c;
}

}  // namespace plan_detail

extern const FamilyRow kBackwardTensorOpsFamily = {
    "backward tensor ops", MetalPass::Backward,
    "backward; float16, bfloat16; head dims 64, 96, 128 (D_v = D_qk) or the MLA pair (192, 128); every option; "
    "any Nq; unit feature strides of k and v; impl 'auto' or 'tensor_ops'; an Apple 10 GPU (M5) with macOS 26.2 "
    "and the MSL 4 library (any family when forced)",
    "flash_backward_mpp_dq_*,flash_backward_mpp_dkdv_*,flash_sinks_grad",
    backward_tensor_ops_takes, plan_detail::backward_tensor_ops_plan};

}  // namespace flash_metal
