// Loading flash_metal's shader library and caching its pipelines.
//
// Written for this project; the shape (one library per process, pipelines
// keyed by name and function constants behind a mutex) follows what
// PyTorch's MetalShaderLibrary does internally, without depending on that
// ATen-internal class. Manual retain/release: setup.py builds with
// -fno-objc-arc. No exception is ever thrown inside an @autoreleasepool
// (it would skip the pool's drain): errors are collected as strings and
// thrown after the pool has closed.
#include "library.h"
#include "shader_source.h"

#include <Foundation/Foundation.h>
#include <c10/util/Exception.h>

#include <dlfcn.h>

#include <cstdlib>
#include <fstream>
#include <mutex>
#include <unordered_map>

namespace flash_metal::mps {
namespace {

// File names inside the installed package directory (flash_metal/), as
// setup.py's BuildWithShaders writes them.
constexpr const char* kMetallibName = "flash_metal.metallib";
constexpr const char* kShaderSourceName = "shaders/attention.metal";
// Set to 1 to ignore the metallib and compile the shipped sources: lets a
// Mac with the full toolchain exercise the fallback path users without it get.
constexpr const char* kForceRuntimeCompileEnv = "FLASH_METAL_RUNTIME_COMPILE";
// Hint appended to build errors: the sources and the metallib come from one install.
constexpr const char* kReinstallHint = "reinstall flash_metal (pip install --no-build-isolation .)";

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

// The loaded library and where it came from (for error messages).
struct LoadedLibrary {
  id<MTLLibrary> library = nil;  // retained for the process lifetime
  std::string origin;            // e.g. "the precompiled /.../flash_metal.metallib"
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

id<MTLLibrary> compile_source(id<MTLDevice> device, const std::string& source, std::string* error) {
  id<MTLLibrary> library = nil;
  MTLCompileOptions* options = [[MTLCompileOptions alloc] init];
  // Metal 3.1 (macOS 14): the first version with bfloat, and the standard
  // setup.py's precompiled metallib uses (-std=metal3.1).
  [options setLanguageVersion:MTLLanguageVersion3_1];
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

LoadedLibrary load_library(id<MTLDevice> device) {
  const std::string dir = package_directory();
  const std::string metallib = dir + "/" + kMetallibName;
  const std::string source_path = dir + "/" + kShaderSourceName;
  const char* force = std::getenv(kForceRuntimeCompileEnv);
  const bool use_metallib = !(force != nullptr && std::string(force) == "1") && file_exists(metallib);

  LoadedLibrary out;
  std::string error;
  if (use_metallib) {
    out.origin = "the precompiled " + metallib;
    out.library = load_metallib(device, metallib, &error);
    TORCH_CHECK(out.library != nil, "flash_metal: cannot load ", out.origin, ": ", error, "; ", kReinstallHint);
    return out;
  }
  TORCH_CHECK(file_exists(source_path), "flash_metal: found neither ", metallib, " nor the shader sources ",
              source_path, "; ", kReinstallHint);
  std::string source;
  try {
    source = shader_source::inline_local_includes(source_path);
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "flash_metal: cannot assemble the shader sources: ", e.what(), "; ", kReinstallHint);
  }
  out.origin = "the shader sources " + source_path + " (compiled at run time: no metallib was installed)";
  out.library = compile_source(device, source, &error);
  TORCH_CHECK(out.library != nil, "flash_metal: Metal's runtime compiler rejected ", out.origin, ":\n", error);
  return out;
}

std::string cache_key(const std::string& name, const std::vector<bool>& constants) {
  std::string key = name + "/";
  for (bool c : constants) key += c ? '1' : '0';
  return key;
}

// Everything below is guarded by mutex().
std::mutex& mutex() {
  static std::mutex m;
  return m;
}
LoadedLibrary& library_slot() {
  static LoadedLibrary lib;
  return lib;
}
std::unordered_map<std::string, Pipeline>& pipelines() {
  static auto* map = new std::unordered_map<std::string, Pipeline>();  // leaked: outlives static destruction
  return *map;
}

Pipeline build_pipeline(id<MTLDevice> device, const LoadedLibrary& lib, const std::string& name,
                        const std::vector<bool>& constants) {
  std::string error;
  Pipeline p;
  MTLFunctionConstantValues* values = [[MTLFunctionConstantValues alloc] init];
  for (size_t i = 0; i < constants.size(); ++i) {
    bool value = constants[i];
    [values setConstantValue:&value type:MTLDataTypeBool atIndex:i];
  }
  @autoreleasepool {
    NSError* err = nil;
    id<MTLFunction> function = [lib.library newFunctionWithName:[NSString stringWithUTF8String:name.c_str()]
                                                 constantValues:values
                                                          error:&err];  // +1
    if (function == nil) {
      error = "kernel '" + name + "' is not in " + lib.origin + " (" + describe(err) +
              "). The library is probably stale, built from older shaders than this extension: " +
              kReinstallHint;
    } else {
      p.state = [device newComputePipelineStateWithFunction:function error:&err];  // +1, kept by the cache
      if (p.state == nil) error = "cannot build the pipeline of kernel '" + name + "': " + describe(err);
      [function release];
    }
  }
  [values release];
  TORCH_CHECK(p.state != nil, "flash_metal: ", error);
  p.max_threads_per_threadgroup = [p.state maxTotalThreadsPerThreadgroup];
  p.static_threadgroup_memory = [p.state staticThreadgroupMemoryLength];
  return p;
}

}  // namespace

Pipeline get_pipeline(id<MTLDevice> device, const std::string& name, const std::vector<bool>& constants) {
  std::lock_guard<std::mutex> lock(mutex());
  const std::string key = cache_key(name, constants);
  auto hit = pipelines().find(key);
  if (hit != pipelines().end()) return hit->second;

  LoadedLibrary& lib = library_slot();
  if (lib.library == nil) lib = load_library(device);  // throws leave the slot empty: the next call retries
  Pipeline p = build_pipeline(device, lib, name, constants);
  pipelines().emplace(key, p);
  return p;
}

}  // namespace flash_metal::mps
