// Helpers shared by the Metal planner's files: the routing (csrc/metal/routing.cpp
// and the kernel families of csrc/metal/families/: which kernel and which
// blocks, choose_metal_kernel), csrc/metal/launch.cpp (grids,
// threadgroups, bindings and params: plan_metal_attention and its backward)
// and csrc/metal/registry.cpp (every launch the planner can produce). Internal:
// nothing outside those files includes it.
#pragma once

#include "metal/plan.h"
#include "../../shaders/decode/attention_decode_rows.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <string>

namespace flash_metal::plan_detail {

inline constexpr const char* kOp = "flash_metal.attention_forward";

inline const char* dtype_name(c10::ScalarType t) {
  switch (t) {
    case c10::ScalarType::Float: return "float32";
    case c10::ScalarType::Half: return "float16";
    case c10::ScalarType::BFloat16: return "bfloat16";
    default: TORCH_CHECK_TYPE(false, kOp, ": no Metal kernel for dtype ", t);
  }
}

template <size_t N>
inline uint32_t bucket_of(int64_t head_dim, const std::array<uint32_t, N>& buckets) {
  for (uint32_t b : buckets) {
    if (head_dim <= b) return b;
  }
  TORCH_CHECK_VALUE(false, kOp, ": head_dim ", head_dim, " exceeds the largest bucket ", buckets.back());
}

inline uint32_t ceil_div(int64_t a, int64_t b) { return static_cast<uint32_t>((a + b - 1) / b); }

// Bytes of one element of the inputs (every kernel's tiles are stored in it).
inline uint32_t dtype_bytes(c10::ScalarType t) { return t == c10::ScalarType::Float ? 4 : 2; }

// Threadgroup memory of the tiled kernel (shaders/post/attention_tiled.h): one K
// tile and one V tile of kPostKeysPerTile rows, each row padded to the
// head-dim bucket so the kernel's inner loops run to a compile-time bound
// (registers, not stack), stored in the input dtype (half the memory for
// float16/bfloat16; converted to float on read). 2 * 16 * bucket * bytes:
// a multiple of 16 (bucket >= 32), as Metal requires, and at most
// 2 * 16 * 256 * 4 = 32 KiB (float32, bucket 256), Metal's limit.
inline uint32_t tiled_threadgroup_memory(uint32_t bucket, c10::ScalarType dtype) {
  return 2 * kPostKeysPerTile * bucket * dtype_bytes(dtype);
}

// Threadgroup memory of the prefill kernel (shaders/prefill/attention_prefill.h),
// the layout its header documents: a Q tile of block_q rows and one K/V tile
// of block_k rows, used by K and then V in turn (MLX's steel layout), every
// row holding the bucket's columns plus 16 bytes of padding against bank
// conflicts (MLX PR #1899), all in the input dtype.
// With feature parts (parts > 1), each of the block_q / 8 * parts
// SIMD-groups also writes its partial S (block_k / 8 fragments of 8 x 8
// floats, 256 bytes each) after the tiles: the split-K sum (issue 19).
inline uint32_t prefill_threadgroup_memory(uint32_t block_q, uint32_t block_k, uint32_t bucket, c10::ScalarType dtype,
                                           uint32_t parts) {
  const uint32_t row = (bucket + 16 / dtype_bytes(dtype)) * dtype_bytes(dtype);
  const uint32_t partials = parts > 1 ? block_q / 8 * parts * (block_k / 8) * 256 : 0;
  return (block_q + block_k) * row + partials;
}

// The tensor-op prefill (impl='tensor_ops', shaders/tensor_ops/attention_prefill_mpp.h):
// 64 query rows in 4 SIMD-groups of 16 (one 16-row matmul2d tile each) and
// 32 keys per block, MLX NAX's BQ / BK (steel_attention_nax; its host uses
// bk = 32 though bk = 64 is instantiated), and the threads it declares.
inline constexpr uint32_t kTensorOpsBlockQ = 64;
inline constexpr uint32_t kTensorOpsBlockK = 32;
inline constexpr uint32_t kTensorOpsMaxThreads = 128;  // kPrefillMppMaxThreads in the shader
// Metal's threadgroup-memory limit on every Apple GPU of the supported
// macOS versions (MTLDevice.maxThreadgroupMemoryLength is 32 KiB on Apple7+).
inline constexpr uint32_t kMaxThreadgroupMemory = 32 * 1024;

// Its threadgroup memory: each SIMD-group's P (16 x block_k) and Q rows
// (16 x head_dim, read from device memory once), both in the input dtype,
// and one float per row (alpha, then 1 / l); a multiple of 16.
inline constexpr uint32_t tensor_ops_threadgroup_bytes(uint32_t elem_bytes, uint32_t head_dim) {
  return kTensorOpsBlockQ / 16 * 16 * ((kTensorOpsBlockK + head_dim) * elem_bytes + 4);
}
// The widest instantiation (16-bit, D = 128) fits: 20,736 bytes.
static_assert(tensor_ops_threadgroup_bytes(2, 128) <= kMaxThreadgroupMemory, "tensor-op prefill over 32 KiB");

// The MLA pair the tensor-op kernels serve beside equal head dims (issue 20
// section 2: DeepSeek-V2/V3's and Kimi's prefill and training), q/k 192 and
// v 128. Why these and no other: the pair real models use; (128, 64) and
// (96, 64) would be two more instantiations each per dtype in every build.
inline constexpr uint32_t kTensorOpsMlaHeadDim = 192;
inline constexpr uint32_t kTensorOpsMlaHeadDimV = 128;
inline bool is_tensor_ops_mla(const AttentionProblem& p) {
  return p.head_dim == kTensorOpsMlaHeadDim && p.head_dim_v == kTensorOpsMlaHeadDimV;
}
// The forward stages Q only (192 wide), so its memory is D = 192's: 28,928
// bytes at 16-bit, 4 SIMD-groups, as the equal-dims kernels.
static_assert(tensor_ops_threadgroup_bytes(2, kTensorOpsMlaHeadDim) == 28928 &&
                  tensor_ops_threadgroup_bytes(2, kTensorOpsMlaHeadDim) <= kMaxThreadgroupMemory,
              "tensor-op MLA prefill over 32 KiB");
// The MSL 4 library's names: _d<D> for equal head dims, _dqk<D>_dv<DV> for
// the MLA pair (shaders/attention_mpp.metal).
inline std::string tensor_ops_suffix(const AttentionProblem& p, const std::string& dtype_suffix_d) {
  if (p.head_dim_v == p.head_dim) return dtype_suffix_d;
  return std::string(dtype_name(p.dtype)) + "_dqk" + std::to_string(p.head_dim) + "_dv" +
         std::to_string(p.head_dim_v);
}
inline uint32_t tensor_ops_threadgroup_memory(c10::ScalarType dtype, uint32_t head_dim) {
  return tensor_ops_threadgroup_bytes(dtype_bytes(dtype), head_dim);
}

// The tensor-op prefill at D = 256 split along D (shaders/
// attention_prefill_mpp_dsplit.h, MLX's attention_nax_dsplit idea): 32
// query rows in 2 row groups of 16, each served by a pair of SIMD-groups
// owning 128 features apiece (4 SIMD-groups), 32 keys per block.
inline constexpr uint32_t kTensorOpsDsplitHeadDim = 256;
inline constexpr uint32_t kTensorOpsDsplitBlockQ = 32;
inline constexpr uint32_t kTensorOpsDsplitHalves = 2;  // WN: SIMD-groups per row group
// Its threadgroup memory: per SIMD-group P (16 x block_k) and its Q slice
// (16 x head_dim / 2) in the input dtype and a float per row; per row group
// one float slot of partial S (16 x block_k) per half.
inline constexpr uint32_t tensor_ops_dsplit_threadgroup_bytes(uint32_t elem_bytes, uint32_t head_dim) {
  return kTensorOpsDsplitBlockQ / 16 * kTensorOpsDsplitHalves *
         (16 * (kTensorOpsBlockK + head_dim / kTensorOpsDsplitHalves) * elem_bytes + 16 * 4 +
          16 * kTensorOpsBlockK * 4);
}
// 28,928 bytes at 16-bit, D = 256: Q staged in threadgroup memory fits only
// with one slot of partials per half (two barriers per block; the shader's
// header explains the choice).
static_assert(tensor_ops_dsplit_threadgroup_bytes(2, kTensorOpsDsplitHeadDim) == 28928 &&
                  tensor_ops_dsplit_threadgroup_bytes(2, kTensorOpsDsplitHeadDim) <= kMaxThreadgroupMemory,
              "tensor-op split-D prefill over 32 KiB");

// The 64-row variant (flash_attention_prefill_mpp_dsplit_wide, the same
// header; issue 21's "memory-bound at 32 rows"): 64 query rows in 4 row
// groups, 8 SIMD-groups (256 threads, the threads it declares), 16 keys per
// block. Q cannot be staged: 64 x 256 x 2 = 32,768 bytes, the whole budget;
// it lives in registers (a left-input cooperative tensor per SIMD-group),
// which is what sets BK: per lane O's 16 x 128 floats (64) + Q's 16 x 128
// 16-bit values (32) + S's 16 x BK floats (BK / 2) + 8 row values + the
// overhead (16) is 136 at BK 32, over the 128 registers a thread addresses,
// and 128 at BK 16 (tensor_ops_dsplit_live_registers). Threadgroup memory:
// per SIMD-group P (16 x 16, T) and a float per row, and TWO slots of
// partial S (double-buffered: one barrier per block), 20,992 bytes.
inline constexpr uint32_t kTensorOpsDsplitWideBlockQ = 64;
inline constexpr uint32_t kTensorOpsDsplitWideBlockK = 16;
inline constexpr uint32_t kTensorOpsDsplitWideMaxThreads = 256;  // kPrefillMppDsplitWideMaxThreads in the shader
inline constexpr uint32_t kTensorOpsDsplitWideSlots = 2;
inline constexpr uint32_t tensor_ops_dsplit_wide_threadgroup_bytes(uint32_t elem_bytes) {
  constexpr uint32_t sgs = kTensorOpsDsplitWideBlockQ / 16 * kTensorOpsDsplitHalves;
  return sgs * 16 * kTensorOpsDsplitWideBlockK * elem_bytes + sgs * 16 * 4 +
         kTensorOpsDsplitWideSlots * sgs * 16 * kTensorOpsDsplitWideBlockK * 4;
}
static_assert(tensor_ops_dsplit_wide_threadgroup_bytes(2) == 20992 &&
                  tensor_ops_dsplit_wide_threadgroup_bytes(2) <= kMaxThreadgroupMemory &&
                  // staged Q would not fit: its slices alone are the budget
                  kTensorOpsDsplitWideBlockQ * kTensorOpsDsplitHeadDim * 2 >= kMaxThreadgroupMemory,
              "tensor-op split-D 64-row prefill: 32 KiB");

// The tensor-op backward (shaders/tensor_ops/attention_backward_mpp.h): SIMD-groups of
// 16 rows (query rows for dQ, keys for dK/dV); 32 keys per dQ block and 32
// query rows per dK/dV block (one thread per streamed query fills its
// stats). Threadgroup memory, 16-bit T:
//   dQ:    per SIMD-group Q and dO (16 x D each), dS (16 x 32), 4 floats per row
//   dK/dV: shared by the SIMD-groups, the streamed Q and dO block (32 x D
//          each) and 4 floats per query; per SIMD-group P^T and dS^T (16 x
//          32 each) (K and V from device memory)
inline constexpr uint32_t kTensorOpsBackwardBlock = 32;
// With the MLA pair dO (hence its tiles) is head_dim_v wide, Q head_dim.
inline constexpr uint32_t tensor_ops_backward_slice(bool dkdv, uint32_t elem_bytes, uint32_t head_dim,
                                                    uint32_t head_dim_v) {
  return dkdv ? 2 * 16 * kTensorOpsBackwardBlock * elem_bytes
              : 16 * (head_dim + head_dim_v) * elem_bytes + 16 * kTensorOpsBackwardBlock * elem_bytes + 16 * 16;
}
inline constexpr uint32_t tensor_ops_backward_slice(bool dkdv, uint32_t elem_bytes, uint32_t head_dim) {
  return tensor_ops_backward_slice(dkdv, elem_bytes, head_dim, head_dim);
}
inline constexpr uint32_t tensor_ops_backward_shared(bool dkdv, uint32_t elem_bytes, uint32_t head_dim,
                                                     uint32_t head_dim_v) {
  return dkdv ? kTensorOpsBackwardBlock * (head_dim + head_dim_v) * elem_bytes + kTensorOpsBackwardBlock * 16 : 0;
}
inline constexpr uint32_t tensor_ops_backward_shared(bool dkdv, uint32_t elem_bytes, uint32_t head_dim) {
  return tensor_ops_backward_shared(dkdv, elem_bytes, head_dim, head_dim);
}
inline constexpr uint32_t tensor_ops_backward_bytes(bool dkdv, uint32_t elem_bytes, uint32_t head_dim,
                                                    uint32_t head_dim_v, uint32_t simdgroups) {
  return tensor_ops_backward_shared(dkdv, elem_bytes, head_dim, head_dim_v) +
         simdgroups * tensor_ops_backward_slice(dkdv, elem_bytes, head_dim, head_dim_v);
}
inline constexpr uint32_t tensor_ops_backward_bytes(bool dkdv, uint32_t elem_bytes, uint32_t head_dim,
                                                    uint32_t simdgroups) {
  return tensor_ops_backward_bytes(dkdv, elem_bytes, head_dim, head_dim, simdgroups);
}
// SIMD-groups per threadgroup: 4 (MLX NAX's WM) where they fit 32 KiB, else
// 2 (the instantiations of shaders/attention_mpp.metal: dQ 4, 4, 2 at D 64,
// 96, 128; dK/dV 4 at every D: 16,896 / 20,992 / 25,088 bytes).
inline constexpr uint32_t tensor_ops_backward_simdgroups(bool dkdv, uint32_t elem_bytes, uint32_t head_dim,
                                                         uint32_t head_dim_v) {
  return tensor_ops_backward_bytes(dkdv, elem_bytes, head_dim, head_dim_v, 4) <= kMaxThreadgroupMemory ? 4 : 2;
}
inline constexpr uint32_t tensor_ops_backward_simdgroups(bool dkdv, uint32_t elem_bytes, uint32_t head_dim) {
  return tensor_ops_backward_simdgroups(dkdv, elem_bytes, head_dim, head_dim);
}
// The MLA pair (192, 128), 16-bit: dQ 4 SIMD-groups would need 46,080 bytes
// (each stages Q 16 x 192 and dO 16 x 128), so 2 (23,040); dK/dV 4 (29,184:
// the shared Q 32 x 192 and dO 32 x 128 block, then P^T and dS^T per
// SIMD-group). The instantiations in shaders/attention_mpp.metal match.
static_assert(tensor_ops_backward_simdgroups(false, 2, kTensorOpsMlaHeadDim, kTensorOpsMlaHeadDimV) == 2 &&
                  tensor_ops_backward_bytes(false, 2, kTensorOpsMlaHeadDim, kTensorOpsMlaHeadDimV, 2) == 23040 &&
                  tensor_ops_backward_simdgroups(true, 2, kTensorOpsMlaHeadDim, kTensorOpsMlaHeadDimV) == 4 &&
                  tensor_ops_backward_bytes(true, 2, kTensorOpsMlaHeadDim, kTensorOpsMlaHeadDimV, 4) == 29184,
              "tensor-op MLA backward: the instantiations in shaders/attention_mpp.metal, under 32 KiB");
static_assert(tensor_ops_backward_bytes(true, 2, 128, 2) <= kMaxThreadgroupMemory &&
                  tensor_ops_backward_bytes(false, 2, 128, 2) <= kMaxThreadgroupMemory,
              "tensor-op backward: two SIMD-groups fit 32 KiB at D = 128");
static_assert(tensor_ops_backward_simdgroups(false, 2, 96) == 4 && tensor_ops_backward_simdgroups(false, 2, 128) == 2 &&
                  tensor_ops_backward_simdgroups(true, 2, 64) == 4 && tensor_ops_backward_simdgroups(true, 2, 128) == 4,
              "the instantiations in shaders/attention_mpp.metal");

// The tensor-op backward at D = 256 split along D (shaders/
// attention_backward_mpp_dsplit.h): pairs of SIMD-groups, each half owning
// 128 features. dQ: one pair on 16 query rows, 32 keys per block; dK/dV:
// two pairs on 16 keys each, 16 queries per streamed block (a 32-row Q / dO
// block at D = 256 is 32 KiB alone). Threadgroup memory, 16-bit T:
//   dQ:    per half Q_h and dO_h (16 x 128 each), dS (16 x 32); float
//          partial S and dP (16 x 32 each), 4 stats and a partial Delta per row
//   dK/dV: the shared Q and dO block (16 x 256 each) and 4 floats per query;
//          per SIMD-group float partial S^T and dP^T (16 x 16 each) and P^T,
//          dS^T (16 x 16 each)
inline constexpr uint32_t kTensorOpsDsplitBackwardBlock = 16;  // dQ rows; dK/dV streamed queries
inline constexpr uint32_t kTensorOpsDsplitBackwardPairs = 2;   // dK/dV pairs (dQ: one)
inline constexpr uint32_t tensor_ops_dsplit_backward_bytes(bool dkdv, uint32_t elem_bytes, uint32_t head_dim) {
  constexpr uint32_t r = 16, bq = kTensorOpsDsplitBackwardBlock, bk = kTensorOpsBackwardBlock;
  const uint32_t dh = head_dim / kTensorOpsDsplitHalves;
  return dkdv ? 2 * bq * head_dim * elem_bytes + bq * 16 +
                    kTensorOpsDsplitBackwardPairs * kTensorOpsDsplitHalves * (2 * r * bq * 4 + 2 * r * bq * elem_bytes)
              : kTensorOpsDsplitHalves * (r * (2 * dh + bk) * elem_bytes + (2 * r * bk + r * 4 + r) * 4);
}
// 27,264 (dQ) and 28,928 (dK/dV) bytes at 16-bit, D = 256: under Metal's 32 KiB.
static_assert(tensor_ops_dsplit_backward_bytes(false, 2, kTensorOpsDsplitHeadDim) == 27264 &&
                  tensor_ops_dsplit_backward_bytes(true, 2, kTensorOpsDsplitHeadDim) == 28928 &&
                  tensor_ops_dsplit_backward_bytes(false, 2, kTensorOpsDsplitHeadDim) <= kMaxThreadgroupMemory &&
                  tensor_ops_dsplit_backward_bytes(true, 2, kTensorOpsDsplitHeadDim) <= kMaxThreadgroupMemory,
              "tensor-op split-D backward over 32 KiB");

// The backward's split-K scratch (the shader's backward_partials_bytes):
// with parts, 2 x streamed / 8 fragments of 8 x 8 floats per SIMD-group,
// if they fit 32 KiB beside the unpadded tiles; else 0 (the parts then
// recompute S and dP: float32 at bucket 256).
inline uint32_t backward_partials_bytes(uint32_t own, uint32_t streamed, uint32_t bucket, c10::ScalarType dtype,
                                        uint32_t parts) {
  const uint32_t partials = own / 8 * parts * 2 * (streamed / 8) * 256;
  const uint32_t tiles = 2 * (own + streamed) * bucket * dtype_bytes(dtype);
  return parts > 1 && tiles + partials <= kMaxThreadgroupMemory ? partials : 0;
}

// Threadgroup memory of either backward kernel (shaders/backward/attention_backward.h):
// two tiles of the rows a simdgroup owns (Q and dO, or K and V) and two of
// the streamed rows (K and V, or Q and dO), each row the bucket's columns in
// the input dtype plus 16 bytes of padding, or no padding when the padded
// tiles would exceed 32 KiB (the shader's backward_row_pad, same rule).
// With feature parts (parts > 1) each of the own / 8 * parts SIMD-groups
// also writes its partial S and dP (2 x streamed / 8 fragments of 8 x 8
// floats, 256 bytes each) after the tiles: the split-K sum (issue 19,
// the shader's backward_partials_bytes).
inline uint32_t backward_threadgroup_memory(uint32_t own, uint32_t streamed, uint32_t bucket, c10::ScalarType dtype,
                                            uint32_t parts) {
  const uint32_t rows = 2 * (own + streamed);
  const uint32_t padded = bucket * dtype_bytes(dtype) + 16;
  const uint32_t partials = backward_partials_bytes(own, streamed, bucket, dtype, parts);
  return rows * (rows * padded + partials <= kMaxThreadgroupMemory ? padded : padded - 16) + partials;
}

inline std::string kib(uint32_t bytes) { return std::to_string(bytes) + " bytes"; }

// Threads per threadgroup of a launch.
inline uint64_t threads_of(const MetalLaunch& launch) {
  return uint64_t{launch.threadgroup[0]} * launch.threadgroup[1] * launch.threadgroup[2];
}

// Why blocks start at multiples of 32 keys: a block then starts on a whole
// SIMD-group of keys in every decode kernel layout.
inline constexpr int64_t kSplitKeyQuantum = 32;

// Keys per split-KV block: Nk over `splits`, rounded up to whole quanta of
// `quantum` keys (a multiple of kSplitKeyQuantum). The decode kernels pass
// key groups x 32 (decode_split_quantum): every key group of every full
// block then runs the same number of 32-key blocks (issue 43).
inline uint32_t split_keys(int64_t kv_len, uint32_t splits, int64_t quantum = kSplitKeyQuantum) {
  const int64_t keys = std::max<int64_t>(1, kv_len);
  int64_t per = (keys + splits - 1) / splits;
  return static_cast<uint32_t>((per + quantum - 1) / quantum * quantum);
}

// Query rows per SIMD-group of the decode kernels: decode_rows_per_simd
// (shaders/decode/attention_decode_rows.h, shared with the kernels), sized by the
// register model below.
// Why at most 8 SIMD-groups per threadgroup: the decode kernels declare
// [[max_total_threads_per_threadgroup(kDecodeMaxThreads)]] (256, see
// shaders/common/params.h for why that size fits their registers at any allocation).
inline constexpr uint32_t kDecodeMaxSimdgroups = kDecodeMaxThreads / 32;
// Why 8 key groups when the whole GQA group fits one SIMD-group's rows: a
// single SIMD-group would leave the threadgroup one warp wide and the keys
// one lane-block at a time; 8 SIMD-groups take interleaved key blocks
// (MLX's sdpa_vector spreads keys over 32) and merge through threadgroup
// memory, while 8 keeps that merge buffer under 9 KB at D = 256.
inline constexpr uint32_t kDecodeKeyGroups = 8;
static_assert(32 * kDecodeKeyGroups <= kDecodeMaxThreads, "the key groups fit the decode kernels' declared limit");

// Row groups (of decode_rows_per_simd rows) of one GQA group.
inline uint32_t decode_row_groups(const AttentionProblem& p, uint32_t bucket) {
  return ceil_div(p.gqa_ratio() * p.q_len, decode_rows_per_simd(static_cast<int>(bucket)));
}

// Row groups of one decode threadgroup (attention_decode.h's RGL): those of
// one row chunk.
inline uint32_t decode_row_groups_per_threadgroup(const AttentionProblem& p, uint32_t bucket, uint32_t chunks) {
  return ceil_div(decode_row_groups(p, bucket), chunks);
}

// Key groups of one decode threadgroup (attention_decode.h's KG): as many as
// fill kDecodeMaxSimdgroups beside its RGL row groups (8 for a single row
// group, 4 for 2, 2 for 3 or 4, else 1). Each key group's row groups share
// its keys; the key groups split them, so more of them keep more distinct
// K/V lines in flight per threadgroup (issue 19).
inline uint32_t decode_key_groups(uint32_t rgl) { return std::max<uint32_t>(1, kDecodeKeyGroups / rgl); }

// SIMD-groups of one decode threadgroup (attention_decode.h's KG * RGL).
inline uint32_t decode_simdgroups_per_threadgroup(const AttentionProblem& p, uint32_t bucket, uint32_t chunks) {
  const uint32_t rgl = decode_row_groups_per_threadgroup(p, bucket, chunks);
  return decode_key_groups(rgl) * rgl;
}

// The split-KV decode's block quantum: key groups x 32 keys, so the key
// groups of a block (which take its 32-key blocks in turn) split it evenly.
inline int64_t decode_split_quantum(const AttentionProblem& p, uint32_t bucket, uint32_t chunks) {
  return kSplitKeyQuantum * decode_key_groups(decode_row_groups_per_threadgroup(p, bucket, chunks));
}

// Threadgroup memory of a decode threadgroup (attention_decode.h's
// tg_bytes): with several key groups, their partial states merged in
// threadgroup memory (floats); with one, none used (its row groups read the
// same K/V rows from device memory, issue 19), and 16 bytes, the least
// length Metal takes for the declared [[threadgroup(0)]] argument.
inline uint32_t decode_threadgroup_memory(const AttentionProblem& p, uint32_t bucket, uint32_t chunks) {
  const uint32_t rgl = decode_row_groups_per_threadgroup(p, bucket, chunks);
  const uint32_t kg = decode_key_groups(rgl);
  const uint32_t padded_dim = 32 * ceil_div(bucket, 32);
  const uint32_t rs = static_cast<uint32_t>(decode_rows_per_simd(static_cast<int>(bucket)));
  return kg > 1 ? (kg * rgl * (rs + 1 + padded_dim) * 4 + 15) / 16 * 16 : 16;
}

// ---- Live-value models: 32-bit values per lane each kernel family keeps
// live, the planner's register estimates (LaunchEstimate). Counted from the
// shaders' data structures, not from compiled code (no Apple compiler
// here): what the first Mac run's pipeline statistics will correct.

// Values every kernel keeps besides its arrays: addresses, loop bounds and
// counters, the fragment or element being loaded. Why 16: the prefill
// loop's base pointers (q, k, v, o: 4 x 2 for 64-bit), 4 bounds and
// counters, 4 for the fragment in flight; the same order for the others.
inline constexpr uint32_t kLiveOverhead = 16;

// The backward: accumulators (dQ: bucket / 8 fragments; dK and dV: twice
// that; each over `split` feature parts, a SIMD-group each) plus one block of P and dP (2
// fragments each per 8 keys or queries), 2 floats per fragment per lane.
// The planner's register budget (kBackwardRegisterBudget, csrc/metal/families/family.h) bounds these.
inline uint32_t dq_live_floats(uint32_t bucket, uint32_t block_k, uint32_t split) {
  return bucket / 4 / split + block_k / 2;
}
inline uint32_t dkdv_live_floats(uint32_t bucket, uint32_t block_q, uint32_t split) {
  return bucket / 2 / split + block_q / 2;
}

// The post's kernels: one query row per thread, its float accumulator
// of the bucket's width and its query row (bucket values each), plus the
// online-softmax state.
inline uint32_t post_live_registers(uint32_t bucket) { return 2 * bucket + 4 + kLiveOverhead; }

// The prefill kernel: the output rows (bucket / 8 fragments of 2 floats, over `parts` SIMD-groups),
// one block of scores (block_k / 8 fragments of 2 floats), the row max and
// sum (2 per fragment row a lane holds) and the Q/K fragments of one 8-wide
// feature step (2 x 2).
inline uint32_t prefill_live_registers(uint32_t bucket, uint32_t block_k, uint32_t parts) {
  return bucket / 4 / parts + block_k / 4 + 2 + 4 + kLiveOverhead;
}

// The decode kernels (shaders/decode/attention_decode.h, decode_attend), at their
// widest point, the V loop of a block, with `rows` query rows per
// SIMD-group: per row a lane holds its slice (ceil(bucket / 32) values) of
// q, of the accumulator and of the block's partial product, and 5 scalars
// (running max, running sum, the block's weight p of its key, the rescale
// alpha, the row's query index), plus with a mask the block's mask term of
// its key (read once, before K: the block skip; 1 more; its row's offset is
// recomputed per block, issue 43); plus decode_keys_in_flight keys' slices
// of K or V (the unrolled step's loads, all issued before the first is
// used). (The scores of the K loop become the weights p; the block bounds
// are recomputed per block.)
constexpr uint32_t decode_live_registers(uint32_t bucket, uint32_t rows, bool has_mask) {
  const uint32_t slice = (bucket + 31) / 32;
  const uint32_t in_flight = static_cast<uint32_t>(decode_keys_in_flight(static_cast<int>(bucket)));
  return rows * (3 * slice + 5 + (has_mask ? 1 : 0)) + in_flight * slice + kLiveOverhead;
}
// Under fc_paged (a paged KV cache, shaders/common/attention_decode_paged.h) the
// page walk's values on top, per lane, the same for every row: the cursor
// of the key being read (table entry, row in page, page: 3; K's cursor,
// then V's, never both), the block's first key and the fixed step between
// blocks (two PageSteps, 2 each) and the page size: 8. (The table pointer
// replaces the batch offset of K and V, which fc_paged drops.) Never with a
// mask: attention_kvcache takes none.
inline constexpr uint32_t kPagedLiveValues = 8;
constexpr uint32_t decode_live_registers(uint32_t bucket, uint32_t rows, bool has_mask, bool paged) {
  return decode_live_registers(bucket, rows, has_mask) + (paged ? kPagedLiveValues : 0);
}
inline uint32_t decode_live_registers(uint32_t bucket, bool has_mask, bool paged = false) {
  return decode_live_registers(bucket, static_cast<uint32_t>(decode_rows_per_simd(static_cast<int>(bucket))),
                               has_mask, paged);
}
// The kernels' rows per SIMD-group are the register budget's: the most (a
// power of two up to 8) within kDecodeRegisterBudget even with a mask; at
// one row (D 192, 256) whatever one row takes (D 256: 78 with a mask, over
// the budget: it runs at the occupancy estimate_launch gives it).
constexpr bool decode_rows_fit_budget(uint32_t bucket) {
  const uint32_t rs = static_cast<uint32_t>(decode_rows_per_simd(static_cast<int>(bucket)));
  return (rs == 1 || decode_live_registers(bucket, rs, true) <= uint32_t{kDecodeRegisterBudget}) &&
         (rs == 8 || decode_live_registers(bucket, 2 * rs, true) > uint32_t{kDecodeRegisterBudget});
}
// The page walk's values fit beside the rows (no mask: see kPagedLiveValues)
// but at D 64 (76: 4 rows and 4 keys in flight), 128 (74) and 256 (85),
// which run at the occupancy estimate_launch gives them (2 threadgroups of 8
// SIMD-groups per core at 64 and 128: 16 SIMD-groups x 4 rows in flight,
// where 24 x 2 were before issue 43), within the addressable 128.
constexpr bool decode_paged_fits_budget(uint32_t bucket) {
  return decode_live_registers(bucket, static_cast<uint32_t>(decode_rows_per_simd(static_cast<int>(bucket))), false,
                               true) <= uint32_t{kDecodeRegisterBudget};
}
static_assert(decode_paged_fits_budget(32) && decode_paged_fits_budget(72) && decode_paged_fits_budget(80) &&
                  decode_paged_fits_budget(96) && decode_paged_fits_budget(192) &&
                  decode_live_registers(64u, 4u, false, true) == 76 &&
                  decode_live_registers(128u, 2u, false, true) == 74 && decode_live_registers(256u, 1u, false, true) == 85,
              "the paged decode's live values within kDecodeRegisterBudget but at D 64, 128 and 256");
static_assert(decode_rows_fit_budget(32) && decode_rows_fit_budget(64) && decode_rows_fit_budget(72) &&
                  decode_rows_fit_budget(80) && decode_rows_fit_budget(96) && decode_rows_fit_budget(128) &&
                  decode_rows_fit_budget(192) && decode_rows_fit_budget(256),
              "decode_rows_per_simd (shaders/decode/attention_decode_rows.h): the most rows within the budget");
static_assert(decode_live_registers(256u, 1u, true) == 78 && decode_live_registers(256u, 1u, false, true) == 85 &&
                  decode_live_registers(256u, 1u, false, true) <= 128,
              "D 256 with 4 keys in flight: over the budget, within the addressable registers");

// The decode-only buckets 512 and 576 (kDecodeHeadDimBuckets) exceed
// kDecodeRegisterBudget even at one row (slices of 16 and 18 values, 2 keys
// in flight: 102 and 112 with a mask, 109 and 119 paged): they run at lower occupancy,
// which estimate_launch counts (by registers) and the model prices
// (benchmarks/model/families/decode_wide.py); still within the 128 registers
// an Apple GPU thread addresses (kBackwardRegisterBudget's note), so by
// this model nothing spills.
inline constexpr uint32_t kThreadAddressableRegisters = 128;
static_assert(decode_rows_per_simd(512) == 1 && decode_rows_per_simd(576) == 1 &&
                  decode_live_registers(576u, 1u, true) <= kThreadAddressableRegisters &&
                  decode_live_registers(576u, 1u, false, true) <= kThreadAddressableRegisters,
              "the wide decode buckets: one row per SIMD-group, within the addressable registers");

// The tensor-op split-D forward's live values per lane (a model, as the
// others): O's 16 x 128 floats and S's 16 x block_k floats over 32 lanes, 8
// row values (max, sum, alpha, the block's reduction) and the overhead; the
// 64-row kernel adds Q's 16 x 128 16-bit values (Q in registers), so it
// takes 16 keys per block to stay within the addressable registers.
constexpr uint32_t tensor_ops_dsplit_live_registers(uint32_t block_q, uint32_t block_k) {
  const uint32_t half = kTensorOpsDsplitHeadDim / kTensorOpsDsplitHalves;
  return 16 * (half + block_k) / 32 + 8 + kLiveOverhead +
         (block_q == kTensorOpsDsplitWideBlockQ ? 16 * half * 2 / 4 / 32 : 0);
}
static_assert(tensor_ops_dsplit_live_registers(kTensorOpsDsplitWideBlockQ, kTensorOpsDsplitWideBlockK) == 128 &&
                  tensor_ops_dsplit_live_registers(kTensorOpsDsplitWideBlockQ, kTensorOpsDsplitWideBlockK) <=
                      kThreadAddressableRegisters &&
                  tensor_ops_dsplit_live_registers(kTensorOpsDsplitWideBlockQ, 32) > kThreadAddressableRegisters,
              "the 64-row split-D kernel: BK 16 is what fits the addressable registers with Q held");

// The split-KV merge: one row's partial max, sum and feature slice per lane.
inline constexpr uint32_t kMergeLiveRegisters = 8 + kLiveOverhead;

// Residency of `launch` on `gpu` with `live_registers` per lane (csrc/metal/gpus.cpp).
LaunchEstimate estimate_launch(const MetalLaunch& launch, uint32_t live_registers, const GpuSpec& gpu);

// The tensor-op prefill (csrc/metal/families/tensor_ops.cpp): whether Auto
// takes it for a prefill (else *why_not says why, on Apple 10 GPUs), and its
// blocks and reason, forced or not; refuses what it does not cover.
bool tensor_ops_route(const AttentionProblem& p, const GpuSpec& gpu, std::string* why_not);
// Why the tensor-op kernels cannot read k and v as given ("" when they can:
// unit feature strides), and the forced path's refusal naming it.
std::string tensor_ops_stride_gap(const AttentionProblem& p);
void check_tensor_ops_strides(const AttentionProblem& p, const char* op);
void choose_tensor_ops(const AttentionProblem& p, bool forced, const GpuSpec& gpu, KernelChoice* c);
// The forward's own gate and choice (csrc/metal/families/tensor_ops_dsplit.cpp):
// D = 256 on the split-D kernel, Auto only where the model says it wins;
// every other head dim as tensor_ops_route / choose_tensor_ops.
bool tensor_ops_forward_route(const AttentionProblem& p, const GpuSpec& gpu, std::string* why_not);
void choose_tensor_ops_forward(const AttentionProblem& p, bool forced, const GpuSpec& gpu, KernelChoice* c);
// The tensor-op backward (csrc/metal/families/backward_tensor_ops.cpp): whether Auto takes it (the forward's gate plus
// what the backward kernels cover; else *why_not), and its blocks and reason.
bool tensor_ops_backward_route(const AttentionProblem& p, const GpuSpec& gpu, std::string* why_not);
void choose_tensor_ops_backward(const AttentionProblem& p, bool forced, const GpuSpec& gpu, KernelChoice* c);
// The backward at every head dim (csrc/metal/families/backward_tensor_ops_dsplit.cpp):
// D = 256 on the split-D kernels (Auto only where the model says they win),
// every other as tensor_ops_backward_route / choose_tensor_ops_backward.
bool tensor_ops_backward_route_all_d(const AttentionProblem& p, const GpuSpec& gpu, std::string* why_not);
void choose_tensor_ops_backward_all_d(const AttentionProblem& p, bool forced, const GpuSpec& gpu, KernelChoice* c);

// The prefill's (csrc/metal/families/prefill.cpp): the paged prefill's
// sentence for explain(), and whether a prefill packs its GQA group's heads
// into each threadgroup (fc_pack_gqa; appends the reason's sentence).
std::string prefill_pages_note(const AttentionProblem& p, uint32_t block_k, bool pack_gqa);
bool prefill_pack_gqa(const AttentionProblem& p, uint32_t block_q, std::string* reason);

// The split-D forward at D = 512 (csrc/metal/families/prefill_splitd.cpp): its blocks
// and reason (choose_metal_kernel, when splitd_takes), and its launch's
// name, grid, threadgroup, memory and estimate (plan_metal_attention sets
// the constants and bindings, as for the prefill).
KernelChoice choose_splitd(const AttentionProblem& p, KernelRequest requested, const GpuSpec& gpu);
void splitd_launch(const AttentionProblem& p, const KernelChoice& c, const GpuSpec& gpu, MetalLaunch* l);
// Split along keys (c.kv_splits > 1, fc_split_kv): the partials' sizes and
// the merge pass (flash_decode_merge at D_v) after `l`, the split-D launch.
void splitd_merge_launch(const AttentionProblem& p, const KernelChoice& c, const GpuSpec& gpu, const MetalLaunch& l,
                         MetalPlan* plan);
// The split-D backward at D = 512 (csrc/metal/families/backward_splitd.cpp): its blocks and reason
// (whether it takes a call: splitd_backward_takes, csrc/metal/plan.h), and its two
// kernels' threadgroup bytes and live values (dkdv: the dK/dV kernel's, else
// the dQ kernel's) for csrc/metal/launch_backward.cpp.
KernelChoice choose_splitd_backward(const AttentionProblem& p, KernelRequest requested, const GpuSpec& gpu);
uint32_t splitd_backward_threadgroup_bytes(bool dkdv);
uint32_t splitd_backward_live_registers(bool dkdv);

// The wide decode's sentence for explain() (csrc/metal/families/wide_decode.cpp):
// the bucket and the model's verdict against the composite path.
std::string wide_decode_note(const AttentionProblem& p, uint32_t bucket);

}  // namespace flash_metal::plan_detail
