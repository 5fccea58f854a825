// The shader library and its compute pipelines, for the MPS backend.
//
// The library is loaded once per process and device from the installed
// package: the precompiled flash_metal.metallib next to the _C extension when
// setup.py built it from the very sources installed beside it (a hash file
// says so), else the shipped shaders/attention.metal compiled by Metal's
// runtime compiler, with a warning when a metallib was there but stale or
// unloadable. Both paths compile without fast math (the kernels rely on
// infinities). macOS older than 14 is refused with a clear error: Metal 3.1,
// which the kernels need for bfloat, starts there. Pipelines are cached by
// device, kernel name and function-constant values; the cache's lock is never
// held while Metal compiles, so threads build different pipelines at once.
// Everything is thread-safe. Every failure throws c10::Error (warnings are
// TORCH_WARN) on the calling thread, except that try_get_pipeline and
// get_pipelines report pipeline failures as strings: their builds run inside
// blocks libdispatch calls, where an exception would terminate the process.
//
// Objective-C++ (manual retain/release, never ARC): include only from .mm.
#pragma once

#include <Metal/Metal.h>

#include <cstdint>
#include <string>
#include <vector>

namespace flash_metal::mps {

// A specialized, ready-to-encode pipeline. The cache owns the reference for
// the lifetime of the process: callers must neither retain nor release it.
struct Pipeline {
  id<MTLComputePipelineState> state = nil;
  uint64_t max_threads_per_threadgroup = 0;  // the pipeline's limit (depends on its register use)
  uint64_t static_threadgroup_memory = 0;    // bytes the kernel declares statically
  uint64_t thread_execution_width = 0;       // its SIMD-group width
};

// The pipeline of kernel `name` with [[function_constant(i)]] = constants[i]
// (all boolean), built for `device` on first use. Throws c10::Error naming
// the kernel and the library it was looked up in.
Pipeline get_pipeline(id<MTLDevice> device, const std::string& name, const std::vector<bool>& constants);

// get_pipeline that never throws, for a block libdispatch runs: the pipeline,
// or a nil state and `error`, the message get_pipeline would throw.
struct PipelineResult {
  Pipeline pipeline;
  std::string error;  // "" on success
};
PipelineResult try_get_pipeline(id<MTLDevice> device, const std::string& name,
                                const std::vector<bool>& constants) noexcept;

// Many pipelines at once (pipelines.mm): the library is loaded first, on the
// calling thread (its errors are thrown and its fallback warnings raised
// there, as get_pipeline's are), then every request is built concurrently
// with dispatch_apply on a global concurrent queue. Result i answers request
// i; a pipeline that fails is reported in its result, never thrown.
struct PipelineRequest {
  std::string kernel_name;
  std::vector<bool> constants;
};
std::vector<PipelineResult> get_pipelines(id<MTLDevice> device, const std::vector<PipelineRequest>& requests);

// The MSL 4 library (flash_metal_mpp.metallib: the Metal 4 tensor-op
// kernels, whose names start "flash_attention_prefill_mpp_"; get_pipeline
// looks them up there): "" when this process can use it on `device`, else
// why not: macOS older than 26.2, none installed (setup.py builds it only
// where the toolchain can), stale, or not loadable. Never throws; loads it
// on first use. There is no runtime-compile fallback for it: a toolchain
// that cannot build it is what the fallback would lack too.
std::string tensor_ops_library_problem(id<MTLDevice> device);

// Where the library get_pipeline uses on `device` came from, e.g. "the
// precompiled /.../flash_metal.metallib"; loads it on first use (same errors).
std::string library_origin(id<MTLDevice> device);

// The same, as fields (flash_metal::metal_device_info reports them).
struct LibraryInfo {
  std::string kind;    // "metallib" or "runtime_compile"
  std::string path;    // the metallib, or the shader source compiled at run time
  std::string reason;  // why the sources were compiled at run time ("" for the metallib)
  std::string origin;  // library_origin's sentence
};
LibraryInfo library_info(id<MTLDevice> device);

// Every pipeline built so far on `device`: kernel name, function constants
// ("0"/"1" per constant), and the pipeline (owned by the cache).
struct CachedPipeline {
  std::string kernel_name;
  std::string constants;
  Pipeline pipeline;
};
std::vector<CachedPipeline> cached_pipelines(id<MTLDevice> device);

// The Metal device for work that has no tensor to take a device from (the
// pipeline builds of the macOS CI, metal_device_info): PyTorch's MPS device
// when PyTorch has one, else the first of MTLCopyAllDevices(). Not
// MTLCreateSystemDefaultDevice(), which can return nil in a process without a
// window-server session (a CI job, ssh) on Apple silicon. nil when there is
// no Metal device at all. The device is owned elsewhere (PyTorch) or kept for
// the process: callers neither retain nor release it. `source`, if given,
// receives "torch" or "MTLCopyAllDevices".
id<MTLDevice> metal_device(std::string* source = nullptr);

}  // namespace flash_metal::mps
