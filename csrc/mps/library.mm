// Loading flash_metal's shader library and caching its pipelines.
//
// Written for this project; the shape (one library per process, pipelines
// keyed by name and function constants behind a mutex) follows what
// PyTorch's MetalShaderLibrary does internally, without depending on that
// ATen-internal class. Unlike it, the mutex is released while Metal builds a
// pipeline (look up, build unlocked, insert; the first insert wins), so
// metal_build_all_pipelines can build them all at once. Manual retain/release: setup.py builds with
// -fno-objc-arc. No exception is ever thrown inside an @autoreleasepool
// (it would skip the pool's drain): errors are collected as strings and
// thrown after the pool has closed. Compile options follow PyTorch's own
// runtime compile (MTLMathModeSafe) and the -fno-fast-math both PyTorch and
// MLX pass to `metal` (setup.py does too). The kernels are written to stay
// right under fast math (a finite running-max sentinel, no arithmetic on
// infinities; see shaders/common/attention_common.h), but IEEE semantics are what
// the emulator tests, so they are what we ask Apple's compiler for.
#include "library.h"
#include "metal/plan.h"  // is_tensor_ops_kernel
#include "shader_source.h"

#include <ATen/mps/MPSDevice.h>
#include <Foundation/Foundation.h>
#include <c10/util/Exception.h>

#include <dlfcn.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <mutex>
#include <unordered_map>

// Apple's compiler checks availability against the deployment target: here,
// after every header, an API newer than that target used outside an
// `if (@available(...))` guard (mathMode is macOS 15, MTLLanguageVersion3_1
// macOS 14) is an error instead of an unrecognized-selector crash on an older
// macOS. (tests/mps/test_mps_host.py checks the same guards textually on Linux.)
#pragma clang diagnostic error "-Wunguarded-availability-new"

// MTLMathMode, MTLMathFloatingPointFunctions and MTLCompileOptions' mathMode
// and mathFloatingPointFunctions appear in the macOS 15 SDK (Xcode 16).
// `@available` below guards the run time, not the SDK: built with Xcode 15 or
// Command Line Tools 15 (the macOS 14 SDK), those names do not exist and this
// file would not compile. So when the SDK predates macOS 15 (it defines no
// __MAC_15_0), declare them here with Apple's documented values, as PyTorch's
// MPSGraphSequoiaOps.h does (idea credited, nothing copied): a binary built
// with the older SDK then still asks for safe, precise math when it runs on
// macOS 15, where the selectors exist. The availability attribute keeps the
// pragma above enforcing the @available guard on their use.
// (tests/mps/test_mps_host.py syntax-checks this file against an SDK-14 view of
// its Apple stubs, which lacks them, and tests/mps/test_mps_exec_runtime.py runs
// that build.)
#if !defined(__MAC_15_0)
#define FLASH_METAL_MACOS_15_API __attribute__((availability(macos, introduced = 15.0)))
// https://developer.apple.com/documentation/metal/mtlmathmode?language=objc
typedef enum : NSInteger {
  MTLMathModeSafe = 0,
  MTLMathModeRelaxed = 1,
  MTLMathModeFast = 2,
} MTLMathMode FLASH_METAL_MACOS_15_API;
// https://developer.apple.com/documentation/metal/mtlmathfloatingpointfunctions?language=objc
typedef enum : NSInteger {
  MTLMathFloatingPointFunctionsFast = 0,
  MTLMathFloatingPointFunctionsPrecise = 1,
} MTLMathFloatingPointFunctions FLASH_METAL_MACOS_15_API;
@interface MTLCompileOptions ()
@property(readwrite, nonatomic) MTLMathMode mathMode FLASH_METAL_MACOS_15_API;
@property(readwrite, nonatomic) MTLMathFloatingPointFunctions mathFloatingPointFunctions FLASH_METAL_MACOS_15_API;
@end
#undef FLASH_METAL_MACOS_15_API
#endif

