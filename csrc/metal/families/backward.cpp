// The simdgroup backward (shaders/backward/attention_backward.h): FlashAttention-2's
// backward with recomputation, metal-flash-attention's atomics-free split
// (flash_backward_dq, then flash_backward_dkdv; flash_sinks_grad with sinks),
// at every head dim up to 256. Its blocks (one search over the register
// budget, threadgroup memory and residency), its reason, and the "backward"
// row: Auto's catch-all after the tensor-op rows.
#include "metal/families/family.h"

namespace flash_metal {

namespace plan_detail {

namespace {

// The backward's blocks for one bucket (choose_backward's search, below).
struct BackwardBlocks {
  uint32_t resident = 0, parts = 0, own = 0, streamed = 0;
  bool recompute = false;
};

BackwardBlocks backward_blocks(uint32_t bucket, c10::ScalarType dtype) {
  const auto better = [](const BackwardBlocks& a, const BackwardBlocks& b) {
    if (a.resident != b.resident) return a.resident > b.resident;
    if (a.recompute != b.recompute) return !a.recompute;
    if (a.parts != b.parts) return a.parts < b.parts;
    if (a.own != b.own) return a.own > b.own;
    return a.streamed > b.streamed;
  };
  BackwardBlocks best;
  for (uint32_t parts : {1u, 2u, 3u, 4u, 8u}) {
    if (bucket % (8 * parts) != 0) continue;
    for (uint32_t own : {64u, 32u, 16u, 8u}) {
      const uint32_t simdgroups = own / 8 * parts;
      const uint32_t threads = 32 * simdgroups;
      if (threads > uint32_t{kBackwardMaxThreads}) continue;
      for (uint32_t streamed : {32u, 16u, 8u}) {
        const uint32_t bytes = backward_threadgroup_memory(own, streamed, bucket, dtype, parts);
        const uint32_t live = std::max(dq_live_floats(bucket, streamed, parts),
                                       dkdv_live_floats(bucket, streamed, parts)) + kLiveOverhead;
        // The general loader gives every thread the same number of elements.
        const bool even = own * bucket % threads == 0 && streamed * bucket % threads == 0;
        if (bytes > kMaxThreadgroupMemory || live > kBackwardRegisterBudget || !even) continue;
        // Parts whose split-K scratch does not fit recompute S and dP instead.
        const bool recompute = parts > 1 && backward_partials_bytes(own, streamed, bucket, dtype, parts) == 0;
        BackwardBlocks cand{std::min(kResidentTarget, resident_on_every_chip(simdgroups, bytes, live)), parts,
                            own, streamed, recompute};
        if (best.parts == 0 || better(cand, best)) best = cand;
      }
    }
  }
  return best;
}

// The simdgroup backward's choice (Auto only: the tensor-op rows come first
// in the table and took what their gate passes; their reason why not is
// quoted here, on Apple 10 GPUs).
KernelChoice choose_backward(const AttentionProblem& p, const GpuSpec& gpu) {
  std::string tensor_ops_why_not;
  tensor_ops_backward_route_all_d(p, gpu, &tensor_ops_why_not);
  KernelChoice c;
  c.kind = KernelRequest::Prefill;  // the simdgroup-matrix family
  // The bucket every tile fits: the wider of D_qk and D_v (MLA-style calls;
  // each tile is loaded at its own width, attention_backward.h).
  c.bucket = bucket_of(std::max(p.head_dim, p.head_dim_v), kFastHeadDimBuckets);
  // Blocks: one rule for both kernels. R rows owned (query rows for dQ,
  // keys for dK/dV) in R / 8 row groups, S rows streamed per block (keys
  // for dQ, query rows for dK/dV), and F feature parts: each row group runs
  // F SIMD-groups that share its rows and the tiles, each keeping the
  // accumulators of 1 / F of the features (dQ: bucket / 8 / F fragments;
  // dK and dV twice that) and multiplying S and dP over those features
  // only; the parts sum their partials through a threadgroup scratch
  // (split-K, attention_backward.h: no product repeated, one more barrier
  // per streamed block; metal-flash-attention blocks along D instead). Every
  // candidate keeps both kernels' live values (accumulators, one block of P
  // and dP, kLiveOverhead) within the register budget, its four tiles and
  // the parts' scratch within 32 KiB and within kBackwardMaxThreads. Among
  // them, in order (backward_blocks):
  //  1. resident SIMD-groups per core, on the chip that holds fewest, up to
  //     kResidentTarget (the 32 KiB cores of Apple 9 bind first);
  //  2. split-K over recomputation (a part recomputes S and dP only where
  //     the scratch does not fit: float32 at D = 80 and 256);
  //  3. the fewest parts (the least scratch, partial-sum reads and barriers);
  //  4. the largest R: the streamed side is re-read once per R owned rows,
  //     so R sets the memory traffic (K/V reads of the dQ kernel);
  //  5. the largest S (MMAs per barrier pair).
  // A bucket none of whose blocks reaches kResidentTarget runs in the next
  // bucket that does (zero-padded): float32 at 72, whose 9 fragments split
  // only into 3 parts, where the split-K scratch costs the second
  // threadgroup on 32 KiB cores (16,16,3: 6 resident), runs 80's 32,16,2
  // (8 resident, recomputing: 11/7 x 80/72 the products of 72's split-K,
  // half its K/V re-reads; modelled 1.03-1.12x faster on M1, M3 Max,
  // M4 Pro, M5 at 1 x 8 x 1024; no instantiation of its own).
  // The result, float16/bfloat16 | float32 (R, S, F), 8 resident
  // SIMD-groups per core on every named chip, shaders/attention.metal
  // instantiates it:
  //   D = 32: 64,32,1 | 64,32,1   64: 64,32,1 | 32,16,2   72: 64,32,1 | (80's)
  //   D = 80: 64,32,1 | 32,16,2 (recomputing)   96: 64,16,1 | 16,16,4   128: 32,16,2 | 16,8,4
  //   D = 192: 16,16,4 | 8,8,8 (both split-K: 192's tiles leave room for
  //   the scratch, 256's do not)
  //   D = 256: 16,8,4 | 8,8,8 (recomputing: no room for the scratch)
  // Tiles keep their 16-byte row padding where it fits (backward_row_pad).
  BackwardBlocks best = backward_blocks(c.bucket, p.dtype);
  std::string wider;
  for (uint32_t bucket : kFastHeadDimBuckets) {
    if (best.resident >= kResidentTarget) break;
    if (bucket <= c.bucket) continue;
    const BackwardBlocks next = backward_blocks(bucket, p.dtype);
    if (next.parts == 0 || next.resident <= best.resident) continue;
    wider = "; the " + std::to_string(c.bucket) + "-wide blocks reach only " + std::to_string(best.resident) +
            " resident simdgroups per core on some named chip, so the " + std::to_string(bucket) +
            "-wide instantiation runs instead";
    c.bucket = bucket;
    best = next;
  }
  TORCH_CHECK(best.parts != 0, "flash_metal.attention_backward: internal error: no block size fits head dims ",
              p.head_dim, " / ", p.head_dim_v);
  c.block_q = best.own; c.block_k = best.streamed; c.simdgroups = best.own / 8 * best.parts;
  c.dkv_block_k = best.own; c.dkv_block_q = best.streamed; c.dkv_simdgroups = c.simdgroups;
  c.dq_feature_split = c.dkv_feature_split = best.parts;
  const uint32_t dq_bytes = backward_threadgroup_memory(c.block_q, c.block_k, c.bucket, p.dtype, best.parts);
  const uint32_t dkv_bytes = backward_threadgroup_memory(c.dkv_block_k, c.dkv_block_q, c.bucket, p.dtype, best.parts);
  const uint32_t dq_floats = dq_live_floats(c.bucket, c.block_k, c.dq_feature_split);
  const uint32_t dkv_floats = dkdv_live_floats(c.bucket, c.dkv_block_q, c.dkv_feature_split);
  c.reason = "backward: FlashAttention-2 with recomputation, metal-flash-attention's atomics-free split (dQ and "
             "Delta parallel over query blocks, then dK/dV parallel over key blocks; deterministic); dQ kernel: " +
             std::to_string(c.block_q) + " queries x " + std::to_string(c.block_k) + " keys on " +
             std::to_string(c.simdgroups) + " simdgroups, " + kib(dq_bytes) + ", " + std::to_string(dq_floats) +
             " live floats per lane; dK/dV kernel: " + std::to_string(c.dkv_block_k) + " keys x " +
             std::to_string(c.dkv_block_q) + " queries on " + std::to_string(c.dkv_simdgroups) + " simdgroups, " +
             kib(dkv_bytes) + ", " + std::to_string(dkv_floats) + " live floats per lane";
  if (best.parts > 1 && best.recompute) {
    c.reason += "; dQ, dK and dV split over " + std::to_string(best.parts) +
                " simdgroups by features; the split-K scratch (" +
                kib(c.simdgroups * 2 * (c.block_k / 8) * 256) +
                ") does not fit 32 KiB beside the tiles, so each part recomputes its rows' S and dP over all "
                "features: the price, (4F + 3) / 7 = " + std::to_string(4 * best.parts + 3) +
                " / 7 x the matrix products of whole-feature simdgroups";
  } else if (best.parts > 1) {
    c.reason += "; dQ, dK and dV split over " + std::to_string(best.parts) +
                " simdgroups by features (whole, dK and dV would take " +
                std::to_string(dkdv_live_floats(c.bucket, c.dkv_block_q, 1) + kLiveOverhead) + " registers per lane)";
    // The price of the parts, split-K (attention_backward.h,
    // backward_reduce_parts): no matrix product is repeated; each part
    // multiplies S and dP over its own features, writes the partials to a
    // threadgroup scratch (counted in the bytes above), one more barrier
    // per streamed block (3 instead of 2), and sums the F partials it needs.
    c.reason += "; the price: S and dP are summed over the parts through " +
                kib(c.simdgroups * 2 * (c.block_k / 8) * 256) + " (dQ kernel) and " +
                kib(c.dkv_simdgroups * 2 * (c.dkv_block_q / 8) * 256) +
                " (dK/dV kernel) of threadgroup memory and one more barrier per streamed block (split-K: "
                "no matrix product repeated)";
  }
  c.reason += " (within the " + std::to_string(kBackwardRegisterBudget) + "-value register budget, " +
              std::to_string(best.resident) + " resident simdgroups per core on every named chip)";
  if (p.head_dim_v != p.head_dim) {  // MLA-style: which products run over which dim
    c.reason += wider + "; v has its own head dim (MLA-style): D_qk = " + std::to_string(p.head_dim) +
                " (q, k: S = Q.K^T, dQ, dK) and D_v = " + std::to_string(p.head_dim_v) +
                " (v, out, grad_out: Delta, dO.V^T, dV) run in the " + std::to_string(c.bucket) +
                "-wide instantiation of the wider, each zero-padded past its own width (no read or write past it)";
  } else {
    c.reason += wider + padding_note(p.head_dim, c.bucket);
  }
  if (!tensor_ops_why_not.empty()) c.reason += "; tensor ops not used: " + tensor_ops_why_not;
  return c;
}

}  // namespace

}  // namespace plan_detail

namespace {

using namespace plan_detail;

WhyNot backward_takes(const RouteContext& ctx) {
  if (!within_fast_dims(ctx.p)) return past_fast_dims(ctx.p);
  if (ctx.requested != KernelRequest::Auto) {
    return std::string("impl='") + request_name(ctx.requested) + "' (the simdgroup backward is impl='auto''s)";
  }
  return std::nullopt;
}

KernelChoice backward_plan(const RouteContext& ctx) { return choose_backward(ctx.p, ctx.gpu); }

}  // namespace

extern const FamilyRow kBackwardFamily = {
    "backward", MetalPass::Backward,
    "backward; float32, float16, bfloat16; head dims up to 256 (any D_v pair, the wider's bucket); every option; "
    "any Nq; not paged; impl 'auto'; any GPU",
    "flash_backward_dq_*,flash_backward_dkdv_*,flash_sinks_grad",
    backward_takes, backward_plan};

}  // namespace flash_metal
