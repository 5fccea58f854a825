// The tensor-op prefill (issue 21): FlashAttention-2 on Metal 4 tensor ops
// (MPP matmul2d, shaders/tensor_ops/attention_prefill_mpp.h, the MSL 4 library) at head
// dims 64, 96, 128 and the MLA pair (192, 128): Auto's gate (tensor_ops_route,
// which the backward's shares), the kernel's choice, and the "tensor ops"
// row. D = 256 is the split-D row's (tensor_ops_dsplit.cpp).
#include "metal/families/family.h"

namespace flash_metal::plan_detail {

namespace {

// The model's verdict on the MLA pair (benchmarks/model/families/accel.py,
// mla_against_simdgroup; a model, not a measurement): on every M5-family
// GPU, at 1 x 16 x 4096 x (192, 128) float16, causal and not, forward and
// backward, the tensor-op kernels against the simdgroup kernels.
// tests/model/test_metal_model_accel.py recomputes it and fails if this constant
// disagrees with the model.
constexpr bool kMlaModelWins = true;
constexpr const char* kMlaModelAgainst =
    "the model (benchmarks/model/families/accel.py: a model, not a measurement) does not predict the tensor-op "
    "kernels ahead of the simdgroup kernels at (192, 128) on the M5 family";

}  // namespace

// The backward's reason quotes it too (backward_tensor_ops.cpp).
const char* const kMlaModelNote =
    "the model (benchmarks/model/families/accel.py, from the kernels' emulated counts: a model, not a measurement) "
    "predicts them ahead of the simdgroup kernels at (192, 128) on every M5-family GPU (1 x 16 x 4096, float16, "
    "causal and not, forward and backward)";

namespace {

bool served_dims(const AttentionProblem& p) {
  return (p.head_dim_v == p.head_dim && (p.head_dim == 64 || p.head_dim == 96 || p.head_dim == 128)) ||
         is_tensor_ops_mla(p);
}

}  // namespace

// Why the tensor-op kernels cannot read k and v as given ("" when they can):
// they read both as Metal tensors over device memory, whose innermost stride
// must be 1 (Apple: "The stride value of the array's first element needs to
// be exactly 1, because it is the innermost dimension",
// developer.apple.com/documentation/metal/mtltensordescriptor/strides; the
// public MPP kernels build theirs with {1, ld}); the Metal emulator refuses
// any other. q and grad_out are staged element by element, out and the
// gradients written so: any strides there.
std::string tensor_ops_stride_gap(const AttentionProblem& p) {
  if (p.k_dim_stride == 1 && p.v_dim_stride == 1) return "";
  return std::string(p.k_dim_stride != 1 ? "k" : "v") + " strided along the head dim (feature stride " +
         std::to_string(p.k_dim_stride != 1 ? p.k_dim_stride : p.v_dim_stride) +
         "): the tensor-op kernels read k and v as Metal tensors, whose innermost stride must be 1";
}

void check_tensor_ops_strides(const AttentionProblem& p, const char* op) {
  const std::string gap = tensor_ops_stride_gap(p);
  TORCH_CHECK_VALUE(gap.empty(), op, ": impl='tensor_ops' cannot take ", gap, " (Apple's rule for tensor strides); "
                    "pass a view with unit feature stride (e.g. .contiguous()) or use impl='auto'");
}

// The tensor-op prefill (issue 21): FlashAttention-2 on MPP matmul2d
// (shaders/tensor_ops/attention_prefill_mpp.h), forced by impl='tensor_ops' or picked
// by Auto (tensor_ops_route). Refuses, naming the argument, what the kernel
// does not cover yet.
void choose_tensor_ops(const AttentionProblem& p, bool forced, const GpuSpec& gpu, KernelChoice* c) {
  TORCH_CHECK_TYPE(p.dtype == c10::ScalarType::Half || p.dtype == c10::ScalarType::BFloat16, kOp,
                   ": impl='tensor_ops' takes float16 or bfloat16 q, k, v; got ", dtype_name(p.dtype),
                   " (float32 runs on impl='prefill' or 'auto')");
  TORCH_CHECK_VALUE(served_dims(p), kOp,
                    ": impl='tensor_ops' takes head_dim 64, 96 or 128 with v's head dim equal, or the MLA pair "
                    "q/k 192 with v 128 (its instantiations, unpadded); got ", p.head_dim, " / ", p.head_dim_v,
                    " (use impl='prefill' or 'auto')");
  // The options (attn_mask, window_left / window_right, softcap, varlen,
  // sinks) run through attention_features.h's helpers, as in the simdgroup
  // prefill; tests/metal/test_metal_tensor_ops.py checks each under both layouts.
  c->bucket = static_cast<uint32_t>(p.head_dim);
  c->block_q = kTensorOpsBlockQ;
  c->block_k = kTensorOpsBlockK;
  c->simdgroups = kTensorOpsBlockQ / 16;
  c->reason = forced ? std::string("forced: tensor_ops (impl='tensor_ops'); ")
                     : "tensor ops: an Apple " + std::to_string(gpu.family) +
                           " GPU (a neural accelerator in every core) with macOS 26.2 and the MSL 4 library, "
                           "float16 / bfloat16 at a head dim the kernel serves (FLASH_METAL_DISABLE_TENSOR_OPS=1 "
                           "turns this off)" + (is_tensor_ops_mla(p) ? std::string(", and at (192, 128) ") +
                           kMlaModelNote : std::string()) + "; ";
  c->reason += "FlashAttention-2 on Metal 4 tensor ops (MPP matmul2d, the MSL 4 library): blocks of " +
               std::to_string(c->block_q) + " queries x " + std::to_string(c->block_k) + " keys on " +
               std::to_string(c->simdgroups) + " simdgroups of 16 rows, each simdgroup's Q rows read from device "
               "memory once, K and V by matmul2d" +
               (is_tensor_ops_mla(p) ? std::string(" (S = Q.K^T over q/k's 192 features, O += P.V 128 wide)")
                                     : std::string()) + ", Q and P through " +
               kib(tensor_ops_threadgroup_memory(p.dtype, c->bucket)) + " of threadgroup memory";
}

// Whether Auto's prefill runs on the tensor-op kernels, MLX's
// is_nax_available and PyTorch's has_mpp gate made one function: an Apple 10
// GPU or later (M5: matmul2d engages its neural accelerators; on Apple 9
// matmul2d runs on the shader cores, and our model has no figure that it
// beats the simdgroup kernel there, so it stays off), macOS 26.2 and the MSL
// 4 library in this process, the switch not off (all three in
// gpu.tensor_ops_missing), and a problem the kernel serves: float16 or
// bfloat16 (float32 stays IEEE on simdgroup matrices: relaxed, TF32-like
// precision is never chosen for the caller) at head dim 64, 96 or 128 for
// q, k and v alike, or the MLA pair (192, 128) when the model puts the
// tensor-op kernels ahead there (kMlaModelWins). *why_not says what failed, for Apple 10 GPUs only (on
// older ones the path is not a candidate, and their reasons stay short).
bool tensor_ops_route(const AttentionProblem& p, const GpuSpec& gpu, std::string* why_not) {
  if (gpu.family < kTensorOpsMinFamily) return false;
  if (p.paged) {
    *why_not = "a paged KV cache (the tensor-op kernels do not read the block table; the simdgroup prefill does)";
  } else if (!tensor_ops_stride_gap(p).empty()) {
    *why_not = tensor_ops_stride_gap(p);
  } else if (p.dtype != c10::ScalarType::Half && p.dtype != c10::ScalarType::BFloat16) {
    *why_not = "float32 stays on simdgroup matrices (the tensor-op kernels take float16 / bfloat16)";
  } else if (!served_dims(p)) {
    *why_not = "head dims " + std::to_string(p.head_dim) + " / " + std::to_string(p.head_dim_v) +
               ": the tensor-op kernels serve 64, 96 and 128 with equal q/k and v dims, and the MLA pair 192 / 128";
  } else if (!gpu.tensor_ops_missing.empty()) {
    *why_not = gpu.tensor_ops_missing;
  } else if (is_tensor_ops_mla(p) && !kMlaModelWins) {
    *why_not = kMlaModelAgainst;
  } else {
    return true;
  }
  return false;
}

}  // namespace flash_metal::plan_detail

