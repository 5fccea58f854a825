// The quantized-cache decode (issue 44): attention_kvcache over int8, 4-bit
// (MLX affine) or float8_e4m3fn caches, K and V in formats of their own, read
// in place by flash_decode_quant / flash_decode_quant_split
// (shaders/decode/attention_decode_quant.h: the decode kernels' loop with
// the codes dequantized in registers; the split's partials go to the
// native flash_decode_merge). First in the forward table: no other row
// reads a quantized cache, so this one takes every quantized call and
// refuses, naming the argument, what it cannot serve (Nq > 8, packed
// queries, head dims above 256, another impl). One pass or split as the
// decode decides (finish_decode, decode.cpp).
#include "metal/families/family.h"

namespace flash_metal {

namespace {

using namespace plan_detail;

const char* format_name(int f) {
  return f == 1 ? "int8" : f == 2 ? "q4" : f == 3 ? "fp8_e4m3" : "native";
}

WhyNot decode_quant_takes(const RouteContext& ctx) {
  if (!ctx.p.kv_quantized()) return std::string("no quantized KV cache");
  return std::nullopt;
}

KernelChoice decode_quant_plan(const RouteContext& ctx) {
  const AttentionProblem& p = ctx.p;
  constexpr const char* kOp = "flash_metal.attention_kvcache";
  TORCH_CHECK_NOT_IMPLEMENTED(ctx.requested == KernelRequest::Auto || ctx.requested == KernelRequest::Decode ||
                                  ctx.requested == KernelRequest::DecodeSplit,
                              kOp, ": a quantized KV cache runs the quantized decode kernels on Metal; impl='",
                              request_name(ctx.requested), "' does not read one (use 'auto', 'decode' or "
                              "'decode_split')");
  TORCH_CHECK_NOT_IMPLEMENTED(!p.varlen && p.q_len <= kMaxDecodeRows, kOp, ": a quantized KV cache is read on Metal "
                              "by the decode kernels only: Nq <= ", kMaxDecodeRows, " unpacked query rows; got ",
                              p.varlen ? "packed queries (cu_seqlens_q)" : "Nq = " + std::to_string(p.q_len),
                              " (chunked prefill over a quantized cache runs on CPU; or flash_metal.dequantize_kv)");
  TORCH_CHECK_NOT_IMPLEMENTED(within_fast_dims(p), kOp, ": a quantized KV cache is read on Metal at head dims up to ",
                              kFastHeadDimBuckets.back(), "; got ", p.head_dim, " / ", p.head_dim_v);
  KernelChoice c = forward_opening(ctx);
  c.reason = std::string("quantized decode: k ") + format_name(p.k_format) + ", v " + format_name(p.v_format) +
             (p.k_format == 2 ? " (k groups of " + std::to_string(p.k_group) + ")" : std::string()) +
             (p.v_format == 2 ? " (v groups of " + std::to_string(p.v_group) + ")" : std::string()) +
             ", dequantized in registers inside the online softmax (no dequantized copy); " + c.reason;
  finish_decode(ctx, &c);
  return c;
}

}  // namespace

extern const FamilyRow kDecodeQuantFamily = {
    "quantized decode", MetalPass::Forward,
    "forward; float32, float16, bfloat16 queries; a quantized KV cache (attention_kvcache: int8, 4-bit MLX affine "
    "with groups of 32/64/128, float8_e4m3fn; K and V each its own format or q's dtype); head dims up to 256; "
    "window, softcap, sinks, GQA; Nq <= 8, not packed; impl 'auto', 'decode' or 'decode_split'; any GPU",
    "flash_decode_quant_*,flash_decode_merge_*",
    decode_quant_takes, decode_quant_plan};

}  // namespace flash_metal
