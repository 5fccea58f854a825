// Launch shapes of the Metal path: from a KernelChoice (csrc/metal/families/table.cpp)
// to the dispatches attention_forward / attention_backward encode: kernel
// names, grids, threadgroups, threadgroup memory, function constants, the
// binding table and the AttentionParams block. The MPS host and the
// emulated backend both run exactly these launches.
#include "metal/launch_detail.h"

namespace flash_metal {

using namespace plan_detail;

namespace plan_detail {

// The options' inputs, bound by every feature kernel (prefill, decode,
// split decode, both backward kernels) after its own tensors.
const std::vector<BufferBinding> kFeatureBuffers = {
    {LaunchTensor::Mask, kSlotMask}, {LaunchTensor::CuSeqlensQ, kSlotCuSeqlensQ},
    {LaunchTensor::CuSeqlensK, kSlotCuSeqlensK}};

std::vector<BufferBinding> with_features(std::vector<BufferBinding> b) {
  b.insert(b.end(), kFeatureBuffers.begin(), kFeatureBuffers.end());
  return b;
}

// The forward feature kernels (prefill, decode, split pass 1) also bind the
// sinks (fc_has_sinks; q in the slot without them).
std::vector<BufferBinding> with_forward_features(std::vector<BufferBinding> b) {
  b = with_features(std::move(b));
  b.push_back({LaunchTensor::Sinks, kSlotSinks});
  return b;
}

// The decode kernels (one pass, split pass 1) and the prefill also bind the
// paged cache's block_table and cache_seqlens (fc_paged; q in the slots
// without them), and carry fc_paged as a 13th function constant.
std::vector<BufferBinding> with_paged(std::vector<BufferBinding> b) {
  b.push_back({LaunchTensor::BlockTable, kSlotBlockTable});
  b.push_back({LaunchTensor::CacheSeqlens, kSlotCacheSeqlens});
  return b;
}

// flash_sinks_grad (shaders/backward/attention_sinks.h): reads lse, Delta, the
// varlen offsets and the sinks; writes grad_sinks.
const std::vector<BufferBinding> kSinksGradBuffers = {
    {LaunchTensor::Lse, kSlotLse}, {LaunchTensor::Delta, kSlotDelta}, {LaunchTensor::CuSeqlensQ, kSlotCuSeqlensQ},
    {LaunchTensor::CuSeqlensK, kSlotCuSeqlensK}, {LaunchTensor::Sinks, kSlotSinks},
    {LaunchTensor::GradSinks, kSlotGradSinks}};

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

// A quantized cache's decode (flash_decode_quant*) also binds the scales and
// biases (a slot without one: the side's scale, or q; never read).
std::vector<BufferBinding> with_quant_scales(const AttentionProblem& p, std::vector<BufferBinding> b) {
  if (!p.kv_quantized()) return b;
  b.push_back({LaunchTensor::KScale, kSlotKScale});
  b.push_back({LaunchTensor::KBias, kSlotKBias});
  b.push_back({LaunchTensor::VScale, kSlotVScale});
  b.push_back({LaunchTensor::VBias, kSlotVBias});
  return b;
}

// The quantized decode's function constants (attention_decode_quant.h),
// its KvQuantParams, and k's / v's strides in bytes for a quantized side
// (its codes are read as bytes; a side in q's dtype keeps element strides).
void quantize_decode_launch(const AttentionProblem& p, const LaunchStrides& s, MetalLaunch* l) {
  l->function_constants.resize(kDecodeQuantFunctionConstantCount, false);
  const int formats[2] = {p.k_format, p.v_format};
  const c10::ScalarType scale_dtypes[2] = {p.k_scale_dtype, p.v_scale_dtype};
  for (int side = 0; side < 2; ++side) {
    if (formats[side] == 0) continue;
    l->function_constants[kKvFormatFunctionConstant + 3 * side + (formats[side] - 1)] = true;
    if (formats[side] == 2 && scale_dtypes[side] != c10::ScalarType::Float) {
      l->function_constants[kKvScaleDtypeFunctionConstant + 2 * side +
                            (scale_dtypes[side] == c10::ScalarType::Half ? 0 : 1)] = true;
    }
  }
  AttentionParams& a = l->params;
  if (p.k_format != 0) {
    a.k_batch_stride *= p.k_code_bytes; a.k_head_stride *= p.k_code_bytes;
    a.k_row_stride *= p.k_code_bytes; a.k_dim_stride *= p.k_code_bytes;
  }
  if (p.v_format != 0) {
    a.v_batch_stride *= p.v_code_bytes; a.v_head_stride *= p.v_code_bytes;
    a.v_row_stride *= p.v_code_bytes; a.v_dim_stride *= p.v_code_bytes;
  }
  KvQuantParams& q = l->quant_params;
  q.k_scale_batch_stride = s.k_scale[0]; q.k_scale_row_stride = s.k_scale[1]; q.k_scale_head_stride = s.k_scale[2];
  q.v_scale_batch_stride = s.v_scale[0]; q.v_scale_row_stride = s.v_scale[1]; q.v_scale_head_stride = s.v_scale[2];
  const auto shift = [](int64_t g) {
    int32_t n = 0;
    while (g > 1) { g >>= 1; ++n; }
    return n;
  };
  q.k_group_shift = p.k_format == 2 ? shift(p.k_group) : 0;
  q.v_group_shift = p.v_format == 2 ? shift(p.v_group) : 0;
  l->quant_params_index = kKvQuantParamsIndex;
}

// The decode kernels' launches, exactly as shaders/decode/attention_decode.h
// documents them: one threadgroup per (kv head, batch[, key block]) serving
// all gqa_ratio * Nq query rows of the GQA group, so each K/V element is read
// once for all of them (or, past kDecodeMaxSimdgroups row groups, one per
// row chunk of it); then, when split, the merge pass.
void decode_launches(const AttentionProblem& p, const KernelChoice& c, const std::string& suffix, const GpuSpec& gpu,
                     MetalLaunch l, MetalPlan* plan) {
  const uint32_t kv_heads = static_cast<uint32_t>(p.kv_heads), batch = static_cast<uint32_t>(p.batch);
  const uint32_t in_flight = decode_row_groups_per_threadgroup(p, c.bucket, c.row_chunks);
  const uint32_t key_groups = decode_key_groups(in_flight);
  // Several key groups: their partial states merged in threadgroup memory;
  // one: 16 bytes, unused (decode_threadgroup_memory).
  const uint32_t bytes = decode_threadgroup_memory(p, c.bucket, c.row_chunks);
  l.threadgroup = {32, key_groups, in_flight};
  l.threadgroup_memory = bytes;
  l.max_threads_per_threadgroup = kDecodeMaxThreads;
  // A quantized cache: the same launches of flash_decode_quant* (the merge is the native one).
  const std::string prefix = p.kv_quantized() ? "flash_decode_quant_" : "flash_decode_";
  if (c.kv_splits == 1) {
    l.kernel_name = prefix + suffix;
    l.grid = {kv_heads * c.row_chunks, batch, 1};
    l.estimate = estimate_launch(l, decode_live_registers(c.bucket, p.mask != MaskKind::None, p.paged), gpu);
    plan->launches.push_back(l);
    return;
  }
  const int64_t all_rows = p.batch * p.q_heads * p.q_len;
  plan->partial_out_elements = all_rows * c.kv_splits * p.head_dim_v;  // v's width (the accumulator's)
  plan->partial_stats_elements = all_rows * c.kv_splits * 2;
  l.kernel_name = prefix + "split_" + suffix;
  l.grid = {kv_heads * c.row_chunks, batch, c.kv_splits};
  l.buffers = with_quant_scales(p, with_paged(with_forward_features(kSplitBuffers)));
  l.estimate = estimate_launch(l, decode_live_registers(c.bucket, p.mask != MaskKind::None, p.paged), gpu);
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
  m.quant_params_index = 0;
  m.estimate = estimate_launch(m, kMergeLiveRegisters, gpu);
  plan->launches.push_back(m);
}

// The split-D forward split along keys (csrc/metal/families/prefill_splitd.cpp chooses
// c.kv_splits): the merge pass after its launch `l`.
void splitd_merge_launch(const AttentionProblem& p, const KernelChoice& c, const GpuSpec& gpu, const MetalLaunch& l,
                         MetalPlan* plan) {
  if (c.kv_splits <= 1) return;
  // The partials, flash_decode_split's layout: [B][Hq][Nq][splits][D_v]
  // floats and (m, l) pairs; varlen: batch 0, Nq = total_q rows.
  const int64_t rows = p.q_heads * (p.varlen ? p.total_q : p.batch * p.q_len);
  plan->partial_out_elements = rows * c.kv_splits * p.head_dim_v;
  plan->partial_stats_elements = rows * c.kv_splits * 2;
  // The merge: the decode's own (attention_decode_split.h) at D_v = 512, one
  // SIMD-group per output row; varlen rows are the packed rows of batch 0.
  MetalLaunch m = l;
  m.kernel_name = std::string("flash_decode_merge_") + dtype_name(p.dtype) + "_d" + std::to_string(p.head_dim_v);
  if (p.varlen) {
    m.params.q_len = static_cast<int32_t>(p.total_q);
    m.params.batch = 1;
  }
  m.grid = {static_cast<uint32_t>(p.varlen ? p.total_q : p.q_len), static_cast<uint32_t>(p.q_heads),
            static_cast<uint32_t>(p.varlen ? 1 : p.batch)};
  m.threadgroup = {32, 1, 1};
  m.max_threads_per_threadgroup = kDecodeMergeMaxThreads;
  m.threadgroup_memory = 0;
  m.function_constants.clear();
  m.buffers = kMergeBuffers;
  m.estimate = estimate_launch(m, kMergeLiveRegisters, gpu);
  plan->launches.push_back(m);
}


// The function constants of a feature kernel (indices 0 .. 11, fc_dense
// false: with_dense sets it); align_q and align_k are the prefill / backward
// edge specializations (never with varlen, whose sequences have their own
// lengths), has_grad_lse the dQ kernel's, sinks the forward kernels'.
std::vector<bool> feature_constants(const AttentionProblem& p, bool align_q, bool align_k, bool has_grad_lse,
                                    bool sinks) {
  std::vector<bool> c(kFunctionConstantCount, false);
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
  c[kSinksFunctionConstant] = sinks;
  return c;
}

// Why fc_dense is off whenever D_v != D_qk (issue 20 section 2): the bucket
// is the wider dim's, so the narrower operand has padding columns the dense
// loader would not zero (it copies whole DMAX-wide rows); and one constant
// governs every tensor a kernel loads, so keeping it on for the wider
// operand alone would need a second function constant, i.e. more pipeline
// variants for a rare shape. The general loader reads each tensor at its own
// width. The sentence explain() prints for it:
std::string different_dims_note(const AttentionProblem& p) {
  return "v's head dim D_v = " + std::to_string(p.head_dim_v) + " differs from q's and k's D_qk = " +
         std::to_string(p.head_dim) + ", so one of them has padding columns in the bucket (one fc_dense for all "
         "tensors)";
}

// Rows of a tile's span the dense loader's 32-bit offsets must cover. Why
// 128: a tile has at most 64 rows (the largest BQ / BK of any prefill or
// backward instantiation: the backward's 64 owned rows), and the loader's
// offsets step up to THREADS / CPR <= 64 rows past it (256 threads, at
// least 4 chunks per row) before the loop ends; 128 bounds both.
constexpr int64_t kDenseOffsetRows = 128;
// Bytes per dense load: the shader's kDenseLoadBytes (a uint4, the widest
// per-thread load in Metal).
constexpr int64_t kDenseLoadBytes = 16;

// fc_dense: may the tile loader (shaders/prefill/attention_prefill.h,
// prefill_load_tile_dense) copy every tile as 16-byte chunks? True when each
// tensor it reads (q, k, v, and grad_out in the backward) has
//   - feature stride 1: a row's D features are contiguous;
//   - D == D_v == the bucket: the chunks copy whole DMAX-wide rows, so there
//     are no padding columns to zero (the general loader zeroes them);
//   - 16-byte aligned rows: storage offset and the batch, head and row
//     strides multiples of 16 bytes, so every row the kernel addresses
//     (any batch, head, row, varlen sequence start) is (the MTLBuffer itself
//     is page aligned; the emulator keeps the caller's alignment);
//   - row stride * kDenseOffsetRows bytes below 2^31, for the loader's
//     32-bit offsets.
// A batch or head stride of a dimension of size 1 never multiplies a
// nonzero index and is not checked. Otherwise false, and *why names the
// first tensor and condition that failed.
bool dense_loader(const AttentionProblem& p, const LaunchStrides& s, uint32_t bucket, bool backward,
                  std::string* why) {
  const int64_t elem = dtype_bytes(p.dtype);
  const auto aligned = [&](int64_t elements) { return (elements * elem) % kDenseLoadBytes == 0; };
  struct Tensor { const char* name; const std::array<int64_t, 4>& strides; int64_t offset; int64_t heads; };
  const Tensor tensors[] = {{"q", s.q, s.offsets[0], p.q_heads},
                            {"k", s.k, s.offsets[1], p.kv_heads},
                            {"v", s.v, s.offsets[2], p.kv_heads},
                            {"grad_out", s.grad_out, s.offsets[3], p.q_heads}};
  if (p.head_dim_v != p.head_dim) {
    *why = different_dims_note(p);
    return false;
  }
  if (p.head_dim != bucket) {
    *why = "head_dim " + std::to_string(p.head_dim) + " is below its bucket " + std::to_string(bucket);
    return false;
  }
  for (const Tensor& t : tensors) {
    if (!backward && std::string(t.name) == "grad_out") continue;
    const std::string n = t.name;
    if (t.strides[3] != 1) {
      *why = n + "'s feature stride is " + std::to_string(t.strides[3]) + ", not 1";
      return false;
    }
    if (t.offset < 0 || !aligned(t.offset)) {
      *why = t.offset < 0 ? n + "'s storage offset is unknown"
                          : n + "'s storage offset is not a multiple of 16 bytes";
      return false;
    }
    const bool batch_used = p.batch > 1 && !p.varlen, head_used = t.heads > 1;
    if ((batch_used && !aligned(t.strides[0])) || (head_used && !aligned(t.strides[1])) || !aligned(t.strides[2])) {
      *why = n + "'s batch, head or row stride is not a multiple of 16 bytes";
      return false;
    }
    if (t.strides[2] < 0 || t.strides[2] * elem * kDenseOffsetRows >= (int64_t(1) << 31)) {
      *why = n + "'s row stride is too large for 32-bit tile offsets";
      return false;
    }
  }
  *why = "";
  return true;
}

// A feature kernel's function constants with fc_dense (index
// kDenseFunctionConstant) appended.
std::vector<bool> with_dense(std::vector<bool> c, bool dense) {
  c.resize(kFunctionConstantCount, false);
  c[kDenseFunctionConstant] = dense;
  return c;
}

// fc_dense for the decode kernels (shaders/decode/attention_decode.h,
// decode_feature): may each lane read its contiguous run of a K or V row as
// vector loads? True when k and v (the tensors read per key; q is read once)
// have feature stride 1, D == D_v == the bucket (no padding features) and 16-byte
// aligned rows (storage offset, batch, head and row strides), as
// dense_loader requires of them; the decode kernels address rows with
// 64-bit offsets, so the row stride has no 32-bit bound. Otherwise false,
// and *why names the first tensor and condition that failed.
bool decode_dense_loads(const AttentionProblem& p, const LaunchStrides& s, uint32_t bucket, std::string* why) {
  const int64_t elem = dtype_bytes(p.dtype);
  const auto aligned = [&](int64_t elements) { return (elements * elem) % kDenseLoadBytes == 0; };
  if (p.head_dim_v != p.head_dim) {
    *why = different_dims_note(p);
    return false;
  }
  if (p.head_dim != bucket) {
    *why = "head_dim " + std::to_string(p.head_dim) + " is below its bucket " + std::to_string(bucket);
    return false;
  }
  struct Tensor { const char* name; const std::array<int64_t, 4>& strides; int64_t offset; };
  for (const Tensor& t : {Tensor{"k", s.k, s.offsets[1]}, Tensor{"v", s.v, s.offsets[2]}}) {
    const std::string n = t.name;
    if (t.strides[3] != 1) {
      *why = n + "'s feature stride is " + std::to_string(t.strides[3]) + ", not 1";
      return false;
    }
    if (t.offset < 0 || !aligned(t.offset)) {
      *why = t.offset < 0 ? n + "'s storage offset is unknown" : n + "'s storage offset is not a multiple of 16 bytes";
      return false;
    }
    // (Paged: the batch stride is the page stride, used whatever the batch.)
    if (((p.batch > 1 || p.paged) && !aligned(t.strides[0])) || (p.kv_heads > 1 && !aligned(t.strides[1])) ||
        !aligned(t.strides[2])) {
      *why = n + "'s batch, head or row stride is not a multiple of 16 bytes";
      return false;
    }
  }
  *why = "";
  return true;
}

// The paged prefill's page walk on top of prefill_live_registers (per lane,
// an estimate as kPagedLiveValues is the decode's): through the block loop
// the block's first key and the step between blocks (two PageSteps, 2
// each), the one-page-tiles flag and the block's page: 6. Where tiles may
// cross pages, the row-by-row loader's state while P is live (the V tile):
// its cursor (2), current row, entry, and 64-bit page base (2): 6 more. Not
// counted in the planner's block choice (the kernels are the contiguous
// prefill's instantiations); explain() prints the estimate with them.
uint32_t prefill_paged_live_values(const AttentionProblem& p, uint32_t block_k) {
  if (!p.paged) return 0;
  return p.kv_len <= p.page_size || p.page_size % block_k == 0 ? 6 : 12;
}

// fc_dense for the paged prefill, past dense_loader's conditions: every
// tile inside one page (the dense loader steps rows by one stride) and the
// page stride (k/v's batch stride, used whatever the batch) 16-byte aligned.
bool paged_prefill_dense(const AttentionProblem& p, const LaunchStrides& s, uint32_t block_k, std::string* why) {
  if (p.kv_len > p.page_size && p.page_size % block_k != 0) {
    *why = "paged, tiles may cross pages (" + std::to_string(p.page_size) + "-key pages, " +
           std::to_string(block_k) + "-key blocks)";
    return false;
  }
  if ((s.k[0] * dtype_bytes(p.dtype)) % kDenseLoadBytes != 0 || (s.v[0] * dtype_bytes(p.dtype)) % kDenseLoadBytes != 0) {
    *why = "k's or v's page stride is not a multiple of 16 bytes";
    return false;
  }
  return true;
}

// The reason's sentence about the loader, for explain().
std::string loader_reason(bool dense, const std::string& why) {
  return dense ? " Tile loader: dense, one 16-byte load per 16 bytes of a row (fc_dense)."
               : " Tile loader: one load per element (fc_dense off: " + why + ").";
}

// The parameter block of every launch: strides as given, sizes from the problem.
AttentionParams make_params(const AttentionProblem& p, const LaunchStrides& s, uint32_t kv_splits,
                            int64_t split_quantum) {
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
  a.head_dim_v = static_cast<int32_t>(p.head_dim_v);  // == head_dim unless MLA-style (issue 20 section 2)
  a.reserved = 0;
  a.causal_offset = static_cast<int32_t>(p.causal_offset());
  a.scale = static_cast<float>(p.scale);
  a.scale_log2 = p.scale_log2();
  a.kv_splits = static_cast<int32_t>(kv_splits);
  a.split_keys = kv_splits > 1 ? static_cast<int32_t>(split_keys(p.kv_len, kv_splits, split_quantum))
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
  if (p.paged) {  // the decode kernels' page walk (fc_paged); k/v strides are the cache's (KvCacheCall)
    a.page_size = static_cast<int32_t>(p.page_size);
    a.table_stride = static_cast<int32_t>(p.table_stride);
  }
  if (p.varlen) {
    // The packed tensors are (1, H, total, D) views: a sequence is found by
    // its first row (cu_seqlens), never by a batch stride. A paged cache's
    // k/v keep theirs: it is the page stride (packed queries, fc_paged).
    a.q_batch_stride = a.o_batch_stride = 0;
    if (!p.paged) a.k_batch_stride = a.v_batch_stride = 0;
    a.lse_batch_stride = a.do_batch_stride = a.glse_batch_stride = 0;
  }
  return a;
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

}  // namespace plan_detail

MetalPlan plan_metal_attention(const AttentionProblem& p, const LaunchStrides& s, KernelRequest requested,
                               const GpuSpec& gpu) {
  const KernelChoice c = choose_metal_kernel(p, requested, gpu);
  MetalPlan plan;
  plan.reason = c.reason;
  const std::string suffix = std::string(dtype_name(p.dtype)) + "_d" + std::to_string(c.bucket);

  // The decode's blocks in whole quanta of its key groups x 32 (decode_splits).
  const bool decode_family = c.kind == KernelRequest::Decode || c.kind == KernelRequest::DecodeSplit;
  const AttentionParams a =
      make_params(p, s, c.kv_splits, decode_family ? decode_split_quantum(p, c.bucket, c.row_chunks) : kSplitKeyQuantum);

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
      l.estimate = estimate_launch(l, post_live_registers(c.bucket), gpu);
      plan.launches.push_back(l);
      break;
    case KernelRequest::Prefill:
      if (c.bucket > kFastHeadDimBuckets.back()) {  // the split-D forward (csrc/metal/families/prefill_splitd.cpp: its 3 pairs)
        l.function_constants = feature_constants(p, false, false, false, p.sinks);
        l.buffers = with_forward_features(kForwardBuffers);
        // the partials (fc_split_kv), bound always: the kernel declares them
        l.buffers.push_back({LaunchTensor::PartialOut, kSlotPartialOut});
        l.buffers.push_back({LaunchTensor::PartialStats, kSlotPartialStats});
        splitd_launch(p, c, gpu, &l);
        plan.launches.push_back(l);
        splitd_merge_launch(p, c, gpu, l, &plan);
        break;
      }
      l.kernel_name = "flash_attention_prefill_" + suffix + "_bq" + std::to_string(c.block_q) + "_bk" +
                      std::to_string(c.block_k) + "_wm" + std::to_string(c.simdgroups);
      {
        // Pack GQA: the rows of a threadgroup are packed rows of its kv
        // head's group, Nq * G of them per (batch, kv head) (routing checked
        // they fit int32).
        const int64_t rows = c.pack_gqa ? p.q_len * p.gqa_ratio() : p.q_len;
        l.grid = {ceil_div(rows, c.block_q), c.pack_gqa ? static_cast<uint32_t>(p.kv_heads) : heads, batch};
      }
      l.threadgroup = {32 * c.simdgroups, 1, 1};
      l.max_threads_per_threadgroup = kPrefillMaxThreads;
      l.threadgroup_memory = prefill_threadgroup_memory(c.block_q, c.block_k, c.bucket, p.dtype, c.simdgroups * 8 / c.block_q);
      {
        std::string why;
        bool dense = dense_loader(p, s, c.bucket, false, &why);
        if (dense && p.paged) dense = paged_prefill_dense(p, s, c.block_k, &why);
        // Paged: each sequence has its own key count (cache_seqlens), so no key block is known aligned.
        // Packed: no ragged query block when the packed rows, Nq * G, fill whole blocks.
        const int64_t rows = c.pack_gqa ? p.q_len * p.gqa_ratio() : p.q_len;
        l.function_constants = with_dense(
            feature_constants(p, rows % c.block_q == 0, !p.paged && p.kv_len % c.block_k == 0, false, p.sinks),
            dense);
        l.function_constants.resize(kPrefillFunctionConstantCount, false);
        l.function_constants[kPagedFunctionConstant] = p.paged;  // K/V through block_table (attention_kvcache)
        l.function_constants[kPackGqaFunctionConstant] = c.pack_gqa;
        plan.reason += loader_reason(dense, why);
      }
      l.buffers = with_paged(with_forward_features(kForwardBuffers));
      l.estimate = estimate_launch(l, prefill_live_registers(c.bucket, c.block_k, c.simdgroups * 8 / c.block_q) +
                                          prefill_paged_live_values(p, c.block_k), gpu);
      plan.launches.push_back(l);
      break;
    case KernelRequest::TensorOps: {
      // One threadgroup per (query block, head, batch), as the prefill's.
      // D = 256: the split-D kernel (pairs of SIMD-groups, each half of D;
      // shaders/tensor_ops/attention_prefill_mpp_dsplit.h), its name ending in the halves.
      // Its 64-row variant (block_q 64: Q in registers, 8 SIMD-groups) declares 256 threads.
      const bool dsplit = c.bucket == kTensorOpsDsplitHeadDim;
      const bool wide = dsplit && c.block_q == kTensorOpsDsplitWideBlockQ;
      l.kernel_name = std::string("flash_attention_prefill_mpp_") + (dsplit ? "dsplit_" : "") +
                      tensor_ops_suffix(p, suffix) + "_bq" +
                      std::to_string(c.block_q) + "_bk" + std::to_string(c.block_k) +
                      (dsplit ? "_wn" + std::to_string(kTensorOpsDsplitHalves) : "");
      l.grid = {ceil_div(p.q_len, c.block_q), heads, batch};
      l.threadgroup = {32 * c.simdgroups, 1, 1};
      l.max_threads_per_threadgroup = wide ? kTensorOpsDsplitWideMaxThreads : kTensorOpsMaxThreads;
      l.threadgroup_memory = wide     ? tensor_ops_dsplit_wide_threadgroup_bytes(dtype_bytes(p.dtype))
                             : dsplit ? tensor_ops_dsplit_threadgroup_bytes(dtype_bytes(p.dtype), c.bucket)
                                      : tensor_ops_threadgroup_memory(p.dtype, c.bucket);
      // Its library declares fc_causal and the options' constants only (no
      // align / dense / grad_lse: tensor extents handle the ragged edges);
      // the values at the other indices are false and Metal ignores values
      // for constants a function does not declare.
      l.function_constants = feature_constants(p, false, false, false, p.sinks);
      l.buffers = with_forward_features(kForwardBuffers);
      // The kernel's tensors index a head's q, k, v in int32 (matmul2d
      // extents and strides, shaders/tensor_ops/attention_prefill_mpp.h).
      const auto head_span = [](const std::array<int64_t, 4>& st, int64_t rows, int64_t cols) {
        return (rows - 1) * st[2] + (cols - 1) * st[3];
      };
      TORCH_CHECK_VALUE(head_span(s.q, p.q_len, p.head_dim) < (int64_t{1} << 31) &&
                            head_span(s.k, p.kv_len, p.head_dim) < (int64_t{1} << 31) &&
                            head_span(s.v, p.kv_len, p.head_dim_v) < (int64_t{1} << 31),
                        kOp, ": impl='tensor_ops' indexes one head of q, k, v in int32: a head spans more than "
                        "2^31 elements here (use impl='prefill' or 'auto')");
      // Live values per lane (a model, like the others): O's 16 x D_v floats
      // and S's 16 x block_k over the 32 lanes (O's 16 x D / 2 at D = 256,
      // split; the 64-row variant adds Q's slice: tensor_ops_dsplit_live_registers),
      // plus the row state and the usual overhead.
      l.estimate = estimate_launch(l, dsplit ? tensor_ops_dsplit_live_registers(c.block_q, c.block_k)
                                             : 16 * (static_cast<uint32_t>(p.head_dim_v) + c.block_k) / 32 + 8 +
                                                   kLiveOverhead,
                                   gpu);
      plan.launches.push_back(l);
      break;
    }
    default: {
      std::string why;
      bool dense = decode_dense_loads(p, s, c.bucket, &why);
      if (p.kv_quantized()) {
        // Codes are read a byte (or a nibble) per feature, so fc_dense only
        // places each lane's features: its contiguous run, D == D_v == the
        // bucket, both sides quantized (a side in q's dtype reads its run
        // as vector loads, which this planner does not check the alignment of).
        dense = p.head_dim == p.head_dim_v && p.head_dim == c.bucket && p.k_format != 0 && p.v_format != 0;
        why = dense ? "" : "a side in q's dtype, or head dims below their bucket";
      }
      l.function_constants = with_dense(feature_constants(p, false, false, false, p.sinks), dense);
      l.function_constants.resize(kDecodeFunctionConstantCount, false);
      l.function_constants[kPagedFunctionConstant] = p.paged;  // K/V through block_table (attention_kvcache)
      if (p.kv_quantized()) {
        plan.reason += dense ? " K/V codes: each lane dequantizes its contiguous run of a row (fc_dense)."
                             : " K/V codes: the strided features per lane (fc_dense off: " + why + ").";
      } else {
        plan.reason += dense ? " K/V loads: each lane reads its contiguous run of a row as vector loads (fc_dense)."
                             : " K/V loads: one strided scalar load per feature (fc_dense off: " + why + ").";
      }
      l.buffers = with_quant_scales(p, with_paged(with_forward_features(kForwardBuffers)));
      if (p.kv_quantized()) quantize_decode_launch(p, s, &l);
      decode_launches(p, c, suffix, gpu, l, &plan);
      break;
    }
  }
  for (MetalLaunch& launch : plan.launches) launch.family = c.family;
  check_launch_limits(plan);
  return plan;
}

}  // namespace flash_metal
