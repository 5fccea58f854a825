// A kernel family of the tests' own (tests/metal/test_metal_routing_table.py): never
// part of the product, built by the test into its own shared library and
// registered into the forward routing table through the
// metal_routing_register_family op (the row's address, from
// fm_test_double_family below). It takes one signature call, float16 at
// head dim 64 with softcap 7.25, and plans the simdgroup prefill's kernel
// for it with blocks of its own choosing that the library has (32 x 32 on
// 4 SIMD-groups): one new file and one table row, as a product family is
// added (docs/how-it-works.md, "Where to add a kernel family").
//
// Header-only use of the planner: nothing here needs a symbol of _C.
#include "metal/families/family.h"

namespace {

using namespace flash_metal;

constexpr double kSignatureSoftcap = 7.25;

WhyNot test_double_takes(const RouteContext& ctx) {
  const AttentionProblem& p = ctx.p;
  if (p.softcap != kSignatureSoftcap) return std::string("softcap is not the test's signature, 7.25");
  if (p.dtype != c10::ScalarType::Half || p.head_dim != 64 || p.head_dim_v != 64) {
    return std::string("float16 at head dims 64 / 64 only");
  }
  if (ctx.requested != KernelRequest::Auto) return std::string("impl='auto' only");
  return std::nullopt;
}

KernelChoice test_double_plan(const RouteContext&) {
  KernelChoice c;
  c.kind = KernelRequest::Prefill;
  c.bucket = 64;
  c.block_q = 32;
  c.block_k = 32;
  c.simdgroups = 4;
  c.reason = "test double: the prefill kernel at d64, blocks of 32 queries x 32 keys on 4 simdgroups";
  return c;
}

const FamilyRow kTestDoubleFamily = {
    "test double", MetalPass::Forward,
    "tests only: forward, float16, head dims 64 / 64, softcap 7.25, impl 'auto'",
    "flash_attention_prefill_float16_d64_*",
    test_double_takes, test_double_plan};

}  // namespace

extern "C" __attribute__((visibility("default"))) const flash_metal::FamilyRow* fm_test_double_family() {
  return &kTestDoubleFamily;
}
