// The tensor-op forward's decision at head dim 256 (issue 21, item 1): the
// split-D kernel (shaders/tensor_ops/attention_prefill_mpp_dsplit.h), forced by
// impl='tensor_ops' or taken by Auto behind the same gate as the D <= 128
// tensor-op forward plus the model's verdict against the simdgroup prefill.
// Every other head dim goes to tensor_ops_route / choose_tensor_ops
// (csrc/metal/families/tensor_ops.cpp), which the backward shares: the backward
// has no D <= 128 kernel at 256, so those two keep refusing 256. The "tensor
// ops split-D" row is at the end.
#include <cstdlib>
#include <string>

#include "metal/families/family.h"

namespace flash_metal::plan_detail {

namespace {

// The model's verdict (benchmarks/model/families/accel.py, dsplit_against_
// simdgroup; a model, not a measurement): on every M5-family GPU, at
// 1 x 32 (8 KV) x 4096 x 256 float16, causal and not, the split-D tensor-op
// forward against the simdgroup prefill at D = 256.
// tests/model/test_metal_model_accel.py recomputes it and fails if this constant
// disagrees with the model.
constexpr bool kDsplitModelWins = true;
constexpr const char* kDsplitModelNote =
    "the model (benchmarks/model/families/accel.py, from the kernel's emulated counts: a model, not a measurement) "
    "predicts it ahead of the simdgroup prefill at D = 256 on every M5-family GPU (1 x 32 (8) x 4096 x 256 "
    "float16, causal and not)";
constexpr const char* kDsplitModelAgainst =
    "the model (benchmarks/model/families/accel.py: a model, not a measurement) does not predict the split-D "
    "tensor-op forward ahead of the simdgroup prefill at D = 256 on the M5 family";

bool is_dsplit(const AttentionProblem& p) {
  return p.head_dim == kTensorOpsDsplitHeadDim && p.head_dim_v == kTensorOpsDsplitHeadDim;
}

// The 32-row kernel or the 64-row one (flash_attention_prefill_mpp_dsplit_wide,
// Q in registers). The model (benchmarks/model/families/accel.py, wide_against_32:
// a model, not a measurement) prices both from their emulated counts: the
// 64-row kernel asks for each K/V block once per 64 query rows instead of 32,
// which is what bounds the 32-row kernel (bytes to the core), but has half as
// many threadgroups, so a grid too small to fill the GPU's cores twice over runs
// fewer SIMD-groups per core, and both run one threadgroup per core (the 32-row
// one by its 28,928 bytes, the 64-row one by its 128 live values x 256 threads),
// so a partial last wave costs the 64-row kernel twice the work. Its verdict
// (M5, M5 Pro, M5 Max, float16, causal and not, Nq 128-2048, Hq 1-40; t = 64-row
// threadgroups per core): the 32-row kernel ahead at t <= 0.4 (1.14-1.40x the
// 64-row kernel's time) and, not causal, at t = 1.2 (a second wave nearly
// empty: 1.09x at the point); the 64-row kernel ahead over its whole band at
// every t >= 2 sampled (0.71-0.88x; 0.72x at 1 x 32 (8) x 4096), and between
// 0.8 and 1.6 except t = 1.2. As a rule: the 64-row kernel when the grid of
// 64-row threadgroups (ceil(Nq / 64) x Hq x B) is at least
// kDsplitWideMinPerCore = 2 per core of the GPU, else the 32-row kernel
// (which keeps some shapes the model gives the 64-row kernel by 1-13 %: the
// rule stays where the model's verdict does not swing with the waves).
// tests/model/test_metal_model_accel.py recomputes the model on both sides of the
// threshold and fails if this rule disagrees with it.
constexpr int64_t kDsplitWideMinPerCore = 2;
// FLASH_METAL_TENSOR_OPS_DSPLIT_ROWS=32 or 64 picks the kernel whatever the
// rule says (the model prices both; a Mac can time both).
constexpr const char* kDsplitRowsEnv = "FLASH_METAL_TENSOR_OPS_DSPLIT_ROWS";

// 0 when the rule decides, else the rows the switch asks for.
int64_t dsplit_rows_forced() {
  const char* value = std::getenv(kDsplitRowsEnv);
  if (value == nullptr || *value == '\0') return 0;
  const std::string v(value);
  TORCH_CHECK_VALUE(v == "32" || v == "64", kOp, ": ", kDsplitRowsEnv, " must be 32 or 64; got '", v, "'");
  return v == "64" ? 64 : 32;
}

// Whether the 64-row kernel takes the call, and a sentence saying why.
bool dsplit_wide_takes(const AttentionProblem& p, const GpuSpec& gpu, std::string* why) {
  const int64_t forced = dsplit_rows_forced();
  if (forced != 0) {
    *why = std::string(kDsplitRowsEnv) + "=" + std::to_string(forced) + " picks the " + std::to_string(forced) +
           "-row kernel";
    return forced == 64;
  }
  const int64_t tgs = (p.q_len + kTensorOpsDsplitWideBlockQ - 1) / kTensorOpsDsplitWideBlockQ * p.q_heads * p.batch;
  const int64_t need = kDsplitWideMinPerCore * static_cast<int64_t>(gpu.cores);
  const bool wide = tgs >= need;
  *why = std::to_string(tgs) + " threadgroups of 64 rows " + (wide ? ">= " : "< ") + std::to_string(need) + " (" +
         std::to_string(kDsplitWideMinPerCore) + " per core of the " + gpu.name + "'s " + std::to_string(gpu.cores) +
         "): the model (benchmarks/model/families/accel.py; a model, not a measurement) puts the " +
         (wide ? "64-row kernel ahead there (each K/V block fetched once per 64 query rows instead of 32, which "
                 "bounds the 32-row kernel)"
               : "32-row kernel ahead there (twice the threadgroups to fill the cores)");
  return wide;
}

}  // namespace

bool tensor_ops_forward_route(const AttentionProblem& p, const GpuSpec& gpu, std::string* why_not) {
  if (!is_dsplit(p)) return tensor_ops_route(p, gpu, why_not);
  if (gpu.family < kTensorOpsMinFamily) return false;
  if (p.paged) {
    *why_not = "a paged KV cache (the tensor-op kernels do not read the block table; the simdgroup prefill does)";
  } else if (!tensor_ops_stride_gap(p).empty()) {
    *why_not = tensor_ops_stride_gap(p);
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
  check_tensor_ops_strides(p, kOp);
  if (is_tensor_ops_mla(p)) {  // the MLA pair (192, 128): the D <= 128 kernel's template (csrc/metal/families/tensor_ops.cpp)
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
  std::string rows_why;
  const bool wide = dsplit_wide_takes(p, gpu, &rows_why);
  c->bucket = kTensorOpsDsplitHeadDim;
  c->block_q = wide ? kTensorOpsDsplitWideBlockQ : kTensorOpsDsplitBlockQ;
  c->block_k = wide ? kTensorOpsDsplitWideBlockK : kTensorOpsBlockK;
  c->simdgroups = c->block_q / 16 * kTensorOpsDsplitHalves;
  c->reason = forced ? std::string("forced: tensor_ops (impl='tensor_ops'); ")
                     : "tensor ops: an Apple " + std::to_string(gpu.family) +
                           " GPU (a neural accelerator in every core) with macOS 26.2 and the MSL 4 library, "
                           "float16 / bfloat16 (FLASH_METAL_DISABLE_TENSOR_OPS=1 turns this off), and at D = 256 " +
                           kDsplitModelNote + "; ";
  c->reason += "FlashAttention-2 on Metal 4 tensor ops (MPP matmul2d, the MSL 4 library), split along D: blocks of " +
               std::to_string(c->block_q) + " queries x " + std::to_string(c->block_k) + " keys on " +
               std::to_string(c->simdgroups) + " simdgroups, pairs of them sharing 16 rows with 128 features each "
               "(partial scores summed through threadgroup memory, both halves run the softmax), Q slices read "
               "from device memory once " +
               (wide ? "into registers (left-input cooperative tensors; staged they would fill 32 KiB), partials "
                       "double-buffered, "
                     : "into threadgroup memory, ") +
               kib(wide ? tensor_ops_dsplit_wide_threadgroup_bytes(dtype_bytes(p.dtype))
                        : tensor_ops_dsplit_threadgroup_bytes(dtype_bytes(p.dtype), c->bucket)) +
               " of threadgroup memory; " + std::to_string(c->block_q) + " rows: " + rows_why;
}

}  // namespace flash_metal::plan_detail

namespace flash_metal {

namespace {

WhyNot tensor_ops_dsplit_takes(const RouteContext& ctx) { return plan_detail::tensor_ops_forward_candidate(ctx, true); }

}  // namespace

extern const FamilyRow kTensorOpsDsplitFamily = {
    "tensor ops split-D", MetalPass::Forward,
    "forward; float16, bfloat16; head dims 256 / 256 (split along D; 32- or 64-row blocks); every option; impl "
    "'auto' at Nq > 8 or varlen where the model puts it ahead, or 'tensor_ops' at head_dim 256; unit feature "
    "strides of k and v; not paged; an Apple 10 GPU (M5) with macOS 26.2 and the MSL 4 library (any family when "
    "forced)",
    "flash_attention_prefill_mpp_dsplit_*",
    tensor_ops_dsplit_takes, plan_detail::tensor_ops_forward_plan};

}  // namespace flash_metal
