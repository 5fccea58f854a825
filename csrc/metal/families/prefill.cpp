// The prefill (shaders/prefill/attention_prefill.h): FlashAttention-2 on simdgroup
// matrices, the catch-all of Auto's calls above kMaxDecodeRows query rows
// and of packed sequences. Its blocks, its pack GQA decision (issue 20
// section 4) and its sentences for explain(); the paged row (paged.cpp)
// plans the paged prefill with the same finish_prefill.
#include "metal/families/family.h"

namespace flash_metal::plan_detail {

// The paged prefill's K/V tiles (shaders/prefill/attention_prefill.h, fc_paged):
// inside one page, or row by row through the table. The sentence explain() prints.
std::string prefill_pages_note(const AttentionProblem& p, uint32_t block_k, bool pack_gqa) {
  const std::string bk = std::to_string(block_k), pages = std::to_string(p.page_size) + " keys";
  const bool one = p.kv_len <= p.page_size, whole = one || p.page_size % block_k == 0;
  return (one ? "; one page per sequence (the table's capacity, " + pages + ", is one page): every " + bk +
                    "-key tile lies in it"
              : "; pages of " + pages + (whole ? ", a multiple of the " : ", not a multiple of the ") + bk +
                    "-key block: " + (whole ? "every tile lies in one page" : "tiles may cross pages")) +
         (whole ? " and loads from its base (the dense loader where it applies), one table read per key block"
                : ", so each row is found through the table (the general per-element loader, a table read per "
                  "page a thread enters; page sizes that are a multiple of " + bk + " load whole tiles)") +
         (pack_gqa ? "; each (packed query block, kv head) threadgroup reads every key of its sequence it can see "
                     "once, K and V, only from the pages in use, for all the GQA group's heads"
                   : "; each (query block, query head) threadgroup reads every key of its sequence it can see once, "
                     "K and V, only from the pages in use") +
         "; the page walk adds " +
         (whole ? "6" : "12") + " live values per lane (in the estimate)";
}

// Pack GQA for the prefill (fc_pack_gqa, shaders/prefill/attention_prefill.h): with
// G = Hq / Hkv > 1, one threadgroup per (batch, kv head, block of block_q
// packed rows), packed row m being query row m / G of the group's head m % G,
// so the group's G heads share every K/V tile a threadgroup loads
// (FlashAttention-3's and FlashInfer's pack GQA). Each threadgroup still reads
// the keys its rows see once, so K/V traffic follows the threadgroup count:
// ceil(Nq * G / block_q) * Hkv instead of ceil(Nq / block_q) * Hq, never more.
// The saving is G-fold for short queries (Nq * G <= block_q: the whole group
// in one block, each K/V byte read once per GQA group, as the decode kernels
// read it), fills the ragged last block otherwise, and is nil for long
// queries with Nq a multiple of block_q (the same number of threadgroups,
// each reading all its keys; under causal masking the finer packed blocks
// stop at their own last row, a little less). The products and the softmax
// are the same per row. Routed only for short queries (below); the
// kernel itself takes any Nq, and the tests run it packed at ragged Nq too.
// Every prefill form can pack: contiguous, paged (attention_kvcache) and
// varlen (packed queries, with or without a table): a sequence's packed rows
// are G times its query rows wherever they start, so the kernel's code is the
// same and the grid covers max_seqlen_q * G (whose blocks past a shorter
// sequence's end return at once, as they do unpacked). Appends the reason's
// sentence; returns the decision.
bool prefill_pack_gqa(const AttentionProblem& p, uint32_t block_q, std::string* reason) {
  const int64_t g = p.gqa_ratio();
  if (g <= 1) return false;
  const std::string G = std::to_string(g);
  const int64_t rows = p.q_len * g;
  const int64_t packed = (rows + block_q - 1) / block_q * p.kv_heads;
  const int64_t unpacked = (p.q_len + block_q - 1) / block_q * p.q_heads;
  // Why only short queries (2 * Nq <= BQ: one head's rows fill at most half
  // a block, so every unpacked threadgroup is at least half idle): every
  // threadgroup reads each key its rows see once, so K/V traffic follows the
  // threadgroup count, and filling the idle rows with the group's other heads
  // cuts it. The Metal model, on a batch that fills the GPU (8 x 32(8) heads,
  // Nk 1024, D 64, causal, f16), predicts packing 1.27-1.74x faster on M3 Max,
  // M4 Pro and M5 at Nq 12-16 (M1 Max 1.00-1.32x), level at Nq 24 and 40, and
  // 9% slower at Nq 40 on one sequence, where fuller threadgroups lengthen a
  // grid smaller than the GPU (benchmarks/model/families/paged.py; a model,
  // not a measurement).
  if (2 * p.q_len > block_q) {
    *reason += "; GQA heads not packed (Nq = " + std::to_string(p.q_len) + " fills more than half a block of " +
               std::to_string(block_q) + " rows: packing would read K/V in " + std::to_string(packed) +
               " threadgroups instead of " + std::to_string(unpacked) +
               ", and the Metal model predicts it level or slower there; a model, not a measurement)";
    return false;
  }
  *reason += "; pack GQA (fc_pack_gqa): one threadgroup per (batch, kv head, block of " + std::to_string(block_q) +
             " packed rows), its rows the " + G + " query heads of the kv head's group (packed row m: query row m / " +
             G + " of head m % " + G + "), which share each K/V tile it loads: " + std::to_string(packed) +
             " threadgroups per " + (p.varlen ? "sequence" : "batch") + " read the K/V they see instead of " +
             std::to_string(unpacked) + " (Nq = " + std::to_string(p.q_len) +
             (p.varlen ? " = max_seqlen_q; each sequence's queries pack the same way)" : ")");
  return true;
}

// The prefill's blocks, pack GQA and paged sentences, after forward_opening;
// Auto's reason first says why the tensor-op kernels did not take the call
// (on Apple 10 GPUs, where they are a candidate).
void finish_prefill(const RouteContext& ctx, KernelChoice* out) {
  const AttentionProblem& p = ctx.p;
  KernelChoice& c = *out;
  if (ctx.requested == KernelRequest::Auto) {
    std::string why_not;
    if (!tensor_ops_forward_route(p, ctx.gpu, &why_not) && !why_not.empty()) {
      c.reason += "; tensor ops not used: " + why_not;
    }
  }
  c.bucket = bucket_of(std::max(p.head_dim, p.head_dim_v), kFastHeadDimBuckets);
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
  c.reason += padding_note(p, c.bucket);
}

}  // namespace flash_metal::plan_detail

