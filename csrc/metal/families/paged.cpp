// The paged KV cache (attention_kvcache with a block table, issue 13): the
// decode kernels (Nq <= 8, unpacked) or the prefill reading K/V through the
// table (fc_paged), each sequence's key count from cache_seqlens. Its route
// (kvcache_reads_table: read the table, or gather the rows in use and plan
// the varlen call) and the "paged" row, which plans with the decode's and the
// prefill's finishing steps (decode.cpp, prefill.cpp). Head dims above 256
// read the table in the wide decode only (wide_decode.cpp).
#include "metal/families/family.h"

namespace flash_metal {

using namespace plan_detail;

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
  if (p.kv_quantized()) {  // never gathered (nor composite): only the quantized decode reads one (decode_quant.cpp)
    TORCH_CHECK_NOT_IMPLEMENTED(requested != KernelRequest::Prefill && !p.varlen && p.q_len <= kMaxDecodeRows &&
                                    within_fast_dims(p),
                                "flash_metal.attention_kvcache: a quantized KV cache is read on Metal by the decode "
                                "kernels only: Nq <= ", kMaxDecodeRows, " unpacked query rows, head dims up to ",
                                kFastHeadDimBuckets.back(), ", impl 'auto', 'decode' or 'decode_split'; got Nq = ",
                                p.q_len, p.varlen ? " (packed queries)" : "", ", head dims ", p.head_dim, " / ",
                                p.head_dim_v, ", impl='", request_name(requested), "' (on CPU every case runs; or "
                                "flash_metal.dequantize_kv)");
    *why = "quantized paged KV cache: the quantized decode kernels read codes and scales through the block table (" +
           pages + ", fc_paged; nothing copied, nothing dequantized in memory): ";
    return true;
  }
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

namespace {

WhyNot paged_takes(const RouteContext& ctx) {
  const AttentionProblem& p = ctx.p;
  if (!p.paged) return std::string("no paged KV cache (attention_kvcache's block table)");
  if (p.kv_quantized()) return std::string("a quantized KV cache (the quantized decode row)");
  if (!within_fast_dims(p)) return past_fast_dims(p);
  if (ctx.requested != KernelRequest::Auto && ctx.requested != KernelRequest::Prefill &&
      ctx.requested != KernelRequest::Decode && ctx.requested != KernelRequest::DecodeSplit) {
    return std::string("impl='") + request_name(ctx.requested) + "' names a family that reads no block table";
  }
  return std::nullopt;
}

// forward_opening picks the kernel as for a contiguous cache (the prefill
// for packed queries, Nq > 8 or impl='prefill'; else the decode kernels).
KernelChoice paged_plan(const RouteContext& ctx) {
  KernelChoice c = forward_opening(ctx);
  if (c.kind == KernelRequest::Prefill) {
    finish_prefill(ctx, &c);
  } else {
    finish_decode(ctx, &c);
  }
  return c;
}

}  // namespace

extern const FamilyRow kPagedFamily = {
    "paged", MetalPass::Forward,
    "forward; float32, float16, bfloat16; head dims up to 256 (any D_v pair); every option; paged KV cache "
    "(block_table, cache_seqlens): the decode kernels at Nq <= 8 unpacked, else the prefill (packed queries too); "
    "impl 'auto', 'decode', 'decode_split' or 'prefill'; any GPU",
    "flash_decode_*,flash_attention_prefill_float*,flash_attention_prefill_bfloat16_*",
    paged_takes, paged_plan};

}  // namespace flash_metal
