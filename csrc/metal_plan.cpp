#include "metal_plan.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>

namespace flash_metal {
namespace {

constexpr const char* kOp = "flash_metal.attention_forward";

const char* dtype_name(c10::ScalarType t) {
  switch (t) {
    case c10::ScalarType::Float: return "float32";
    case c10::ScalarType::Half: return "float16";
    case c10::ScalarType::BFloat16: return "bfloat16";
    default: TORCH_CHECK_TYPE(false, kOp, ": no Metal kernel for dtype ", t);
  }
}

template <size_t N>
uint32_t bucket_of(int64_t head_dim, const std::array<uint32_t, N>& buckets) {
  for (uint32_t b : buckets) {
    if (head_dim <= b) return b;
  }
  TORCH_CHECK_VALUE(false, kOp, ": head_dim ", head_dim, " exceeds the largest bucket ", buckets.back());
}

uint32_t ceil_div(int64_t a, int64_t b) { return static_cast<uint32_t>((a + b - 1) / b); }

// Bytes of one element of the inputs (every kernel's tiles are stored in it).
uint32_t dtype_bytes(c10::ScalarType t) { return t == c10::ScalarType::Float ? 4 : 2; }

// Threadgroup memory of the tiled kernel (shaders/attention_tiled.h): one K
// tile and one V tile of kPostKeysPerTile rows, each row padded to the
// head-dim bucket so the kernel's inner loops run to a compile-time bound
// (registers, not stack), stored in the input dtype (half the memory for
// float16/bfloat16; converted to float on read). 2 * 16 * bucket * bytes:
// a multiple of 16 (bucket >= 32), as Metal requires, and at most
// 2 * 16 * 256 * 4 = 32 KiB (float32, bucket 256), Metal's limit.
uint32_t tiled_threadgroup_memory(uint32_t bucket, c10::ScalarType dtype) {
  return 2 * kPostKeysPerTile * bucket * dtype_bytes(dtype);
}

// Threadgroup memory of the prefill kernel (shaders/attention_prefill.h),
// the layout its header documents: a Q tile of block_q rows and one K/V tile
// of block_k rows, used by K and then V in turn (MLX's steel layout), every
// row holding the bucket's columns plus 16 bytes of padding against bank
// conflicts (MLX PR #1899), all in the input dtype.
uint32_t prefill_threadgroup_memory(uint32_t block_q, uint32_t block_k, uint32_t bucket, c10::ScalarType dtype) {
  const uint32_t row = (bucket + 16 / dtype_bytes(dtype)) * dtype_bytes(dtype);
  return (block_q + block_k) * row;
}

// Metal's threadgroup-memory limit on every Apple GPU of the supported
// macOS versions (MTLDevice.maxThreadgroupMemoryLength is 32 KiB on Apple7+).
constexpr uint32_t kMaxThreadgroupMemory = 32 * 1024;

// Threadgroup memory of either backward kernel (shaders/attention_backward.h):
// two tiles of the rows a simdgroup owns (Q and dO, or K and V) and two of
// the streamed rows (K and V, or Q and dO), each row the bucket's columns in
// the input dtype plus 16 bytes of padding, or no padding when the padded
// tiles would exceed 32 KiB (the shader's backward_row_pad, same rule).
uint32_t backward_threadgroup_memory(uint32_t own, uint32_t streamed, uint32_t bucket, c10::ScalarType dtype) {
  const uint32_t rows = 2 * (own + streamed);
  const uint32_t padded = bucket * dtype_bytes(dtype) + 16;
  return rows * (rows * padded <= kMaxThreadgroupMemory ? padded : padded - 16);
}

// The binding slots of the attention kernels: they mirror the [[buffer(n)]]
// and [[threadgroup(n)]] attributes of the kernel templates in shaders/*.h
// (tests/test_metal_kernels.py checks each instantiation's signature against
// these tables). One slot per tensor across every kernel, so a tensor is
// always at the same index.
constexpr uint32_t kSlotQ = 0, kSlotK = 1, kSlotV = 2, kSlotOut = 3, kSlotLse = 4;
constexpr uint32_t kAttentionParamsIndex = 5;       // constant AttentionParams& p [[buffer(5)]]
constexpr uint32_t kSlotPartialOut = 6, kSlotPartialStats = 7;
constexpr uint32_t kSlotGradOut = 8, kSlotGradQ = 9, kSlotGradK = 10, kSlotGradV = 11, kSlotGradLse = 12,
                   kSlotDelta = 13;
constexpr uint32_t kSlotMask = 14, kSlotCuSeqlensQ = 15, kSlotCuSeqlensK = 16;
constexpr uint32_t kAttentionThreadgroupIndex = 0;  // dynamic threadgroup memory, [[threadgroup(0)]]

// The options' inputs, bound by every feature kernel (prefill, decode,
// split decode, both backward kernels) after its own tensors.
const std::vector<BufferBinding> kFeatureBuffers = {
    {LaunchTensor::Mask, kSlotMask}, {LaunchTensor::CuSeqlensQ, kSlotCuSeqlensQ},
    {LaunchTensor::CuSeqlensK, kSlotCuSeqlensK}};

std::vector<BufferBinding> with_features(std::vector<BufferBinding> b) {
  b.insert(b.end(), kFeatureBuffers.begin(), kFeatureBuffers.end());
  return b;
}

// Every forward kernel (post kernels, prefill, one-pass decode).
const std::vector<BufferBinding> kForwardBuffers = {
    {LaunchTensor::Q, kSlotQ}, {LaunchTensor::K, kSlotK}, {LaunchTensor::V, kSlotV},
    {LaunchTensor::Out, kSlotOut}, {LaunchTensor::Lse, kSlotLse}};
// Split-KV pass 1: reads q, k, v; writes the partials.
const std::vector<BufferBinding> kSplitBuffers = {
    {LaunchTensor::Q, kSlotQ}, {LaunchTensor::K, kSlotK}, {LaunchTensor::V, kSlotV},
    {LaunchTensor::PartialOut, kSlotPartialOut}, {LaunchTensor::PartialStats, kSlotPartialStats}};
// Split-KV pass 2: reads the partials; writes out and lse.
const std::vector<BufferBinding> kMergeBuffers = {
    {LaunchTensor::Out, kSlotOut}, {LaunchTensor::Lse, kSlotLse},
    {LaunchTensor::PartialOut, kSlotPartialOut}, {LaunchTensor::PartialStats, kSlotPartialStats}};

// Backward pass 1 (flash_backward_dq): reads q, k, v, out, lse, grad_out
// and grad_lse; writes grad_q and Delta.
const std::vector<BufferBinding> kBackwardDqBuffers = {
    {LaunchTensor::Q, kSlotQ}, {LaunchTensor::K, kSlotK}, {LaunchTensor::V, kSlotV},
    {LaunchTensor::Out, kSlotOut}, {LaunchTensor::Lse, kSlotLse}, {LaunchTensor::GradOut, kSlotGradOut},
    {LaunchTensor::GradQ, kSlotGradQ}, {LaunchTensor::GradLse, kSlotGradLse}, {LaunchTensor::Delta, kSlotDelta}};
// Backward pass 2 (flash_backward_dkdv): reads q, k, v, lse, grad_out and
// Delta; writes grad_k and grad_v.
const std::vector<BufferBinding> kBackwardDkdvBuffers = {
    {LaunchTensor::Q, kSlotQ}, {LaunchTensor::K, kSlotK}, {LaunchTensor::V, kSlotV},
    {LaunchTensor::Lse, kSlotLse}, {LaunchTensor::GradOut, kSlotGradOut}, {LaunchTensor::GradK, kSlotGradK},
    {LaunchTensor::GradV, kSlotGradV}, {LaunchTensor::Delta, kSlotDelta}};

std::string kib(uint32_t bytes) { return std::to_string(bytes) + " bytes"; }

}  // namespace

KernelRequest parse_kernel_request(const std::string& kernel) {
  if (kernel == "auto") return KernelRequest::Auto;
  if (kernel == "untiled") return KernelRequest::Untiled;
  if (kernel == "tiled") return KernelRequest::Tiled;
  if (kernel == "prefill") return KernelRequest::Prefill;
  if (kernel == "decode") return KernelRequest::Decode;
  if (kernel == "decode_split") return KernelRequest::DecodeSplit;
  TORCH_CHECK_VALUE(false, kOp,
                    ": impl must be one of 'auto', 'untiled', 'tiled', 'prefill', 'decode', 'decode_split'; got '",
                    kernel, "'");
}

GpuClass parse_gpu_class(const std::string& name) {
  if (name == "base") return GpuClass::Base;
  if (name == "max") return GpuClass::Max;
  if (name == "ultra") return GpuClass::Ultra;
  TORCH_CHECK_VALUE(false, kOp, ": gpu must be one of 'base', 'max', 'ultra'; got '", name, "'");
}

GpuClass gpu_class_from_device_name(const std::string& name) {
  const auto ends_with = [&](const std::string& tail) {
    return name.size() >= tail.size() && name.compare(name.size() - tail.size(), tail.size(), tail) == 0;
  };
  if (ends_with(" Ultra")) return GpuClass::Ultra;
  if (ends_with(" Max")) return GpuClass::Max;
  return GpuClass::Base;
}

namespace {

const char* request_name(KernelRequest r) {
  switch (r) {
    case KernelRequest::Untiled: return "untiled";
    case KernelRequest::Tiled: return "tiled";
    case KernelRequest::Prefill: return "prefill";
    case KernelRequest::Decode: return "decode";
    case KernelRequest::DecodeSplit: return "decode_split";
    default: return "auto";
  }
}

// Cores of a representative chip of each class (M3: 10, M3 Max: 40, M3
// Ultra: 80; Apple's published configurations). Only the split count uses it.
uint32_t representative_cores(GpuClass gpu) {
  switch (gpu) {
    case GpuClass::Ultra: return 80;
    case GpuClass::Max: return 40;
    default: return 10;
  }
}

// Split-KV decode knobs.
// Why 4 threadgroups per core: decode is bound by memory bandwidth, and a
// core hides DRAM latency only with several threadgroups' loads in flight;
// fewer leaves bandwidth unused, more only adds merge work.
constexpr uint32_t kDecodeGroupsPerCore = 4;
// Why 256 keys at least per block: the merge pass re-reads head_dim floats of
// partial output per block and row, which must stay small next to the block's
// own K/V bytes (256 keys x D x 2 tensors); it also keeps the extra
// dispatch worth its cost on short contexts.
constexpr int64_t kMinKeysPerSplit = 256;
// Why at most 64 blocks: bounds the merge loop and the scratch memory
// (64 x D floats per query row), and 64 already fills an Ultra at B*Hkv = 5.
constexpr uint32_t kMaxKvSplits = 64;
// Why blocks start at multiples of 32 keys: a block then starts on a whole
// SIMD-group of keys in every decode kernel layout.
constexpr int64_t kSplitKeyQuantum = 32;

// Query rows per SIMD-group of the decode kernels, per bucket (the kernel's
// decode_rows_per_simd): each row costs a lane 3 * DMAX / 32 floats of
// registers (its q slice, accumulator and block product), so the rows shrink
// as DMAX grows to keep that near 48-64 floats per lane.
uint32_t decode_rows_per_simd(uint32_t bucket) { return bucket <= 64 ? 8 : (bucket <= 128 ? 4 : 2); }
// Why at most 8 SIMD-groups per threadgroup: the decode kernels declare
// [[max_total_threads_per_threadgroup(kDecodeMaxThreads)]] (256, see
// shaders/params.h for why that size fits their registers at any allocation).
constexpr uint32_t kDecodeMaxSimdgroups = kDecodeMaxThreads / 32;
// Why 8 key groups when the whole GQA group fits one SIMD-group's rows: a
// single SIMD-group would leave the threadgroup one warp wide and the keys
// one lane-block at a time; 8 SIMD-groups take interleaved key blocks
// (MLX's sdpa_vector spreads keys over 32) and merge through threadgroup
// memory, while 8 keeps that merge buffer under 9 KB at D = 256.
constexpr uint32_t kDecodeKeyGroups = 8;
static_assert(32 * kDecodeKeyGroups <= kDecodeMaxThreads, "the key groups fit the decode kernels' declared limit");

// Row groups (of decode_rows_per_simd rows) of one GQA group.
uint32_t decode_row_groups(const AttentionProblem& p, uint32_t bucket) {
  return ceil_div(p.gqa_ratio() * p.q_len, decode_rows_per_simd(bucket));
}
// Threadgroups that share one (batch, kv head[, key block]), each serving a
// part of the GQA group's rows: 1 while the group fits kDecodeMaxSimdgroups
// SIMD-groups (K/V then read once for all of its rows), else as few as fit.
// More threadgroups, not fatter ones: the threadgroup size stays within the
// kernels' declared limit, and the chunks of a kv head run side by side.
uint32_t decode_row_chunks(const AttentionProblem& p, uint32_t bucket) {
  return ceil_div(decode_row_groups(p, bucket), kDecodeMaxSimdgroups);
}

// Split count for the decode kernels: enough (batch, kv head, row chunk,
// block) threadgroups to give every core of the class kDecodeGroupsPerCore,
// within kMinKeysPerSplit and kMaxKvSplits. At least 2 when forced.
uint32_t decode_splits(const AttentionProblem& p, uint32_t chunks, GpuClass gpu, bool forced, std::string* why) {
  const int64_t groups = std::max<int64_t>(1, p.batch * p.kv_heads * chunks);
  const int64_t target = int64_t{representative_cores(gpu)} * kDecodeGroupsPerCore;
  const int64_t want = (target + groups - 1) / groups;
  const int64_t by_length = std::max<int64_t>(1, p.kv_len / kMinKeysPerSplit);
  int64_t splits = std::min<int64_t>({want, by_length, int64_t{kMaxKvSplits}});
  if (forced) splits = std::max<int64_t>(splits, 2);
  splits = std::max<int64_t>(splits, 1);
  // Whole blocks of a multiple of 32 keys; drop blocks that would be empty.
  const int64_t keys = std::max<int64_t>(1, p.kv_len);
  int64_t per = (keys + splits - 1) / splits;
  per = (per + kSplitKeyQuantum - 1) / kSplitKeyQuantum * kSplitKeyQuantum;
  if (!forced) splits = (keys + per - 1) / per;
  *why = std::to_string(groups) +
         (chunks > 1 ? " (batch, kv head, row chunk) threadgroups want " : " (batch, kv head) pairs want ") +
         std::to_string(want) + " blocks to give a " +
         std::to_string(representative_cores(gpu)) + "-core GPU " + std::to_string(kDecodeGroupsPerCore) +
         " threadgroups per core; Nk = " + std::to_string(p.kv_len) + " allows " + std::to_string(by_length) +
         " blocks of >= " + std::to_string(kMinKeysPerSplit) + " keys; at most " + std::to_string(kMaxKvSplits);
  return static_cast<uint32_t>(splits);
}

uint32_t split_keys(int64_t kv_len, uint32_t splits) {
  const int64_t keys = std::max<int64_t>(1, kv_len);
  int64_t per = (keys + splits - 1) / splits;
  return static_cast<uint32_t>((per + kSplitKeyQuantum - 1) / kSplitKeyQuantum * kSplitKeyQuantum);
}

std::string padding_note(int64_t head_dim, uint32_t bucket) {
  if (head_dim == bucket) return "";
  return "; head_dim " + std::to_string(head_dim) + " runs zero-padded in the " + std::to_string(bucket) +
         "-wide instantiation (no read or write past head_dim)";
}

// The decode kernels' launches, exactly as shaders/attention_decode.h
// documents them: one threadgroup per (kv head, batch[, key block]) serving
// all gqa_ratio * Nq query rows of the GQA group, so each K/V element is read
// once for all of them (or, past kDecodeMaxSimdgroups row groups, one per
// row chunk of it); then, when split, the merge pass.
void decode_launches(const AttentionProblem& p, const KernelChoice& c, const std::string& suffix, MetalLaunch l,
                     MetalPlan* plan) {
  const uint32_t kv_heads = static_cast<uint32_t>(p.kv_heads), batch = static_cast<uint32_t>(p.batch);
  const uint32_t rows_per_simd = decode_rows_per_simd(c.bucket);
  const uint32_t row_groups = decode_row_groups(p, c.bucket);
  const uint32_t in_flight = ceil_div(row_groups, c.row_chunks);  // row groups per threadgroup
  const uint32_t key_groups = row_groups == 1 ? kDecodeKeyGroups : 1;
  const uint32_t padded_dim = 32 * ceil_div(c.bucket, 32);  // features per row, lanes' padding included
  // One row group: the key groups' partial states, merged in threadgroup
  // memory (floats). Several: one staged block of 32 K or V rows (in T),
  // read by every row group.
  const uint32_t bytes = row_groups == 1
                             ? (key_groups * (rows_per_simd + 1 + padded_dim) * 4 + 15) / 16 * 16
                             : 32 * c.bucket * dtype_bytes(p.dtype);
  l.threadgroup = {32, key_groups, in_flight};
  l.threadgroup_memory = bytes;
  l.max_threads_per_threadgroup = kDecodeMaxThreads;
  if (c.kv_splits == 1) {
    l.kernel_name = "flash_decode_" + suffix;
    l.grid = {kv_heads * c.row_chunks, batch, 1};
    plan->launches.push_back(l);
    return;
  }
  const int64_t all_rows = p.batch * p.q_heads * p.q_len;
  plan->partial_out_elements = all_rows * c.kv_splits * p.head_dim;
  plan->partial_stats_elements = all_rows * c.kv_splits * 2;
  l.kernel_name = "flash_decode_split_" + suffix;
  l.grid = {kv_heads * c.row_chunks, batch, c.kv_splits};
  l.buffers = with_features(kSplitBuffers);
  plan->launches.push_back(l);
  // The merge: one SIMD-group per query row, the lanes over the features.
  MetalLaunch m = l;
  m.kernel_name = "flash_decode_merge_" + suffix;
  m.grid = {static_cast<uint32_t>(p.q_len), static_cast<uint32_t>(p.q_heads), batch};
  m.threadgroup = {32, 1, 1};
  m.max_threads_per_threadgroup = kDecodeMergeMaxThreads;
  m.threadgroup_memory = 0;
  m.function_constants.clear();
  m.buffers = kMergeBuffers;
  plan->launches.push_back(m);
}

// The backward's register budget, in float32 values per lane that live
// across a whole block: the accumulators (dQ: bucket / 8 fragments; dK and
// dV: twice that) plus one block of P and dP (2 fragments each per 8 keys or
// queries), 2 floats per fragment per lane. Why 72: an Apple GPU thread
// addresses at most 128 32-bit registers (Dougall Johnson's G13
// architecture notes; [I], not measured here), and the loop needs the rest
// for the fragments being read, addresses and counters; ~69 is what a thread
// gets at the occupancy that saturates the ALUs (24 simdgroups per core,
// metal-benchmarks). MLX's fused backward (PR #3241) had to shrink its blocks
// at D = 128 and lost to its unfused path there, so the blocks below shrink
// the streamed side first and keep the accumulators in registers.
constexpr uint32_t kBackwardRegisterBudget = 72;
// What a thread can address at all ([I], as above).
constexpr uint32_t kMaxRegistersPerThread = 128;

uint32_t dq_live_floats(uint32_t bucket, uint32_t block_k) { return bucket / 4 + block_k / 2; }
uint32_t dkdv_live_floats(uint32_t bucket, uint32_t block_q, uint32_t split) {
  return bucket / 2 / split + block_q / 2;
}

KernelChoice choose_backward(const AttentionProblem& p, KernelRequest requested) {
  TORCH_CHECK_VALUE(requested == KernelRequest::Auto, "flash_metal.attention_backward: impl must be 'auto' (the "
                    "backward has one kernel family, flash_backward_dq + flash_backward_dkdv); got '",
                    request_name(requested), "'");
  KernelChoice c;
  c.kind = KernelRequest::Prefill;  // the simdgroup-matrix family
  c.bucket = bucket_of(p.head_dim, kFastHeadDimBuckets);
  // dK and dV of 8 keys x the whole bucket would take bucket / 2 floats per
  // lane: 128 at D = 256, every register a thread has. There each dK/dV
  // threadgroup keeps half the features (two threadgroups per key block,
  // each recomputing P and dP): 64.
  c.dkv_feature_split = dkdv_live_floats(c.bucket, 8, 1) > kBackwardRegisterBudget ? 2 : 1;
  // Blocks: one rule for both kernels, R rows owned (8 per simdgroup: query
  // rows for dQ, keys for dK/dV) and S rows streamed per block (keys for dQ,
  // query rows for dK/dV). Largest R first: the streamed side is re-read
  // once per R owned rows, so R sets the kernel's memory traffic (the
  // forward's block_q argument); then the largest S, which sets how many
  // MMAs share one barrier pair. Both within the register budget (the
  // accumulators plus S / 8 fragments of P and of dP) and 32 KiB of tiles.
  // The result, float16/bfloat16 | float32 (R, S):
  //   D = 32: 32,32 | 32,32   64: 32,32 | 32,16   72, 80: 32,32 | 32,16
  //   D = 96: 32,32 | 32,8    128: 32,16 | 16,8   256: 16,8 | 8,8
  // (float32 rows are twice the bytes, so its tiles bind first).
  // Tiles keep their 16-byte row padding (bank conflicts) if any block pair
  // fits with it; only float32 at D = 256 (8 + 8 rows) has to drop it.
  const uint32_t padded_row = c.bucket * dtype_bytes(p.dtype) + 16;
  bool found = false;
  for (bool padded : {true, false}) {
    for (uint32_t own : {32u, 16u, 8u}) {
      for (uint32_t streamed : {32u, 16u, 8u}) {
        const bool fits = padded ? 2 * (own + streamed) * padded_row <= kMaxThreadgroupMemory
                                 : backward_threadgroup_memory(own, streamed, c.bucket, p.dtype) <= kMaxThreadgroupMemory;
        if (found || !fits || dq_live_floats(c.bucket, streamed) > kBackwardRegisterBudget ||
            dkdv_live_floats(c.bucket, streamed, c.dkv_feature_split) > kBackwardRegisterBudget) {
          continue;
        }
        found = true;
        c.block_q = own; c.block_k = streamed; c.simdgroups = own / 8;
        c.dkv_block_k = own; c.dkv_block_q = streamed; c.dkv_simdgroups = own / 8;
      }
    }
  }
  TORCH_CHECK(found, "flash_metal.attention_backward: internal error: no block size fits head_dim ", p.head_dim);
  const uint32_t dq_bytes = backward_threadgroup_memory(c.block_q, c.block_k, c.bucket, p.dtype);
  const uint32_t dkv_bytes = backward_threadgroup_memory(c.dkv_block_k, c.dkv_block_q, c.bucket, p.dtype);
  const uint32_t dq_floats = dq_live_floats(c.bucket, c.block_k);
  const uint32_t dkv_floats = dkdv_live_floats(c.bucket, c.dkv_block_q, c.dkv_feature_split);
  c.reason = "backward: FlashAttention-2 with recomputation, metal-flash-attention's atomics-free split (dQ and "
             "Delta parallel over query blocks, then dK/dV parallel over key blocks; deterministic); dQ kernel: " +
             std::to_string(c.block_q) + " queries x " + std::to_string(c.block_k) + " keys on " +
             std::to_string(c.simdgroups) + " simdgroups, " + kib(dq_bytes) + ", " + std::to_string(dq_floats) +
             " live floats per lane; dK/dV kernel: " + std::to_string(c.dkv_block_k) + " keys x " +
             std::to_string(c.dkv_block_q) + " queries on " + std::to_string(c.dkv_simdgroups) + " simdgroups, " +
             kib(dkv_bytes) + ", " + std::to_string(dkv_floats) + " live floats per lane";
  if (c.dkv_feature_split > 1) {
    c.reason += ", dK and dV split over " + std::to_string(c.dkv_feature_split) +
                " threadgroups by features (whole, they would take " +
                std::to_string(dkdv_live_floats(c.bucket, c.dkv_block_q, 1)) + " of a thread's " +
                std::to_string(kMaxRegistersPerThread) + " registers; each part recomputes P and dP)";
  }
  c.reason += " (within the " + std::to_string(kBackwardRegisterBudget) + "-float register budget)";
  c.reason += padding_note(p.head_dim, c.bucket);
  return c;
}

}  // namespace

KernelChoice choose_metal_kernel(const AttentionProblem& p, KernelRequest requested, GpuClass gpu, MetalPass pass) {
  if (pass == MetalPass::Backward) return choose_backward(p, requested);
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
                           (p.causal && p.window_right > 0);
  TORCH_CHECK_VALUE(!post_kernel || !has_options, kOp, ": impl='", request_name(c.kind),
                    "' (the post's kernel) serves plain or causal attention only; attn_mask, window_left/"
                    "window_right, softcap and varlen need impl='auto', 'prefill' or (Nq <= 8) 'decode'");
  const bool decode_family = c.kind == KernelRequest::Decode || c.kind == KernelRequest::DecodeSplit;
  TORCH_CHECK_VALUE(!decode_family || !p.varlen, kOp, ": impl='", request_name(c.kind),
                    "' does not take packed variable-length sequences; use impl='auto' or 'prefill'");
  TORCH_CHECK_VALUE(!decode_family || p.q_len <= kMaxDecodeRows, kOp, ": impl='", request_name(c.kind),
                    "' serves at most ", kMaxDecodeRows, " query rows; got ", p.q_len,
                    " (use impl='prefill' or 'auto')");

  switch (c.kind) {
    case KernelRequest::Untiled:
    case KernelRequest::Tiled:
      c.bucket = bucket_of(p.head_dim, kHeadDimBuckets);
      if (c.kind == KernelRequest::Tiled) {
        c.reason += " (K/V tiles of " + std::to_string(kPostKeysPerTile) + " keys shared by " +
                    std::to_string(kPostThreadsPerGroup) + " queries, " +
                    kib(tiled_threadgroup_memory(c.bucket, p.dtype)) + " of threadgroup memory)";
      }
      break;
    case KernelRequest::Prefill: {
      c.bucket = bucket_of(p.head_dim, kFastHeadDimBuckets);
      // Block sizes per head-dim bucket (MLX's steel table; PyTorch's prefill
      // kernel makes the same choice at 256). Each simdgroup owns 8 query
      // rows, so block_q = 8 * simdgroups. Per lane a simdgroup keeps its
      // output rows (bucket / 8 fragments of 2 floats) and the scores of one
      // key block (block_k / 8 fragments of 2 floats) in registers.
      if (c.bucket <= 96) {
        // Why 32 x 32 with 4 simdgroups: 128 threads share each K/V block
        // among 32 query rows; 4 score fragments and at most 12 output
        // fragments per lane fit the register file without spilling, and
        // the tiles take at most 25.6 KB (float32, D=96), 13.3 KB in half.
        c.block_q = 32; c.block_k = 32; c.simdgroups = 4;
      } else if (c.bucket <= 128) {
        // Why 16 keys at D=128: 16 output fragments per lane already, so the
        // score block shrinks to 2 fragments; 25.3 KB in float32, 13.1 KB in half.
        c.block_q = 32; c.block_k = 16; c.simdgroups = 4;
      } else {
        // Why 2 simdgroups and 8 keys at D=256: 32 output fragments per lane
        // leave room for a single score fragment; 16 query rows keep the
        // float32 tiles at 25.0 KB (MLX's 32/16 needs 40 KB in float32, and
        // MLX routes D=256 to its unfused path for that reason).
        c.block_q = 16; c.block_k = 8; c.simdgroups = 2;
      }
      const uint32_t bytes = prefill_threadgroup_memory(c.block_q, c.block_k, c.bucket, p.dtype);
      c.reason += "; blocks of " + std::to_string(c.block_q) + " queries x " + std::to_string(c.block_k) +
                  " keys on " + std::to_string(c.simdgroups) + " simdgroups, " + kib(bytes) +
                  " of threadgroup memory" + (bytes <= 16 * 1024 ? " (two threadgroups fit one core's 32 KiB)" : "");
      break;
    }
    case KernelRequest::Decode:
    case KernelRequest::DecodeSplit: {
      c.bucket = bucket_of(p.head_dim, kFastHeadDimBuckets);
      std::string why;
      const bool forced_split = c.kind == KernelRequest::DecodeSplit;
      const bool forced_one = explicit_request && c.kind == KernelRequest::Decode;
      c.row_chunks = decode_row_chunks(p, c.bucket);
      c.kv_splits = forced_one ? 1 : decode_splits(p, c.row_chunks, gpu, forced_split, &why);
      c.kind = c.kv_splits > 1 ? KernelRequest::DecodeSplit : KernelRequest::Decode;
      if (c.row_chunks > 1) {
        c.reason += "; but its " + std::to_string(decode_row_groups(p, c.bucket)) + " row groups of " +
                    std::to_string(decode_rows_per_simd(c.bucket)) + " rows exceed one threadgroup's " +
                    std::to_string(kDecodeMaxSimdgroups) + " SIMD-groups (the kernels' declared " +
                    std::to_string(kDecodeMaxThreads) + "-thread limit), so " + std::to_string(c.row_chunks) +
                    " threadgroups (row chunks) per (batch, kv head) each serve a part and read K/V once each";
      }
      if (!forced_one) {
        c.reason += c.kv_splits > 1 ? "; split-KV: " + std::to_string(c.kv_splits) + " key blocks, then a merge pass ("
                                    : "; one pass (";
        c.reason += why + ")";
      }
      break;
    }
    default:
      break;
  }
  c.reason += padding_note(p.head_dim, c.bucket);
  return c;
}

namespace {

// The function constants of a feature kernel (indices 0 .. 9); align_q and
// align_k are the prefill / backward edge specializations (never with
// varlen, whose sequences have their own lengths), has_grad_lse the dQ kernel's.
std::vector<bool> feature_constants(const AttentionProblem& p, bool align_q, bool align_k, bool has_grad_lse) {
  std::vector<bool> c(kFeatureFunctionConstants, false);
  c[kCausalFunctionConstant] = p.causal;
  c[kAlignQFunctionConstant] = align_q && !p.varlen;
  c[kAlignKFunctionConstant] = align_k && !p.varlen;
  c[kHasGradLseFunctionConstant] = has_grad_lse;
  c[kHasMaskFunctionConstant] = p.mask != MaskKind::None;
  c[kMaskBoolFunctionConstant] = p.mask == MaskKind::Bool;
  c[kMaskFloat32FunctionConstant] = p.mask == MaskKind::Float32;
  c[kWindowLeftFunctionConstant] = p.has_window_left();
  c[kSoftcapFunctionConstant] = p.has_softcap();
  c[kVarlenFunctionConstant] = p.varlen;
  return c;
}

// The parameter block of every launch: strides as given, sizes from the problem.
AttentionParams make_params(const AttentionProblem& p, const LaunchStrides& s, uint32_t kv_splits) {
  AttentionParams a{};
  a.q_batch_stride = s.q[0]; a.q_head_stride = s.q[1]; a.q_row_stride = s.q[2]; a.q_dim_stride = s.q[3];
  a.k_batch_stride = s.k[0]; a.k_head_stride = s.k[1]; a.k_row_stride = s.k[2]; a.k_dim_stride = s.k[3];
  a.v_batch_stride = s.v[0]; a.v_head_stride = s.v[1]; a.v_row_stride = s.v[2]; a.v_dim_stride = s.v[3];
  a.o_batch_stride = s.o[0]; a.o_head_stride = s.o[1]; a.o_row_stride = s.o[2]; a.o_dim_stride = s.o[3];
  a.lse_batch_stride = s.lse[0]; a.lse_head_stride = s.lse[1]; a.lse_row_stride = s.lse[2];
  a.batch = static_cast<int32_t>(p.batch);
  a.q_heads = static_cast<int32_t>(p.q_heads);
  a.kv_heads = static_cast<int32_t>(p.kv_heads);
  a.gqa_ratio = static_cast<int32_t>(p.gqa_ratio());
  a.q_len = static_cast<int32_t>(p.q_len);
  a.kv_len = static_cast<int32_t>(p.kv_len);
  a.head_dim = static_cast<int32_t>(p.head_dim);
  a.causal_offset = static_cast<int32_t>(p.causal_offset());
  a.scale = static_cast<float>(p.scale);
  a.scale_log2 = p.scale_log2();
  a.kv_splits = static_cast<int32_t>(kv_splits);
  a.split_keys = kv_splits > 1 ? static_cast<int32_t>(split_keys(p.kv_len, kv_splits))
                                 : static_cast<int32_t>(p.kv_len);

  a.do_batch_stride = s.grad_out[0]; a.do_head_stride = s.grad_out[1];
  a.do_row_stride = s.grad_out[2]; a.do_dim_stride = s.grad_out[3];
  a.glse_batch_stride = s.grad_lse[0]; a.glse_head_stride = s.grad_lse[1]; a.glse_row_stride = s.grad_lse[2];

  a.mask_batch_stride = s.mask[0]; a.mask_head_stride = s.mask[1];
  a.mask_row_stride = s.mask[2]; a.mask_col_stride = s.mask[3];
  a.window_left = static_cast<int32_t>(p.window_left >= 0 ? p.window_left : 0);
  a.window_right = static_cast<int32_t>(p.window_right >= 0 ? p.window_right : 0);
  a.softcap_log2 = p.has_softcap() ? static_cast<float>(p.softcap * 1.4426950408889634) : 0.0f;
  a.inv_softcap_log2 = p.has_softcap() ? static_cast<float>(1.0 / (p.softcap * 1.4426950408889634)) : 0.0f;
  a.total_q = static_cast<int32_t>(p.total_q);
  a.total_k = static_cast<int32_t>(p.total_k);
  if (p.varlen) {
    // The packed tensors are (1, H, total, D) views: a sequence is found by
    // its first row (cu_seqlens), never by a batch stride.
    a.q_batch_stride = a.k_batch_stride = a.v_batch_stride = a.o_batch_stride = 0;
    a.lse_batch_stride = a.do_batch_stride = a.glse_batch_stride = 0;
  }
  return a;
}

uint64_t threads_of(const MetalLaunch& launch) {
  return uint64_t{launch.threadgroup[0]} * launch.threadgroup[1] * launch.threadgroup[2];
}

// Every launch within Metal's threadgroup-memory limit and within its
// kernel's declared [[max_total_threads_per_threadgroup]].
void check_launch_limits(const MetalPlan& plan) {
  for (const MetalLaunch& launch : plan.launches) {
    TORCH_CHECK(launch.threadgroup_memory <= kMaxThreadgroupMemory && launch.threadgroup_memory % 16 == 0, kOp,
                ": internal error: ", launch.kernel_name, " planned with ", launch.threadgroup_memory,
                " bytes of threadgroup memory");
    TORCH_CHECK(launch.max_threads_per_threadgroup > 0 && threads_of(launch) <= launch.max_threads_per_threadgroup,
                kOp, ": internal error: ", launch.kernel_name, " planned with ", threads_of(launch),
                " threads per threadgroup; the kernel declares at most ", launch.max_threads_per_threadgroup);
  }
}

}  // namespace

MetalPlan plan_metal_attention(const AttentionProblem& p, const LaunchStrides& s, KernelRequest requested,
                               GpuClass gpu) {
  const KernelChoice c = choose_metal_kernel(p, requested, gpu);
  MetalPlan plan;
  plan.reason = c.reason;
  const std::string suffix = std::string(dtype_name(p.dtype)) + "_d" + std::to_string(c.bucket);

  const AttentionParams a = make_params(p, s, c.kv_splits);

  MetalLaunch l;
  l.params = a;
  l.params_index = kAttentionParamsIndex;
  l.threadgroup_memory_index = kAttentionThreadgroupIndex;
  l.buffers = kForwardBuffers;
  l.function_constants = {p.causal};  // index kCausalFunctionConstant
  const uint32_t heads = static_cast<uint32_t>(p.q_heads), batch = static_cast<uint32_t>(p.batch);

  switch (c.kind) {
    case KernelRequest::Untiled:
    case KernelRequest::Tiled:
      // Both post kernels give each thread one query row, so one threadgroup
      // covers kPostThreadsPerGroup rows of one (batch, head).
      l.grid = {ceil_div(p.q_len, kPostThreadsPerGroup), heads, batch};
      l.threadgroup = {kPostThreadsPerGroup, 1, 1};
      l.max_threads_per_threadgroup = kPostMaxThreads;
      if (c.kind == KernelRequest::Tiled) {
        l.kernel_name = "flash_attention_tiled_" + suffix + "_bk" + std::to_string(kPostKeysPerTile) + "_t" +
                        std::to_string(kPostThreadsPerGroup);
        l.threadgroup_memory = tiled_threadgroup_memory(c.bucket, p.dtype);
      } else {
        l.kernel_name = "flash_attention_untiled_" + suffix + "_t" + std::to_string(kPostThreadsPerGroup);
      }
      plan.launches.push_back(l);
      break;
    case KernelRequest::Prefill:
      l.kernel_name = "flash_attention_prefill_" + suffix + "_bq" + std::to_string(c.block_q) + "_bk" +
                      std::to_string(c.block_k) + "_wm" + std::to_string(c.simdgroups);
      l.grid = {ceil_div(p.q_len, c.block_q), heads, batch};
      l.threadgroup = {32 * c.simdgroups, 1, 1};
      l.max_threads_per_threadgroup = kPrefillMaxThreads;
      l.threadgroup_memory = prefill_threadgroup_memory(c.block_q, c.block_k, c.bucket, p.dtype);
      l.function_constants = feature_constants(p, p.q_len % c.block_q == 0, p.kv_len % c.block_k == 0, false);
      l.buffers = with_features(kForwardBuffers);
      plan.launches.push_back(l);
      break;
    default:
      l.function_constants = feature_constants(p, false, false, false);
      l.buffers = with_features(kForwardBuffers);
      decode_launches(p, c, suffix, l, &plan);
      break;
  }
  check_launch_limits(plan);
  return plan;
}

MetalPlan plan_metal_attention_backward(const AttentionProblem& p, const LaunchStrides& s, bool has_grad_lse,
                                        KernelRequest requested, GpuClass gpu) {
  const KernelChoice c = choose_metal_kernel(p, requested, gpu, MetalPass::Backward);
  MetalPlan plan;
  plan.reason = c.reason;
  plan.delta_elements = p.varlen ? p.q_heads * p.total_q : p.batch * p.q_heads * p.q_len;
  const std::string suffix = std::string(dtype_name(p.dtype)) + "_d" + std::to_string(c.bucket);
  const uint32_t batch = static_cast<uint32_t>(p.batch);

  MetalLaunch dq;
  dq.params = make_params(p, s, 1);
  dq.params_index = kAttentionParamsIndex;
  dq.threadgroup_memory_index = kAttentionThreadgroupIndex;
  dq.kernel_name = "flash_backward_dq_" + suffix + "_bq" + std::to_string(c.block_q) + "_bk" +
                   std::to_string(c.block_k) + "_wm" + std::to_string(c.simdgroups);
  dq.grid = {ceil_div(p.q_len, c.block_q), static_cast<uint32_t>(p.q_heads), batch};
  dq.threadgroup = {32 * c.simdgroups, 1, 1};
  dq.max_threads_per_threadgroup = kBackwardMaxThreads;
  dq.threadgroup_memory = backward_threadgroup_memory(c.block_q, c.block_k, c.bucket, p.dtype);
  // Indices kCausalFunctionConstant, kAlignQ..., kAlignK..., kHasGradLse...
  dq.function_constants = feature_constants(p, p.q_len % c.block_q == 0, p.kv_len % c.block_k == 0, has_grad_lse);
  dq.buffers = with_features(kBackwardDqBuffers);
  plan.launches.push_back(dq);

  MetalLaunch dkv = dq;
  dkv.kernel_name = "flash_backward_dkdv_" + suffix + "_bq" + std::to_string(c.dkv_block_q) + "_bk" +
                    std::to_string(c.dkv_block_k) + "_wm" + std::to_string(c.dkv_simdgroups) + "_ds" +
                    std::to_string(c.dkv_feature_split);
  dkv.grid = {ceil_div(p.kv_len, c.dkv_block_k) * c.dkv_feature_split, static_cast<uint32_t>(p.kv_heads), batch};
  dkv.threadgroup = {32 * c.dkv_simdgroups, 1, 1};
  dkv.threadgroup_memory = backward_threadgroup_memory(c.dkv_block_k, c.dkv_block_q, c.bucket, p.dtype);
  dkv.function_constants = feature_constants(p, p.q_len % c.dkv_block_q == 0, p.kv_len % c.dkv_block_k == 0, false);
  dkv.buffers = with_features(kBackwardDkdvBuffers);
  plan.launches.push_back(dkv);
  check_launch_limits(plan);
  return plan;
}

std::vector<MetalLaunch> all_metal_launches() {
  std::vector<MetalLaunch> launches;
  // One entry per (kernel, function constants), planned at the largest
  // threadgroup any of the shapes below gives it: the pipeline check
  // (csrc/mps/pipelines.mm) then compares the pipeline's limit with the most
  // threads the planner launches it with.
  auto add = [&](const MetalLaunch& l) {
    for (MetalLaunch& seen : launches) {
      if (seen.kernel_name == l.kernel_name && seen.function_constants == l.function_constants) {
        if (threads_of(l) > threads_of(seen)) seen = l;
        return;
      }
    }
    launches.push_back(l);
  };
  // Problem sizes reaching every branch: q/k lengths that are multiples of
  // every block (64) and lengths that are not (65), one decode row with a
  // short and a long context (one row group: 8 key groups, 256 threads), and
  // a 16-head GQA group of 8 decode rows (16 or more row groups: row chunks
  // of 8 SIMD-groups staging K/V, 256 threads).
  struct Shape { int64_t q_len, kv_len; KernelRequest request; int64_t q_heads = 1; };
  const Shape shapes[] = {
      {64, 64, KernelRequest::Untiled}, {64, 64, KernelRequest::Tiled},
      {64, 64, KernelRequest::Prefill}, {65, 64, KernelRequest::Prefill},
      {64, 65, KernelRequest::Prefill}, {65, 65, KernelRequest::Prefill},
      {1, 64, KernelRequest::Decode},   {1, 4096, KernelRequest::DecodeSplit},
      {8, 64, KernelRequest::Decode, 16}, {8, 4096, KernelRequest::DecodeSplit, 16},
  };
  for (c10::ScalarType dtype : {c10::ScalarType::Float, c10::ScalarType::Half, c10::ScalarType::BFloat16}) {
    for (uint32_t d : kFastHeadDimBuckets) {
      for (const Shape& shape : shapes) {
        for (bool causal : {false, true}) {
          AttentionProblem p;
          p.batch = p.kv_heads = 1;
          p.q_heads = shape.q_heads;
          p.q_len = shape.q_len;
          p.kv_len = shape.kv_len;
          p.head_dim = d;
          p.causal = causal;
          p.scale = 1.0;
          p.dtype = dtype;
          const int64_t D = d, H = p.q_heads, N = p.q_len, M = p.kv_len;
          const LaunchStrides packed{{H * N * D, N * D, D, 1}, {M * D, M * D, D, 1}, {M * D, M * D, D, 1},
                                     {H * N * D, N * D, D, 1}, {H * N, N, 1}};
          for (const MetalLaunch& l : plan_metal_attention(p, packed, shape.request).launches) add(l);
        }
      }
      // The backward: both kernels, every alignment of either side (its
      // blocks are at most 32, so 64 is aligned and 65 is not), causal or
      // not, with and without grad_lse.
      for (const int64_t q_len : {64, 65}) {
        for (const int64_t kv_len : {64, 65}) {
          for (bool causal : {false, true}) {
            for (bool grad_lse : {false, true}) {
              AttentionProblem p;
              p.batch = p.q_heads = p.kv_heads = 1;
              p.q_len = q_len;
              p.kv_len = kv_len;
              p.head_dim = d;
              p.causal = causal;
              p.scale = 1.0;
              p.dtype = dtype;
              const int64_t D = d;
              const LaunchStrides packed{{D, D, D, 1}, {D, D, D, 1}, {D, D, D, 1}, {D, D, D, 1}, {1, 1, 1},
                                         {D, D, D, 1}, {1, 1, 1}};
              for (const MetalLaunch& l : plan_metal_attention_backward(p, packed, grad_lse).launches) add(l);
            }
          }
        }
      }
      // The options, one at a time, causal or not, on every feature family
      // (their combinations are the same constants switched together, so
      // these cover every code path each constant guards; the pipelines a
      // combination needs are built on first use like any other).
      enum Option { BoolMask, InputMask, Float32Mask, WindowLeft, Softcap, Varlen };
      for (Option option : {BoolMask, InputMask, Float32Mask, WindowLeft, Softcap, Varlen}) {
        for (bool causal : {false, true}) {
          AttentionProblem p;
          p.batch = p.q_heads = p.kv_heads = 1;
          p.head_dim = d;
          p.window_right = causal ? 0 : -1;
          p.causal = causal;
          p.scale = 1.0;
          p.dtype = dtype;
          p.mask = option == BoolMask ? MaskKind::Bool
                   : option == InputMask ? MaskKind::Input
                   : option == Float32Mask ? MaskKind::Float32 : MaskKind::None;
          if (option == WindowLeft) p.window_left = 16;
          if (option == Softcap) p.softcap = 30.0;
          p.varlen = option == Varlen;
          const int64_t D = d;
          const LaunchStrides packed{{D, D, D, 1}, {D, D, D, 1}, {D, D, D, 1}, {D, D, D, 1}, {1, 1, 1},
                                     {D, D, D, 1}, {1, 1, 1}, {0, 0, 64, 1}};
          const std::array<std::pair<int64_t, KernelRequest>, 3> forward = {
              {{65, KernelRequest::Prefill}, {1, KernelRequest::Decode}, {1, KernelRequest::DecodeSplit}}};
          for (const auto& [q_len, request] : forward) {
            if (p.varlen && request != KernelRequest::Prefill) continue;
            p.q_len = p.total_q = q_len;
            p.kv_len = p.total_k = request == KernelRequest::DecodeSplit ? 4096 : 65;
            for (const MetalLaunch& l : plan_metal_attention(p, packed, request).launches) add(l);
          }
          p.q_len = p.kv_len = p.total_q = p.total_k = 65;
          for (bool grad_lse : {false, true}) {
            for (const MetalLaunch& l : plan_metal_attention_backward(p, packed, grad_lse).launches) add(l);
          }
        }
      }
    }
  }
  for (const MetalLaunch& l : launches) {
    const auto starts = [&](const char* prefix) { return l.kernel_name.rfind(prefix, 0) == 0; };
    const bool decode = starts("flash_decode_") && !starts("flash_decode_merge_");
    TORCH_CHECK(!decode || threads_of(l) == kDecodeMaxThreads, kOp, ": internal error: all_metal_launches plans ",
                l.kernel_name, " with ", threads_of(l), " threads, not the planner's largest, ", kDecodeMaxThreads);
  }
  return launches;
}

std::vector<std::string> all_metal_kernel_names() {
  std::vector<std::string> names;
  for (const MetalLaunch& l : all_metal_launches()) {
    if (std::find(names.begin(), names.end(), l.kernel_name) == names.end()) names.push_back(l.kernel_name);
  }
  return names;
}

}  // namespace flash_metal
