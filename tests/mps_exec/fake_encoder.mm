// A recording fake of PyTorch's shared compute command encoder and of
// libdispatch's dispatch_sync, dispatch_apply and global queues, for the
// execution test (never shipped). The
// encoder implements the MTLComputeCommandEncoder declarations in
// tests/mps_syntax/stubs/, records every call for the Python harness to
// replay into the Metal emulator, and checks the Metal rules the emulator
// cannot see (see record_error calls): calls outside dispatch_sync on the
// stream's queue, calls on an ended encoder, argument-table indices, setBytes
// and threadgroup-memory sizes, offsets past a buffer's end.
#include "fake_runtime.h"

#include <algorithm>
#include <atomic>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace fm_exec {
namespace {

// Metal's argument table: indices 0..30 for buffers and threadgroup memory.
// Why 31: the documented limit of both tables on Apple silicon.
constexpr NSUInteger kArgumentTableSize = 31;
// setBytes:length:atIndex: is documented for data under 4 KiB.
constexpr NSUInteger kSetBytesLimit = 4096;
// setThreadgroupMemoryLength: lengths must be multiples of 16 bytes.
constexpr NSUInteger kThreadgroupMemoryGranule = 16;

// The queues dispatch_sync has entered on this thread, innermost last.
thread_local std::vector<dispatch_queue_t> queue_stack;

}  // namespace

dispatch_queue_t current_queue() { return queue_stack.empty() ? nullptr : queue_stack.back(); }

}  // namespace fm_exec

// --- the compute command encoder ------------------------------------------------------------

@interface FakeEncoder : NSObject <MTLComputeCommandEncoder>
@end

namespace {
struct EncoderPayload : fm_exec::Payload {
  uint64_t serial = 0;  // 1, 2, ...: the stream's encoders in order of creation
  bool ended = false;
};

// Common prefix of every encoder event: the call, the encoder, whether it ran
// inside dispatch_sync on the stream's queue, and whether the encoder had
// already ended (Metal's validation layer aborts on any call to an ended
// encoder; without it the call is undefined).
std::string encoder_event(id encoder, const char* op) {
  const bool on_queue = fm_exec::current_queue() != nullptr && fm_exec::current_queue() == fm_exec::stream_queue();
  if (!on_queue) fm_exec::record_error(std::string(op) + " called outside dispatch_sync on the stream's queue");
  const auto* p = fm_exec::payload<EncoderPayload>(encoder);
  const bool ended = p != nullptr && p->ended;
  if (ended) {
    fm_exec::record_error(std::string(op) + " sent to compute encoder #" + std::to_string(p->serial) +
                          ", which has ended: with profiling on, PyTorch's endProfileKernel synchronizes the stream "
                          "and so ends its shared encoder; fetch stream->commandEncoder() again for each dispatch");
  }
  return std::string("{\"op\":\"") + op + "\",\"on_stream_queue\":" + (on_queue ? "true" : "false") +
         ",\"encoder\":" + std::to_string(p != nullptr ? p->serial : 0) + ",\"ended\":" + (ended ? "true" : "false");
}

bool check_index(const char* op, NSUInteger index) {
  if (index < fm_exec::kArgumentTableSize) return true;
  fm_exec::record_error(std::string(op) + ": index " + std::to_string(index) + " is outside Metal's argument table");
  return false;
}
}  // namespace

