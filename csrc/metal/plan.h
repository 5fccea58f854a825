// Portable planning for the Metal path: which kernel, what grid, how much
// threadgroup memory, and the AttentionParams block. Shared by the MPS
// implementation (csrc/mps/attention_mps.mm) and by the metal_plan op that the
// test suite's emulated-Metal backend and flash_metal.explain() use, so the
// emulator runs exactly the launches a Mac would. No Objective-C, no Metal.
#pragma once

#include "../checks.h"
#include "../../shaders/common/params.h"

#include <array>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace flash_metal {

// What the caller asked for with the `impl` argument.
enum class KernelRequest {
  Auto,         // let choose_metal_kernel() decide
  Untiled,      // the post's first kernel: one query per thread, K/V read from device memory
  Tiled,        // the post's second kernel: K/V tiles staged in threadgroup memory
  Prefill,      // FlashAttention-2 on simdgroup matrices (shaders/prefill/attention_prefill.h)
  Decode,       // token generation, Nq <= 8: one pass over the keys (shaders/decode/attention_decode.h)
  DecodeSplit,  // token generation, Nq <= 8: split-KV partials, then a merge pass
  TensorOps,    // FlashAttention-2 on Metal 4 tensor ops, MPP matmul2d (shaders/tensor_ops/attention_prefill_mpp.h and
                // attention_backward_mpp.h, the MSL 4 library attention_mpp.metal); forced, or Auto's gate
  Composite,    // no kernel of ours: chunked ATen matmuls and softmax (csrc/composite.h)
};

// Whether a host name is one of the MSL 4 library's kernels
// (shaders/attention_mpp.metal: the tensor-op forward and backward), which
// the MPS host looks up in that library rather than the portable one.
inline bool is_tensor_ops_kernel(const std::string& name) {
  return name.rfind("flash_attention_prefill_mpp_", 0) == 0 || name.rfind("flash_backward_mpp_", 0) == 0;
}

// Which pass a plan is for: attention_forward, or attention_backward (the
// two kernels of shaders/backward/attention_backward.h).
enum class MetalPass { Forward, Backward };

// Parses the `impl` argument; throws a ValueError listing the accepted names.
KernelRequest parse_kernel_request(const std::string& kernel);

// The class of Apple GPU, a hint for how many threadgroups it takes to fill
// it (the split-KV decode's block count). Metal exposes no core count, but
// the device name does tell the class (MLX reads the same thing from the
// architecture name's last letter): "Apple M2 Ultra" (60-80 cores), "Apple
// M3 Max" (30-40), anything else, base and Pro chips (8-20 cores), is Base.
enum class GpuClass { Base, Max, Ultra };

// "base", "max" or "ultra"; throws a ValueError otherwise.
GpuClass parse_gpu_class(const std::string& name);
// From MTLDevice.name, such as "Apple M3 Max"; unknown names give Base.
GpuClass gpu_class_from_device_name(const std::string& name);

// GpuSpec::tensor_ops_missing of a spec made from a name, not by the MPS host.
inline constexpr const char* kTensorOpsUnknownOffMac =
    "planned without a Mac, which cannot tell whether this process has macOS 26.2 and the MSL 4 library (give "
    "gpu='<chip>+tensor_ops' to plan as if it had)";

// The switch that keeps Auto off the tensor-op kernels, as PyTorch's
// PYTORCH_MPS_DISABLE_PREFILL_ATTENTION does for its own: "1" turns it on.
inline constexpr const char* kDisableTensorOpsEnv = "FLASH_METAL_DISABLE_TENSOR_OPS";
// "" unless that switch is on; then the sentence saying so.
std::string tensor_ops_switched_off();

// The oldest Apple GPU family Auto runs the tensor-op kernels on. Why 10:
// M5's cores each hold a neural accelerator that matmul2d engages; on Apple 9
// (M3, M4) matmul2d runs on the shader cores, and the model has no figure that
// it beats the simdgroup kernel there (csrc/metal/families/tensor_ops.cpp).
inline constexpr uint32_t kTensorOpsMinFamily = 10;
// Why a process on an Apple `family` GPU cannot run the tensor-op kernels, ""
// when it can: the one rule behind a Mac's GpuSpec::tensor_ops_missing
// (csrc/mps/attention_mps.mm), hence Auto's gate (tensor_ops_route), and
// behind metal_device_info's "tensor_ops" (csrc/mps/device_info.mm). In order:
// the GPU family (unless forced: impl='tensor_ops' runs on any family), the
// FLASH_METAL_DISABLE_TENSOR_OPS switch (unless forced), then
// library_problem(): macOS 26.2 and the MSL 4 library (library.mm's
// tensor_ops_library_problem), asked only when the rest holds, since asking
// loads that library.
std::string tensor_ops_problem(uint32_t family, bool forced, const std::function<std::string()>& library_problem);