namespace flash_metal {

// Declared in csrc/metal/plan.h. The family's sentence stays short: on older GPUs
// the path is no candidate for Auto, and explain() does not mention it.
std::string tensor_ops_problem(uint32_t family, bool forced, const std::function<std::string()>& library_problem) {
  if (!forced && family < kTensorOpsMinFamily) {
    return "an Apple " + std::to_string(family) + " GPU (Auto runs the tensor-op kernels from Apple " +
           std::to_string(kTensorOpsMinFamily) + ", M5, on)";
  }
  std::string problem = forced ? std::string() : tensor_ops_switched_off();
  if (problem.empty()) problem = library_problem();
  return problem;
}

}  // namespace flash_metal

namespace flash_metal {

namespace {

using namespace plan_detail;

// The "tensor ops" and "tensor ops split-D" rows' common question: a call
// the tensor-op forward may take (impl='tensor_ops', or Auto's prefill
// calls), before the gate. `dsplit`: whether D = 256 is the row's.
WhyNot tensor_ops_candidate(const RouteContext& ctx, bool dsplit) {
  const AttentionProblem& p = ctx.p;
  if (!within_fast_dims(p)) return past_fast_dims(p);
  if (ctx.requested == KernelRequest::TensorOps) {
    if ((p.head_dim == kTensorOpsDsplitHeadDim) == dsplit) return std::nullopt;
    return std::string(dsplit ? "head_dim " + std::to_string(p.head_dim) + " is not 256 (the tensor ops row)"
                              : "head_dim 256 (the tensor ops split-D row)");
  }
  if (ctx.requested != KernelRequest::Auto) {
    return std::string("impl='") + request_name(ctx.requested) + "' names another family";
  }
  if (!p.varlen && p.q_len <= kMaxDecodeRows) {
    return "Nq = " + std::to_string(p.q_len) + " <= " + std::to_string(kMaxDecodeRows) +
           " query rows, not packed (the decode kernels)";
  }
  const bool is_dsplit = p.head_dim == kTensorOpsDsplitHeadDim && p.head_dim_v == kTensorOpsDsplitHeadDim;
  if (is_dsplit != dsplit) {
    return std::string(dsplit ? "head dims other than 256 / 256 (the tensor ops row)"
                              : "head dims 256 / 256 (the tensor ops split-D row)");
  }
  std::string why_not;
  if (tensor_ops_forward_route(p, ctx.gpu, &why_not)) return std::nullopt;
  if (why_not.empty()) why_not = tensor_ops_problem(ctx.gpu.family, false, [] { return std::string(); });
  return why_not;
}

WhyNot tensor_ops_takes(const RouteContext& ctx) { return tensor_ops_candidate(ctx, false); }

}  // namespace

namespace plan_detail {

// Both tensor-op rows plan so: forward_opening's checks, then the kernel's
// choice (its reason replaces the opening's; no padding: each head dim runs
// at its own width).
KernelChoice tensor_ops_forward_plan(const RouteContext& ctx) {
  KernelChoice c = forward_opening(ctx);
  c.kind = KernelRequest::TensorOps;
  choose_tensor_ops_forward(ctx.p, ctx.requested != KernelRequest::Auto, ctx.gpu, &c);
  return c;
}

WhyNot tensor_ops_forward_candidate(const RouteContext& ctx, bool dsplit) { return tensor_ops_candidate(ctx, dsplit); }

}  // namespace plan_detail

extern const FamilyRow kTensorOpsFamily = {
    "tensor ops", MetalPass::Forward,
    "forward; float16, bfloat16; head dims 64, 96, 128 (D_v = D_qk) or the MLA pair (192, 128); every option; "
    "impl 'auto' at Nq > 8 or varlen, or 'tensor_ops'; unit feature strides of k and v; not paged; an Apple 10 "
    "GPU (M5) with macOS 26.2 and the MSL 4 library (any family when forced)",
    "flash_attention_prefill_mpp_float16_*,flash_attention_prefill_mpp_bfloat16_*",
    tensor_ops_takes, plan_detail::tensor_ops_forward_plan};

}  // namespace flash_metal
