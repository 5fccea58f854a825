// The Metal path's routing helpers shared by the kernel families
// (csrc/metal/families/: one file per family, its row in table.cpp, where
// choose_metal_kernel walks the table), plus the parsers of the op's `impl`
// argument. The `gpu` argument's are csrc/metal/gpus.cpp's.
#include "metal/families/family.h"

#include <algorithm>
#include <cmath>

namespace flash_metal {

using plan_detail::kOp;

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

namespace plan_detail {

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

bool within_fast_dims(const AttentionProblem& p) {
  return p.head_dim <= kFastHeadDimBuckets.back() && p.head_dim_v <= kFastHeadDimBuckets.back();
}

std::string past_fast_dims(const AttentionProblem& p) {
  return "head dims " + std::to_string(p.head_dim) + " / " + std::to_string(p.head_dim_v) + " exceed " +
         std::to_string(kFastHeadDimBuckets.back()) + " (the wide decode, the split-D kernels or the composite path)";
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

uint32_t resident_on_every_chip(uint32_t simdgroups, uint32_t bytes, uint32_t live) {
  MetalLaunch l;
  l.threadgroup = {32 * simdgroups, 1, 1};
  l.threadgroup_memory = bytes;
  uint32_t least = UINT32_MAX;
  for (const GpuSpec& gpu : known_gpus()) least = std::min(least, estimate_launch(l, live, gpu).simdgroups_per_core);
  return least;
}

KernelChoice forward_opening(const RouteContext& ctx) {
  const AttentionProblem& p = ctx.p;
  const KernelRequest requested = ctx.requested;
  // A v head dim of its own (MLA-style D_qk != D_v, issue 20 section 2):
  // the forward's fast families (prefill, decode, split decode, paged) and
  // the backward's two kernels take it, in the wider dim's bucket
  // (head_dim_v in AttentionParams); the post's kernels do not (below).
  const bool own_v = p.head_dim_v != p.head_dim;
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
  return c;
}

}  // namespace plan_detail

}  // namespace flash_metal