// The GPU a plan is sized and estimated for (csrc/metal/gpus.cpp, each
// figure with its source there). The split-KV decode sizes its blocks by
// `cores`; the per-launch estimates (LaunchEstimate) use the per-core
// register file and threadgroup memory.
struct GpuSpec {
  std::string name;                      // "M3 Pro", or the class's representative chip
  GpuClass cls = GpuClass::Base;
  uint32_t cores = 0;
  uint32_t threadgroup_memory_per_core = 0;  // bytes resident threadgroups share
  uint32_t register_file_per_core = 0;       // bytes of general-purpose registers
  // Apple GPU family (MTLGPUFamilyApple<N>): 7 M1, 8 M2, 9 M3 and M4, 10 M5,
  // whose cores each hold a neural accelerator that Metal 4 tensor ops use.
  uint32_t family = 0;
  // Why this process cannot run the Metal 4 tensor-op kernels ("" when it
  // can): the MPS host fills it (macOS 26.2, the MSL 4 library, the
  // FLASH_METAL_DISABLE_TENSOR_OPS switch); a plan made off a Mac cannot know
  // them, unless the gpu argument says "+tensor_ops" (parse_gpu).
  std::string tensor_ops_missing = kTensorOpsUnknownOffMac;
};
// The metal_plan op's `gpu` argument: a class ("base", "max", "ultra": its
// representative chip, M3 / M3 Max / M3 Ultra) or a chip ("m1", "m1-pro",
// "m1-max", "m1-ultra", ..., "m3-pro", "m4-max", "m5", "m5-max"; case and
// spaces or dashes as you like), optionally followed by "+tensor_ops": plan
// as a process that has macOS 26.2 and the MSL 4 library would (Auto may
// then pick the tensor-op kernels; see choose_metal_kernel). Throws a
// ValueError listing them otherwise.
GpuSpec parse_gpu(const std::string& name);
// From MTLDevice.name ("Apple M3 Pro"): the named chip when known, else the
// representative chip of its class (so a future "Apple M6 Max" plans as a Max).
GpuSpec gpu_from_device_name(const std::string& name);
// Every named chip, for tests and the performance model.
std::vector<GpuSpec> known_gpus();

// Element strides of the five tensors a launch touches, outermost first.
// The backward adds grad_out (like o) and grad_lse (like lse; lse's own
// strides when there is none); the forward leaves them zero.
struct LaunchStrides {
  std::array<int64_t, 4> q, k, v, o;
  std::array<int64_t, 3> lse;
  std::array<int64_t, 4> grad_out{};
  std::array<int64_t, 3> grad_lse{};
  std::array<int64_t, 4> mask{};  // attn_mask expanded to (B, Hq, Nq, Nk): 0 on broadcast dimensions
  // Storage offsets, in elements, of q, k, v and grad_out: the tensors the
  // prefill and backward tile loaders read. The dense loader (fc_dense)
  // needs their row starts 16-byte aligned; -1 means unknown, and then the
  // general loader runs.
  std::array<int64_t, 4> offsets{{-1, -1, -1, -1}};
  // A quantized cache's scale strides (kv_scale_strides, csrc/kvcache_quant.h), K then V.
  std::array<int64_t, 3> k_scale{}, v_scale{};
};