@implementation FakeEncoder
- (void)setComputePipelineState:(id<MTLComputePipelineState>)state {
  if (!fm_exec::check_alive(self, "-[MTLComputeCommandEncoder setComputePipelineState:]")) return;
  const auto* p = fm_exec::payload<PipelinePayload>(state);
  if (p == nullptr) {
    fm_exec::record_error("setComputePipelineState: not a live fake pipeline");
    return;
  }
  fm_exec::record(encoder_event(self, "setComputePipelineState") + ",\"pipeline\":" + fm_exec::id_of(state) +
                  ",\"kernel\":" + fm_exec::quote(p->kernel) +
                  ",\"constants\":" + fm_exec::constants_json(p->constants) + "}");
}
- (void)setBuffer:(id<MTLBuffer>)buffer offset:(NSUInteger)offset atIndex:(NSUInteger)index {
  if (!fm_exec::check_alive(self, "-[MTLComputeCommandEncoder setBuffer:offset:atIndex:]")) return;
  check_index("setBuffer:offset:atIndex:", index);
  const auto* b = fm_exec::check_alive(buffer, "setBuffer:offset:atIndex: (its buffer argument)")
                      ? fm_exec::payload<BufferPayload>(buffer)
                      : nullptr;
  if (b == nullptr) {
    fm_exec::record_error("setBuffer:offset:atIndex: " + std::to_string(index) + " got no live fake MTLBuffer");
    return;
  }
  if (offset > b->length) {
    fm_exec::record_error("setBuffer:offset:atIndex: " + std::to_string(index) + ": offset " + std::to_string(offset) +
                          " is past the buffer's end (" + std::to_string(b->length) + " bytes)");
  }
  fm_exec::record(encoder_event(self, "setBuffer") + ",\"buffer\":" + fm_exec::id_of(buffer) + ",\"contents\":" +
                  std::to_string(reinterpret_cast<uintptr_t>(b->memory)) + ",\"length\":" +
                  std::to_string(b->length) + ",\"offset\":" + std::to_string(offset) +
                  ",\"index\":" + std::to_string(index) + "}");
}
- (void)setBytes:(const void*)bytes length:(NSUInteger)length atIndex:(NSUInteger)index {
  if (!fm_exec::check_alive(self, "-[MTLComputeCommandEncoder setBytes:length:atIndex:]")) return;
  check_index("setBytes:length:atIndex:", index);
  if (length > fm_exec::kSetBytesLimit) {
    fm_exec::record_error("setBytes:length:atIndex: " + std::to_string(length) + " bytes; Metal allows up to 4 KiB");
  }
  static const char* hex = "0123456789abcdef";
  std::string data;
  for (NSUInteger i = 0; i < length; ++i) {
    const auto byte = static_cast<const unsigned char*>(bytes)[i];
    data += hex[byte >> 4];
    data += hex[byte & 15];
  }
  fm_exec::record(encoder_event(self, "setBytes") + ",\"index\":" + std::to_string(index) + ",\"hex\":\"" + data + "\"}");
}
- (void)setThreadgroupMemoryLength:(NSUInteger)length atIndex:(NSUInteger)index {
  if (!fm_exec::check_alive(self, "-[MTLComputeCommandEncoder setThreadgroupMemoryLength:atIndex:]")) return;
  check_index("setThreadgroupMemoryLength:atIndex:", index);
  if (length % fm_exec::kThreadgroupMemoryGranule != 0) {
    fm_exec::record_error("setThreadgroupMemoryLength: " + std::to_string(length) +
                          " bytes is not a multiple of 16, as Metal requires");
  }
  fm_exec::record(encoder_event(self, "setThreadgroupMemoryLength") + ",\"length\":" + std::to_string(length) +
                  ",\"index\":" + std::to_string(index) + "}");
}
- (void)dispatchThreadgroups:(MTLSize)threadgroupsPerGrid threadsPerThreadgroup:(MTLSize)threadsPerThreadgroup {
  if (!fm_exec::check_alive(self, "-[MTLComputeCommandEncoder dispatchThreadgroups:threadsPerThreadgroup:]")) return;
  const MTLSize& g = threadgroupsPerGrid;
  const MTLSize& t = threadsPerThreadgroup;
  fm_exec::record(encoder_event(self, "dispatchThreadgroups") + ",\"grid\":[" + std::to_string(g.width) + "," +
                  std::to_string(g.height) + "," + std::to_string(g.depth) + "],\"threadgroup\":[" +
                  std::to_string(t.width) + "," + std::to_string(t.height) + "," + std::to_string(t.depth) + "]}");
}
- (void)endEncoding {
  fm_exec::record_error("endEncoding: the host ended PyTorch's shared compute encoder");
  fm_exec::record(encoder_event(self, "endEncoding") + "}");
}
- (void)setBufferOffset:(NSUInteger)offset atIndex:(NSUInteger)index {
  if (!fm_exec::check_alive(self, "-[MTLComputeCommandEncoder setBufferOffset:atIndex:]")) return;
  check_index("setBufferOffset:atIndex:", index);
  fm_exec::record(encoder_event(self, "setBufferOffset") + ",\"offset\":" + std::to_string(offset) +
                  ",\"index\":" + std::to_string(index) + "}");
}
- (void)setBuffers:(const id<MTLBuffer>[])buffers offsets:(const NSUInteger[])offsets withRange:(NSRange)range {
  for (NSUInteger i = 0; i < range.length; ++i) {
    [self setBuffer:buffers[i] offset:offsets[i] atIndex:range.location + i];
  }
}
- (void)dispatchThreads:(MTLSize)threadsPerGrid threadsPerThreadgroup:(MTLSize)threadsPerThreadgroup {
  if (!fm_exec::check_alive(self, "-[MTLComputeCommandEncoder dispatchThreads:threadsPerThreadgroup:]")) return;
  const MTLSize& g = threadsPerGrid;
  const MTLSize& t = threadsPerThreadgroup;
  fm_exec::record(encoder_event(self, "dispatchThreads") + ",\"threads\":[" + std::to_string(g.width) + "," +
                  std::to_string(g.height) + "," + std::to_string(g.depth) + "],\"threadgroup\":[" +
                  std::to_string(t.width) + "," + std::to_string(t.height) + "," + std::to_string(t.depth) + "]}");
}
- (void)memoryBarrierWithScope:(MTLBarrierScope)scope {
  fm_exec::record(encoder_event(self, "memoryBarrier") + "}");
}
- (void)useResource:(id<MTLResource>)resource usage:(MTLResourceUsage)usage {
  fm_exec::record(encoder_event(self, "useResource") + "}");
}
- (void)pushDebugGroup:(NSString*)string {
  fm_exec::record(encoder_event(self, "pushDebugGroup") + ",\"name\":" + fm_exec::quote(fm_exec::string_of(string)) + "}");
}
- (void)popDebugGroup {
  fm_exec::record(encoder_event(self, "popDebugGroup") + "}");
}
- (void)insertDebugSignpost:(NSString*)string {
  fm_exec::record(encoder_event(self, "insertDebugSignpost") + ",\"name\":" + fm_exec::quote(fm_exec::string_of(string)) +
                  "}");
}
FM_LABEL_AND_DEVICE(MTLComputeCommandEncoder)
@end

