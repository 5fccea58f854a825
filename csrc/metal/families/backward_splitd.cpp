// The split-D backward at D_qk = D_v = 512 (shaders/backward/attention_backward_splitd.h;
// its launches are in csrc/metal/launch_backward.cpp): whether it takes a call
// (splitd_backward_takes: impl='prefill' only, the model puts it behind the
// composite backward for Auto), its blocks and reason, and the "backward
// split-D" row. The forward's split-D kernel is prefill_splitd.cpp's.
#include "metal/families/family.h"

namespace flash_metal {

namespace {

// The head dim the split-D backward is instantiated for, exactly (whole
// 64-feature parts, no padding columns).
constexpr int64_t kSplitDHeadDim = 512;

// The backward's verdict (benchmarks/model/families/splitd_backward.py prints
// it from the split-D backward's exact emulator counts against the
// composite backward's model; tests/metal/test_metal_backward_splitd.py holds it):
// a model, not a measurement, at 1 x 8 x {1024, 4096} x 512, float16.
// Behind everywhere: the dK/dV kernel, owning 8 keys, re-reads Q and dO once
// per 8 keys (twice per block: S^T's transposed fragments, then dK's), the
// dQ kernel K and V once per 8 query rows, and at 512 features those bytes
// outweigh the composite path's N x N traffic. So impl='auto' never routes
// it; impl='prefill' runs it (O(N) memory, deterministic).
constexpr const char* kSplitDBackwardVerdict =
    "the model puts the split-D backward behind the composite backward (unfused / split-D 0.34-0.52x causal, "
    "0.18-0.26x not causal, at 1x8x{1024,4096}x512 float16 on M1 Max, M3 Max, M4 Pro and M5, the whole band "
    "behind; memory-bound: its dK/dV kernel re-reads Q and dO once per 8 keys; "
    "benchmarks/model/families/splitd_backward.py: a model, not a measurement), so impl='auto' keeps the composite "
    "path (impl='prefill' runs the split-D backward: O(N) memory, deterministic)";

}  // namespace

bool splitd_backward_takes(const AttentionProblem& p, KernelRequest requested, std::string* why_not) {
  std::string why;
  const bool forced = requested == KernelRequest::Prefill;
  if (p.head_dim != kSplitDHeadDim || p.head_dim_v != kSplitDHeadDim) {
    why = "the split-D backward runs D_qk = D_v = " + std::to_string(kSplitDHeadDim) +
          " exactly (whole 64-feature parts, no padding columns); got " + std::to_string(p.head_dim) + " / " +
          std::to_string(p.head_dim_v);
  } else if (p.paged) {
    why = "a paged KV cache has no backward";
  } else if (!forced && requested != KernelRequest::Auto) {
    why = "this impl does not name the split-D backward (impl='auto' or 'prefill' does)";
  } else if (!forced) {
    why = kSplitDBackwardVerdict;
  }
  if (why_not != nullptr) *why_not = why;
  return why.empty();
}

namespace plan_detail {

// The split-D backward's blocks (shaders/backward/attention_backward_splitd.h says
// why): dQ over 8 query rows x 32-key blocks, dK/dV over 8 keys x 32-row
// query blocks, each on 8 SIMD-groups of 64 features. Host names encode them.
constexpr uint32_t kSplitDBackwardOwn = 8, kSplitDBackwardStreamed = 32, kSplitDBackwardSimdgroups = 8;

// Threadgroup memory, the kernels' layouts in floats: 2 x WM x 8 x S
// partials (S and dP), then the dQ kernel's 8 x S dS and WM x 8 Delta
// shares, or the dK/dV kernel's 8 x S P^T and 8 x S dS^T.
constexpr uint32_t splitd_backward_bytes(bool dkdv) {
  const uint32_t block = 8 * kSplitDBackwardStreamed;
  return (2 * kSplitDBackwardSimdgroups * block + (dkdv ? 2 * block : block + kSplitDBackwardSimdgroups * 8)) * 4;
}
static_assert(splitd_backward_bytes(false) == 17664 && splitd_backward_bytes(true) == 18432 &&
                  splitd_backward_bytes(true) <= kMaxThreadgroupMemory && splitd_backward_bytes(false) % 16 == 0 &&
                  splitd_backward_bytes(true) % 16 == 0,
              "the split-D backward's scratch: within 32 KiB, a multiple of 16 bytes");
static_assert(32 * kSplitDBackwardSimdgroups <= uint32_t{kBackwardMaxThreads}, "its declared limit (params.h)");

// Live values per lane: the dQ kernel's Q and dQ fragments (16 each at 64
// features) plus one block of S or dP (8), two operand fragments (4) and
// kLiveOverhead: 60; the dK/dV kernel's dK and dV (16 each) plus S^T and
// dP^T (8 each) and the same: 68. dO (dQ kernel) and K and V (dK/dV kernel)
// are re-read per block, not kept (they would add 16 and 32).
constexpr uint32_t splitd_backward_live(bool dkdv) {
  const uint32_t part = kSplitDHeadDim / 4 / kSplitDBackwardSimdgroups;  // one 8 x 64 slice, in floats per lane
  const uint32_t block = kSplitDBackwardStreamed / 4;                     // one 8 x 32 block
  return (dkdv ? 2 * part + 2 * block : 2 * part + block) + 4 + kLiveOverhead;
}
static_assert(splitd_backward_live(false) <= uint32_t{kDecodeRegisterBudget} &&
                  splitd_backward_live(true) <= uint32_t{kDecodeRegisterBudget},
              "within the planner's 72-value budget");

uint32_t splitd_backward_threadgroup_bytes(bool dkdv) { return splitd_backward_bytes(dkdv); }
uint32_t splitd_backward_live_registers(bool dkdv) { return splitd_backward_live(dkdv); }

KernelChoice choose_splitd_backward(const AttentionProblem&, KernelRequest, const GpuSpec& gpu) {
  KernelChoice c;
  c.kind = KernelRequest::Prefill;  // the simdgroup-matrix family
  c.bucket = static_cast<uint32_t>(kSplitDHeadDim);
  c.block_q = kSplitDBackwardOwn;
  c.block_k = kSplitDBackwardStreamed;
  c.simdgroups = kSplitDBackwardSimdgroups;
  c.dkv_block_k = kSplitDBackwardOwn;
  c.dkv_block_q = kSplitDBackwardStreamed;
  c.dkv_simdgroups = kSplitDBackwardSimdgroups;
  c.dq_feature_split = c.dkv_feature_split = kSplitDBackwardSimdgroups;
  MetalLaunch l;
  l.threadgroup = {32 * kSplitDBackwardSimdgroups, 1, 1};
  l.threadgroup_memory = splitd_backward_bytes(true);
  const LaunchEstimate e = estimate_launch(l, splitd_backward_live(false), gpu);
  c.reason = std::string("backward (split-D): ") +
             "requested by the caller (impl='prefill') at D = 512 (impl='auto' keeps the composite path: " +
             kSplitDBackwardVerdict + ")" +
             "; the simdgroup backward's four 512-wide tiles do not fit 32 KiB, so the head dimension is blocked "
             "(metal-flash-attention's idea) in FlashAttention-2's atomics-free split: a dQ kernel over " +
             std::to_string(kSplitDBackwardOwn) + " query rows x " + std::to_string(kSplitDBackwardStreamed) +
             "-key blocks (Q and dQ in registers, dO re-read, " + kib(splitd_backward_bytes(false)) + ", " +
             std::to_string(splitd_backward_live(false)) + " live values per lane), then a dK/dV kernel over " +
             std::to_string(kSplitDBackwardOwn) + " keys x " + std::to_string(kSplitDBackwardStreamed) +
             "-row query blocks (dK, dV in registers, K/V re-read, the GQA group's heads in order, " +
             kib(splitd_backward_bytes(true)) + ", " + std::to_string(splitd_backward_live(true)) +
             " live values per lane), each on " + std::to_string(kSplitDBackwardSimdgroups) + " simdgroups of " +
             std::to_string(kSplitDHeadDim / kSplitDBackwardSimdgroups) +
             " features reading their operands from device memory, S and dP summed through threadgroup memory "
             "(2 barriers per block), no atomics, deterministic; " + std::to_string(e.simdgroups_per_core) +
             " resident simdgroups per core on " + gpu.name + "; not yet verified on Apple hardware";
  return c;
}

}  // namespace plan_detail

namespace {

using namespace plan_detail;

WhyNot backward_splitd_takes(const RouteContext& ctx) {
  const int64_t fast = kFastHeadDimBuckets.back();
  if (ctx.p.head_dim <= fast && ctx.p.head_dim_v <= fast) {
    return std::string("head dims within 256 (the split-D backward runs 512 / 512)");
  }
  std::string why_not;
  if (splitd_backward_takes(ctx.p, ctx.requested, &why_not)) return std::nullopt;
  return why_not;
}

KernelChoice backward_splitd_plan(const RouteContext& ctx) {
  return choose_splitd_backward(ctx.p, ctx.requested, ctx.gpu);
}

}  // namespace

extern const FamilyRow kBackwardSplitDFamily = {
    "backward split-D", MetalPass::Backward,
    "backward; float32, float16, bfloat16; head dims 512 / 512 exactly; every option; any Nq; not paged; impl "
    "'prefill' only (Auto keeps the composite backward: the model puts it behind); any GPU",
    "flash_backward_splitd_dq_*,flash_backward_splitd_dkdv_*,flash_sinks_grad",
    backward_splitd_takes, backward_splitd_plan};

}  // namespace flash_metal
