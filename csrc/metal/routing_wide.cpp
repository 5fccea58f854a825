// The wide decode's routing (issue 20 sections 2/3): which forward calls
// with head dims above 256 the decode kernels take, in the decode-only
// buckets 512 and 576 (csrc/metal/plan.h kDecodeHeadDimBuckets), and the
// sentence explain() adds for them. The rest of the routing is
// csrc/metal/routing.cpp (choose_metal_kernel, kvcache_reads_table) and
// csrc/composite.cpp (composite_route), which ask decode_takes_wide_dims.
#include "metal/plan_detail.h"

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
// kWideDecodeMaxRows rows per kv head, Nk 1k-32k (benchmarks/metal_model_decode_wide.py). Why a constant:
// explain() quotes it; tests/test_metal_model_decode_wide.py holds the
// model to it.
constexpr const char* kWideDecodeLeastSpeedup = "2x";

// The wide decode's sentence for explain(): the model's verdict (issue 20
// section 2/3; the figures are benchmarks/metal_model_decode_wide.py's
// table, asserted by tests/test_metal_model_decode_wide.py).
std::string wide_decode_note(const AttentionProblem& p, uint32_t bucket) {
  return "; head dims " + std::to_string(p.head_dim) + " / " + std::to_string(p.head_dim_v) +
         " in the decode-only bucket " + std::to_string(bucket) +
         " (prefill and backward stop at 256): one pass over K/V with 1 query row per SIMD-group, predicted at "
         "least " + kWideDecodeLeastSpeedup + " faster than the composite path's ATen ops at every modelled decode "
         "shape of at most " + std::to_string(kWideDecodeMaxRows) + " query rows per kv head "
         "(benchmarks/metal_model_decode_wide.py: a model, not a measurement)";
}

}  // namespace plan_detail

}  // namespace flash_metal
