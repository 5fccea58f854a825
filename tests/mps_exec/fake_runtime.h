// Internals shared by the fakes of tests/mps_exec (never shipped): object
// bookkeeping for the fake Foundation/Metal classes, the recording the
// Python harness reads, and the knobs it sets. Objective-C++ (include from
// .mm files only), compiled against the Apple declarations in
// tests/mps_syntax/stubs/, so every fake implements exactly that API.
//
// Objects. Under the GCC Objective-C runtime a class with no instance
// variables has an instance size of 1 byte, and the stubs' NSObject declares
// no `isa`, so no fake declares instance variables: +alloc reserves room for
// the class pointer, and each object's state lives in a side table keyed by
// its address (retain count, a C++ payload). An object whose count reaches 0
// loses its payload but keeps its entry, as a zombie: a later message to it,
// or one release too many, is recorded as an error instead of corrupting
// memory, and its address is never reused.
#pragma once

#include <Foundation/Foundation.h>
#include <Metal/Metal.h>

#include <cstdint>
#include <cstdlib>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace fm_exec {

// Per-object state of one fake class (a subclass per class).
struct Payload {
  virtual ~Payload() = default;
};

// Lifetime, with Cocoa's manual retain/release rules.
id allocate_object(Class cls);                        // +alloc: count 1, no payload yet
void set_payload(id object, std::unique_ptr<Payload> payload);
Payload* payload_of(id object);                        // nullptr for dead or unknown objects
void retain(id object);
void release(id object);                               // at 0: payload destroyed, object becomes a zombie
void autorelease(id object);                           // records an error when no pool is in place
void push_autorelease_pool();
void pop_autorelease_pool();                           // releases what was autoreleased since the push
// True if `object` is a live fake; else records "<what> sent to a deallocated/unknown object".
bool check_alive(id object, const char* what);

template <class P>
P* payload(id object) {
  return dynamic_cast<P*>(payload_of(object));
}

// Foundation helpers for the Metal fakes.
std::string string_of(NSString* s);                    // "" for nil
std::string url_path(NSURL* url);
NSError* make_error(const std::string& description);   // autoreleased, like Cocoa's out-errors
NSString* autoreleased_string(const std::string& text);
NSArray<NSString*>* autoreleased_string_array(const std::vector<std::string>& items);
NSArray* new_array(const std::vector<id>& items);      // +1 (the Create rule); retains each item
// The label property of any fake Metal object (nil until set).
NSString* label_of(id object);
void set_label(id object, NSString* label, const char* what);
int64_t retain_count(id object);
// A stub-declared API the fakes do not model: records an error naming it.
void unmodelled(const std::string& what);

// The recording: a list of JSON objects (events) plus errors (strings).
void record(const std::string& json_object);
void record_error(const std::string& message);
std::string quote(const std::string& text);            // a JSON string literal
std::string id_of(id object);                          // an object's address, for the recording
std::string constants_json(const std::map<NSUInteger, bool>& constants);  // {"0":true,...}

// dispatch_sync bookkeeping: the queue the calling thread is running on.
dispatch_queue_t current_queue();
dispatch_queue_t stream_queue();                        // the fake MPS stream's serial queue

// The process's fake device.
id<MTLDevice> device();
// The stream's shared compute encoder, as MPSStream::commandEncoder() hands it
// out: the open one, or a new one (no bindings) once the previous has ended.
id<MTLComputeCommandEncoder> stream_encoder();
// What MPSStream::synchronize does first (endKernelCoalescing): ends the open
// encoder, if any. The ended encoder stays alive (its command buffer holds
// it), and every later call on it is recorded as an error.
void end_stream_encoder(const std::string& why);

