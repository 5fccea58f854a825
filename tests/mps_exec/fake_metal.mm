// A recording fake of the Metal API flash_metal's host uses: device,
// library, function, pipeline state, buffer, compile options and function
// constant values (the compute encoder and dispatch_sync are in
// fake_encoder.mm), and the harness's C API. Implements
// the declarations in tests/mps_syntax/stubs/ (the build turns a missing
// protocol method into an error), records every call the Python harness
// replays into the Metal emulator, and checks the Metal rules the emulator
// cannot see (see record_error calls). Never shipped.
#include "fake_runtime.h"

#include "device_info.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <mutex>
#include <set>
#include <sstream>
#include <thread>

namespace fm_exec {
namespace {

std::mutex& recording_mutex() {
  static std::mutex m;
  return m;
}
std::vector<std::string>& events() {
  static auto* v = new std::vector<std::string>();
  return *v;
}
std::vector<std::string>& errors() {
  static auto* v = new std::vector<std::string>();
  return *v;
}

}  // namespace

std::string id_of(id object) { return std::to_string(reinterpret_cast<uintptr_t>(object)); }

std::string constants_json(const std::map<NSUInteger, bool>& constants) {
  std::string out = "{";
  for (const auto& [index, value] : constants) {
    if (out.size() > 1) out += ",";
    out += "\"" + std::to_string(index) + "\":" + (value ? "true" : "false");
  }
  return out + "}";
}

void record(const std::string& json_object) {
  std::lock_guard<std::mutex> lock(recording_mutex());
  events().push_back(json_object);
}

void record_error(const std::string& message) {
  std::lock_guard<std::mutex> lock(recording_mutex());
  errors().push_back(message);
}

// One JSON quoting for the recording and the product's device_info answer
// (csrc/device_info.h: RFC 8259 escaping).
std::string quote(const std::string& text) { return flash_metal::device_info::quote(text); }

Knobs& knobs() {
  static Knobs k;
  return k;
}

}  // namespace fm_exec

// --- payloads -------------------------------------------------------------------------------

namespace {

struct LibraryPayload : fm_exec::Payload {
  std::string origin;  // "metallib <path>" or "source"
  std::set<std::string> kernels;
};
struct FunctionPayload : fm_exec::Payload {
  std::string name;
  std::map<NSUInteger, bool> constants;
};
struct CompileOptionsPayload : fm_exec::Payload {
  std::map<std::string, int64_t> set;  // options the host set explicitly
};
struct ConstantValuesPayload : fm_exec::Payload {
  std::map<NSUInteger, bool> values;
};

}  // namespace

// --- buffers --------------------------------------------------------------------------------

@implementation FakeBuffer
- (instancetype)initWithLength:(NSUInteger)length {
  auto p = std::make_unique<BufferPayload>();
  // Why 16 KiB alignment: Apple-silicon pages, which MTLBuffers start on.
  // Why the 0xFF fill: NaN in float32, float16 and bfloat16 alike, so any
  // element a kernel never writes fails the oracle comparison.
  const size_t rounded = (length + 16383) / 16384 * 16384;
  p->memory = std::aligned_alloc(16384, rounded == 0 ? 16384 : rounded);
  std::memset(p->memory, 0xFF, rounded == 0 ? 16384 : rounded);
  p->length = length;
  fm_exec::set_payload(self, std::move(p));
  return self;
}
- (void*)contents {
  if (!fm_exec::check_alive(self, "-[MTLBuffer contents]")) return nullptr;
  return fm_exec::payload<BufferPayload>(self)->memory;
}
- (NSUInteger)length {
  if (!fm_exec::check_alive(self, "-[MTLBuffer length]")) return 0;
  return fm_exec::payload<BufferPayload>(self)->length;
}
FM_LABEL_AND_DEVICE(MTLBuffer)
@end

// --- compile options and function constants -------------------------------------------------