// Threads per threadgroup of both post kernels. Why 32: one Apple SIMD-group,
// the post's choice, and for the tiled kernel the number of queries that share
// one K/V tile.
constexpr uint32_t kPostThreadsPerGroup = 32;
static_assert(kPostThreadsPerGroup <= kPostMaxThreads, "the post kernels declare kPostMaxThreads (shaders/common/params.h)");
// Keys per K/V tile of the tiled kernel. Why 16: the post's named
// configuration; at D=256 two float32 tiles take 2*16*256*4 = 32 KiB, exactly
// Metal's threadgroup-memory limit.
constexpr uint32_t kPostKeysPerTile = 16;
// Head-dim buckets of the post's kernels: each instantiation keeps a float32
// accumulator of the bucket's width per thread, so a smaller bucket means
// fewer registers.
constexpr std::array<uint32_t, 4> kHeadDimBuckets = {32, 64, 128, 256};
// Head-dim buckets of the fast kernels (prefill and decode): multiples of 8
// (the simdgroup-matrix tile), one per common model width (72: SigLIP vision
// towers, 1152/16; 80: Phi-2, 2560/32; 96: Phi-3-mini, 3072/32; 192:
// DeepSeek-V2/V3 and Kimi's multi-head latent attention in prefill and
// training, D_qk = 128 + 64 rotary features (issue 20 section 3: in 256 it
// ran 256's smaller blocks, 16 query rows by 8 keys, and tiles a third
// wider than its rows; the kernels' guard already skipped the padded
// products); the rest
// Llama-family), so those models' D pays no padding; any other D <= 256 runs
// zero-padded in the next bucket (129..192 in 192, 193..256 in 256). MLX's
// steel attention's set, plus 192.
constexpr std::array<uint32_t, 8> kFastHeadDimBuckets = {32, 64, 72, 80, 96, 128, 192, 256};
// Head-dim buckets of the decode kernels: the fast ones plus two above 256
// that only decode has (issue 20): 512 (Gemma's global layers) and 576
// (absorbed MLA, D_qk = 576 with D_v = 512; dims in (512, 576]); see
// shaders/attention.metal for why two. Why decode only: decode is
// memory-bound and the fused decode reads each K/V row once per GQA group,
// predicted ahead of the composite path at every modelled decode shape
// (benchmarks/model/families/decode_wide.py), while the FA2 template at 512 is
// predicted 2-3x slower than unfused (benchmarks/model/families/d512.py): the
// template and the backward stop at 256; above, causal D = 512 forwards run
// the split-D kernel (splitd_takes) and the rest the composite path.
constexpr std::array<uint32_t, 10> kDecodeHeadDimBuckets = {32, 64, 72, 80, 96, 128, 192, 256, 512, 576};
// Query rows the decode kernels serve at most. Why 8: one 8x8 simdgroup-matrix
// tile of queries; below it the prefill kernel's 8-row fragments would run
// mostly empty (MLX switches to its vector kernels at the same point).
constexpr int64_t kMaxDecodeRows = 8;
// Query rows per kv head (gqa_ratio * Nq) the wide decode takes at most.
// Why 16: at 1 row per SIMD-group every row group loads each K/V row
// through the core's L1, so the kernel's on-core traffic grows with the
// rows; the model (benchmarks/model/families/decode_wide.py) puts it at least
// 2.4x ahead of the composite path at 16 rows (MLA with 16 query heads,
// Gemma-like with 8 rows) and behind it at 128 (MLA with 128 heads): past
// 16 impl='auto' runs the composite path (a decode kernel sharing K/V
// fragments across rows, on simdgroup matrices, is what MLA's 128 heads
// need: not built); impl='decode' / 'decode_split' still take them.
constexpr int64_t kWideDecodeMaxRows = 16;
// Indices of the [[function_constant]]s: causal masking (every kernel), and
// the prefill kernel's edge specializations, true when Nq (Nk) is a multiple
// of the query (key) block, so aligned shapes carry no edge code.
constexpr uint32_t kCausalFunctionConstant = 0;
constexpr uint32_t kAlignQFunctionConstant = 1;
constexpr uint32_t kAlignKFunctionConstant = 2;
// The backward's dQ kernel: a gradient flows into lse (grad_lse is read).
constexpr uint32_t kHasGradLseFunctionConstant = 3;
// The options of shaders/common/attention_features.h (prefill, decode and backward
// kernels): an attn_mask is bound, it is bool, it is additive float32 (else
// in the input dtype), keys are bounded below (window_left), softcapping,
// packed variable-length sequences. (The causal constant, index 0, also
// carries a right window: keys bounded above.)
constexpr uint32_t kHasMaskFunctionConstant = 4;
constexpr uint32_t kMaskBoolFunctionConstant = 5;
constexpr uint32_t kMaskFloat32FunctionConstant = 6;
constexpr uint32_t kWindowLeftFunctionConstant = 7;
constexpr uint32_t kSoftcapFunctionConstant = 8;
constexpr uint32_t kVarlenFunctionConstant = 9;
// The prefill and backward kernels' dense tile loader (fc_dense in
// shaders/prefill/attention_prefill.h; csrc/metal/launch.cpp's dense_loader decides it).
constexpr uint32_t kDenseFunctionConstant = 10;
// The forward kernels (prefill, decode, split decode): attention sinks are
// bound (fc_has_sinks in shaders/common/attention_features.h). False for every
// other kernel, which never reads it.
constexpr uint32_t kSinksFunctionConstant = 11;
// Function constants of every feature kernel launch (indices 0 .. 11).
constexpr uint32_t kFunctionConstantCount = 12;
// The decode kernels (one pass, split pass 1) and the prefill: a paged KV
// cache, K/V read through block_table with per-sequence cache_seqlens
// (fc_paged in shaders/common/attention_features.h). Their launches carry 13
// constants, the other kernels' 12 (they never read index 12).
constexpr uint32_t kPagedFunctionConstant = 12;
constexpr uint32_t kDecodeFunctionConstantCount = 13;
// The prefill (flash_attention_prefill) only: pack GQA, one threadgroup per
// (batch, kv head, block of packed rows) whose rows are the group's query
// heads' (fc_pack_gqa in shaders/prefill/attention_prefill.h; KernelChoice::pack_gqa).
// Its launches carry 14 constants.
constexpr uint32_t kPackGqaFunctionConstant = 13;
constexpr uint32_t kPrefillFunctionConstantCount = 14;
// The split-D forward (flash_attention_prefill_splitd) only: split along
// keys, the threadgroup's key range one of KernelChoice::kv_splits, partials
// for flash_decode_merge (fc_split_kv in shaders/prefill/attention_prefill_splitd.h).
// Its launches carry 15 constants.
constexpr uint32_t kSplitKvFunctionConstant = 14;
constexpr uint32_t kSplitDFunctionConstantCount = 15;
// The quantized-cache decode (flash_decode_quant*, shaders/decode/attention_decode_quant.h,
// issue 44) only: K's format (int8, 4-bit, fp8; none: q's dtype) at 15-17,
// V's at 18-20, the 4-bit scales' dtype (half, bfloat; neither: float32) of
// K at 21-22 and of V at 23-24. Its launches carry 25 constants (13 and 14 false).
constexpr uint32_t kKvFormatFunctionConstant = 15;       // + 3 * side + (format - 1)
constexpr uint32_t kKvScaleDtypeFunctionConstant = 21;   // + 2 * side + (half ? 0 : 1)
constexpr uint32_t kDecodeQuantFunctionConstantCount = 25;

