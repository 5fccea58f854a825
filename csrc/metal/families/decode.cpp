// The decode kernels (shaders/decode/attention_decode.h): token generation, Nq <=
// kMaxDecodeRows query rows, every K/V row read once per (batch, kv head) for
// all the GQA group's rows; one pass, or split along keys then merged. This
// file holds their planner (row chunks, the split count, the reason) and the
// "decode" row: the one-pass kernel; the "split decode" row
// (decode_split.cpp), the wide decode (wide_decode.cpp) and the paged row
// (paged.cpp) plan with the same finish_decode.
#include "metal/families/family.h"

namespace flash_metal {

namespace plan_detail {

namespace {


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


}  // namespace

uint32_t auto_decode_splits(const AttentionProblem& p, const GpuSpec& gpu) {
  const uint32_t bucket = bucket_of(std::max(p.head_dim, p.head_dim_v), kDecodeHeadDimBuckets);
  std::string why;
  return decode_splits(p, bucket, decode_row_chunks(p, bucket), gpu, false, &why);
}

// The decode's bucket (the decode-only 512 and 576 with the wide decode's
// sentence), row chunks, split count and their sentences, the padding last.
void finish_decode(const RouteContext& ctx, KernelChoice* out) {
  const AttentionProblem& p = ctx.p;
  KernelChoice& c = *out;
  c.bucket = bucket_of(std::max(p.head_dim, p.head_dim_v), kDecodeHeadDimBuckets);
  if (c.bucket > kFastHeadDimBuckets.back()) c.reason += wide_decode_note(p, c.bucket);
  std::string why;
  const bool forced_split = ctx.requested == KernelRequest::DecodeSplit;
  const bool forced_one = ctx.requested == KernelRequest::Decode;
  c.row_chunks = decode_row_chunks(p, c.bucket);
  c.kv_splits = forced_one ? 1 : decode_splits(p, c.bucket, c.row_chunks, ctx.gpu, forced_split, &why);
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
  c.reason += padding_note(p, c.bucket);
}

}  // namespace plan_detail

namespace {

using namespace plan_detail;

// Auto's decode calls: dims within 256, no paged cache (the paged row), no
// packed queries, Nq <= kMaxDecodeRows; impl='decode' names it.
WhyNot decode_takes(const RouteContext& ctx) {
  const AttentionProblem& p = ctx.p;
  if (!within_fast_dims(p)) return past_fast_dims(p);
  if (p.paged) return std::string("a paged KV cache (the paged row reads the block table)");
  if (ctx.requested == KernelRequest::Decode) return std::nullopt;
  if (ctx.requested != KernelRequest::Auto) {
    return std::string("impl='") + request_name(ctx.requested) + "' names another family";
  }
  if (p.varlen) return std::string("packed variable-length sequences (the decode kernels take no cu_seqlens)");
  if (p.q_len > kMaxDecodeRows) {
    return "Nq = " + std::to_string(p.q_len) + " > " + std::to_string(kMaxDecodeRows) + " query rows";
  }
  const uint32_t splits = auto_decode_splits(p, ctx.gpu);
  if (splits > 1) return "split-KV fills the GPU: " + std::to_string(splits) + " key blocks (the split decode)";
  return std::nullopt;
}

KernelChoice decode_plan(const RouteContext& ctx) {
  KernelChoice c = forward_opening(ctx);
  finish_decode(ctx, &c);
  return c;
}

}  // namespace

extern const FamilyRow kDecodeFamily = {
    "decode", MetalPass::Forward,
    "forward; float32, float16, bfloat16; head dims up to 256 (any D_v pair, the wider's bucket); every option "
    "but varlen; Nq <= 8; not paged; impl 'auto' (one pass: the split count is 1) or 'decode'; any GPU",
    "flash_decode_float*,flash_decode_bfloat16_*",
    decode_takes, decode_plan};

}  // namespace flash_metal