namespace {
void set_option(MTLCompileOptions* options, const char* name, int64_t value) {
  if (!fm_exec::check_alive(options, "an MTLCompileOptions setter")) return;
  fm_exec::payload<CompileOptionsPayload>(options)->set[name] = value;
}
int64_t get_option(MTLCompileOptions* options, const char* name, int64_t metal_default) {
  if (!fm_exec::check_alive(options, "an MTLCompileOptions getter")) return metal_default;
  const auto& set = fm_exec::payload<CompileOptionsPayload>(options)->set;
  auto it = set.find(name);
  return it == set.end() ? metal_default : it->second;
}
}  // namespace

// The macOS 15 options exist at run time on macOS 15 whatever SDK the host
// was built with (library.mm declares them itself for older SDKs), so the
// fake implements them in every SDK view; in the SDK-14 view, where the stubs
// lack their types, with the enums' underlying integer type.
#if defined(__MAC_15_0)
using FmMathMode = MTLMathMode;
using FmMathFloatingPointFunctions = MTLMathFloatingPointFunctions;
#else
using FmMathMode = NSInteger;
using FmMathFloatingPointFunctions = NSInteger;
#endif
// Metal's values (https://developer.apple.com/documentation/metal/mtlmathmode,
// .../mtlmathfloatingpointfunctions and .../mtllanguageversion/version3_2).
constexpr int64_t kMathModeFast = 2, kMathFloatingPointFunctionsFast = 0, kLanguageVersion3_2 = (3 << 16) + 2;

@implementation MTLCompileOptions
- (instancetype)init {
  fm_exec::set_payload(self, std::make_unique<CompileOptionsPayload>());
  return self;
}
- (MTLLanguageVersion)languageVersion {
  // Metal's default is the newest version the OS supports; 3.2 = macOS 15.
  return static_cast<MTLLanguageVersion>(get_option(self, "languageVersion", kLanguageVersion3_2));
}
- (void)setLanguageVersion:(MTLLanguageVersion)languageVersion {
  set_option(self, "languageVersion", static_cast<int64_t>(languageVersion));
}
- (BOOL)fastMathEnabled {
  return get_option(self, "fastMathEnabled", 1) != 0;  // Metal's default: fast math on
}
- (void)setFastMathEnabled:(BOOL)fastMathEnabled {
  set_option(self, "fastMathEnabled", fastMathEnabled ? 1 : 0);
}
- (FmMathMode)mathMode {
  return static_cast<FmMathMode>(get_option(self, "mathMode", kMathModeFast));  // Metal's default
}
- (void)setMathMode:(FmMathMode)mathMode {
  set_option(self, "mathMode", mathMode);
}
- (FmMathFloatingPointFunctions)mathFloatingPointFunctions {
  return static_cast<FmMathFloatingPointFunctions>(
      get_option(self, "mathFloatingPointFunctions", kMathFloatingPointFunctionsFast));  // Metal's default
}
- (void)setMathFloatingPointFunctions:(FmMathFloatingPointFunctions)mathFloatingPointFunctions {
  set_option(self, "mathFloatingPointFunctions", mathFloatingPointFunctions);
}
- (NSDictionary*)preprocessorMacros {
  return nil;  // none set: the only value the fake models
}
- (void)setPreprocessorMacros:(NSDictionary*)preprocessorMacros {
  if (preprocessorMacros != nil) fm_exec::unmodelled("-[MTLCompileOptions setPreprocessorMacros:] with macros");
}
@end

@implementation MTLFunctionConstantValues
- (instancetype)init {
  fm_exec::set_payload(self, std::make_unique<ConstantValuesPayload>());
  return self;
}
- (void)setConstantValue:(const void*)value type:(MTLDataType)type atIndex:(NSUInteger)index {
  if (!fm_exec::check_alive(self, "-[MTLFunctionConstantValues setConstantValue:type:atIndex:]")) return;
  if (type != MTLDataTypeBool) {
    fm_exec::record_error("setConstantValue: type " + std::to_string(type) +
                          " is not modelled by the fake (only MTLDataTypeBool)");
    return;
  }
  fm_exec::payload<ConstantValuesPayload>(self)->values[index] = *static_cast<const bool*>(value);
}
- (void)setConstantValue:(const void*)value type:(MTLDataType)type withName:(NSString*)name {
  fm_exec::unmodelled("-[MTLFunctionConstantValues setConstantValue:type:withName:]");
}
- (void)setConstantValues:(const void*)values type:(MTLDataType)type withRange:(NSRange)range {
  for (NSUInteger i = 0; i < range.length; ++i) {
    [self setConstantValue:static_cast<const bool*>(values) + i type:type atIndex:range.location + i];
  }
}
@end

