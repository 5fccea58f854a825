// flash_metal::metal_device_info on macOS builds: what the Metal device, the
// OS and the shader library report, as JSON (keys at the schema, in
// csrc/flash_metal.cpp; the writer in csrc/device_info.h). Thin: it asks
// Metal and library.mm, and decides nothing. Never throws for a missing
// device or a library that does not load: those are reported, since this is
// what a first Mac user or a CI job pastes into an issue.
#include "device_info.h"
#include "library.h"
#include "metal/plan.h"

#include <Foundation/Foundation.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <string>
#include <vector>

namespace flash_metal::mps {
namespace {

namespace json = flash_metal::device_info;

// Apple's documented MTLGPUFamily values for the two families newer than the
// oldest SDK this file must build with (the macOS 14 SDK, Xcode 15): the
// constants themselves are spelled only in newer SDKs. PyTorch's MPS code
// asks for Apple10 by its value the same way.
// https://developer.apple.com/documentation/metal/mtlgpufamily/apple10?language=objc
constexpr NSInteger kGPUFamilyApple10 = 1010;
// https://developer.apple.com/documentation/metal/mtlgpufamily/metal4?language=objc
constexpr NSInteger kGPUFamilyMetal4 = 5002;

// An error's message without the C++ backtrace c10::Error may append.
std::string message_of(const std::exception& e) {
  if (const auto* c10_error = dynamic_cast<const c10::Error*>(&e)) return c10_error->what_without_backtrace();
  return e.what();
}

// Each family is asked only on a macOS that knows it (each check below
// names the release that introduced it), and reported null otherwise.
std::string families_json(id<MTLDevice> device) {
  json::Object o;
  const auto ask = [&](const char* name, NSInteger family) {
    o.flag(name, [device supportsFamily:static_cast<MTLGPUFamily>(family)]);
  };
  if (@available(macOS 11.0, *)) {
    ask("Apple7", MTLGPUFamilyApple7);
  } else {
    o.null("Apple7");
  }
  if (@available(macOS 13.0, *)) {
    ask("Apple8", MTLGPUFamilyApple8);
  } else {
    o.null("Apple8");
  }
  if (@available(macOS 14.0, *)) {
    ask("Apple9", MTLGPUFamilyApple9);
  } else {
    o.null("Apple9");
  }
  if (@available(macOS 26.0, *)) {
    ask("Apple10", kGPUFamilyApple10);
  } else {
    o.null("Apple10");
  }
  ask("Mac2", MTLGPUFamilyMac2);  // macOS 10.15, older than any macOS PyTorch runs on
  if (@available(macOS 13.0, *)) {
    ask("Metal3", MTLGPUFamilyMetal3);
  } else {
    o.null("Metal3");
  }
  if (@available(macOS 26.0, *)) {
    ask("Metal4", kGPUFamilyMetal4);
  } else {
    o.null("Metal4");
  }
  return o.json();
}

// The caller's thread may have no autorelease pool: each function that gets
// autoreleased objects (names) opens its own and copies out before it drains.
std::string macos_json() {
  NSOperatingSystemVersion v{};
  @autoreleasepool {
    v = [[NSProcessInfo processInfo] operatingSystemVersion];
  }
  const std::string version =
      std::to_string(v.majorVersion) + "." + std::to_string(v.minorVersion) + "." + std::to_string(v.patchVersion);
  return json::Object()
      .str("version", version)
      .num("major", v.majorVersion)
      .num("minor", v.minorVersion)
      .num("patch", v.patchVersion)
      .json();
}

std::string name_of(id<MTLDevice> device) {
  std::string name;
  @autoreleasepool {
    NSString* ns = [device name];
    if (ns != nil && [ns UTF8String] != nullptr) name = [ns UTF8String];
  }
  return name;
}

// Whether this process runs the tensor-op kernels: the routing's own rule
// (tensor_ops_problem), on the spec the MPS host plans with (the device's name).
std::string tensor_ops_json(id<MTLDevice> device) {
  const GpuSpec spec = gpu_from_device_name(name_of(device));
  const auto library = [device] { return tensor_ops_library_problem(device); };
  return json::tensor_ops(tensor_ops_problem(spec.family, false, library),
                          tensor_ops_problem(spec.family, true, library), spec.family);
}

std::string device_json(id<MTLDevice> device, const std::string& source) {
  const std::string name = name_of(device);
  const MTLSize most = [device maxThreadsPerThreadgroup];
  return json::Object()
      .str("name", name)
      .unum("registry_id", [device registryID])
      .str("source", source)
      .flag("has_unified_memory", [device hasUnifiedMemory])
      .unum("max_threadgroup_memory_length", [device maxThreadgroupMemoryLength])
      .raw("max_threads_per_threadgroup", "[" + std::to_string(most.width) + "," + std::to_string(most.height) +
                                              "," + std::to_string(most.depth) + "]")
      .raw("families", families_json(device))
      .json();
}

std::string library_json(id<MTLDevice> device, bool* loaded) {
  json::Object o;
  try {
    const LibraryInfo info = library_info(device);
    *loaded = true;
    return o.str("kind", info.kind)
        .str("path", info.path)
        .str("reason", info.reason)
        .str("origin", info.origin)
        .null("error")
        .json();
  } catch (const std::exception& e) {
    *loaded = false;
    return o.null("kind").null("path").null("reason").null("origin").str("error", message_of(e)).json();
  }
}

std::string constants_of(const std::vector<bool>& constants) {
  std::string s;
  for (bool c : constants) s += c ? '1' : '0';
  return s;
}

// Builds every pipeline the planner can name (all_metal_launches), all at
// once (get_pipelines), each failure reported instead of thrown. Returns the
// errors as JSON objects.
std::vector<std::string> build_every_pipeline(id<MTLDevice> device) {
  const std::vector<MetalLaunch> launches = all_metal_launches();
  std::vector<PipelineRequest> requests;
  for (const MetalLaunch& launch : launches) requests.push_back({launch.kernel_name, launch.function_constants});
  const std::vector<PipelineResult> results = get_pipelines(device, requests);  // the library is already loaded
  std::vector<std::string> errors;
  for (size_t i = 0; i < launches.size(); ++i) {
    if (results[i].error.empty()) continue;
    errors.push_back(json::Object()
                         .str("kernel", launches[i].kernel_name)
                         .str("function_constants", constants_of(launches[i].function_constants))
                         .str("error", results[i].error)
                         .json());
  }
  return errors;
}

std::string pipelines_json(id<MTLDevice> device) {
  std::vector<CachedPipeline> cached = cached_pipelines(device);
  std::sort(cached.begin(), cached.end(), [](const CachedPipeline& a, const CachedPipeline& b) {
    return a.kernel_name != b.kernel_name ? a.kernel_name < b.kernel_name : a.constants < b.constants;
  });
  std::string out = "[";
  for (const CachedPipeline& c : cached) {
    if (out.size() > 1) out += ",";
    out += json::Object()
               .str("kernel", c.kernel_name)
               .str("function_constants", c.constants)
               .unum("max_total_threads_per_threadgroup", c.pipeline.max_threads_per_threadgroup)
               .unum("thread_execution_width", c.pipeline.thread_execution_width)
               .unum("static_threadgroup_memory_length", c.pipeline.static_threadgroup_memory)
               .json();
  }
  return out + "]";
}

std::string metal_device_info(bool build_pipelines) {
  const std::string macos = macos_json();
  std::string source;
  id<MTLDevice> device = metal_device(&source);
  if (device == nil) {
    return json::unavailable(
        "no Metal device: PyTorch's MPS device is unavailable and MTLCopyAllDevices() lists none", true, macos);
  }
  bool loaded = false;
  const std::string library = library_json(device, &loaded);
  std::vector<std::string> errors;
  if (loaded && build_pipelines) errors = build_every_pipeline(device);
  std::string error_list = "[";
  for (const std::string& e : errors) error_list += (error_list.size() > 1 ? "," : "") + e;
  error_list += "]";
  return json::Object()
      .num("schema", json::kSchemaVersion)
      .flag("available", true)
      .null("reason")
      .flag("mps_backend", true)
      .raw("macos", macos)
      .raw("device", device_json(device, source))
      .raw("library", library)
      .raw("pipelines", pipelines_json(device))
      .raw("pipeline_errors", error_list)
      .raw("tensor_ops", tensor_ops_json(device))
      .json();
}

}  // namespace

// No tensor arguments, so no backend key: CompositeExplicitAutograd, which
// the dispatcher prefers over csrc/device_info.cpp's CompositeImplicitAutograd
// fallback that every build registers.
TORCH_LIBRARY_IMPL(flash_metal, CompositeExplicitAutograd, m) {
  m.impl("metal_device_info", &metal_device_info);
}

}  // namespace flash_metal::mps
