// The split decode: the decode kernels split along keys (flash_decode_split,
// partials per key block), then flash_decode_merge. Auto takes it where the
// decode's split count (auto_decode_splits: one wave of resident
// threadgroups, blocks of >= 128 keys) is above 1; impl='decode_split'
// forces at least 2 blocks. Planned by the decode's finish_decode
// (decode.cpp), which decides the split count and says why.
#include "metal/families/family.h"

namespace flash_metal {

namespace {

using namespace plan_detail;

WhyNot decode_split_takes(const RouteContext& ctx) {
  const AttentionProblem& p = ctx.p;
  if (!within_fast_dims(p)) return past_fast_dims(p);
  if (p.paged) return std::string("a paged KV cache (the paged row reads the block table)");
  if (ctx.requested == KernelRequest::DecodeSplit) return std::nullopt;
  if (ctx.requested != KernelRequest::Auto) {
    return std::string("impl='") + request_name(ctx.requested) + "' names another family";
  }
  if (p.varlen) return std::string("packed variable-length sequences (the decode kernels take no cu_seqlens)");
  if (p.q_len > kMaxDecodeRows) {
    return "Nq = " + std::to_string(p.q_len) + " > " + std::to_string(kMaxDecodeRows) + " query rows";
  }
  if (auto_decode_splits(p, ctx.gpu) == 1) return std::string("one key block fills the GPU (the one-pass decode)");
  return std::nullopt;
}

KernelChoice decode_split_plan(const RouteContext& ctx) {
  KernelChoice c = forward_opening(ctx);
  finish_decode(ctx, &c);
  return c;
}

}  // namespace

extern const FamilyRow kDecodeSplitFamily = {
    "split decode", MetalPass::Forward,
    "forward; float32, float16, bfloat16; head dims up to 256 (any D_v pair, the wider's bucket); every option "
    "but varlen; Nq <= 8; not paged; impl 'auto' (more than one key block fills the GPU) or 'decode_split'; any GPU",
    "flash_decode_split_*,flash_decode_merge_*",
    decode_split_takes, decode_split_plan};

}  // namespace flash_metal
