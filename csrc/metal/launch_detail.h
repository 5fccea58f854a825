// What the Metal launch files share (csrc/metal/launch.cpp: the forward's
// launches and the helpers; csrc/metal/launch_backward.cpp: the backward's):
// the kernels' binding slots and tables, and the helpers both build
// launches with. Internal to csrc/; the plan's public shape is csrc/metal/plan.h.
#pragma once

#include "metal/plan_detail.h"

namespace flash_metal::plan_detail {

// The binding slots of the attention kernels: they mirror the [[buffer(n)]]
// and [[threadgroup(n)]] attributes of the kernel templates in shaders/*.h
// (tests/metal/test_metal_kernels.py checks each instantiation's signature against
// these tables). One slot per tensor across every kernel, so a tensor is
// always at the same index.
constexpr uint32_t kSlotQ = 0, kSlotK = 1, kSlotV = 2, kSlotOut = 3, kSlotLse = 4;
constexpr uint32_t kAttentionParamsIndex = 5;       // constant AttentionParams& p [[buffer(5)]]
constexpr uint32_t kSlotPartialOut = 6, kSlotPartialStats = 7;
constexpr uint32_t kSlotGradOut = 8, kSlotGradQ = 9, kSlotGradK = 10, kSlotGradV = 11, kSlotGradLse = 12,
                   kSlotDelta = 13;
constexpr uint32_t kSlotMask = 14, kSlotCuSeqlensQ = 15, kSlotCuSeqlensK = 16;
constexpr uint32_t kSlotSinks = 17, kSlotGradSinks = 18;
constexpr uint32_t kSlotBlockTable = 19, kSlotCacheSeqlens = 20;  // the paged cache (fc_paged: decode, prefill)
// The quantized cache (flash_decode_quant*): scales, biases and KvQuantParams.
constexpr uint32_t kSlotKScale = 21, kSlotKBias = 22, kSlotVScale = 23, kSlotVBias = 24;
constexpr uint32_t kKvQuantParamsIndex = 25;  // constant KvQuantParams& qp [[buffer(25)]]
constexpr uint32_t kAttentionThreadgroupIndex = 0;  // dynamic threadgroup memory, [[threadgroup(0)]]

// Binding tables (csrc/metal/launch.cpp has each one's comment).
extern const std::vector<BufferBinding> kBackwardDqBuffers;
extern const std::vector<BufferBinding> kBackwardDkdvBuffers;
extern const std::vector<BufferBinding> kSinksGradBuffers;

// flash_sinks_grad (shaders/backward/attention_sinks.h).
// Its live values per lane: the loop's sum, row, pointers and the sink (a
// handful, as the merge's model counts; for the estimate only).
constexpr uint32_t kSinksGradLiveRegisters = 16;

// A binding table with the options' inputs (mask, cu_seqlens) appended.
std::vector<BufferBinding> with_features(std::vector<BufferBinding> b);
// The function constants of a feature kernel (indices 0 .. 11, fc_dense false).
std::vector<bool> feature_constants(const AttentionProblem& p, bool align_q, bool align_k, bool has_grad_lse,
                                    bool sinks = false);
// Those constants with fc_dense set.
std::vector<bool> with_dense(std::vector<bool> c, bool dense);
// fc_dense: may the feature kernels load whole 16-byte runs of each row
// (csrc/metal/launch.cpp has the conditions); *why says why not.
bool dense_loader(const AttentionProblem& p, const LaunchStrides& s, uint32_t bucket, bool backward,
                  std::string* why);
// The reason's sentence about the tile loader, for explain().
std::string loader_reason(bool dense, const std::string& why);
// The parameter block of every launch: strides as given, sizes from the problem.
// Split blocks hold whole quanta of split_quantum keys (split_keys).
AttentionParams make_params(const AttentionProblem& p, const LaunchStrides& s, uint32_t kv_splits,
                            int64_t split_quantum = kSplitKeyQuantum);
// Every launch within Metal's threadgroup-memory limit and its kernel's thread limit.
void check_launch_limits(const MetalPlan& plan);

}  // namespace flash_metal::plan_detail
