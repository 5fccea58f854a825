// Portable planning for the Metal path: which kernel, what grid, how much
// threadgroup memory, and the AttentionParams block. Shared by the MPS
// implementation (csrc/mps/attention_mps.mm) and by the metal_plan op that the
// test suite's emulated-Metal backend and flash_metal.explain() use, so the
// emulator runs exactly the launches a Mac would. No Objective-C, no Metal.
#pragma once

#include "checks.h"
#include "../shaders/params.h"

#include <array>
#include <cstdint>
#include <string>
#include <vector>

namespace flash_metal {

// What the caller asked for with the `impl` argument.
enum class KernelRequest {
  Auto,     // let choose_metal_kernel() decide
  Untiled,  // the post's first kernel: one query per thread, K/V read from device memory
  Tiled,    // the post's second kernel: K/V tiles staged in threadgroup memory
};

// Parses the `impl` argument; throws a ValueError listing the accepted names.
KernelRequest parse_kernel_request(const std::string& kernel);

// Element strides of the five tensors a launch touches, outermost first.
struct LaunchStrides {
  std::array<int64_t, 4> q, k, v, o;
  std::array<int64_t, 3> lse;
};

// Threads per threadgroup of both post kernels. Why 32: one Apple SIMD-group,
// the post's choice, and for the tiled kernel the number of queries that share
// one K/V tile.
constexpr uint32_t kPostThreadsPerGroup = 32;
// Keys per K/V tile of the tiled kernel. Why 16: the post's named
// configuration; at D=256 two float32 tiles take 2*16*256*4 = 32 KiB, exactly
// Metal's threadgroup-memory limit.
constexpr uint32_t kPostKeysPerTile = 16;
// Head-dim buckets: each instantiation keeps a float32 accumulator of the
// bucket's width per thread, so a smaller bucket means fewer registers.
constexpr std::array<uint32_t, 4> kHeadDimBuckets = {32, 64, 128, 256};
// Index of the [[function_constant]] that switches causal masking on.
constexpr uint32_t kCausalFunctionConstant = 0;

// The tensors a launch binds as device buffers, in the order of the binding
// table below and of the metal_plan op's `buffer_indices`.
enum class LaunchTensor : uint8_t { Q = 0, K, V, Out, Lse };
constexpr size_t kLaunchTensorCount = 5;

// One row of the binding table: tensor `tensor` goes to [[buffer(index)]],
// bound at its storage offset in bytes.
struct BufferBinding {
  LaunchTensor tensor;
  uint32_t index;
};

struct MetalLaunch {
  std::string kernel_name;                 // host name in the metallib, e.g. flash_attention_tiled_float16_d64_bk16_t32
  std::array<uint32_t, 3> grid{};          // threadgroups per grid (x: query blocks, y: q heads, z: batch)
  std::array<uint32_t, 3> threadgroup{};   // threads per threadgroup
  uint32_t threadgroup_memory = 0;         // bytes of dynamic threadgroup memory (0: none to bind)
  uint32_t threadgroup_memory_index = 0;   // its [[threadgroup(i)]] index
  std::vector<bool> function_constants;    // value of [[function_constant(i)]] at index i
  // The one binding table: the MPS host (csrc/mps/attention_mps.mm) and the
  // test suite's emulated backend both bind from it, so the slots are written
  // down once, here, beside the kernels' [[buffer(n)]] attributes they mirror.
  std::array<BufferBinding, kLaunchTensorCount> buffers{};
  uint32_t params_index = 0;               // [[buffer(i)]] of AttentionParams, bound with setBytes
  AttentionParams params{};                // the parameter block itself
  std::string reason;                      // why this kernel was chosen, for humans
};

// The routing heuristic: picks a kernel for the problem and says why.
KernelRequest choose_metal_kernel(const AttentionProblem& p, KernelRequest requested, std::string* reason);

// The full launch: kernel choice, name, grid, threadgroup, memory and params.
MetalLaunch plan_metal_attention(const AttentionProblem& p, const LaunchStrides& strides,
                                 KernelRequest requested);

// Every kernel name plan_metal_attention can return (each dtype, head-dim
// bucket and kernel kind), in a fixed order without duplicates. Found by
// planning one small problem per combination, so it cannot drift from the
// planner; the macOS pipeline-build test compares it with the metallib.
std::vector<std::string> all_metal_kernel_names();

}  // namespace flash_metal