// --- library, function, pipeline ------------------------------------------------------------

@interface FakeFunction : NSObject <MTLFunction>
@end
@implementation FakeFunction
- (NSString*)name {
  if (!fm_exec::check_alive(self, "-[MTLFunction name]")) return nil;
  return fm_exec::autoreleased_string(fm_exec::payload<FunctionPayload>(self)->name);
}
- (id<MTLDevice>)device {
  return fm_exec::device();
}
@end

@interface FakeLibrary : NSObject <MTLLibrary>
@end
@implementation FakeLibrary
- (id<MTLFunction>)newFunctionWithName:(NSString*)name
                        constantValues:(MTLFunctionConstantValues*)constantValues
                                 error:(NSError**)error {
  if (!fm_exec::check_alive(self, "-[MTLLibrary newFunctionWithName:constantValues:error:]")) return nil;
  const std::string kernel = fm_exec::string_of(name);
  const auto* lib = fm_exec::payload<LibraryPayload>(self);
  const auto* values = fm_exec::payload<ConstantValuesPayload>(constantValues);
  const bool found = lib->kernels.count(kernel) != 0;
  const std::map<NSUInteger, bool> constants = values != nullptr ? values->values : std::map<NSUInteger, bool>{};
  fm_exec::record("{\"op\":\"newFunctionWithName\",\"name\":" + fm_exec::quote(kernel) + ",\"found\":" +
                  (found ? "true" : "false") + ",\"constants\":" + fm_exec::constants_json(constants) + "}");
  if (!found) {
    if (error != nullptr) *error = fm_exec::make_error("Function " + kernel + " was not found in the library");
    return nil;
  }
  FakeFunction* function = [[FakeFunction alloc] init];
  auto p = std::make_unique<FunctionPayload>();
  p->name = kernel;
  p->constants = constants;
  fm_exec::set_payload(function, std::move(p));
  return function;
}
- (id<MTLFunction>)newFunctionWithName:(NSString*)functionName {
  fm_exec::unmodelled("-[MTLLibrary newFunctionWithName:] (without constant values)");
  return nil;
}
- (NSArray<NSString*>*)functionNames {
  if (!fm_exec::check_alive(self, "-[MTLLibrary functionNames]")) return nil;
  std::vector<std::string> names(fm_exec::payload<LibraryPayload>(self)->kernels.begin(),
                                 fm_exec::payload<LibraryPayload>(self)->kernels.end());
  return fm_exec::autoreleased_string_array(names);
}
FM_LABEL(MTLLibrary)
@end

@interface FakePipeline : NSObject <MTLComputePipelineState>
@end
@implementation FakePipeline
- (NSUInteger)maxTotalThreadsPerThreadgroup {
  if (!fm_exec::check_alive(self, "-[MTLComputePipelineState maxTotalThreadsPerThreadgroup]")) return 0;
  return fm_exec::payload<PipelinePayload>(self)->max_threads;
}
- (NSUInteger)staticThreadgroupMemoryLength {
  if (!fm_exec::check_alive(self, "-[MTLComputePipelineState staticThreadgroupMemoryLength]")) return 0;
  return fm_exec::payload<PipelinePayload>(self)->static_memory;
}
- (NSUInteger)threadExecutionWidth {
  return 32;  // Why 32: the SIMD-group width of every Apple GPU
}
- (NSString*)label {
  return nil;  // pipelines built without a descriptor have no label
}
- (id<MTLDevice>)device {
  return fm_exec::device();
}
@end

