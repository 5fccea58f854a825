// Test-only definitions of the at::mps entry points the host calls (declared
// by include/ATen/mps/*.h from include/mps_exec/mps_api.h), MPS tensors on
// Linux, and two test ops to move tensors in and out of them. Never shipped.
//
// MPS tensors: like PyTorch's MPS allocator, the fake allocator's DataPtr
// data IS the MTLBuffer object (a FakeBuffer owning host memory), so the
// host's buffer_of() cast finds a real (fake) buffer. aten::empty.memory_format
// is the only aten kernel registered for MPS: it is all the host calls.
#include "fake_runtime.h"

#include <ATen/ATen.h>
#include <ATen/EmptyTensor.h>
#include <ATen/ops/as_strided_native.h>
#include <ATen/mps/MPSDevice.h>
#include <ATen/mps/MPSProfiler.h>
#include <ATen/mps/MPSStream.h>
#include <c10/core/Allocator.h>
#include <vector>
#include <c10/core/CPUAllocator.h>
#include <torch/library.h>

#include <cstring>

#include "mps/shader_source.h"

// --- at::mps ------------------------------------------------------------------------------

namespace at::mps {

MPSDevice* MPSDevice::getInstance() {
  static MPSDevice instance;
  return &instance;
}

// nil when knob torch_mps_device is 0: PyTorch declined every GPU (MPS unavailable).
id<MTLDevice> MPSDevice::device() {
  return fm_exec::knobs().torch_mps_device != 0 ? fm_exec::device() : nil;
}

MPSStream* getCurrentMPSStream() {
  static MPSStream stream;  // one stream: the fake has no stream pool
  return &stream;
}

dispatch_queue_t MPSStream::queue() const { return fm_exec::stream_queue(); }

id<MTLComputeCommandEncoder> MPSStream::commandEncoder() {
  const bool on_queue = fm_exec::current_queue() == fm_exec::stream_queue();
  if (!on_queue) {
    // Racy with PyTorch's own encoding; recent PyTorch asserts it.
    fm_exec::record_error("MPSStream::commandEncoder() called outside dispatch_sync(stream->queue(), ...)");
  }
  fm_exec::record(std::string("{\"op\":\"commandEncoder\",\"on_stream_queue\":") + (on_queue ? "true" : "false") +
                  "}");
  return fm_exec::stream_encoder();
}

namespace {
std::string on_queue_field() {
  const bool on_queue = fm_exec::current_queue() == fm_exec::stream_queue();
  return std::string(",\"on_stream_queue\":") + (on_queue ? "true" : "false");
}
}  // namespace

// The profiler records its calls; real profiling (os_signpost) is macOS-only.
// With profiling on (knob profiling), endProfileKernel does what PyTorch's
// does to the stream (MPSProfiler.mm, addProfilerCompletedHandler): it
// synchronizes it, whatever the SyncType, and synchronize begins with
// endKernelCoalescing, which ends the shared compute encoder.
namespace Profiler {

uint64_t MPSProfiler::beginProfileKernel(const void* handle, const std::string& kernelName, const TensorList& tensors) {
  static uint64_t next_id = 0;
  fm_exec::record("{\"op\":\"profiler.beginProfileKernel\"" + on_queue_field() + ",\"handle\":" +
                  std::to_string(reinterpret_cast<uintptr_t>(handle)) + ",\"kernel\":" + fm_exec::quote(kernelName) +
                  ",\"tensors\":" + std::to_string(tensors.size()) + "}");
  return ++next_id;
}

void MPSProfiler::endProfileKernel(const void* handle, SyncType syncType) {
  fm_exec::record("{\"op\":\"profiler.endProfileKernel\"" + on_queue_field() + ",\"handle\":" +
                  std::to_string(reinterpret_cast<uintptr_t>(handle)) +
                  ",\"sync_type\":" + std::to_string(static_cast<int>(syncType)) + "}");
  if (fm_exec::knobs().profiling != 0) fm_exec::end_stream_encoder("endProfileKernel with profiling on");
}

}  // namespace Profiler

Profiler::MPSProfiler& getMPSProfiler() {
  static Profiler::MPSProfiler profiler;
  return profiler;
}

}  // namespace at::mps

