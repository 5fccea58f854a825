// The routing heuristic of the Metal path, the one place where a kernel
// family and its shape are chosen (choose_metal_kernel: forward, and the
// backward's blocks), each with the reason flash_metal.explain() prints;
// plus the parsers of the op's `impl` and `gpu` arguments.
#include "metal/plan_detail.h"

#include <algorithm>
#include <cmath>

namespace flash_metal {

using namespace plan_detail;

KernelRequest parse_kernel_request(const std::string& kernel) {
  if (kernel == "auto") return KernelRequest::Auto;
  if (kernel == "untiled") return KernelRequest::Untiled;
  if (kernel == "tiled") return KernelRequest::Tiled;
  if (kernel == "prefill") return KernelRequest::Prefill;
  if (kernel == "decode") return KernelRequest::Decode;
  if (kernel == "decode_split") return KernelRequest::DecodeSplit;
  if (kernel == "tensor_ops") return KernelRequest::TensorOps;
  if (kernel == "composite") return KernelRequest::Composite;
  TORCH_CHECK_VALUE(false, kOp,
                    ": impl must be one of 'auto', 'untiled', 'tiled', 'prefill', 'decode', 'decode_split', "
                    "'tensor_ops', 'composite'; got '",
                    kernel, "'");
}

namespace {

const char* request_name(KernelRequest r) {
  switch (r) {
    case KernelRequest::Untiled: return "untiled";
    case KernelRequest::Tiled: return "tiled";
    case KernelRequest::Prefill: return "prefill";
    case KernelRequest::Decode: return "decode";
    case KernelRequest::DecodeSplit: return "decode_split";
    case KernelRequest::TensorOps: return "tensor_ops";
    case KernelRequest::Composite: return "composite";
    default: return "auto";
  }
}

// Split-KV decode knobs.
// The split count fills ONE WAVE of resident threadgroups (issue 43): the
// launch's SIMD-groups, (batch, kv head, row chunk, key block)
// threadgroups x their KG * RGL SIMD-groups, at most the SIMD-groups the
// cores hold at once (estimate_launch's residency on `gpu`, by registers
// and threadgroup memory). Counted in SIMD-groups, not key-group streams:
// before issue 43 the rule launched 24 streams per core, and a stream is
// RGL SIMD-groups, so GQA launches ran 2-2.13 waves (Llama-3-8B on an M3
// Max at 4k keys: 256 threadgroups for 120 slots), every SIMD-group paying
// its fixed costs (q load, first-row latency, merge, partial stores) for one
// 32-key block. A second wave only repeats those costs: the bytes in flight
// per core are the resident SIMD-groups' either way.
// Why 128 keys at least per block: the merge pass writes and re-reads
// head_dim floats of partial output per block and row, R x D x 8 bytes for a
// GQA group of R rows, which must stay small next to the block's own K/V
// bytes (128 keys x D x 2 tensors x 2 bytes in half): R / 64 of them, 12.5 %
// at GQA 8, 3 % at one row. Half of the 256 it was before issue 19: with
// rows per SIMD-group sized by registers, a GQA group launches fewer
// SIMD-groups per block, and short contexts need the blocks to fill a core.
constexpr int64_t kMinKeysPerSplit = 128;
// Why at most 256 blocks: bounds the merge loop (each merge lane walks the
// blocks) and the scratch memory (256 x D floats per query row); 256 is what
// a one-sequence GQA-7 model with 4 kv heads (Qwen2.5-7B: 8 SIMD-groups per
// block) needs to launch 24 SIMD-groups on each of an 80-core Ultra's cores.
constexpr uint32_t kMaxKvSplits = 256;

// Threadgroups that share one (batch, kv head[, key block]), each serving a
// part of the GQA group's rows: 1 while the group fits kDecodeMaxSimdgroups
// SIMD-groups (K/V then read once for all of its rows), else as few as fit.
// More threadgroups, not fatter ones: the threadgroup size stays within the
// kernels' declared limit, and the chunks of a kv head run side by side.
uint32_t decode_row_chunks(const AttentionProblem& p, uint32_t bucket) {
  return ceil_div(decode_row_groups(p, bucket), kDecodeMaxSimdgroups);
}

// Resident decode threadgroups per core of `gpu`: estimate_launch's rule
// on the launch decode_launches makes (csrc/metal/launch.cpp), the figure
// explain() reports as threadgroups_per_core.
uint32_t decode_resident_threadgroups(const AttentionProblem& p, uint32_t bucket, uint32_t chunks,
                                      const GpuSpec& gpu) {
  MetalLaunch l;
  const uint32_t rgl = decode_row_groups_per_threadgroup(p, bucket, chunks);
  l.threadgroup = {32, decode_key_groups(rgl), rgl};
  l.threadgroup_memory = decode_threadgroup_memory(p, bucket, chunks);
  return estimate_launch(l, decode_live_registers(bucket, p.mask != MaskKind::None, p.paged), gpu)
      .threadgroups_per_core;
}

// Split count for the decode kernels: the most key blocks whose
// threadgroups, with the (batch, kv head, row chunk) ones of each block, fit
// one wave of resident threadgroups on `gpu` (kDecode notes above), within
// kMinKeysPerSplit and kMaxKvSplits; the blocks then rounded to whole
// quanta of key groups x 32 keys (decode_split_quantum), so every key group
// of a full block runs the same number of 32-key blocks and the last block's
// differ by at most one; rounding up leaves the fewest blocks of that size.
// At least 2 when forced. *why says what bound the count and how many waves
// the launch is (more than one only when the (batch, kv head, row chunk)
// threadgroups alone exceed a wave).
uint32_t decode_splits(const AttentionProblem& p, uint32_t bucket, uint32_t chunks, const GpuSpec& gpu, bool forced,
                       std::string* why) {
  const int64_t per_block = std::max<int64_t>(1, p.batch * p.kv_heads * chunks);  // threadgroups per key block
  const uint32_t sgs = decode_simdgroups_per_threadgroup(p, bucket, chunks);
  const uint32_t resident = decode_resident_threadgroups(p, bucket, chunks, gpu);
  const int64_t slots = int64_t{gpu.cores} * resident;  // threadgroups in one wave
  const int64_t fit = slots / per_block;
  const int64_t by_length = std::max<int64_t>(1, p.kv_len / kMinKeysPerSplit);
  const int64_t cap = std::max<int64_t>(1, std::min<int64_t>({fit, by_length, int64_t{kMaxKvSplits}}));
  const int64_t quantum = decode_split_quantum(p, bucket, chunks);
  const int64_t keys = std::max<int64_t>(1, p.kv_len);
  const int64_t per = split_keys(p.kv_len, static_cast<uint32_t>(cap), quantum);
  int64_t splits = (keys + per - 1) / per;
  if (forced) splits = std::max<int64_t>(splits, 2);
  const int64_t launched = per_block * splits;
  const int64_t waves = (launched + slots - 1) / slots;
  const int64_t kg = quantum / kSplitKeyQuantum;
  *why = std::to_string(per_block) + " threadgroups (batch x kv heads x row chunks) per key block, " +
         std::to_string(sgs) + " SIMD-groups each, " + std::to_string(resident) + " resident per core of a " +
         std::to_string(gpu.cores) + "-core " + gpu.name + ": one wave holds " + std::to_string(slots) +
         " threadgroups, so at most " + std::to_string(std::max<int64_t>(fit, 0)) + " blocks; Nk = " +
         std::to_string(p.kv_len) + " allows " + std::to_string(by_length) + " blocks of >= " +
         std::to_string(kMinKeysPerSplit) + " keys; at most " + std::to_string(kMaxKvSplits) + "; blocks of " +
         std::to_string(splits > 1 ? split_keys(p.kv_len, static_cast<uint32_t>(splits), quantum) : keys) +
         " keys, whole quanta of " + std::to_string(kg) + " key groups x 32 (every key group of a full block " +
         std::to_string(per / quantum) + " 32-key blocks); " + std::to_string(launched) + " threadgroups launched, " +
         std::to_string(waves) + (waves == 1 ? " wave" : " waves");
  if (waves > 1) {
    *why += forced && fit >= 1 ? " (impl='decode_split' forces 2 blocks beyond the wave)"
                               : " (more than one wave: the " + std::to_string(per_block) +
                                     " (batch, kv head, row chunk) threadgroups of a single block exceed the " +
                                     std::to_string(slots) + " a wave holds; more blocks would only add waves)";
  }
  return static_cast<uint32_t>(splits);
}

std::string padding_note(int64_t head_dim, uint32_t bucket) {
  if (head_dim == bucket) return "";
  return "; head_dim " + std::to_string(head_dim) + " runs zero-padded in the " + std::to_string(bucket) +
         "-wide instantiation (no read or write past head_dim)";
}

// MLA-style calls (D_v != D_qk, issue 20 section 2) run in the wider dim's
// bucket, each tensor at its own width: the reason says so.
std::string padding_note(const AttentionProblem& p, uint32_t bucket) {
  if (p.head_dim_v != p.head_dim) {
    return "; v has its own head dim (MLA-style): D_qk = " + std::to_string(p.head_dim) + " (q, k: the scores) and D_v = " +
           std::to_string(p.head_dim_v) + " (v, the P.V product, out) run in the " + std::to_string(bucket) +
           "-wide instantiation of the wider, each zero-padded past its own width (no read or write past it)";
  }
  return padding_note(p.head_dim, bucket);
}

// The backward's register budget, in 32-bit values per lane: the live
// registers explain() prints (LaunchEstimate), i.e. the accumulators (dQ:
// bucket / 8 fragments; dK and dV: twice that; over the feature parts)
// plus one block of P and dP (2 fragments each per 8 keys or queries), 2
// floats per fragment per lane, plus kLiveOverhead for addresses, counters
// and the fragments being read (issue 19: the overhead counts too, as in
// the decode planner). Why 72: an Apple GPU thread addresses at most 128
// 32-bit registers (Dougall Johnson's G13 architecture notes; [I], not
// measured here); ~69 is what a thread gets at the occupancy that
// saturates the ALUs (24 simdgroups per core, metal-benchmarks). MLX's fused backward (PR #3241) had to shrink its blocks
// at D = 128 and lost to its unfused path there, so the blocks below shrink
// the streamed side first and keep the accumulators in registers.
constexpr uint32_t kBackwardRegisterBudget = 72;
static_assert(kBackwardRegisterBudget == uint32_t{kDecodeRegisterBudget},
              "one register budget for both planners (shaders/attention_decode_rows.h)");


// Resident SIMD-groups per core choose_backward aims for on every named
// chip. Why 8: a core then has 8 SIMD-groups to switch among while one
// waits on a barrier, a threadgroup-memory read or an MMA's latency
// (issue 19's target for the prefill and backward kernels; the decode
// kernels aim higher, 24 launched, having nothing but loads to overlap).
constexpr uint32_t kResidentTarget = 8;

// Fewest resident SIMD-groups per core over every named chip (csrc/metal/gpus.cpp)
// of a prefill or backward kernel with `simdgroups` per threadgroup, `bytes` of
// threadgroup memory and `live` registers per lane: estimate_launch's rule.
uint32_t resident_on_every_chip(uint32_t simdgroups, uint32_t bytes, uint32_t live) {
  MetalLaunch l;
  l.threadgroup = {32 * simdgroups, 1, 1};
  l.threadgroup_memory = bytes;
  uint32_t least = UINT32_MAX;
  for (const GpuSpec& gpu : known_gpus()) least = std::min(least, estimate_launch(l, live, gpu).simdgroups_per_core);
  return least;
}

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

KernelChoice choose_backward(const AttentionProblem& p, KernelRequest requested, const GpuSpec& gpu) {
  TORCH_CHECK_VALUE(requested == KernelRequest::Auto || requested == KernelRequest::TensorOps,
                    "flash_metal.attention_backward: impl must be 'auto' or 'tensor_ops' (the backward has two "
                    "kernel families: flash_backward_dq + flash_backward_dkdv on simdgroup matrices, and their "
                    "Metal 4 tensor-op twins; and at D_qk = D_v = 512 'prefill' names the split-D backward); got '",
                    request_name(requested), "'");
  // The tensor-op backward (shaders/attention_backward_mpp.h): forced, or
  // Auto's gate, the forward's (tensor_ops_route) plus what its kernels
  // cover; explain() says why not on Apple 10 GPUs.
  std::string tensor_ops_why_not;
  if (requested == KernelRequest::TensorOps || tensor_ops_backward_route_all_d(p, gpu, &tensor_ops_why_not)) {
    KernelChoice t;
    choose_tensor_ops_backward_all_d(p, requested == KernelRequest::TensorOps, gpu, &t);
    return t;
  }
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


bool kvcache_reads_table(const AttentionProblem& p, KernelRequest requested, std::string* why) {
  const bool decode_request = requested == KernelRequest::Decode || requested == KernelRequest::DecodeSplit;
  TORCH_CHECK_VALUE(requested == KernelRequest::Auto || requested == KernelRequest::Prefill || decode_request,
                    "flash_metal.attention_kvcache: impl must be 'auto', 'decode', 'decode_split' or 'prefill' "
                    "(each reads the block table); got '", request_name(requested),
                    "'");
  TORCH_CHECK_VALUE(!decode_request || !p.varlen, "flash_metal.attention_kvcache: impl='", request_name(requested),
                    "' does not take packed queries (cu_seqlens_q); use impl='auto' or 'prefill'");
  TORCH_CHECK_VALUE(!decode_request || p.q_len <= kMaxDecodeRows, "flash_metal.attention_kvcache: impl='",
                    request_name(requested), "' serves at most ", kMaxDecodeRows, " query rows; got ", p.q_len,
                    " (use impl='auto' or 'prefill')");
  const std::string pages = std::to_string(p.page_size) + "-key pages";
  // Dims above 256 read the table only where the wide decode takes them
  // (decode_takes_wide_dims: Nq <= 8, no packed queries, up to 576, with
  // 'auto' at most kWideDecodeMaxRows rows per kv head); the prefill's table
  // reader stops at the fast buckets' 256, and every other wide call gathers
  // (then the varlen plan: the split-D kernel for causal D = 512, else the composite path).
  const bool wide = p.head_dim > kFastHeadDimBuckets.back() || p.head_dim_v > kFastHeadDimBuckets.back();
  if (wide && !decode_takes_wide_dims(p, requested, MetalPass::Forward)) {
    *why = "paged KV cache, gather path (head dims " + std::to_string(p.head_dim) + " / " +
           std::to_string(p.head_dim_v) + " exceed the prefill kernels' widest bucket, " +
           std::to_string(kFastHeadDimBuckets.back()) + ", and the wide decode does not take this call: it takes Nq <= " +
           std::to_string(kMaxDecodeRows) + " unpacked query rows, dims up to " +
           std::to_string(kDecodeHeadDimBuckets.back()) + ", with impl='auto' at most " +
           std::to_string(kWideDecodeMaxRows) + " query rows per kv head): each sequence's rows in use, through the "
           "table of " + pages + ", copied into packed K/V buffers, then the varlen plan: ";
    return false;
  }
  if (requested == KernelRequest::Prefill || p.q_len > kMaxDecodeRows || p.varlen) {
    // Packed queries (cu_seqlens_q: flash_attn_varlen_func's paged prefill)
    // go to the prefill whatever their lengths: the decode kernels take no cu_seqlens.
    *why = "paged KV cache: the prefill kernel reads K/V through the block table (" +
           (requested == KernelRequest::Prefill ? std::string("impl='prefill'")
            : p.varlen ? "packed queries of their own lengths, cu_seqlens_q, max_seqlen_q = " +
                             std::to_string(p.q_len) + ": fc_varlen, no gather"
                       : "Nq = " + std::to_string(p.q_len) + " > " + std::to_string(kMaxDecodeRows)) +
           "; " + pages + ", fc_paged; each sequence's own key count from cache_seqlens, causal and window aligned "
           "to it; nothing copied): ";
    return true;
  }
  *why = "paged KV cache: the decode kernels read K/V through the block table (" + pages +
         ", fc_paged; each sequence's own key count from cache_seqlens; nothing copied): ";
  return true;
}


KernelChoice choose_metal_kernel(const AttentionProblem& p, KernelRequest requested, const GpuSpec& gpu,
                                 MetalPass pass) {
  TORCH_CHECK(requested != KernelRequest::Composite, "flash_metal: impl='composite' is routed before planning "
              "(composite_route, csrc/composite.h)");
  // A v head dim of its own (MLA-style D_qk != D_v, issue 20 section 2):
  // the forward's fast families (prefill, decode, split decode, paged) and
  // the backward's two kernels take it, in the wider dim's bucket
  // (head_dim_v in AttentionParams); the post's kernels do not (below).
  const bool own_v = p.head_dim_v != p.head_dim;
  // Nor head dims past the largest bucket (the CPU kernels take up to
  // kMaxHeadDim = 576, D_v up to 512): 256 but for the decode kernels, which
  // take up to 576 (decode_takes_wide_dims).
  const bool wide_decode = decode_takes_wide_dims(p, requested, pass);
  // And the split-D forward at D = 512 (csrc/metal/routing_splitd.cpp).
  std::string splitd_why;
  const bool wide = p.head_dim > kFastHeadDimBuckets.back() || p.head_dim_v > kFastHeadDimBuckets.back();
  const bool splitd = wide && !wide_decode && splitd_takes(p, requested, pass, &splitd_why);
  const char* pass_name = pass == MetalPass::Backward ? "backward" : "forward";
  TORCH_CHECK_NOT_IMPLEMENTED(wide_decode || splitd || p.head_dim <= kFastHeadDimBuckets.back(),
                              "flash_metal: head_dim ", p.head_dim, " on Metal kernels: not yet (at most ",
                              kFastHeadDimBuckets.back(), ", ", pass_name, "; the decode kernels, Nq <= ",
                              kMaxDecodeRows, ", take up to ", kDecodeHeadDimBuckets.back(), " (impl='auto': at most ",
                              kWideDecodeMaxRows, " query rows per kv head); the split-D forward takes (512, 512), (576, 512) and (256, 512) (",
                              splitd_why, ")); run on CPU tensors, which take head dims up to ", kMaxHeadDim);
  TORCH_CHECK_NOT_IMPLEMENTED(wide_decode || splitd || p.head_dim_v <= kFastHeadDimBuckets.back(),
                              "flash_metal: v's head dim D_v = ", p.head_dim_v, " on Metal kernels: not yet (at most ",
                              kFastHeadDimBuckets.back(), ", ", pass_name, "; the decode kernels, Nq <= ",
                              kMaxDecodeRows, ", take up to ", kMaxHeadDimV, " (impl='auto': at most ", kWideDecodeMaxRows,
                              " query rows per kv head)); run on CPU tensors, which take "
                              "D_v up to ", kMaxHeadDimV);
  if (pass == MetalPass::Backward && splitd) return choose_splitd_backward(p, requested, gpu);
  if (pass == MetalPass::Backward) return choose_backward(p, requested, gpu);
  if (splitd) return choose_splitd(p, requested, gpu);
  // The bucket every tile fits: the wider of the two dims (== head_dim unless MLA-style).
  const int64_t widest = std::max(p.head_dim, p.head_dim_v);
  KernelChoice c;
  const bool explicit_request = requested != KernelRequest::Auto;
  if (explicit_request) {
    c.kind = requested;
    c.reason = std::string(request_name(requested)) + ": requested by the caller (impl='" + request_name(requested) +
               "')";
  } else if (p.varlen) {
    c.kind = KernelRequest::Prefill;
    c.reason = "prefill: packed variable-length sequences (the decode kernels serve one (batch, kv head) of equal "
               "lengths per threadgroup and take no cu_seqlens; the prefill kernel runs one threadgroup per "
               "query block of max_seqlen_q, and blocks past their sequence's end return at once)";
  } else if (p.q_len <= kMaxDecodeRows) {
    c.kind = KernelRequest::Decode;  // one pass or split, decided below
    c.reason = "decode: Nq = " + std::to_string(p.q_len) + " <= " + std::to_string(kMaxDecodeRows) +
               " query rows (token generation): memory-bound, so every K/V row is read once per (batch, kv head) "
               "for all " + std::to_string(p.gqa_ratio() * p.q_len) + " query rows of its GQA group";
  } else {
    c.kind = KernelRequest::Prefill;
    c.reason = "prefill: Nq = " + std::to_string(p.q_len) + " > " + std::to_string(kMaxDecodeRows) +
               " query rows fill 8x8 simdgroup-matrix tiles (FlashAttention-2: K/V blocks shared by the "
               "threadgroup's query rows, both products on simdgroup matrices)";
  }

  // The post's two kernels are the seed post's, kept as it wrote them: plain
  // or causal attention only. Every option goes to the fast families.
  const bool post_kernel = c.kind == KernelRequest::Untiled || c.kind == KernelRequest::Tiled;
  const bool has_options = p.mask != MaskKind::None || p.has_window_left() || p.has_softcap() || p.varlen ||
                           (p.causal && p.window_right > 0) || p.sinks;
  TORCH_CHECK_VALUE(!post_kernel || !has_options, kOp, ": impl='", request_name(c.kind),
                    "' (the post's kernel) serves plain or causal attention only; attn_mask, window_left/"
                    "window_right, softcap, varlen and sinks need impl='auto', 'prefill' or (Nq <= 8) 'decode'");
  TORCH_CHECK_NOT_IMPLEMENTED(!post_kernel || !own_v, "flash_metal: q/k head dim D_qk = ", p.head_dim,
                              " different from v's D_v = ", p.head_dim_v, " on Metal kernels: not yet with impl='",
                              request_name(c.kind), "' (the post's kernel takes one head dim); use impl='auto', "
                              "'prefill' or (Nq <= 8) 'decode'");
  const bool decode_family = c.kind == KernelRequest::Decode || c.kind == KernelRequest::DecodeSplit;
  TORCH_CHECK(!p.paged || c.kind == KernelRequest::Prefill || (decode_family && !p.varlen && p.q_len <= kMaxDecodeRows),
              kOp,
              ": internal error: a paged KV cache plans only the decode and prefill kernels (kvcache_reads_table "
              "sends the rest to the gather path)");
  TORCH_CHECK_VALUE(!decode_family || !p.varlen, kOp, ": impl='", request_name(c.kind),
                    "' does not take packed variable-length sequences; use impl='auto' or 'prefill'");
  TORCH_CHECK_VALUE(!decode_family || p.q_len <= kMaxDecodeRows, kOp, ": impl='", request_name(c.kind),
                    "' serves at most ", kMaxDecodeRows, " query rows; got ", p.q_len,
                    " (use impl='prefill' or 'auto')");

  if (!explicit_request && c.kind == KernelRequest::Prefill) {
    std::string why_not;
    if (tensor_ops_forward_route(p, gpu, &why_not)) {
      c.kind = KernelRequest::TensorOps;
    } else if (!why_not.empty()) {
      c.reason += "; tensor ops not used: " + why_not;
    }
  }
  if (c.kind == KernelRequest::TensorOps) choose_tensor_ops_forward(p, explicit_request, gpu, &c);

  switch (c.kind) {
    case KernelRequest::Untiled:
    case KernelRequest::Tiled:
      c.bucket = bucket_of(widest, kHeadDimBuckets);
      if (c.kind == KernelRequest::Tiled) {
        c.reason += " (K/V tiles of " + std::to_string(kPostKeysPerTile) + " keys shared by " +
                    std::to_string(kPostThreadsPerGroup) + " queries, " +
                    kib(tiled_threadgroup_memory(c.bucket, p.dtype)) + " of threadgroup memory)";
      }
      break;
    case KernelRequest::Prefill: {
      c.bucket = bucket_of(widest, kFastHeadDimBuckets);
      // Blocks: block_q query rows, MLX's steel table's (32; 16 at D = 256,
      // where MLX's 32 x 16 tiles take 40 KB in float32), in 8-row groups
      // that each run `parts` SIMD-groups (each keeping O for 1 / parts of
      // the features; the scores split-K over the parts, summed through a
      // scratch counted in the bytes, attention_prefill.h), and block_k keys per
      // block. block_q sets the K/V traffic (read once per query block), so
      // it stays 32 unless no 32-row block reaches kResidentTarget: then 16
      // (float32 at D = 192 only: its 32-row blocks hold 4 resident
      // SIMD-groups, bk 8 with one part, 31,360 bytes, the parts' scratch
      // not fitting beside the tiles; 16 rows on 4 parts hold 8). Among
      // block_k in {32, 16, 8} and parts in {1, 2, 4, 8}
      // within the register budget (O, one block of scores, the softmax
      // state, kLiveOverhead), 32 KiB, kPrefillMaxThreads and the loader's
      // even split: the most resident SIMD-groups per core on the chip that
      // holds fewest (up to 8, kResidentTarget), then the fewest
      // parts (least scratch), then the longest key block. The
      // result, float16/bfloat16 | float32 (block_k, parts; block_q 32 but
      // where noted):
      //   D = 32: 32,1 | 32,1   64, 72, 80: 32,1 | 16,1   96: 32,1 | 8,1
      //   D = 128: 16,1 | 16,2  192: 8,1 | 16,4 (block_q 16)
      //   D = 256: 8,2 | 8,4 (block_q 16)
      // 192's float16 blocks keep 32 query rows (K/V read half as often as
      // 16-row blocks) at 72 live values, the budget's edge, in 8-key blocks
      // (16 keys take 74).
      uint32_t best_resident = 0, best_parts = 0;
      for (uint32_t block_q : {32u, 16u}) {
        if (best_resident >= kResidentTarget) break;
        if (block_q == 32 && c.bucket == 256) continue;
        for (uint32_t parts : {1u, 2u, 4u, 8u}) {
          const uint32_t simdgroups = block_q / 8 * parts;
          if (c.bucket % (8 * parts) != 0 || 32 * simdgroups > uint32_t{kPrefillMaxThreads}) continue;
          for (uint32_t block_k : {32u, 16u, 8u}) {
            const uint32_t bytes = prefill_threadgroup_memory(block_q, block_k, c.bucket, p.dtype, parts);
            const uint32_t live = prefill_live_registers(c.bucket, block_k, parts);
            const bool even = block_q * c.bucket % (32 * simdgroups) == 0 && block_k * c.bucket % (32 * simdgroups) == 0;
            if (bytes > kMaxThreadgroupMemory || live > kBackwardRegisterBudget || !even) continue;
            const uint32_t resident =
                std::min(kResidentTarget, resident_on_every_chip(simdgroups, bytes, live));
            if (resident > best_resident) {  // ties keep the earlier: more rows, fewer parts, longer blocks
              best_resident = resident; best_parts = parts;
              c.block_q = block_q; c.block_k = block_k; c.simdgroups = simdgroups;
            }
          }
        }
      }
      TORCH_CHECK(best_parts != 0, kOp, ": internal error: no prefill block fits head_dim ", p.head_dim);
      const uint32_t bytes = prefill_threadgroup_memory(c.block_q, c.block_k, c.bucket, p.dtype, best_parts);
      c.reason += "; blocks of " + std::to_string(c.block_q) + " queries x " + std::to_string(c.block_k) +
                  " keys on " + std::to_string(c.simdgroups) + " simdgroups, " + kib(bytes) +
                  " of threadgroup memory, " + std::to_string(prefill_live_registers(c.bucket, c.block_k, best_parts)) +
                  " live values per lane, " + std::to_string(best_resident) +
                  " resident simdgroups per core on every named chip" +
                  (best_parts > 1 ? "; each 8-row group on " + std::to_string(best_parts) +
                                        " simdgroups split by O's features (split-K: each multiplies the scores "
                                        "over its own features and the parts sum them through " +
                                        kib(c.simdgroups * (c.block_k / 8) * 256) +
                                        " of threadgroup memory, no extra barrier and no matrix product "
                                        "repeated; each runs the rows' softmax)"
                                  : "");
      c.pack_gqa = prefill_pack_gqa(p, c.block_q, &c.reason);
      if (p.paged) c.reason += prefill_pages_note(p, c.block_k, c.pack_gqa);
      break;
    }
    case KernelRequest::Decode:
    case KernelRequest::DecodeSplit: {
      c.bucket = bucket_of(widest, kDecodeHeadDimBuckets);
      if (c.bucket > kFastHeadDimBuckets.back()) c.reason += wide_decode_note(p, c.bucket);
      std::string why;
      const bool forced_split = c.kind == KernelRequest::DecodeSplit;
      const bool forced_one = explicit_request && c.kind == KernelRequest::Decode;
      c.row_chunks = decode_row_chunks(p, c.bucket);
      c.kv_splits = forced_one ? 1 : decode_splits(p, c.bucket, c.row_chunks, gpu, forced_split, &why);
      c.kind = c.kv_splits > 1 ? KernelRequest::DecodeSplit : KernelRequest::Decode;
      if (c.row_chunks > 1) {
        c.reason += "; but its " + std::to_string(decode_row_groups(p, c.bucket)) + " row groups of " +
                    std::to_string(decode_rows_per_simd(static_cast<int>(c.bucket))) +
                    " rows exceed one threadgroup's " +
                    std::to_string(kDecodeMaxSimdgroups) + " SIMD-groups (the kernels' declared " +
                    std::to_string(kDecodeMaxThreads) + "-thread limit), so " + std::to_string(c.row_chunks) +
                    " threadgroups (row chunks) per (batch, kv head) each serve a part and read K/V once each";
      }
      if (p.paged) {
        c.reason += "; blocks sized by the table's capacity, " + std::to_string(p.kv_len) +
                    " keys (a block past a sequence's cache_seqlens returns at once)";
      }
      if (!forced_one) {
        c.reason += c.kv_splits > 1 ? "; split-KV: " + std::to_string(c.kv_splits) + " key blocks, then a merge pass ("
                                    : "; one pass (";
        c.reason += why + ")";
      }
      break;
    }
    default:
      break;
  }
  // The tensor-op kernels run each head dim at its own width (the MLA pair too): no padding to note.
  if (c.kind != KernelRequest::TensorOps) c.reason += padding_note(p, c.bucket);
  return c;
}

}  // namespace flash_metal