namespace flash_metal::mps {
namespace {

// File names inside the installed package directory (flash_metal/), as
// setup.py's BuildWithShaders writes them.
constexpr const char* kMetallibName = "flash_metal.metallib";
// The fingerprint of the sources the metallib was built from (setup.py's
// _shader_sources_hash; shader_source::source_tree_hash computes the same).
constexpr const char* kMetallibHashName = "flash_metal.metallib.fnv1a64";
constexpr const char* kShaderDirName = "shaders";
constexpr const char* kShaderSourceName = "shaders/attention.metal";
// The MSL 4 library (setup.py's build_mpp_metallib) and its fingerprint, and
// (its kernels' names: is_tensor_ops_kernel, csrc/metal/plan.h).
constexpr const char* kMppMetallibName = "flash_metal_mpp.metallib";
constexpr const char* kMppMetallibHashName = "flash_metal_mpp.metallib.fnv1a64";
// Set to 1 to ignore the metallib and compile the shipped sources: lets a
// Mac with the full toolchain exercise the fallback path users without it get.
constexpr const char* kForceRuntimeCompileEnv = "FLASH_METAL_RUNTIME_COMPILE";
// Hint appended to build errors: the sources and the metallib come from one install.
constexpr const char* kReinstallHint = "reinstall flash_metal (pip install --no-build-isolation .)";
// What the runtime-compile fallback costs, for its warnings.
constexpr const char* kFallbackNote =
    "compiling the shipped shader sources at run time instead (slower first call; same kernels)";

// The directory holding this shared object (the _C extension), found by
// asking the dynamic loader which file contains this very function.
std::string package_directory() {
  Dl_info info{};
  TORCH_CHECK(dladdr(reinterpret_cast<const void*>(&package_directory), &info) != 0 && info.dli_fname != nullptr,
              "flash_metal: cannot locate the _C extension on disk (dladdr failed), so cannot find its shaders");
  return shader_source::directory_of(info.dli_fname);
}

bool file_exists(const std::string& path) { return std::ifstream(path).good(); }

std::string describe(NSError* error) {
  if (error == nil) return "no error description";
  const char* text = [[error localizedDescription] UTF8String];
  return text != nullptr ? text : "no error description";
}

// Metal 3.1 (macOS 14) is the first language version with bfloat, and the
// one both the metallib (setup.py: -std=metal3.1 -mmacosx-version-min=14.0)
// and the runtime compile use; the bfloat instantiations sit in the same
// library as the others, so nothing loads below it. Refusing older macOS at
// first use, with this message, is the alternative to a Metal 3.0 build
// without bfloat, which flash_metal does not ship.
bool macos_supports_the_kernels() {
  if (@available(macOS 14.0, *)) {
    return true;
  }
  return false;
}

// The loaded library and where it came from (for error messages and
// metal_device_info).
struct LoadedLibrary {
  id<MTLLibrary> library = nil;  // retained for the process lifetime
  std::string origin;            // e.g. "the precompiled /.../flash_metal.metallib"
  std::string kind;              // LibraryInfo::kind
  std::string path;              // the metallib or the compiled source
  std::string reason;            // why compiled at run time, with the detail ("" for the metallib)
};

id<MTLLibrary> load_metallib(id<MTLDevice> device, const std::string& path, std::string* error) {
  id<MTLLibrary> library = nil;
  @autoreleasepool {
    NSURL* url = [NSURL fileURLWithPath:[NSString stringWithUTF8String:path.c_str()]];
    NSError* err = nil;
    library = [device newLibraryWithURL:url error:&err];  // +1, kept
    if (library == nil) *error = describe(err);
  }
  return library;
}

// The runtime compiler's equivalent of setup.py's `metal -std=metal3.1
// -fno-fast-math`: IEEE-safe arithmetic and precise math functions (the
// unqualified exp2/log2 the kernels call are metal::, which fast math maps
// to the fast:: versions). MTLMathModeSafe is PyTorch's runtime default too.
void set_compile_options(MTLCompileOptions* options) {
  if (@available(macOS 15.0, *)) {
    [options setMathMode:MTLMathModeSafe];
    [options setMathFloatingPointFunctions:MTLMathFloatingPointFunctionsPrecise];
    [options setLanguageVersion:MTLLanguageVersion3_1];
  } else if (@available(macOS 14.0, *)) {
    // Before macOS 15 the switch is fastMathEnabled (deprecated from 15 on).
#pragma clang diagnostic push
#pragma clang diagnostic ignored "-Wdeprecated-declarations"
    [options setFastMathEnabled:NO];
#pragma clang diagnostic pop
    [options setLanguageVersion:MTLLanguageVersion3_1];
  }
}

id<MTLLibrary> compile_source(id<MTLDevice> device, const std::string& source, std::string* error) {
  id<MTLLibrary> library = nil;
  MTLCompileOptions* options = [[MTLCompileOptions alloc] init];
  set_compile_options(options);
  @autoreleasepool {
    NSError* err = nil;
    library = [device newLibraryWithSource:[NSString stringWithUTF8String:source.c_str()]
                                   options:options
                                     error:&err];  // +1, kept; err may hold mere warnings on success
    if (library == nil) *error = describe(err);
  }
  [options release];
  return library;
}

// Why the metallib in `dir` must not be used, or "" if it was built from the
// shader sources installed beside it.
std::string metallib_staleness(const std::string& dir, const char* hash_name = kMetallibHashName) {
  std::ifstream in(dir + "/" + hash_name);
  std::string recorded;
  if (!(in >> recorded)) {
    return std::string("it has no readable ") + hash_name + " beside it, so it may predate the installed shader sources";
  }
  std::string actual;
  try {
    actual = shader_source::source_tree_hash(dir + "/" + kShaderDirName);
  } catch (const std::exception& e) {
    return std::string("the installed shader sources cannot be fingerprinted (") + e.what() + ")";
  }
  if (recorded != actual) {
    return "it was built from other shader sources (fingerprint " + recorded + ", installed sources " + actual +
           "): a stale build";
  }
  return "";
}

// `why` goes into the origin sentence; `detail`, if any, extends it in
// LoadedLibrary::reason (the staleness or load error behind a fallback).
LoadedLibrary compile_shipped_sources(id<MTLDevice> device, const std::string& dir, const std::string& why,
                                      const std::string& detail = "") {
  const std::string source_path = dir + "/" + kShaderSourceName;
  TORCH_CHECK(file_exists(source_path), "flash_metal: cannot run on MPS: ", why, ", and the shader sources ",
              source_path, " are missing; ", kReinstallHint);
  std::string source;
  try {
    source = shader_source::inline_local_includes(source_path);
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "flash_metal: cannot assemble the shader sources: ", e.what(), "; ", kReinstallHint);
  }
  LoadedLibrary out;
  out.origin = "the shader sources " + source_path + " (compiled at run time: " + why + ")";
  out.kind = "runtime_compile";
  out.path = source_path;
  out.reason = detail.empty() ? why : why + ": " + detail;
  std::string error;
  out.library = compile_source(device, source, &error);
  TORCH_CHECK(out.library != nil, "flash_metal: Metal's runtime compiler rejected ", out.origin, ":\n", error);
  return out;
}

LoadedLibrary load_library(id<MTLDevice> device) {
  TORCH_CHECK(macos_supports_the_kernels(),
              "flash_metal: the Metal kernels need macOS 14 (Sonoma) or newer, for Metal 3.1; this Mac runs an "
              "older macOS. CPU tensors still work: pass tensors on device='cpu', or upgrade macOS.");
  TORCH_CHECK(device != nil, "flash_metal: no Metal device to build the kernels for");
  const std::string dir = package_directory();
  const std::string metallib = dir + "/" + kMetallibName;
  const char* force = std::getenv(kForceRuntimeCompileEnv);
  if (force != nullptr && std::string(force) == "1") {
    return compile_shipped_sources(device, dir, std::string(kForceRuntimeCompileEnv) + "=1");
  }
  if (!file_exists(metallib)) {
    // setup.py warned at install time (no Metal toolchain): no second warning.
    return compile_shipped_sources(device, dir, "no metallib was installed");
  }
  const std::string stale = metallib_staleness(dir);
  if (!stale.empty()) {
    TORCH_WARN("flash_metal: not using ", metallib, ": ", stale, "; ", kFallbackNote, ". To fix, ", kReinstallHint,
               ".");
    return compile_shipped_sources(device, dir, "the metallib was stale", stale);
  }
  LoadedLibrary out;
  std::string error;
  out.origin = "the precompiled " + metallib;
  out.kind = "metallib";
  out.path = metallib;
  out.library = load_metallib(device, metallib, &error);
  if (out.library == nil) {
    // Typically a metallib built for a newer macOS than this one.
    TORCH_WARN("flash_metal: cannot load ", metallib, " (", error, "); ", kFallbackNote, ".");
    return compile_shipped_sources(device, dir, "the metallib did not load", error);
  }
  return out;
}

// The MSL 4 library on a device, or why there is none (LoadedMpp::problem).
struct LoadedMpp {
  id<MTLLibrary> library = nil;  // retained for the process lifetime; nil with a problem
  std::string origin;            // "the precompiled /.../flash_metal_mpp.metallib"
  std::string problem;           // "" when loaded
};

// Never throws (tensor_ops_library_problem's promise): every failure is a problem string.
LoadedMpp load_mpp_library(id<MTLDevice> device) {
  LoadedMpp out;
  // Why 26.2: the library's deployment target (setup.py METAL4_MACOS_MIN,
  // PyTorch #191794), and the first macOS on which matmul2d engages M5's
  // neural accelerators (MLX's is_nax_available asks the same).
  if (@available(macOS 26.2, *)) {
  } else {
    out.problem = "this Mac runs a macOS older than 26.2, which Metal 4 tensor ops need";
    return out;
  }
  if (device == nil) {
    out.problem = "no Metal device";
    return out;
  }
  std::string dir;
  try {
    dir = package_directory();
  } catch (const std::exception& e) {
    out.problem = e.what();
    return out;
  }
  const std::string path = dir + "/" + kMppMetallibName;
  out.origin = "the precompiled " + path;
  if (!file_exists(path)) {
    out.problem = std::string("no MSL 4 library (") + kMppMetallibName + ") was installed: setup.py builds it only "
                  "with Xcode 26 and the macOS 26.2 SDK or newer, and said why at install time";
    return out;
  }
  const std::string stale = metallib_staleness(dir, kMppMetallibHashName);
  if (!stale.empty()) {
    out.problem = "not using " + path + ": " + stale + "; " + kReinstallHint;
    return out;
  }
  std::string error;
  out.library = load_metallib(device, path, &error);
  if (out.library == nil) out.problem = "cannot load " + path + " (" + error + ")";
  return out;
}

// The pipeline cache's key, and what metal_device_info lists: the device,
// then kernel name and constants.
struct PipelineKey {
  uintptr_t device;
  std::string name;
  std::string constants;
  bool operator==(const PipelineKey& o) const {
    return device == o.device && name == o.name && constants == o.constants;
  }
};
struct PipelineKeyHash {
  size_t operator()(const PipelineKey& k) const {
    return std::hash<std::string>()(std::to_string(k.device) + "/" + k.name + "/" + k.constants);
  }
};

// Everything below is guarded by mutex(). Both maps are leaked on purpose:
// they outlive static destruction, as the retained Metal objects do.
std::mutex& mutex() {
  static std::mutex m;
  return m;
}
std::unordered_map<uintptr_t, LoadedLibrary>& libraries() {
  static auto* map = new std::unordered_map<uintptr_t, LoadedLibrary>();
  return *map;
}
std::unordered_map<uintptr_t, LoadedMpp>& mpp_libraries() {
  static auto* map = new std::unordered_map<uintptr_t, LoadedMpp>();
  return *map;
}
std::unordered_map<PipelineKey, Pipeline, PipelineKeyHash>& pipelines() {
  static auto* map = new std::unordered_map<PipelineKey, Pipeline, PipelineKeyHash>();
  return *map;
}

// The library for `device`, loaded on first use. Caller holds mutex().
const LoadedLibrary& library_for(id<MTLDevice> device) {
  const uintptr_t key = reinterpret_cast<uintptr_t>(device);
  auto hit = libraries().find(key);
  if (hit != libraries().end()) return hit->second;
  LoadedLibrary lib = load_library(device);  // a throw leaves no entry: the next call retries
  return libraries().emplace(key, lib).first->second;
}

// The MSL 4 library for `device`, loaded (or found missing) on first use. Caller holds mutex().
const LoadedMpp& mpp_library_for(id<MTLDevice> device) {
  const uintptr_t key = reinterpret_cast<uintptr_t>(device);
  auto hit = mpp_libraries().find(key);
  if (hit != mpp_libraries().end()) return hit->second;
  return mpp_libraries().emplace(key, load_mpp_library(device)).first->second;
}

// The forward's and the backward's tensor-op kernels (csrc/metal/plan.h's rule).
bool is_mpp_kernel(const std::string& name) { return is_tensor_ops_kernel(name); }

// Builds a pipeline from `library` (described by `origin`, for messages).
// Runs without the cache's lock, possibly on several threads at once
// (metal_build_all_pipelines), so it touches no shared state and never throws:
// a failure leaves state nil and says why in *error. Metal's device and
// library are safe to use from several threads; each call has its own
// function and constant values.
Pipeline build_pipeline(id<MTLDevice> device, id<MTLLibrary> library, const std::string& origin,
                        const std::string& name, const std::vector<bool>& constants, std::string* error) noexcept {
  Pipeline p;
  MTLFunctionConstantValues* values = [[MTLFunctionConstantValues alloc] init];
  for (size_t i = 0; i < constants.size(); ++i) {
    bool value = constants[i];
    [values setConstantValue:&value type:MTLDataTypeBool atIndex:i];
  }
  @autoreleasepool {
    NSError* err = nil;
    id<MTLFunction> function = [library newFunctionWithName:[NSString stringWithUTF8String:name.c_str()]
                                             constantValues:values
                                                      error:&err];  // +1
    if (function == nil) {
      *error = "kernel '" + name + "' is not in " + origin + " (" + describe(err) +
               "). The extension and its shaders come from different builds: " + kReinstallHint;
    } else {
      p.state = [device newComputePipelineStateWithFunction:function error:&err];  // +1, kept by the cache
      if (p.state == nil) *error = "cannot build the pipeline of kernel '" + name + "': " + describe(err);
      [function release];
    }
  }
  [values release];
  if (p.state != nil) {
    p.max_threads_per_threadgroup = [p.state maxTotalThreadsPerThreadgroup];
    p.static_threadgroup_memory = [p.state staticThreadgroupMemoryLength];
    p.thread_execution_width = [p.state threadExecutionWidth];
  }
  return p;
}

std::string constants_string(const std::vector<bool>& constants) {
  std::string s;
  for (bool c : constants) s += c ? '1' : '0';
  return s;
}

// The first half of a lookup, under the lock: the cached pipeline, or, on a
// miss, the library to build it from (loaded now if this is the first use on
// the device; its errors propagate).
struct Lookup {
  Pipeline cached;              // state nil on a miss
  id<MTLLibrary> library = nil;  // owned by libraries(), kept for the process
  std::string origin;
};
Lookup look_up(id<MTLDevice> device, const PipelineKey& key) {
  std::lock_guard<std::mutex> lock(mutex());
  auto hit = pipelines().find(key);
  if (hit != pipelines().end()) return {hit->second, nil, ""};
  if (is_mpp_kernel(key.name)) {
    const LoadedMpp& mpp = mpp_library_for(device);
    TORCH_CHECK(mpp.library != nil, "flash_metal: kernel '", key.name, "' is a Metal 4 tensor-op kernel, and ",
                mpp.problem);
    return {Pipeline{}, mpp.library, mpp.origin};
  }
  const LoadedLibrary& lib = library_for(device);
  return {Pipeline{}, lib.library, lib.origin};
}

// The second half, under the lock again: caches `built` (state +1) and
// returns it, unless another thread cached the same pipeline while this one
// was building; then the cached one wins and `built` is released (one
// reference per cached pipeline, none leaked).
Pipeline keep(const PipelineKey& key, const Pipeline& built) {
  Pipeline cached;
  {
    std::lock_guard<std::mutex> lock(mutex());
    auto [it, inserted] = pipelines().emplace(key, built);
    if (inserted) return built;
    cached = it->second;
  }
  [built.state release];
  return cached;
}

// What c10::Error says without its C++ backtrace (the message TORCH_CHECK was given).
std::string message_of(const std::exception& e) {
  if (const auto* c10_error = dynamic_cast<const c10::Error*>(&e)) return c10_error->what_without_backtrace();
  return e.what();
}

}  // namespace