// The tensors a launch binds as device buffers. PartialOut and PartialStats
// are the split-KV decode's float32 scratch, allocated by the host from
// MetalPlan's sizes. The backward binds q, k, v, out and lse as inputs, and
// GradOut (input), GradQ/GradK/GradV (its outputs), GradLse (input; lse in
// its place when there is none, never read then) and Delta (float32 scratch
// of MetalPlan::delta_elements, written by the first kernel, read by the second).
// Mask, CuSeqlensQ and CuSeqlensK are the options' inputs: attn_mask (bound
// as bytes, read in its own type) and the varlen offsets (int32); a launch
// without them binds q in their slots (never read then: every declared
// buffer is bound, as Metal's validation layer wants). Sinks: the attention
// sinks as float32 (Hq,), contiguous (the host converts them), q in the
// slot without sinks; GradSinks: the backward's float32 (Hq,) output of
// flash_sinks_grad (launched only with sinks). BlockTable and CacheSeqlens:
// the decode and prefill kernels' paged KV cache (int32 (B, max_blocks) and
// (B,)), q in their slots when the cache is not paged.
enum class LaunchTensor : uint8_t {
  Q = 0, K, V, Out, Lse, PartialOut, PartialStats, GradOut, GradQ, GradK, GradV, GradLse, Delta,
  Mask, CuSeqlensQ, CuSeqlensK, Sinks, GradSinks, BlockTable, CacheSeqlens,
  // The quantized cache's scales and biases (flash_decode_quant*): a side
  // without one gets its scale (or q) in the slot, never read.
  KScale, KBias, VScale, VBias
};
constexpr size_t kLaunchTensorCount = 24;

// One row of a binding table: tensor `tensor` goes to [[buffer(index)]],
// bound at its storage offset in bytes.
struct BufferBinding {
  LaunchTensor tensor;
  uint32_t index;
};