// --- MPS tensors --------------------------------------------------------------------------

namespace {

// Storage freed while its GPU work may still be pending. PyTorch's MPS
// allocator returns a freed block to its pool for later work on the same
// stream, whose commands run after the ones already encoded; so an op may
// free a temporary right after encoding the kernels that use it (PyTorch's
// own two-pass sdpa in Attention.mm does, as does our split-KV decode with
// its scratch). Here the "GPU work" is the replay that follows the call, so
// the fake keeps freed buffers alive until the harness says that work is
// done (fm_exec_complete_gpu_work); releasing them at once would hand the
// replay freed memory.
std::vector<FakeBuffer*>& freed_buffers() {
  static std::vector<FakeBuffer*> freed;
  return freed;
}

void release_buffer(void* buffer) { freed_buffers().push_back(static_cast<FakeBuffer*>(buffer)); }

FakeBuffer* buffer_of(const c10::Storage& storage) {
  auto* buffer = static_cast<FakeBuffer*>(const_cast<void*>(storage.data()));
  TORCH_CHECK(buffer != nil && fm_exec::check_alive(buffer, "mps_exec (reading a tensor's storage)"),
              "mps_exec: the tensor's storage holds no live fake MTLBuffer");
  return buffer;
}

class FakeMPSAllocator final : public c10::Allocator {
 public:
  c10::DataPtr allocate(size_t n) override {
    FakeBuffer* buffer = [[FakeBuffer alloc] initWithLength:n];
    return {static_cast<void*>(buffer), static_cast<void*>(buffer), &release_buffer,
            c10::Device(c10::DeviceType::MPS, 0)};
  }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    std::memcpy([static_cast<FakeBuffer*>(dest) contents], [static_cast<FakeBuffer*>(const_cast<void*>(src)) contents],
                count);
  }
};

FakeMPSAllocator& allocator() {
  static FakeMPSAllocator a;
  return a;
}

// aten::empty.memory_format on MPS: NaN-filled (see FakeBuffer).
at::Tensor empty_mps(c10::SymIntArrayRef size, std::optional<at::ScalarType> dtype, std::optional<at::Layout> layout,
                     std::optional<at::Device> device, std::optional<bool> pin_memory,
                     std::optional<at::MemoryFormat> memory_format) {
  TORCH_CHECK(!layout.has_value() || *layout == at::kStrided, "mps_exec: only strided MPS tensors are faked");
  TORCH_CHECK(!pin_memory.value_or(false), "mps_exec: pin_memory is meaningless for MPS tensors");
  (void)device;
  return at::detail::empty_generic(C10_AS_INTARRAYREF_SLOW(size), &allocator(),
                                   c10::DispatchKeySet(c10::DispatchKey::MPS), c10::dtype_or_default(dtype),
                                   memory_format);
}

// A CPU tensor's whole storage copied into one fake MTLBuffer, viewed with
// the same sizes, strides and storage offset.
at::Tensor to_mps(const at::Tensor& cpu) {
  TORCH_CHECK(cpu.device().is_cpu(), "mps_exec::to_mps expects a CPU tensor; got ", cpu.device());
  const size_t nbytes = cpu.storage().nbytes();
  c10::DataPtr data = allocator().allocate(nbytes);
  std::memcpy([static_cast<FakeBuffer*>(data.get()) contents], cpu.storage().data(), nbytes);
  c10::Storage storage(c10::Storage::use_byte_size_t(), nbytes, std::move(data), &allocator(), /*resizable=*/false);
  at::Tensor t = at::detail::make_tensor<c10::TensorImpl>(std::move(storage),
                                                         c10::DispatchKeySet(c10::DispatchKey::MPS), cpu.dtype());
  t.unsafeGetTensorImpl()->set_sizes_and_strides(cpu.sizes(), cpu.strides(), cpu.storage_offset());
  return t;
}

