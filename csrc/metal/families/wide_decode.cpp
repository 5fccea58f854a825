// The wide decode's routing (issue 20 sections 2/3): which forward calls
// with head dims above 256 the decode kernels take, in the decode-only
// buckets 512 and 576 (csrc/metal/plan.h kDecodeHeadDimBuckets), and the
// sentence explain() adds for them; the "wide decode" row, which plans with
// the decode's finish_decode (decode.cpp). The paged row (kvcache_reads_table)
// and csrc/composite.cpp (composite_route) ask decode_takes_wide_dims too.
#include "metal/families/family.h"

namespace flash_metal {

bool decode_takes_wide_dims(const AttentionProblem& p, KernelRequest requested, MetalPass pass) {
  const int64_t fast = kFastHeadDimBuckets.back();
  if (p.head_dim <= fast && p.head_dim_v <= fast) return false;
  const bool decode_request = requested == KernelRequest::Auto || requested == KernelRequest::Decode ||
                              requested == KernelRequest::DecodeSplit;
  const int64_t widest = kDecodeHeadDimBuckets.back();
  return pass == MetalPass::Forward && decode_request && !p.varlen && p.q_len <= kMaxDecodeRows &&
         (requested != KernelRequest::Auto || p.gqa_ratio() * p.q_len <= kWideDecodeMaxRows) &&
         p.head_dim <= widest && p.head_dim_v <= widest;
}

namespace plan_detail {

// The least speedup the model predicts for the fused wide decode over the
// composite path it replaces (csrc/composite.cpp's ATen ops: K and V
// converted to float32 and re-read, the scores written and re-read per
// step, a dispatch each), over its table: M1 to M5, f16/bf16, MLA (576, 512)
// with 16 query heads on one latent head and Gemma-like 512, up to
// kWideDecodeMaxRows rows per kv head, Nk 1k-32k (benchmarks/model/families/decode_wide.py). Why a constant:
// explain() quotes it; tests/model/test_metal_model_decode_wide.py holds the
// model to it.
constexpr const char* kWideDecodeLeastSpeedup = "2x";

// The wide decode's sentence for explain(): the model's verdict (issue 20
// section 2/3; the figures are benchmarks/model/families/decode_wide.py's
// table, asserted by tests/model/test_metal_model_decode_wide.py).
std::string wide_decode_note(const AttentionProblem& p, uint32_t bucket) {
  return "; head dims " + std::to_string(p.head_dim) + " / " + std::to_string(p.head_dim_v) +
         " in the decode-only bucket " + std::to_string(bucket) +
         " (prefill and backward stop at 256): one pass over K/V with 1 query row per SIMD-group, predicted at "
         "least " + kWideDecodeLeastSpeedup + " faster than the composite path's ATen ops at every modelled decode "
         "shape of at most " + std::to_string(kWideDecodeMaxRows) + " query rows per kv head "
         "(benchmarks/model/families/decode_wide.py: a model, not a measurement)";
}

}  // namespace plan_detail

namespace {

using namespace plan_detail;

WhyNot wide_decode_takes(const RouteContext& ctx) {
  const AttentionProblem& p = ctx.p;
  if (decode_takes_wide_dims(p, ctx.requested, ctx.pass)) return std::nullopt;
  if (within_fast_dims(p)) return std::string("head dims within 256 (the decode rows)");
  const int64_t widest = kDecodeHeadDimBuckets.back();
  if (p.head_dim > widest || p.head_dim_v > widest) {
    return "head dims " + std::to_string(p.head_dim) + " / " + std::to_string(p.head_dim_v) + " past " +
           std::to_string(widest);
  }
  if (ctx.requested != KernelRequest::Auto && ctx.requested != KernelRequest::Decode &&
      ctx.requested != KernelRequest::DecodeSplit) {
    return std::string("impl='") + request_name(ctx.requested) + "' names another family";
  }
  if (p.varlen) return std::string("packed variable-length sequences (the decode kernels take no cu_seqlens)");
  if (p.q_len > kMaxDecodeRows) {
    return "Nq = " + std::to_string(p.q_len) + " > " + std::to_string(kMaxDecodeRows) + " query rows";
  }
  return std::to_string(p.gqa_ratio() * p.q_len) + " query rows per kv head > " +
         std::to_string(kWideDecodeMaxRows) + " (impl='auto'; the model puts it behind past them)";
}

KernelChoice wide_decode_plan(const RouteContext& ctx) {
  KernelChoice c = forward_opening(ctx);
  finish_decode(ctx, &c);
  return c;
}

}  // namespace

extern const FamilyRow kWideDecodeFamily = {
    "wide decode", MetalPass::Forward,
    "forward; float32, float16, bfloat16; head dims in (256, 576], D_v up to 512 (buckets 512 and 576); every "
    "option but varlen; Nq <= 8 (impl 'auto': at most 16 query rows per kv head); paged or not; impl 'auto', "
    "'decode' or 'decode_split'; any GPU",
    "flash_decode_*_d512,flash_decode_*_d576",
    wide_decode_takes, wide_decode_plan};

}  // namespace flash_metal