// --- libdispatch ---------------------------------------------------------------------------

@interface FakeQueue : NSObject <OS_dispatch_queue>
@end
@implementation FakeQueue
@end

extern "C" void dispatch_sync(dispatch_queue_t queue, dispatch_block_t block) {
  if (!fm_exec::check_alive(queue, "dispatch_sync")) return;
  const bool stream = queue == fm_exec::stream_queue();
  for (dispatch_queue_t q : fm_exec::queue_stack) {
    if (q == queue) {
      // A serial queue waiting on itself: libdispatch deadlocks (or traps).
      fm_exec::record_error("dispatch_sync onto a queue this thread is already running on: deadlock on macOS");
      return;
    }
  }
  fm_exec::record(std::string("{\"op\":\"dispatch_sync\",\"stream_queue\":") + (stream ? "true" : "false") + "}");
  fm_exec::queue_stack.push_back(queue);
  try {
    block();
  } catch (...) {
    // Exceptions cannot cross libdispatch: on macOS the process would abort.
    fm_exec::record_error("an exception escaped a dispatch_sync block: libdispatch would terminate the process");
  }
  fm_exec::queue_stack.pop_back();
  fm_exec::record("{\"op\":\"dispatch_sync_end\"}");
}

@interface FakeGlobalQueue : NSObject <OS_dispatch_queue_global>
@end
@implementation FakeGlobalQueue
@end

namespace {
// One global concurrent queue per identifier, alive for the process, as
// libdispatch's (retain and release do nothing to them).
std::mutex& global_queues_mutex() {
  static std::mutex m;
  return m;
}
std::vector<std::pair<long, FakeGlobalQueue*>>& global_queues() {
  static auto* queues = new std::vector<std::pair<long, FakeGlobalQueue*>>();
  return *queues;
}
bool is_global_queue(dispatch_queue_t queue) {
  std::lock_guard<std::mutex> lock(global_queues_mutex());
  for (const auto& entry : global_queues()) {
    if (entry.second == queue) return true;
  }
  return false;
}
}  // namespace