// The inverse: a CPU tensor over a copy of the whole fake buffer, same view.
at::Tensor to_cpu(const at::Tensor& mps) {
  TORCH_CHECK(mps.device().is_mps(), "mps_exec::to_cpu expects a (fake) MPS tensor; got ", mps.device());
  FakeBuffer* buffer = buffer_of(mps.storage());
  const size_t nbytes = mps.storage().nbytes();
  TORCH_CHECK(nbytes <= [buffer length], "mps_exec: storage larger than its buffer");
  c10::Storage storage(c10::Storage::use_byte_size_t(), nbytes, c10::GetCPUAllocator(), /*resizable=*/false);
  std::memcpy(storage.mutable_data(), [buffer contents], nbytes);
  at::Tensor t = at::empty({0}, at::TensorOptions().dtype(mps.dtype()));
  t.set_(storage, mps.storage_offset(), mps.sizes(), mps.strides());
  return t;
}

// The MTLBuffer object behind a fake MPS tensor, as an integer, for the
// harness to match recorded setBuffer calls against tensors.
int64_t buffer_id(const at::Tensor& mps) {
  return static_cast<int64_t>(reinterpret_cast<uintptr_t>(buffer_of(mps.storage())));
}

// aten::as_strided on MPS: what every view (expand, transpose, unsqueeze)
// of a fake MPS tensor goes through, as on a real one (PyTorch registers
// the same tensor-impl-only kernel for MPS): the host takes views of the
// mask (expanded to (B, Hq, Nq, Nk)) and of varlen's packed tensors.
at::Tensor as_strided_mps(const at::Tensor& self, c10::SymIntArrayRef size, c10::SymIntArrayRef stride,
                          std::optional<c10::SymInt> storage_offset) {
  std::optional<int64_t> offset;
  if (storage_offset.has_value()) offset = storage_offset->expect_int();
  return at::native::as_strided_tensorimpl(self, C10_AS_INTARRAYREF_SLOW(size), C10_AS_INTARRAYREF_SLOW(stride),
                                           offset);
}

}  // namespace

TORCH_LIBRARY_IMPL(aten, MPS, m) {
  m.impl("empty.memory_format", TORCH_FN(empty_mps));
  m.impl("as_strided", TORCH_FN(as_strided_mps));
}

TORCH_LIBRARY(mps_exec, m) {
  m.def("to_mps(Tensor t) -> Tensor");
  m.def("to_cpu(Tensor t) -> Tensor");
  m.def("buffer_id(Tensor t) -> int");
}
TORCH_LIBRARY_IMPL(mps_exec, CPU, m) { m.impl("to_mps", &to_mps); }
TORCH_LIBRARY_IMPL(mps_exec, MPS, m) {
  m.impl("to_cpu", &to_cpu);
  m.impl("buffer_id", &buffer_id);
}

// The shader-source fingerprint library.mm checks a metallib against
// (csrc/mps/shader_source.h), for the harness to write beside a fake
// metallib. Returns the bytes needed (17 with the terminator); 0 on error.
// The replay of everything recorded so far has finished: release the storage
// freed meanwhile (see freed_buffers).
extern "C" __attribute__((visibility("default"))) void fm_exec_complete_gpu_work() {
  std::vector<FakeBuffer*> freed;
  freed.swap(freed_buffers());
  for (FakeBuffer* buffer : freed) [buffer release];
}

extern "C" __attribute__((visibility("default"))) size_t fm_exec_source_tree_hash(const char* dir, char* out,
                                                                                   size_t capacity) {
  try {
    const std::string hash = flash_metal::shader_source::source_tree_hash(dir);
    if (hash.size() < capacity) std::memcpy(out, hash.c_str(), hash.size() + 1);
    return hash.size() + 1;
  } catch (const std::exception&) {
    return 0;
  }
}
