// The routing table's row: one kernel family of the Metal path, what it
// takes and how it plans. choose_metal_kernel walks its pass's table
// (csrc/metal/families/table.cpp) in priority order and plans with the
// first row that takes the call; explain() prints one line per row (took
// the call, or why not: explain_metal_families).
//
// Adding a family: one new file here defining its FamilyRow (takes, plan,
// the kernels it plans), and one row in table.cpp. Rows are plain
// aggregates of pointers, constant-initialized, so the tables need no
// registration at start-up.
#pragma once

#include "metal/plan_detail.h"

#include <optional>
#include <string>

namespace flash_metal {

// What a row is asked about: one call's problem, the caller's impl, the GPU
// and the pass.
struct RouteContext {
  const AttentionProblem& p;
  KernelRequest requested;
  const GpuSpec& gpu;
  MetalPass pass;
};

// takes()'s answer: nullopt when the family takes the call, else why not
// (a sentence for explain()).
using WhyNot = std::optional<std::string>;

struct FamilyRow {
  // Its name in explain()'s table ("decode", "tensor ops split-D", ...).
  const char* name;
  MetalPass pass;
  // What it takes, in one line: passes, dtypes, head dims, options, Nq,
  // paged, varlen, impl, GPU features (for the docs and metal_routing_table).
  const char* declares;
  // The host names it plans, as comma-separated glob patterns ('*' matches
  // any run): tests/metal/test_metal_routing_table.py holds them to the registry
  // of compiled kernels (csrc/metal/registry.cpp).
  const char* kernels;
  // Never throws: a predicate with its reason. A call the row takes by
  // name (impl=...) but cannot serve is taken, and plan() refuses it with
  // the error that names the argument.
  WhyNot (*takes)(const RouteContext& ctx);
  // The choice (kind, bucket, blocks, reason); may throw for a forced impl
  // it cannot serve.
  KernelChoice (*plan)(const RouteContext& ctx);
};

// The pass's table in priority order: the built-in rows (table.cpp) with
// any test-registered ones spliced in (register_metal_family).
std::vector<const FamilyRow*> metal_family_table(MetalPass pass);

// Tests only (the metal_routing_register_family op): inserts `row` at
// `position` of its pass's table (clamped to its end), for a test double
// compiled outside the product; nullptr removes every registered row.
void register_metal_family(const FamilyRow* row, int64_t position);

// One line per row of the pass's table: "<name>: took the call", or
// "<name>: no: <why>", or, for a row that would take it after the one that
// did, "<name>: would take it too; <first> comes first". impl='composite'
// asks no row.
std::vector<std::string> explain_metal_families(const AttentionProblem& p, KernelRequest requested,
                                                const GpuSpec& gpu, MetalPass pass);

namespace plan_detail {

// Shared by the rows (csrc/metal/routing.cpp).
const char* request_name(KernelRequest r);
// Whether both head dims fit the fast buckets (256): every family but the
// wide decode and the split-D kernels needs it.
bool within_fast_dims(const AttentionProblem& p);
// "head dims D_qk / D_v exceed 256 (...)": the fast families' answer above it.
std::string past_fast_dims(const AttentionProblem& p);
// The forward's first step for the fast families: the kind and the reason's
// opening (impl's, or Auto's: varlen and Nq > 8 the prefill, Nq <= 8 the
// decode), then the refusals of a forced impl that does not fit.
KernelChoice forward_opening(const RouteContext& ctx);
// The padding sentence of a bucket wider than the head dims (MLA-style too).
std::string padding_note(const AttentionProblem& p, uint32_t bucket);
std::string padding_note(int64_t head_dim, uint32_t bucket);
// Resident SIMD-groups per core choose_backward aims for on every named
// chip. Why 8: a core then has 8 SIMD-groups to switch among while one
// waits on a barrier, a threadgroup-memory read or an MMA's latency
// (issue 19's target for the prefill and backward kernels; the decode
// kernels aim higher, 24 launched, having nothing but loads to overlap).
inline constexpr uint32_t kResidentTarget = 8;
// Fewest resident SIMD-groups per core over every named chip (csrc/metal/gpus.cpp)
// of a prefill or backward kernel with `simdgroups` per threadgroup, `bytes` of
// threadgroup memory and `live` registers per lane: estimate_launch's rule.
uint32_t resident_on_every_chip(uint32_t simdgroups, uint32_t bytes, uint32_t live);
// The backward's register budget, in 32-bit values per lane: the live
// registers explain() prints (LaunchEstimate), i.e. the accumulators (dQ:
// bucket / 8 fragments; dK and dV: twice that; over the feature parts)
// plus one block of P and dP (2 fragments each per 8 keys or queries), 2
// floats per fragment per lane, plus kLiveOverhead for addresses, counters
// and the fragments being read (issue 19: the overhead counts too, as in
// the decode planner). Why 72: an Apple GPU thread addresses at most 128
// 32-bit registers (Dougall Johnson's G13 architecture notes; [I], not
// measured here); ~69 is what a thread gets at the occupancy that
// saturates the ALUs (24 simdgroups per core, metal-benchmarks). MLX's fused backward (PR #3241) had to shrink its blocks
// at D = 128 and lost to its unfused path there, so the blocks below shrink
// the streamed side first and keep the accumulators in registers.
// The prefill's blocks keep within it too.
inline constexpr uint32_t kBackwardRegisterBudget = 72;
static_assert(kBackwardRegisterBudget == uint32_t{kDecodeRegisterBudget},
              "one register budget for both planners (shaders/decode/attention_decode_rows.h)");

// Each family's finishing step after forward_opening (its own file).
void finish_post(const AttentionProblem& p, KernelChoice* c);
void finish_prefill(const RouteContext& ctx, KernelChoice* c);
void finish_decode(const RouteContext& ctx, KernelChoice* c);
// The model's verdict on the MLA pair (192, 128), quoted by both tensor-op
// reasons (tensor_ops.cpp).
extern const char* const kMlaModelNote;
// The tensor-op rows' shared question and plan (tensor_ops.cpp,
// backward_tensor_ops.cpp); `dsplit`: whether the row is D = 256's.
WhyNot tensor_ops_forward_candidate(const RouteContext& ctx, bool dsplit);
KernelChoice tensor_ops_forward_plan(const RouteContext& ctx);
WhyNot backward_tensor_ops_candidate(const RouteContext& ctx, bool dsplit);
KernelChoice backward_tensor_ops_plan(const RouteContext& ctx);
// The decode's split count on `gpu` (1: one pass), the one rule the decode
// and split decode rows route on (csrc/metal/families/decode.cpp).
uint32_t auto_decode_splits(const AttentionProblem& p, const GpuSpec& gpu);

}  // namespace plan_detail

}  // namespace flash_metal