// What choose_metal_kernel decides: the kernel family and its shape knobs.
struct KernelChoice {
  KernelRequest kind = KernelRequest::Tiled;
  uint32_t bucket = 0;     // head-dim bucket DMAX of the instantiation
  uint32_t block_q = 0;    // prefill: query rows per threadgroup (8 per simdgroup)
  uint32_t block_k = 0;    // prefill: keys per K/V block
  uint32_t simdgroups = 0; // prefill: simdgroups per threadgroup
  bool pack_gqa = false;   // prefill: fc_pack_gqa, a threadgroup per (batch, kv head, block_q packed rows)
  uint32_t kv_splits = 1;  // split decode: key blocks
  uint32_t row_chunks = 1; // decode: threadgroups sharing one (batch, kv head[, key block]), each a part of
                           // its GQA group's rows (more than kDecodeMaxThreads / 32 row groups)
  uint32_t dkv_block_q = 0;     // backward, dK/dV kernel: query rows per streamed block
  uint32_t dkv_block_k = 0;     // backward, dK/dV kernel: keys per threadgroup (8 per simdgroup)
  uint32_t dkv_simdgroups = 0;  // backward, dK/dV kernel: simdgroups per threadgroup
  uint32_t dkv_feature_split = 1;  // backward, dK/dV kernel: feature parts of dK/dV (a SIMD-group each)
  uint32_t dq_feature_split = 1;   // backward, dQ kernel: feature parts of dQ (a SIMD-group each)
  // (for the backward, block_q / block_k / simdgroups describe its dQ kernel)
  std::string reason;      // why, for humans (flash_metal.explain)
  std::string family;      // the routing table's row that chose it (csrc/metal/families/table.cpp)
};

// The planner's estimates for one launch on one GPU (not measurements; a
// model of what the compiler and the GPU will do, for explain() and the
// performance model): registers from each kernel family's live-value model
// (csrc/metal/plan_detail.h), residency from registers and threadgroup memory.
struct LaunchEstimate {
  uint32_t live_registers = 0;        // 32-bit values per lane the kernel keeps live
  uint32_t threadgroups_per_core = 0; // resident at once (at least 1)
  uint32_t simdgroups_per_core = 0;   // threadgroups_per_core x SIMD-groups per threadgroup
  std::string limit;                  // what bounds residency: "registers" or "threadgroup memory"
};

// One dispatch.
struct MetalLaunch {
  std::string kernel_name;                 // host name in the metallib, e.g. flash_attention_tiled_float16_d64_bk16_t32
  std::array<uint32_t, 3> grid{};          // threadgroups per grid
  std::array<uint32_t, 3> threadgroup{};   // threads per threadgroup
  // The kernel's [[max_total_threads_per_threadgroup(N)]] (shaders/common/params.h):
  // the most threads it may ever be launched with; threadgroup's product
  // never exceeds it (plan_metal_attention checks every launch).
  uint32_t max_threads_per_threadgroup = 0;
  uint32_t threadgroup_memory = 0;         // bytes of dynamic threadgroup memory (0: none to bind)
  uint32_t threadgroup_memory_index = 0;   // its [[threadgroup(i)]] index
  std::vector<bool> function_constants;    // value of [[function_constant(i)]] at index i
  // The binding table: the MPS host (csrc/mps/attention_mps.mm) and the
  // test suite's emulated backend both bind from it, so the slots are written
  // down once, in csrc/metal/launch.cpp, beside the kernels' [[buffer(n)]]
  // attributes they mirror.
  std::vector<BufferBinding> buffers;
  uint32_t params_index = 0;               // [[buffer(i)]] of AttentionParams, bound with setBytes
  AttentionParams params{};                // the parameter block itself
  // The quantized-cache decode's second block (quant_params_index > 0), bound with setBytes too.
  uint32_t quant_params_index = 0;
  KvQuantParams quant_params{};
  LaunchEstimate estimate;                 // on the plan's GpuSpec
  std::string family;                      // the routing table's row that planned it (KernelChoice::family)
};

// Everything attention_forward encodes, in order, on one compute encoder
// (serial dispatch: each launch sees the previous one's writes).
struct MetalPlan {
  std::vector<MetalLaunch> launches;
  int64_t partial_out_elements = 0;    // float32 scratch for LaunchTensor::PartialOut (0: none)
  int64_t partial_stats_elements = 0;  // float32 scratch for LaunchTensor::PartialStats (0: none)
  int64_t delta_elements = 0;          // float32 scratch for LaunchTensor::Delta (0: none), B * Hq * Nq
                                       // (varlen: Hq * total_q)
  std::string reason;                  // why this kernel was chosen, for humans
};