namespace flash_metal {

namespace {

using namespace plan_detail;

// The catch-all of Auto's fast calls: packed sequences (varlen) and Nq > 8
// the tensor-op rows did not take; impl='prefill' names it.
WhyNot prefill_takes(const RouteContext& ctx) {
  const AttentionProblem& p = ctx.p;
  if (!within_fast_dims(p)) return past_fast_dims(p);
  if (p.paged) return std::string("a paged KV cache (the paged row reads the block table)");
  if (ctx.requested == KernelRequest::Prefill) return std::nullopt;
  if (ctx.requested != KernelRequest::Auto) {
    return std::string("impl='") + request_name(ctx.requested) + "' names another family";
  }
  if (!p.varlen && p.q_len <= kMaxDecodeRows) {
    return "Nq = " + std::to_string(p.q_len) + " <= " + std::to_string(kMaxDecodeRows) +
           " query rows, not packed (the decode kernels)";
  }
  return std::nullopt;
}

KernelChoice prefill_plan(const RouteContext& ctx) {
  KernelChoice c = forward_opening(ctx);
  finish_prefill(ctx, &c);
  return c;
}

}  // namespace

extern const FamilyRow kPrefillFamily = {
    "prefill", MetalPass::Forward,
    "forward; float32, float16, bfloat16; head dims up to 256 (any D_v pair, the wider's bucket); every option; "
    "impl 'auto' at Nq > 8 or packed sequences (varlen), or 'prefill' at any Nq; not paged (the paged row); any GPU",
    "flash_attention_prefill_float*,flash_attention_prefill_bfloat16_*",
    prefill_takes, prefill_plan};

}  // namespace flash_metal