extern "C" dispatch_queue_global_t dispatch_get_global_queue(long identifier, unsigned long flags) {
  if (flags != 0) fm_exec::record_error("dispatch_get_global_queue: flags are reserved and must be 0");
  std::lock_guard<std::mutex> lock(global_queues_mutex());
  for (const auto& [id, queue] : global_queues()) {
    if (id == identifier) return queue;
  }
  global_queues().emplace_back(identifier, [[FakeGlobalQueue alloc] init]);
  return global_queues().back().second;
}

// Real threads, as libdispatch's: knob dispatch_apply_threads workers take
// the iterations in turn from a shared counter (libdispatch's own scheme) and
// the call returns when all are done. Races in the code the block calls are
// real races here. An exception escaping the block is recorded (on macOS it
// would terminate the process) and the remaining iterations still run.
extern "C" void dispatch_apply(size_t iterations, dispatch_queue_t queue, void (^block)(size_t)) {
  if (!fm_exec::check_alive(queue, "dispatch_apply")) return;
  const size_t threads = std::max<size_t>(1, std::min<size_t>(iterations, fm_exec::knobs().dispatch_apply_threads));
  const bool global = is_global_queue(queue);
  fm_exec::record("{\"op\":\"dispatch_apply\",\"iterations\":" + std::to_string(iterations) +
                  ",\"threads\":" + std::to_string(threads) + ",\"global_queue\":" + (global ? "true" : "false") + "}");
  std::atomic<size_t> next{0};
  auto work = [&] {
    fm_exec::queue_stack.push_back(queue);
    for (size_t i = next++; i < iterations; i = next++) {
      try {
        block(i);
      } catch (...) {
        fm_exec::record_error("an exception escaped a dispatch_apply block (iteration " + std::to_string(i) +
                              "): libdispatch would terminate the process");
      }
    }
    fm_exec::queue_stack.pop_back();
  };
  std::vector<std::thread> pool;
  for (size_t t = 0; t < threads; ++t) pool.emplace_back(work);
  for (std::thread& t : pool) t.join();
  fm_exec::record("{\"op\":\"dispatch_apply_end\"}");
}

namespace fm_exec {

dispatch_queue_t stream_queue() {
  static FakeQueue* queue = [[FakeQueue alloc] init];  // owned by the stream for the process lifetime
  return queue;
}

namespace {
std::mutex& encoder_mutex() {
  static std::mutex m;
  return m;
}
FakeEncoder* open_encoder = nil;  // PyTorch's shared, coalesced encoder (+1), nil once ended
uint64_t encoders_made = 0;
// Ended encoders, as the command buffer keeps them (+1 each, for the process).
std::vector<FakeEncoder*>& ended_encoders() {
  static auto* v = new std::vector<FakeEncoder*>();
  return *v;
}
}  // namespace

id<MTLComputeCommandEncoder> stream_encoder() {
  std::lock_guard<std::mutex> lock(encoder_mutex());
  if (open_encoder == nil) {
    open_encoder = [[FakeEncoder alloc] init];
    auto p = std::make_unique<EncoderPayload>();
    p->serial = ++encoders_made;
    set_payload(open_encoder, std::move(p));
  }
  return open_encoder;
}

void end_stream_encoder(const std::string& why) {
  FakeEncoder* ended = nil;
  {
    std::lock_guard<std::mutex> lock(encoder_mutex());
    std::swap(ended, open_encoder);
    if (ended == nil) return;  // nothing open: synchronize has nothing to end
    payload<EncoderPayload>(ended)->ended = true;
    ended_encoders().push_back(ended);
  }
  record("{\"op\":\"stream.endKernelCoalescing\",\"encoder\":" +
         std::to_string(payload<EncoderPayload>(ended)->serial) + ",\"why\":" + quote(why) + "}");
}

}  // namespace fm_exec