// --- device -----------------------------------------------------------------------------------

@interface FakeDevice : NSObject <MTLDevice>
@end
@implementation FakeDevice
- (id<MTLLibrary>)newLibraryWithURL:(NSURL*)url error:(NSError**)error {
  if (!fm_exec::check_alive(self, "-[MTLDevice newLibraryWithURL:error:]")) return nil;
  const std::string path = fm_exec::url_path(url);
  fm_exec::record("{\"op\":\"newLibraryWithURL\",\"path\":" + fm_exec::quote(path) + "}");
  std::ifstream in(path);
  std::string line;
  if (!in || !std::getline(in, line) || line != fm_exec::kFakeMetallibMagic) {
    if (error != nullptr) {
      *error = fm_exec::make_error(in ? "fake Metal: " + path + " is not a metallib this device can load"
                                      : "fake Metal: cannot open " + path);
    }
    return nil;
  }
  auto p = std::make_unique<LibraryPayload>();
  p->origin = "metallib " + path;
  while (std::getline(in, line)) {
    if (!line.empty()) p->kernels.insert(line);
  }
  FakeLibrary* library = [[FakeLibrary alloc] init];
  fm_exec::set_payload(library, std::move(p));
  return library;
}
- (id<MTLLibrary>)newLibraryWithSource:(NSString*)source
                               options:(MTLCompileOptions*)options
                                 error:(NSError**)error {
  if (!fm_exec::check_alive(self, "-[MTLDevice newLibraryWithSource:options:error:]")) return nil;
  std::string set = "{";
  if (const auto* o = fm_exec::payload<CompileOptionsPayload>(options)) {
    for (const auto& [name, value] : o->set) {
      if (set.size() > 1) set += ",";
      set += fm_exec::quote(name) + ":" + std::to_string(value);
    }
  }
  set += "}";
  fm_exec::record("{\"op\":\"newLibraryWithSource\",\"source\":" + fm_exec::quote(fm_exec::string_of(source)) +
                  ",\"options\":" + set + "}");
  const fm_exec::Knobs& k = fm_exec::knobs();
  if (k.runtime_kernels.empty()) {
    if (error != nullptr) *error = fm_exec::make_error(k.runtime_compile_error);
    return nil;
  }
  auto p = std::make_unique<LibraryPayload>();
  p->origin = "source";
  p->kernels.insert(k.runtime_kernels.begin(), k.runtime_kernels.end());
  FakeLibrary* library = [[FakeLibrary alloc] init];
  fm_exec::set_payload(library, std::move(p));
  return library;
}
- (id<MTLComputePipelineState>)newComputePipelineStateWithFunction:(id<MTLFunction>)computeFunction
                                                             error:(NSError**)error {
  if (!fm_exec::check_alive(self, "-[MTLDevice newComputePipelineStateWithFunction:error:]")) return nil;
  const auto* f = fm_exec::payload<FunctionPayload>(computeFunction);
  if (f == nullptr) {
    fm_exec::record_error("newComputePipelineStateWithFunction: the function is not a live fake MTLFunction");
    if (error != nullptr) *error = fm_exec::make_error("fake Metal: invalid function");
    return nil;
  }
  // How many builds run at this moment, this one included: the recorded
  // maximum shows whether the host builds pipelines concurrently.
  static std::atomic<int> in_flight{0};
  const int concurrent = ++in_flight;
  const fm_exec::Knobs& k = fm_exec::knobs();
  if (k.pipeline_compile_us != 0) std::this_thread::sleep_for(std::chrono::microseconds(k.pipeline_compile_us));
  --in_flight;
  const bool fails = std::find(k.failing_pipelines.begin(), k.failing_pipelines.end(), f->name) !=
                     k.failing_pipelines.end();
  fm_exec::record("{\"op\":\"newComputePipelineState\",\"kernel\":" + fm_exec::quote(f->name) +
                  ",\"constants\":" + fm_exec::constants_json(f->constants) +
                  ",\"concurrent\":" + std::to_string(concurrent) + ",\"failed\":" + (fails ? "true" : "false") + "}");
  if (fails) {
    // What Metal's compiler service answers for a kernel it cannot build.
    if (error != nullptr) *error = fm_exec::make_error("fake Metal: compiler error in " + f->name + " (planted)");
    return nil;
  }
  auto p = std::make_unique<PipelinePayload>();
  p->kernel = f->name;
  p->constants = f->constants;
  p->max_threads = fm_exec::knobs().max_threads_per_threadgroup;
  p->static_memory = fm_exec::knobs().static_threadgroup_memory;
  FakePipeline* pipeline = [[FakePipeline alloc] init];
  fm_exec::set_payload(pipeline, std::move(p));
  return pipeline;
}
- (NSUInteger)maxThreadgroupMemoryLength {
  return fm_exec::knobs().max_threadgroup_memory;
}
- (NSString*)name {
  const uint64_t g = fm_exec::knobs().device_generation;
  return fm_exec::autoreleased_string(g ? "Apple M" + std::to_string(g) : "flash_metal mps_exec fake device");
}
- (uint64_t)registryID {
  return 0x100000abcULL;  // Why this value: any fixed IORegistry id; tests compare it
}
- (MTLSize)maxThreadsPerThreadgroup {
  return MTLSizeMake(1024, 1024, 1024);  // Why 1024: Apple silicon's per-dimension limit
}
- (BOOL)hasUnifiedMemory {
  return YES;  // Apple silicon
}
- (BOOL)supportsFamily:(MTLGPUFamily)gpuFamily {
  // An Apple8 (M2-class) GPU: what the fake claims to be, unless knob
  // device_generation names an M-generation: then its Apple family (M1 7, M2
  // 8, M3 and M4 9, M5 10; Apple's feature set tables), Metal4 from Apple9 on.
  const uint64_t g = fm_exec::knobs().device_generation;
  const int64_t apple = g == 0 ? 8 : g <= 3 ? 6 + static_cast<int64_t>(g) : g == 4 ? 9 : 5 + static_cast<int64_t>(g);
  const int64_t f = static_cast<int64_t>(gpuFamily);
  // MTLGPUFamilyApple<N> is 1000 + N (Apple's documented values; MTLGPUFamilyApple7 = 1007).
  if (f > 1000 && f <= 1020) return f - 1000 <= apple;
  constexpr int64_t kMetal4 = 5002;  // MTLGPUFamilyMetal4's documented value (device_info.mm)
  if (f == kMetal4) return apple >= 9;
  return gpuFamily == MTLGPUFamilyMetal3 || gpuFamily == MTLGPUFamilyMac2;
}
- (id<MTLCommandQueue>)newCommandQueue {
  fm_exec::unmodelled("-[MTLDevice newCommandQueue] (the host must use PyTorch's stream)");
  return nil;
}
- (id<MTLBuffer>)newBufferWithLength:(NSUInteger)length options:(MTLResourceOptions)options {
  fm_exec::record("{\"op\":\"newBufferWithLength\",\"length\":" + std::to_string(length) + "}");
  return [[FakeBuffer alloc] initWithLength:length];
}
@end

