// The routing tables: one per pass, the kernel families in priority order,
// and the walk that routes with them (choose_metal_kernel) and explains them
// (explain_metal_families). A family is one file in this folder and one row
// here (its extern declaration beside the table).
//
// Why this order. Forward: the two families above 256 first (their calls no
// other row takes); the post's kernels only when impl names them; the
// tensor-op rows ahead of the simdgroup prefill they replace behind Auto's
// gate; the paged cache before the contiguous decode and prefill rows (it
// reads the same kernels through the table); the decode rows before the
// prefill, Auto's catch-all. Backward: split-D (D = 512), the tensor-op
// rows, then the simdgroup backward, Auto's catch-all.
#include "metal/families/family.h"

#include <algorithm>
#include <atomic>
#include <iterator>
#include <mutex>

namespace flash_metal {

extern const FamilyRow kDecodeQuantFamily;       // decode_quant.cpp
extern const FamilyRow kWideDecodeFamily;        // wide_decode.cpp
extern const FamilyRow kPrefillSplitDFamily;     // prefill_splitd.cpp
extern const FamilyRow kPostFamily;              // post.cpp
extern const FamilyRow kTensorOpsDsplitFamily;   // tensor_ops_dsplit.cpp
extern const FamilyRow kTensorOpsFamily;         // tensor_ops.cpp
extern const FamilyRow kPagedFamily;             // paged.cpp
extern const FamilyRow kDecodeFamily;            // decode.cpp
extern const FamilyRow kDecodeSplitFamily;       // decode_split.cpp
extern const FamilyRow kPrefillFamily;           // prefill.cpp
extern const FamilyRow kBackwardSplitDFamily;           // backward_splitd.cpp
extern const FamilyRow kBackwardTensorOpsDsplitFamily;  // backward_tensor_ops_dsplit.cpp
extern const FamilyRow kBackwardTensorOpsFamily;        // backward_tensor_ops.cpp
extern const FamilyRow kBackwardFamily;                 // backward.cpp

namespace {

const FamilyRow* const kForwardTable[] = {
    &kDecodeQuantFamily,
    &kWideDecodeFamily,
    &kPrefillSplitDFamily,
    &kPostFamily,
    &kTensorOpsDsplitFamily,
    &kTensorOpsFamily,
    &kPagedFamily,
    &kDecodeFamily,
    &kDecodeSplitFamily,
    &kPrefillFamily,
};

const FamilyRow* const kBackwardTable[] = {
    &kBackwardSplitDFamily,
    &kBackwardTensorOpsDsplitFamily,
    &kBackwardTensorOpsFamily,
    &kBackwardFamily,
};

// Rows registered by tests (register_metal_family), with their positions.
// The flag keeps the product's calls off the lock while there are none.
struct Registered {
  const FamilyRow* row;
  int64_t position;
};
std::mutex registered_mutex;
std::vector<Registered> registered;
std::atomic<bool> any_registered{false};

using namespace plan_detail;

// The first row that takes the call, or nullptr; *why_not collects each
// earlier row's answer when given.
const FamilyRow* first_taker(const std::vector<const FamilyRow*>& table, const RouteContext& ctx,
                             std::vector<std::pair<const FamilyRow*, std::string>>* why_not) {
  for (const FamilyRow* row : table) {
    WhyNot no = row->takes(ctx);
    if (!no.has_value()) return row;
    if (why_not != nullptr) why_not->emplace_back(row, *no);
  }
  return nullptr;
}

std::string answer_of(const std::vector<std::pair<const FamilyRow*, std::string>>& why_not, const char* name) {
  for (const auto& [row, why] : why_not) {
    if (std::string(row->name) == name) return why;
  }
  return "";
}

// No row of the forward table takes the call: head dims past 256 that
// neither the wide decode nor the split-D forward takes (the errors name
// both); anything else is the table's gap.
[[noreturn]] void refuse_forward(const AttentionProblem& p, const std::string& splitd_why, const char* pass_name) {
  TORCH_CHECK_NOT_IMPLEMENTED(p.head_dim <= kFastHeadDimBuckets.back(),
                              "flash_metal: head_dim ", p.head_dim, " on Metal kernels: not yet (at most ",
                              kFastHeadDimBuckets.back(), ", ", pass_name, "; the decode kernels, Nq <= ",
                              kMaxDecodeRows, ", take up to ", kDecodeHeadDimBuckets.back(), " (impl='auto': at most ",
                              kWideDecodeMaxRows, " query rows per kv head); the split-D forward takes (512, 512), (576, 512) and (256, 512) (",
                              splitd_why, ")); run on CPU tensors, which take head dims up to ", kMaxHeadDim);
  TORCH_CHECK_NOT_IMPLEMENTED(p.head_dim_v <= kFastHeadDimBuckets.back(),
                              "flash_metal: v's head dim D_v = ", p.head_dim_v, " on Metal kernels: not yet (at most ",
                              kFastHeadDimBuckets.back(), ", ", pass_name, "; the decode kernels, Nq <= ",
                              kMaxDecodeRows, ", take up to ", kMaxHeadDimV, " (impl='auto': at most ", kWideDecodeMaxRows,
                              " query rows per kv head)); run on CPU tensors, which take "
                              "D_v up to ", kMaxHeadDimV);
  TORCH_CHECK(false, kOp, ": internal error: no kernel family of the ", pass_name, " takes this call");
}

}  // namespace

std::vector<const FamilyRow*> metal_family_table(MetalPass pass) {
  std::vector<const FamilyRow*> table;
  if (pass == MetalPass::Forward) {
    table.assign(std::begin(kForwardTable), std::end(kForwardTable));
  } else {
    table.assign(std::begin(kBackwardTable), std::end(kBackwardTable));
  }
  if (any_registered.load(std::memory_order_acquire)) {
    std::lock_guard<std::mutex> lock(registered_mutex);
    for (const Registered& r : registered) {
      if (r.row->pass != pass) continue;
      const int64_t at = std::clamp<int64_t>(r.position, 0, static_cast<int64_t>(table.size()));
      table.insert(table.begin() + at, r.row);
    }
  }
  return table;
}

void register_metal_family(const FamilyRow* row, int64_t position) {
  std::lock_guard<std::mutex> lock(registered_mutex);
  if (row == nullptr) {
    registered.clear();
  } else {
    registered.push_back({row, position});
  }
  any_registered.store(!registered.empty(), std::memory_order_release);
}

KernelChoice choose_metal_kernel(const AttentionProblem& p, KernelRequest requested, const GpuSpec& gpu,
                                 MetalPass pass) {
  TORCH_CHECK(requested != KernelRequest::Composite, "flash_metal: impl='composite' is routed before planning "
              "(composite_route, csrc/composite.h)");
  const RouteContext ctx{p, requested, gpu, pass};
  std::vector<std::pair<const FamilyRow*, std::string>> why_not;
  const std::vector<const FamilyRow*> table = metal_family_table(pass);
  const FamilyRow* row = first_taker(table, ctx, &why_not);
  if (row != nullptr) {
    KernelChoice c = row->plan(ctx);
    c.family = row->name;
    return c;
  }
  const bool wide = !within_fast_dims(p);
  if (pass == MetalPass::Forward || wide) {
    refuse_forward(p, answer_of(why_not, pass == MetalPass::Forward ? kPrefillSplitDFamily.name
                                                                     : kBackwardSplitDFamily.name),
                   pass == MetalPass::Backward ? "backward" : "forward");
  }
  TORCH_CHECK_VALUE(false,
                    "flash_metal.attention_backward: impl must be 'auto' or 'tensor_ops' (the backward has two "
                    "kernel families: flash_backward_dq + flash_backward_dkdv on simdgroup matrices, and their "
                    "Metal 4 tensor-op twins; and at D_qk = D_v = 512 'prefill' names the split-D backward); got '",
                    request_name(requested), "'");
}

std::vector<std::string> explain_metal_families(const AttentionProblem& p, KernelRequest requested,
                                                const GpuSpec& gpu, MetalPass pass) {
  const RouteContext ctx{p, requested, gpu, pass};
  std::vector<std::string> lines;
  const FamilyRow* taker = nullptr;
  for (const FamilyRow* row : metal_family_table(pass)) {
    const std::string name = row->name;
    if (requested == KernelRequest::Composite) {
      lines.push_back(name + ": no: impl='composite' names the composite path");
      continue;
    }
    const WhyNot no = row->takes(ctx);
    if (no.has_value()) {
      lines.push_back(name + ": no: " + *no);
    } else if (taker != nullptr) {
      lines.push_back(name + ": would take it too; " + taker->name + " comes first");
    } else {
      taker = row;
      lines.push_back(name + ": took the call");
    }
  }
  return lines;
}

}  // namespace flash_metal