// Knobs set by the harness (fm_exec_configure), read by the fakes.
struct Knobs {
  // Why 1024: the largest threadgroup any Apple GPU accepts, the value a
  // pipeline with modest register use reports.
  uint64_t max_threads_per_threadgroup = 1024;
  // Why 0: our kernels declare no static threadgroup arrays; all tiles are
  // bound with setThreadgroupMemoryLength.
  uint64_t static_threadgroup_memory = 0;
  // Why 32 KiB: maxThreadgroupMemoryLength of every Apple-silicon GPU.
  uint64_t max_threadgroup_memory = 32768;
  // Kernel names a runtime-compiled library contains (newLibraryWithSource:);
  // empty: the compile fails with runtime_compile_error.
  std::vector<std::string> runtime_kernels;
  std::string runtime_compile_error = "fake runtime compiler: no kernel names were configured";
  // The macOS version @available(macOS X.Y, *) sees, as 100 * X + Y. Why
  // 1500: macOS 15, the newest branch the host has.
  uint64_t macos_version = 1500;
  // 1: PyTorch's profiler is on (torch.mps.profiler, PYTORCH_MPS_LOG_PROFILE_INFO):
  // endProfileKernel then synchronizes the stream, ending its shared encoder.
  uint64_t profiling = 0;
  // 1: at::mps::MPSDevice::device() returns the fake device; 0: nil, as when
  // PyTorch declines every GPU.
  uint64_t torch_mps_device = 1;
  // 1: MTLCreateSystemDefaultDevice() returns the fake device. Why 0 by
  // default: it can return nil in a process without a window-server session
  // on Apple silicon (CI jobs, ssh), so the host must not depend on it.
  uint64_t system_default_device = 0;
  // How many devices MTLCopyAllDevices() lists (each the one fake device);
  // 0: a Mac without a usable GPU.
  uint64_t metal_devices = 1;
  // Worker threads of dispatch_apply. Why 4: about libdispatch's width on
  // the macOS runners (a thread per core; GitHub's arm64 runners have 3),
  // and more than this machine's 2 cores, so the threads really interleave.
  uint64_t dispatch_apply_threads = 4;
  // How long each newComputePipelineStateWithFunction: takes, in
  // microseconds. Why 0 by default: the suite's many builds stay fast; the
  // concurrency tests set it so that builds overlap whenever the host lets them.
  uint64_t pipeline_compile_us = 0;
  // 0: the device is "flash_metal mps_exec fake device", an Apple8 GPU (the
  // planner takes an unknown name for its base chip, M3). N: "Apple M<N>", of
  // that generation's family (M5: Apple10), for the tensor-op gate (issue 21).
  uint64_t device_generation = 0;
  // Kernels whose pipelines the fake compiler rejects (fm_exec_set_failing_pipelines).
  std::vector<std::string> failing_pipelines;
};
Knobs& knobs();

// The header line of a fake metallib (a text file: this line, then one
// kernel name per line); newLibraryWithURL: rejects any other file.
constexpr const char* kFakeMetallibMagic = "flash_metal fake metallib v1";

}  // namespace fm_exec

// Payloads the encoder (fake_encoder.mm) reads from objects fake_metal.mm makes.
struct BufferPayload : fm_exec::Payload {
  void* memory = nullptr;
  NSUInteger length = 0;
  ~BufferPayload() override { std::free(memory); }
};
struct PipelinePayload : fm_exec::Payload {
  std::string kernel;
  std::map<NSUInteger, bool> constants;
  uint64_t max_threads = 0;
  uint64_t static_memory = 0;
};

// The label and device properties every Metal object has. Labels are kept
// (they show in Xcode's captures); devices are the one fake device.
#define FM_LABEL(Protocol)                                           \
  -(NSString*)label {                                                \
    return fm_exec::label_of(self);                                  \
  }                                                                  \
  -(void)setLabel : (NSString*)label {                               \
    fm_exec::set_label(self, label, "-[" #Protocol " setLabel:]"); \
  }
#define FM_LABEL_AND_DEVICE(Protocol) \
  FM_LABEL(Protocol)                  \
  -(id<MTLDevice>)device {            \
    return fm_exec::device();         \
  }

// Fakes other files of the harness create or inspect.
@interface FakeBuffer : NSObject <MTLBuffer>
- (instancetype)initWithLength:(NSUInteger)length;
- (void*)contents;
- (NSUInteger)length;
@end

@interface NSAutoreleasePool : NSObject
- (void)drain;
@end