// Apple's Create rule: +1. The same device PyTorch's MPSDevice returns, or
// nil (the default; knob system_default_device), as in a non-interactive
// process on Apple silicon.
extern "C" id<MTLDevice> MTLCreateSystemDefaultDevice(void) {
  const bool found = fm_exec::knobs().system_default_device != 0;
  fm_exec::record(std::string("{\"op\":\"MTLCreateSystemDefaultDevice\",\"nil\":") + (found ? "false" : "true") + "}");
  return found ? [fm_exec::device() retain] : nil;
}

// The Create rule: a +1 array of knob metal_devices entries, each the one fake device.
extern "C" NSArray<id<MTLDevice>>* MTLCopyAllDevices(void) {
  const uint64_t n = fm_exec::knobs().metal_devices;
  fm_exec::record("{\"op\":\"MTLCopyAllDevices\",\"count\":" + std::to_string(n) + "}");
  return fm_exec::new_array(std::vector<id>(n, fm_exec::device()));
}

namespace fm_exec {

id<MTLDevice> device() {
  static FakeDevice* device = [[FakeDevice alloc] init];
  return device;
}

}  // namespace fm_exec

// --- the harness's C API (ctypes) ------------------------------------------------------------

#define FM_EXPORT extern "C" __attribute__((visibility("default")))