// The cache's lock is held to look up and to insert, never while Metal
// compiles, so several threads build different pipelines at once.
Pipeline get_pipeline(id<MTLDevice> device, const std::string& name, const std::vector<bool>& constants) {
  const PipelineKey key{reinterpret_cast<uintptr_t>(device), name, constants_string(constants)};
  const Lookup found = look_up(device, key);
  if (found.cached.state != nil) return found.cached;
  std::string error;
  const Pipeline built = build_pipeline(device, found.library, found.origin, name, constants, &error);
  TORCH_CHECK(built.state != nil, "flash_metal: ", error);
  return keep(key, built);
}

PipelineResult try_get_pipeline(id<MTLDevice> device, const std::string& name,
                                const std::vector<bool>& constants) noexcept {
  PipelineResult result;
  try {
    const PipelineKey key{reinterpret_cast<uintptr_t>(device), name, constants_string(constants)};
    const Lookup found = look_up(device, key);  // throws only if the library fails to load
    if (found.cached.state != nil) {
      result.pipeline = found.cached;
      return result;
    }
    std::string error;
    const Pipeline built = build_pipeline(device, found.library, found.origin, name, constants, &error);
    if (built.state == nil) {
      result.error = "flash_metal: " + error;
      return result;
    }
    result.pipeline = keep(key, built);
  } catch (const std::exception& e) {
    result.error = message_of(e);
  } catch (...) {
    result.error = "flash_metal: an unknown error while building the pipeline of kernel '" + name + "'";
  }
  return result;
}