// The routing heuristic, the one place where a kernel and its shape are
// chosen: family, head-dim bucket, block sizes and split count, each with
// the reason.
// pass = Backward chooses the backward's blocks (requested must be Auto).
KernelChoice choose_metal_kernel(const AttentionProblem& p, KernelRequest requested, const GpuSpec& gpu,
                                 MetalPass pass = MetalPass::Forward);

// attention_kvcache's route on Metal (p.paged): true when a kernel reads K/V
// through the block table (fc_paged): the decode kernels (Nq <= kMaxDecodeRows,
// impl 'auto', 'decode' or 'decode_split') or the prefill (Nq > 8, or impl
// 'prefill'); false for the gather path (the rows in use copied into packed
// buffers, then the varlen plan: head dims past the widest bucket). *why says
// which and why, for explain(). Throws a ValueError for an impl no route takes.
bool kvcache_reads_table(const AttentionProblem& p, KernelRequest requested, std::string* why);

// Whether a forward call with head dims above kFastHeadDimBuckets.back()
// (256) runs the fused decode kernels in a wide bucket (kDecodeHeadDimBuckets):
// Nq <= kMaxDecodeRows, not varlen, impl 'auto', 'decode' or 'decode_split',
// dims within the widest decode bucket. False for dims <= 256 (the usual
// routing applies) and for everything else above (composite_route).
bool decode_takes_wide_dims(const AttentionProblem& p, KernelRequest requested, MetalPass pass);

// Whether a call with head dims above kFastHeadDimBuckets.back() runs the
// split-D forward (shaders/prefill/attention_prefill_splitd.h,
// csrc/metal/families/prefill_splitd.cpp): forward, (D_qk, D_v) = (512, 512),
// (576, 512) or (256, 512), no paged cache, and impl 'prefill', or impl
// 'auto' where the model puts it ahead (512: causal, window_right 0, Nq >
// kMaxDecodeRows; MLA's pairs: kSplitDMla* there); a backward call asks
// splitd_backward_takes. Else false and *why_not
// (if given) says why, for explain(); composite_route then takes the call.
bool splitd_takes(const AttentionProblem& p, KernelRequest requested, MetalPass pass, std::string* why_not);
// The backward's part of it (shaders/backward/attention_backward_splitd.h): D_qk =
// D_v = 512, not paged, and impl='prefill'. impl='auto' never: the model puts
// the split-D backward behind the composite backward on every named chip
// (benchmarks/model/families/splitd_backward.py), and *why_not says so.
bool splitd_backward_takes(const AttentionProblem& p, KernelRequest requested, std::string* why_not);

// The full plan: kernel choice, names, grids, threadgroups, memory, params.
MetalPlan plan_metal_attention(const AttentionProblem& p, const LaunchStrides& strides, KernelRequest requested,
                               const GpuSpec& gpu = parse_gpu("base"));

// The backward's plan: the dQ kernel (which also writes Delta), then the
// dK/dV kernel, then with sinks flash_sinks_grad (grad_sinks from Delta and
// lse), on one encoder in that order; delta_elements of scratch.
// strides.grad_out and strides.grad_lse must be set (grad_lse: lse's when
// has_grad_lse is false).
MetalPlan plan_metal_attention_backward(const AttentionProblem& p, const LaunchStrides& strides, bool has_grad_lse,
                                        KernelRequest requested = KernelRequest::Auto,
                                        const GpuSpec& gpu = parse_gpu("base"));

// One launch of every distinct (kernel name, function constants) pair the
// planner can produce, over every family (the backward's two kernels
// included), dtype, bucket, causal setting, edge alignment and grad_lse
// setting, found by planning small problems, so it cannot drift from
// the planner. Each entry is planned at the largest threadgroup the shapes
// give its kernel (every decode kernel at kDecodeMaxThreads, the most the
// planner ever launches it with), so a pipeline built from it shows whether
// the device admits that size. all_metal_kernel_names() is its set of
// names, in a fixed order without duplicates; the macOS pipeline-build test
// compares it with the metallib and builds every pipeline.
std::vector<MetalLaunch> all_metal_launches();
std::vector<std::string> all_metal_kernel_names();

}  // namespace flash_metal