// {"events": [...], "errors": [...]} since the last call; then clears both.
FM_EXPORT const char* fm_exec_take_recording_json() {
  static thread_local std::string out;
  std::lock_guard<std::mutex> lock(fm_exec::recording_mutex());
  out = "{\"events\":[";
  for (size_t i = 0; i < fm_exec::events().size(); ++i) out += (i ? "," : "") + fm_exec::events()[i];
  out += "],\"errors\":[";
  for (size_t i = 0; i < fm_exec::errors().size(); ++i) out += (i ? "," : "") + fm_exec::quote(fm_exec::errors()[i]);
  out += "]}";
  fm_exec::events().clear();
  fm_exec::errors().clear();
  return out.c_str();
}

// Sets a numeric knob; returns 0, or -1 for an unknown name.
FM_EXPORT int fm_exec_configure(const char* name, uint64_t value) {
  fm_exec::Knobs& k = fm_exec::knobs();
  const std::string key = name;
  if (key == "max_threads_per_threadgroup") {
    k.max_threads_per_threadgroup = value;
  } else if (key == "static_threadgroup_memory") {
    k.static_threadgroup_memory = value;
  } else if (key == "max_threadgroup_memory") {
    k.max_threadgroup_memory = value;
  } else if (key == "macos_version") {
    k.macos_version = value;
  } else if (key == "profiling") {
    k.profiling = value;
  } else if (key == "torch_mps_device") {
    k.torch_mps_device = value;
  } else if (key == "system_default_device") {
    k.system_default_device = value;
  } else if (key == "metal_devices") {
    k.metal_devices = value;
  } else if (key == "dispatch_apply_threads") {
    k.dispatch_apply_threads = value;
  } else if (key == "pipeline_compile_us") {
    k.pipeline_compile_us = value;
  } else if (key == "device_generation") {
    k.device_generation = value;
  } else {
    return -1;
  }
  return 0;
}

// What newLibraryWithSource: produces: a library of these kernel names
// (newline-separated), or, if there are none, a failure with `error`.
FM_EXPORT void fm_exec_set_runtime_compile(const char* kernel_names, const char* error) {
  fm_exec::Knobs& k = fm_exec::knobs();
  k.runtime_kernels.clear();
  std::istringstream lines(kernel_names);
  for (std::string line; std::getline(lines, line);) {
    if (!line.empty()) k.runtime_kernels.push_back(line);
  }
  k.runtime_compile_error = error;
}

// Kernels (newline-separated) whose pipelines newComputePipelineStateWithFunction:
// rejects from now on; "" rejects none.
FM_EXPORT void fm_exec_set_failing_pipelines(const char* kernel_names) {
  fm_exec::Knobs& k = fm_exec::knobs();
  k.failing_pipelines.clear();
  std::istringstream lines(kernel_names);
  for (std::string line; std::getline(lines, line);) {
    if (!line.empty()) k.failing_pipelines.push_back(line);
  }
}

// What the build turns `@available(macOS major.minor, *)` into (_build.py).
FM_EXPORT bool fm_exec_macos_at_least(int major, int minor) {
  const uint64_t wanted = static_cast<uint64_t>(major) * 100 + static_cast<uint64_t>(minor);
  fm_exec::record("{\"op\":\"available\",\"macos\":\"" + std::to_string(major) + "." + std::to_string(minor) + "\"}");
  return fm_exec::knobs().macos_version >= wanted;
}