std::string tensor_ops_library_problem(id<MTLDevice> device) {
  try {
    std::lock_guard<std::mutex> lock(mutex());
    return mpp_library_for(device).problem;
  } catch (const std::exception& e) {  // a failed allocation: report, never throw
    return std::string("the MSL 4 library could not be looked up: ") + e.what();
  }
}

std::string library_origin(id<MTLDevice> device) {
  std::lock_guard<std::mutex> lock(mutex());
  return library_for(device).origin;
}

LibraryInfo library_info(id<MTLDevice> device) {
  std::lock_guard<std::mutex> lock(mutex());
  const LoadedLibrary& lib = library_for(device);
  return {lib.kind, lib.path, lib.reason, lib.origin};
}

std::vector<CachedPipeline> cached_pipelines(id<MTLDevice> device) {
  std::lock_guard<std::mutex> lock(mutex());
  std::vector<CachedPipeline> out;
  for (const auto& [key, pipeline] : pipelines()) {
    if (key.device == reinterpret_cast<uintptr_t>(device)) out.push_back({key.name, key.constants, pipeline});
  }
  return out;
}

id<MTLDevice> metal_device(std::string* source) {
  id<MTLDevice> device = nil;
  try {
    device = at::mps::MPSDevice::getInstance()->device();  // nil where PyTorch declines every GPU
  } catch (const std::exception&) {
    device = nil;  // a PyTorch that refuses this macOS: look for a device ourselves
  }
  if (device != nil) {
    if (source != nullptr) *source = "torch";
    return device;
  }
  // The first device Metal lists. Each distinct device is retained once and
  // kept for the process (Metal's device objects are long-lived singletons),
  // so the pointer stays valid after the array is released.
  static std::mutex kept_mutex;
  static auto* kept = new std::vector<id<MTLDevice>>();
  NSArray<id<MTLDevice>>* all = MTLCopyAllDevices();  // +1 (Create rule)
  if (all != nil) {
    if ([all count] > 0) device = [all objectAtIndex:0];
    std::lock_guard<std::mutex> lock(kept_mutex);
    if (device != nil && std::find(kept->begin(), kept->end(), device) == kept->end()) {
      kept->push_back([device retain]);
    }
    [all release];
  }
  if (device != nil && source != nullptr) *source = "MTLCopyAllDevices";
  return device;
}

}  // namespace flash_metal::mps
