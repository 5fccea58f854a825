// The split-D forward's routing (issue 20 sections 2 and 3): which calls with
// head dims above 256 run the fused split-D forward (shaders/prefill/attention_prefill_splitd.h)
// at D = 512 and at MLA's (576, 512) and (256, 512), packed over the GQA
// group's heads where that saves K/V reads (the absorbed-MLA decode), with
// the sentence explain() prints either way, its blocks, its launch shape and
// the "prefill split-D" row. The split-D backward is backward_splitd.cpp's;
// csrc/composite.cpp (composite_route, the fallback) asks splitd_takes too.
#include "metal/families/family.h"

namespace flash_metal {

namespace {

using namespace plan_detail;

// The (D_qk, D_v) pairs the split-D kernel is instantiated for, exactly (no
// padding columns: its fragments read whole parts of D / 8 features). Why
// these: 512 / 512, Gemma's global layers; 576 / 512, absorbed MLA (DeepSeek
// V2/V3, Kimi: a 512-wide latent plus a 64-wide rope part, v the latent);
// 256 / 512, the other MLA pair issue 20 names. Other dims in (256, 576]
// are rare and stay composite.
constexpr std::pair<int64_t, int64_t> kSplitDPairs[] = {{512, 512}, {576, 512}, {256, 512}};

bool splitd_pair(const AttentionProblem& p) {
  for (const auto& [dqk, dv] : kSplitDPairs) {
    if (p.head_dim == dqk && p.head_dim_v == dv) return true;
  }
  return false;
}

// The model's verdict the route follows (benchmarks/model/families/d512.py
// prints it, benchmarks/model/families/splitd.py computes it from exact
// emulator counts, tests/model/test_metal_model_d512.py holds it): a model, not a
// measurement, at 1 x 8 x {1024, 4096} x 512, float16.
constexpr const char* kSplitDVerdictCausal =
    "causal: the model predicts the split-D plan about 2x ahead of the composite (unfused) path on M1 Max, M3 Max, "
    "M4 Pro and M5, over its whole uncertainty band (benchmarks/model/families/d512.py, from "
    "benchmarks/model/families/splitd.py's exact emulator counts at 1x8x{1024,4096}x512: a model, not a measurement; "
    "on M5 only against unfused matmuls on the shader cores: on its neural accelerators unfused is predicted "
    "ahead)";
constexpr const char* kSplitDVerdictLevel =
    "not causal: the model puts the split-D plan level with the composite (unfused) path (0.99-1.03x at "
    "1x8x{1024,4096}x512 on M1 Max, M3 Max, M4 Pro and M5; benchmarks/model/families/d512.py: a model, not a "
    "measurement; the verdict differs by chip and length, within the model's uncertainty), so the route keeps "
    "the composite path (impl='prefill' runs the split-D kernel)";

// MLA's pairs, (576, 512) and (256, 512) (benchmarks/model/families/splitd_mla.py
// computes these from exact emulator counts; tests/model/test_metal_model_splitd_mla.py
// holds them): a model, not a measurement.
constexpr const char* kSplitDMlaVerdictCausal =
    "causal: the model predicts the split-D plan 2.0-2.1x ahead of the composite (unfused) path at (576, 512) and "
    "(256, 512) on M1 Max, M3 Max, M4 Pro and M5, over its whole uncertainty band (1x8x{1024,4096}, float16, "
    "benchmarks/model/families/splitd_mla.py from exact emulator counts: a model, not a measurement)";
constexpr const char* kSplitDMlaVerdictLevel =
    "not causal: the model puts the split-D plan level with the composite (unfused) path at (576, 512) and "
    "(256, 512) (0.99-1.05x at 1x8x{1024,4096} on M1 Max, M3 Max, M4 Pro and M5; "
    "benchmarks/model/families/splitd_mla.py: a model, not a measurement), so the route keeps the composite path "
    "(impl='prefill' runs the split-D kernel)";
constexpr const char* kSplitDMlaVerdictDecode =
    "the absorbed-MLA decode past the wide decode's rows per kv head: the model predicts the packed split-D plan "
    "ahead of the composite path over its whole uncertainty band from 32 threadgroups (B x 128 query heads on one "
    "latent kv head, B 2-8, Nq 1, Nk 4096-32768: 1.1-2.3x on M1 Max, M3 Max, M4 Pro and M5) and 1.8-3.5x ahead of "
    "the wide decode forced there; a grid smaller than that runs each threadgroup's whole key walk on one core "
    "(B 1 x 128: 0.6-0.8x on M1 Max and M3 Max), so below it only the split along keys is routed (packed, "
    "Nk >= 4096, the rows the model prices) and the rest stays composite (benchmarks/model/families/splitd_mla.py: a "
    "model, not a measurement)";
// The least grid the MLA decode routes to split-D with: the model's band is
// ahead of the composite path on every chip from 32 threadgroups (B 2 x 128
// heads, packed) and behind on M1 Max and M3 Max at 16 (B 1 x 128), where
// each core walks all Nk keys of one threadgroup serially (no split along
// keys: benchmarks/model/families/splitd_mla.py).
constexpr int64_t kSplitDMlaDecodeMinThreadgroups = 32;

// Whether the split-D grid packs (as prefill_pack_gqa packs: G > 1 and
// 2 * Nq <= 8 rows), and its threadgroups before any split along keys.
bool splitd_packs(const AttentionProblem& p) { return p.gqa_ratio() > 1 && 2 * p.q_len <= 8; }
int64_t splitd_threadgroups(const AttentionProblem& p) {
  const int64_t g = p.gqa_ratio();
  return p.batch * (splitd_packs(p) ? p.kv_heads * ((p.q_len * g + 7) / 8) : p.q_heads * ((p.q_len + 7) / 8));
}

// The split along keys (fc_split_kv) of the packed decode, the one rule
// (splitd_kv_splits below applies it; splitd_takes routes on it):
// - where: a packed decode (Nq <= kMaxDecodeRows) whose grid is below
//   kSplitDMlaDecodeMinThreadgroups, the grids the model finds short of
//   threadgroups (each core walks one threadgroup's whole key range);
//   larger grids stay one pass (their band is already ahead unsplit);
// - how many: as many as the chip keeps resident allow (cores x resident
//   threadgroups per core, estimate_launch, over the unsplit grid, rounded
//   down: one more split past the resident slots starts a second wave of a
//   few threadgroups, which the model prices at a whole wave: M5's 10 cores
//   x 3 over 16 threadgroups give 1, so it runs one pass, which the model
//   puts ahead there), each split at least kSplitDMinKeysPerSplit keys, at
//   most kSplitDMaxKvSplits.
// Why 256 keys at least per split: a packed threadgroup's partials are 8 rows
// x 512 floats (16 KiB written, then re-read by the merge) against its K/V
// reads of 256 x (576 + 512) x 2 bytes (557 KB in half): 6 %; and its Q
// (8 x 576) is loaded once per 8 key blocks at least.
constexpr int64_t kSplitDMinKeysPerSplit = 256;
// Why at most 64: bounds the merge's loop over splits (one SIMD-group per
// row walks them) and the scratch (64 x 512 floats per row); 16 threadgroups
// x 64 = 1,024 is past what the largest named chip (M3 Max / M4 Max's 40
// cores x 3 resident) keeps in flight.
constexpr uint32_t kSplitDMaxKvSplits = 64;
// The least Nk the auto route splits at: the model's rows (Nk 4096 and 32768;
// benchmarks/model/families/splitd_mla.py split_verdicts) start there.
constexpr int64_t kSplitDMlaSplitMinKeys = 4096;
constexpr const char* kSplitDMlaVerdictSplit =
    "the absorbed-MLA decode on a grid below 32 packed threadgroups (B 1 x 128 query heads on one latent kv "
    "head, Nk >= 4096), split along keys (fc_split_kv) as the chip's resident threadgroups allow, then merged "
    "(flash_decode_merge): the model predicts it ahead of the composite path and of the unsplit packed kernel "
    "over its whole uncertainty band at Nk 4096 and 32768 (1.9-2.8x over composite, 1.8-4.2x over unsplit on "
    "M1 Max, M3 Max and M4 Pro); where the resident slots allow no second split (M5 and the base chips, 8-10 "
    "cores) it runs one pass, which the model puts 1.75-1.94x ahead of composite on M5 (1.8-2.7x on base M1-M4) "
    "(benchmarks/model/families/splitd_mla.py: a model, not a measurement)";

bool splitd_decode_splits_keys(const AttentionProblem& p) {
  return p.q_len <= kMaxDecodeRows && splitd_packs(p) && splitd_threadgroups(p) < kSplitDMlaDecodeMinThreadgroups;
}

}  // namespace

bool splitd_takes(const AttentionProblem& p, KernelRequest requested, MetalPass pass, std::string* why_not) {
  if (pass == MetalPass::Backward) return splitd_backward_takes(p, requested, why_not);
  std::string why;
  const bool forced = requested == KernelRequest::Prefill;
  const bool mla = p.head_dim != p.head_dim_v;
  if (!splitd_pair(p)) {
    why = "the split-D kernel runs (D_qk, D_v) = (512, 512), (576, 512) or (256, 512) exactly (whole parts of "
          "D / 8 features, no padding columns); got " + std::to_string(p.head_dim) + " / " +
          std::to_string(p.head_dim_v);
  } else if (p.paged) {
    why = "the split-D kernel does not read a paged KV cache (the gather path packs the pages first)";
  } else if (!forced && requested != KernelRequest::Auto) {
    why = "this impl does not name the split-D kernel (impl='auto' or 'prefill' does)";
  } else if (!forced && mla && p.q_len <= kMaxDecodeRows) {
    // The absorbed-MLA decode past the wide decode's rows per kv head
    // (decode_takes_wide_dims answers first): packed split-D where the grid
    // fills the GPU, the model's kSplitDMlaVerdictDecode. Every option the
    // kernel has keeps it.
    // Below its threadgroups, the split along keys where the model prices it
    // (kSplitDMlaVerdictSplit): packed, Nk >= kSplitDMlaSplitMinKeys.
    const int64_t tgs = splitd_threadgroups(p);
    const bool split = splitd_decode_splits_keys(p) && p.kv_len >= kSplitDMlaSplitMinKeys;
    if (tgs < kSplitDMlaDecodeMinThreadgroups && !split) {
      why = "a decode grid of " + std::to_string(tgs) + " split-D threadgroups < " +
            std::to_string(kSplitDMlaDecodeMinThreadgroups) + (splitd_packs(p) ? ", Nk = " +
            std::to_string(p.kv_len) + " < " + std::to_string(kSplitDMlaSplitMinKeys) + " for the split along keys" :
            ", unpacked") + ": " + kSplitDMlaVerdictDecode;
    }
  } else if (!forced && !p.causal) {
    why = mla ? kSplitDMlaVerdictLevel : kSplitDVerdictLevel;
  } else if (!forced && p.window_right > 0) {
    why = "a right window (window_right = " + std::to_string(p.window_right) +
          " > 0): the model priced causal attention only (impl='prefill' runs the split-D kernel)";
  } else if (!forced && p.q_len <= kMaxDecodeRows) {
    why = "Nq = " + std::to_string(p.q_len) + " <= " + std::to_string(kMaxDecodeRows) +
          " past the wide decode's rows per kv head: the model priced the split-D plan on prefill "
          "shapes only (impl='prefill' runs it)";
  }
  if (why_not != nullptr) *why_not = why;
  return why.empty();
}

namespace plan_detail {

// The kernel's blocks: 8 query rows, 32 keys, 8 SIMD-groups of 64
// features (the header says why these). The host name encodes them.
constexpr uint32_t kSplitDBlockQ = 8, kSplitDBlockK = 32, kSplitDSimdgroups = 8;

// Threadgroup memory, the kernel's layout in floats: WM x 8 x BK partial
// scores, 8 x BK weights P, WM x 8 row maxima and WM x 8 row sums.
constexpr uint32_t splitd_threadgroup_bytes(uint32_t block_k, uint32_t simdgroups) {
  return (simdgroups * 8 * block_k + 8 * block_k + 2 * simdgroups * 8) * 4;
}
static_assert(splitd_threadgroup_bytes(kSplitDBlockK, kSplitDSimdgroups) == 9728 &&
                  splitd_threadgroup_bytes(kSplitDBlockK, kSplitDSimdgroups) <= kMaxThreadgroupMemory &&
                  splitd_threadgroup_bytes(kSplitDBlockK, kSplitDSimdgroups) % 16 == 0,
              "the split-D scratch: within 32 KiB, a multiple of 16 bytes");
static_assert(32 * kSplitDSimdgroups <= uint32_t{kPrefillSplitDMaxThreads}, "its declared limit (params.h)");

// Live values per lane: the prefill's model (O's fragments over the parts,
// one block of S, the row state, two operand fragments, kLiveOverhead)
// plus Q's fragments, which the template keeps in threadgroup memory and
// this kernel in registers, and its second running max (the shared step's
// row): at 512 / 512 16 + 16 + 8 + 6 + 16 + 1 = 63; at 576 / 512 18 for Q,
// 65; at 256 / 512 8, 55. Pack GQA's row offsets are computed once, before
// the key loop, and not counted.
constexpr uint32_t splitd_live_registers(int64_t dqk, int64_t dv) {
  return static_cast<uint32_t>((dqk + dv) / 4 / kSplitDSimdgroups) + kSplitDBlockK / 4 + 2 + 4 + kLiveOverhead + 1;
}
static_assert(splitd_live_registers(512, 512) == 63 && splitd_live_registers(576, 512) == 65 &&
                  splitd_live_registers(576, 512) <= uint32_t{kDecodeRegisterBudget} &&
                  splitd_live_registers(256, 512) <= uint32_t{kDecodeRegisterBudget},
              "within the planner's 72-value budget");

// The kernel's host name: d<D> where D_qk = D_v, else dqk<D_qk>_dv<D_v>.
std::string splitd_dims_name(const AttentionProblem& p) {
  return p.head_dim == p.head_dim_v ? "d" + std::to_string(p.head_dim)
                                    : "dqk" + std::to_string(p.head_dim) + "_dv" + std::to_string(p.head_dim_v);
}

KernelChoice choose_splitd(const AttentionProblem& p, KernelRequest requested, const GpuSpec& gpu) {
  KernelChoice c;
  c.kind = KernelRequest::Prefill;
  c.bucket = static_cast<uint32_t>(std::max(p.head_dim, p.head_dim_v));  // > 256: metal_launch's split-D case
  c.block_q = kSplitDBlockQ;
  c.block_k = kSplitDBlockK;
  c.simdgroups = kSplitDSimdgroups;
  const bool mla = p.head_dim != p.head_dim_v;
  const std::string dims = mla ? "D_qk = " + std::to_string(p.head_dim) + ", D_v = " + std::to_string(p.head_dim_v)
                               : "D_qk = D_v = " + std::to_string(p.head_dim);
  MetalLaunch l;
  l.threadgroup = {32 * kSplitDSimdgroups, 1, 1};
  l.threadgroup_memory = splitd_threadgroup_bytes(kSplitDBlockK, kSplitDSimdgroups);
  const uint32_t live = splitd_live_registers(p.head_dim, p.head_dim_v);
  const LaunchEstimate e = estimate_launch(l, live, gpu);
  std::string verdict;
  if (requested == KernelRequest::Prefill) {
    verdict = "requested by the caller (impl='prefill') at " + (mla ? dims : "D = " + std::to_string(p.head_dim));
  } else if (!mla) {
    verdict = dims + ", " + kSplitDVerdictCausal;
  } else if (p.q_len > kMaxDecodeRows) {
    verdict = dims + ", " + kSplitDMlaVerdictCausal;
  } else {
    verdict = dims + ", " + (splitd_decode_splits_keys(p) ? kSplitDMlaVerdictSplit : kSplitDMlaVerdictDecode);
  }
  c.reason = "prefill (split-D): " + verdict +
             "; the FA2 template's 512-wide tiles leave 8 x 8 blocks in 32 KiB (predicted 2-3x slower than "
             "unfused), so the head dimension is blocked instead (metal-flash-attention's idea): blocks of " +
             std::to_string(kSplitDBlockQ) + " queries x " + std::to_string(kSplitDBlockK) + " keys on " +
             std::to_string(kSplitDSimdgroups) + " simdgroups of " + std::to_string(p.head_dim / kSplitDSimdgroups) +
             " features of Q and " + std::to_string(p.head_dim_v / kSplitDSimdgroups) +
             " of O each, Q and O in registers, K/V read from device memory per part" +
             (mla ? " (strides in elements: k and v may be views of one latent cache)" : "") +
             ", the scores summed through threadgroup memory and the softmax shared (3 barriers per key block), " +
             kib(l.threadgroup_memory) + " of threadgroup memory, " + std::to_string(live) +
             " live values per lane, " + std::to_string(e.simdgroups_per_core) + " resident simdgroups per core on " +
             gpu.name;
  c.pack_gqa = prefill_pack_gqa(p, kSplitDBlockQ, &c.reason);
  const int64_t rows = c.pack_gqa ? p.q_len * p.gqa_ratio() : p.q_len;
  c.reason += " (" + std::to_string(ceil_div(rows, kSplitDBlockQ)) + " query blocks per " +
              (c.pack_gqa ? "kv head" : "head") + ")";
  if (c.pack_gqa && splitd_decode_splits_keys(p)) {
    // The split along keys (the rule above kSplitDMinKeysPerSplit): fill the
    // chip's resident threadgroups, whole 32-key quanta, empty splits dropped.
    const int64_t base = splitd_threadgroups(p);
    const int64_t resident = std::max<int64_t>(1, e.simdgroups_per_core / kSplitDSimdgroups);
    const int64_t target = int64_t{gpu.cores} * resident;
    const int64_t want = target / base;  // rounded down: no partial second wave
    const int64_t by_length = std::max<int64_t>(1, p.kv_len / kSplitDMinKeysPerSplit);
    const int64_t asked = std::max<int64_t>(1, std::min<int64_t>({want, by_length, int64_t{kSplitDMaxKvSplits}}));
    const int64_t per = split_keys(p.kv_len, static_cast<uint32_t>(asked));
    c.kv_splits = static_cast<uint32_t>((std::max<int64_t>(1, p.kv_len) + per - 1) / per);
    c.reason += "; " + std::to_string(base) + " packed threadgroups against " + std::to_string(target) +
                " resident on " + gpu.name + " (" + std::to_string(resident) + " per core), Nk = " +
                std::to_string(p.kv_len) + " allows " + std::to_string(by_length) + " splits of >= " +
                std::to_string(kSplitDMinKeysPerSplit) + " keys, at most " + std::to_string(kSplitDMaxKvSplits) +
                (c.kv_splits > 1 ? ": split along keys (fc_split_kv) into " + std::to_string(c.kv_splits) +
                                       " ranges of " + std::to_string(per) +
                                       " keys, partials merged by flash_decode_merge (d512)"
                                 : ": one pass");
  }
  c.reason += "; not yet verified on Apple hardware";
  return c;
}

static_assert(kSplitKeyQuantum == kSplitDBlockK, "fc_split_kv: a split's keys are whole key blocks");

void splitd_launch(const AttentionProblem& p, const KernelChoice& c, const GpuSpec& gpu, MetalLaunch* l) {
  l->kernel_name = std::string("flash_attention_prefill_splitd_") + dtype_name(p.dtype) + "_" +
                   splitd_dims_name(p) + "_bq" + std::to_string(c.block_q) + "_bk" + std::to_string(c.block_k) +
                   "_wm" + std::to_string(c.simdgroups);
  // Pack GQA: the rows are packed rows of a kv head's group, Nq * G of them
  // per (batch, kv head) (fc_pack_gqa).
  const int64_t rows = c.pack_gqa ? p.q_len * p.gqa_ratio() : p.q_len;
  // Split along keys: x runs over (split, query block) (fc_split_kv).
  l->grid = {ceil_div(rows, c.block_q) * c.kv_splits, static_cast<uint32_t>(c.pack_gqa ? p.kv_heads : p.q_heads),
             static_cast<uint32_t>(p.batch)};
  l->threadgroup = {32 * c.simdgroups, 1, 1};
  l->max_threads_per_threadgroup = kPrefillSplitDMaxThreads;
  l->threadgroup_memory = splitd_threadgroup_bytes(c.block_k, c.simdgroups);
  l->function_constants.resize(kSplitDFunctionConstantCount, false);
  l->function_constants[kPackGqaFunctionConstant] = c.pack_gqa;
  l->function_constants[kSplitKvFunctionConstant] = c.kv_splits > 1;
  l->estimate = estimate_launch(*l, splitd_live_registers(p.head_dim, p.head_dim_v), gpu);
}

}  // namespace plan_detail

namespace {

using namespace plan_detail;

WhyNot prefill_splitd_takes(const RouteContext& ctx) {
  const int64_t fast = kFastHeadDimBuckets.back();
  if (ctx.p.head_dim <= fast && ctx.p.head_dim_v <= fast) {
    return std::string("head dims within 256 (the split-D forward runs (512, 512), (576, 512) and (256, 512))");
  }
  std::string why_not;
  if (splitd_takes(ctx.p, ctx.requested, MetalPass::Forward, &why_not)) return std::nullopt;
  return why_not;
}

KernelChoice prefill_splitd_plan(const RouteContext& ctx) { return choose_splitd(ctx.p, ctx.requested, ctx.gpu); }

}  // namespace

extern const FamilyRow kPrefillSplitDFamily = {
    "prefill split-D", MetalPass::Forward,
    "forward; float32, float16, bfloat16; head dims (512, 512), (576, 512), (256, 512) exactly; every option; impl "
    "'auto' where the model puts it ahead (causal prefill, MLA's packed decode) or 'prefill'; not paged; any GPU",
    "flash_attention_prefill_splitd_*,flash_decode_merge_*_d512",
    prefill_splitd_takes, prefill_splitd_plan};

}  // namespace flash_metal

