// The post's two kernels (shaders/post/attention_tiled.h): one query per thread,
// K/V read from device memory (untiled) or staged in 16-key tiles of
// threadgroup memory (tiled). Kept as the seed post wrote them: plain or
// causal attention, one head dim, only when impl names them (Auto never
// picks them: the fast families serve every call they do).
#include "metal/families/family.h"

namespace flash_metal {

namespace plan_detail {

void finish_post(const AttentionProblem& p, KernelChoice* c) {
  c->bucket = bucket_of(std::max(p.head_dim, p.head_dim_v), kHeadDimBuckets);
  if (c->kind == KernelRequest::Tiled) {
    c->reason += " (K/V tiles of " + std::to_string(kPostKeysPerTile) + " keys shared by " +
                 std::to_string(kPostThreadsPerGroup) + " queries, " +
                 kib(tiled_threadgroup_memory(c->bucket, p.dtype)) + " of threadgroup memory)";
  }
  c->reason += padding_note(p, c->bucket);
}

}  // namespace plan_detail

namespace {

using namespace plan_detail;

WhyNot post_takes(const RouteContext& ctx) {
  if (ctx.requested != KernelRequest::Untiled && ctx.requested != KernelRequest::Tiled) {
    return std::string("impl='untiled' or 'tiled' only (Auto takes the fast families)");
  }
  if (!within_fast_dims(ctx.p)) return past_fast_dims(ctx.p);
  return std::nullopt;
}

// forward_opening refuses what the post's kernels do not serve (options, a
// v head dim of its own), naming impl.
KernelChoice post_plan(const RouteContext& ctx) {
  KernelChoice c = forward_opening(ctx);
  finish_post(ctx.p, &c);
  return c;
}

}  // namespace

extern const FamilyRow kPostFamily = {
    "post kernels", MetalPass::Forward,
    "forward; float32, float16, bfloat16; head dims up to 256, D_v = D_qk; plain or causal only (no mask, window, "
    "softcap, varlen, sinks); any Nq; not paged; impl 'untiled' or 'tiled' only; any GPU",
    "flash_attention_untiled_*,flash_attention_tiled_*",
    post_takes, post_plan};

}  // namespace flash_metal
