// State shared by the runtime's translation units (executor.cpp, memory.cpp,
// sanitizer.cpp). Not seen by kernel code.
#pragma once
#include <csetjmp>
#include <map>
#include <cstdint>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "../include/fm/abi.h"

#define FMEMU_EXPORT extern "C" __attribute__((visibility("default")))

// Python-facing dispatch description (see _library.py for the ctypes mirror).
struct fm_buffer_desc {
  int index;
  int writable;
  void* data;
  uint64_t size;
};
struct fm_dispatch_desc {
  int kernel;
  int nroles;
  const fm_role* roles;
  int nbuffers;
  const fm_buffer_desc* buffers;
  int ntg;
  const uint64_t* tg_lengths;  // indexed by [[threadgroup(n)]]
  unsigned grid[3];
  unsigned threadgroup[3];
  unsigned max_threads;  // [[max_total_threads_per_threadgroup]] or 0
  uint64_t seed;         // 0 = deterministic order
};

// Per-dispatch counts the runtime keeps, read by Python after the run through
// fm_last_counts (see _library.py's _CountsDesc for the ctypes mirror).
// Byte counts are filled by the instrumented build's access callbacks only.
struct fm_dispatch_counts {
  uint64_t threadgroups, threads;
  uint64_t threadgroup_barriers;  // rendezvous, once per threadgroup
  uint64_t simdgroup_barriers;    // rendezvous, once per SIMD-group
  uint64_t threadgroup_bytes_read, threadgroup_bytes_written;
  uint64_t device_bytes_read[32], device_bytes_written[32];  // by [[buffer(n)]]
  fm_kernel_counts kernel;        // what the shim counted (fm_rt_counts)
  // Load instructions (one access callback each) by width: slot w counts
  // accesses of 1 << w bytes (1, 2, 4, 8, 16).
  uint64_t device_loads[32][5];   // by [[buffer(n)]]
  uint64_t threadgroup_loads[5];
  // The traffic model's rules (issue 19), by [[buffer(n)]]:
  // device_unique_bytes_read: bytes of device memory a threadgroup's load
  // brings in: its address not read by the same threadgroup within its last
  // kL1WindowBytes of such bytes (what reaches DRAM if a threadgroup's
  // SIMD-groups share lines through the core's L1: an assumption);
  // device_load_requests / device_request_bytes: load instructions and
  // their bytes after the broadcast rule, the lanes of one SIMD-group
  // executing one load instruction (the same call site, the n-th time since
  // the SIMD-group last met) at the same address counting once.
  uint64_t device_unique_bytes_read[32];
  uint64_t device_load_requests[32];
  uint64_t device_request_bytes[32];
  // Loads in flight (issue 43), by [[buffer(n)]]: a SIMD-group's "load
  // window" is the run of device load instructions (as the broadcast rule
  // counts them: call site and its n-th execution) between two of its
  // meetings (a collective, a barrier, or its threadgroup's end). Nothing
  // between two meetings makes one of those loads wait for another, so the
  // loads of a window can all be in flight at once; a meeting whose
  // operands come from them waits for them (a load whose value is not used
  // there, a prefetch, may stay in flight past it: the window does not see
  // that). device_load_windows: windows holding at least one load of
  // buffer n; device_window_loads: the load instructions in them (their sum);
  // device_window_max: the most in one window.
  uint64_t device_load_windows[32];
  uint64_t device_window_loads[32];
  uint64_t device_window_max[32];
};
// The width slot of an access of `size` bytes (1 << slot == size).
inline int fm_width_slot(unsigned size) { return size >= 16 ? 4 : size >= 8 ? 3 : size >= 4 ? 2 : size >= 2 ? 1 : 0; }

namespace fmrt {

// Metal limits on Apple GPUs (MTLDevice maxThreadsPerThreadgroup and
// maxThreadgroupMemoryLength on every Apple-silicon family we target).
constexpr unsigned kMaxThreadsPerThreadgroup = 1024;
constexpr unsigned long kMaxThreadgroupMemory = 32768;
// setThreadgroupMemoryLength requires multiples of 16 bytes.
constexpr unsigned long kThreadgroupLengthAlign = 16;
// Redzone after every threadgroup allocation: wider than the widest single
// access (16 bytes), so an off-by-one element or row lands in it.
constexpr unsigned long kRedzone = 64;
// device_unique_bytes_read's window: a load re-reading an address its
// threadgroup read within its last 8 KiB of new bytes is a cache hit. Why 8
// KiB: an estimate of a core's L1 data cache (Apple publishes none); big
// enough for the decode kernels' sibling SIMD-groups, a few rows apart, and
// small beside any K/V that a threadgroup re-reads in rounds.
constexpr uint64_t kL1WindowBytes = 8192;

struct Site {
  int kind = 0;  // 0 threadgroup_barrier, 1 simdgroup_barrier, 2 SIMD collective
  unsigned flags = 0;
  const char* what = "";
  const char* file = "";
  int line = 0;
  int col = 0;
  bool same(const Site& o) const {
    return kind == o.kind && line == o.line && col == o.col && (file == o.file || std::string(file) == o.file);
  }
  std::string describe() const;
};

enum class FiberState { Ready, AtBarrier, AtSimd, Done };

struct Fiber {
  void* sp = nullptr;
  char* stack_lo = nullptr;  // lowest usable byte; the guard page is just below
  FiberState state = FiberState::Ready;
  Site site;
  unsigned tid = 0;  // thread_index_in_threadgroup
  unsigned lane = 0, simd = 0;
  unsigned simd_epoch = 0;  // simdgroup_barriers this thread's SIMD-group passed
  // Device loads by call site since the SIMD-group last met (the broadcast rule).
  std::unordered_map<const void*, uint32_t> load_seq;
  const unsigned char* exchange = nullptr;
  fm_invocation inv{};
};

struct SimdGroup {
  unsigned width = 0;
  unsigned gen = 0;  // completed collectives; selects the exchange buffer
  // One device load instruction of the SIMD-group since it last met, (call
  // site, n-th execution), -> the (address, width) pairs its lanes read.
  std::map<std::pair<const void*, uint32_t>, std::vector<std::pair<const char*, unsigned>>> loads;
  // Its load instructions since it last met, by [[buffer(n)]] (the load window).
  uint32_t window_loads[32] = {};
  alignas(64) unsigned char buf[2][FMEMU_SIMD_WIDTH * FMEMU_SIMD_SLOT_BYTES];
};

struct DeviceBuffer {
  int index = 0;
  char* region_lo = nullptr;  // first byte of the leading guard page
  char* region_hi = nullptr;  // one past the trailing guard page
  char* start = nullptr;      // what the kernel sees
  uint64_t size = 0;
  void* host = nullptr;  // the caller's memory, copied back after the run
  bool writable = false;
  size_t map_len = 0;
};

struct TgAlloc {
  std::string name;
  std::string where;
  unsigned long offset = 0, size = 0;
};

// One recorded access to a threadgroup byte (race detector).
struct Access {
  uint64_t pc = 0;
  uint32_t epoch = 0;
  uint16_t tid = 0;
  uint16_t simd_epoch = 0;
};
struct Shadow {
  Access write, read1, read2;
};

struct Report {
  std::string kind;
  std::string message;
  std::vector<uint64_t> pcs;  // offsets in the library, symbolized by Python as {pc0}, {pc1}
};

struct KernelEntry {
  std::string host, expr, file;
  int line = 0;
  void* fn = nullptr;
  fm_invoker invoke = nullptr;
  int nparams = 0;
};

struct FunctionConstant {
  int index = 0, type = 0;
  void* value = nullptr;
  bool* defined = nullptr;
  std::string name;
};

// Everything one OS thread needs to run threadgroups.
struct Worker {
  // dispatch description
  const KernelEntry* kernel = nullptr;
  std::vector<fm_role> roles;
  void* buffers[32] = {};
  void* tg_ptrs[32] = {};
  unsigned grid[3] = {1, 1, 1}, tpg[3] = {1, 1, 1};
  unsigned nthreads = 0, nsimd = 0;
  uint64_t seed = 0;
  // current threadgroup
  unsigned group[3] = {0, 0, 0};
  std::vector<Fiber> fibers;
  std::vector<SimdGroup> simds;
  Fiber* current = nullptr;
  void* sched_sp = nullptr;
  char* stacks = nullptr;
  size_t stacks_len = 0, stack_stride = 0;
  // threadgroup memory
  char* arena = nullptr;
  unsigned long arena_cap = 0, arena_used = 0, user_bytes = 0;
  std::vector<TgAlloc> allocs;
  std::unordered_map<void*, size_t> static_index;  // key -> allocs index
  std::vector<uint16_t> owner;                     // arena byte -> 1 + allocs index, 0 = redzone
  std::vector<Shadow> shadow;
  uint32_t epoch = 1;
  // device memory
  std::vector<DeviceBuffer> dev;
  char* dev_lo = nullptr;
  char* dev_hi = nullptr;
  // outcome
  sigjmp_buf abort_env;
  bool fatal = false;
  std::vector<Report> reports;
  std::unordered_set<std::string> report_keys;
  bool instrument_active = false;
  fm_dispatch_counts counts{};
  // device_unique_bytes_read, per threadgroup: each load address read, ->
  // group_new_bytes when it was last read; the bytes brought in so far.
  std::unordered_map<const char*, uint64_t> recent_reads;
  uint64_t group_new_bytes = 0;
};

// The worker running a dispatch. A plain global, not thread_local: a library
// runs one dispatch at a time (Python holds a per-library lock), and
// initial-exec TLS in several dlopen'ed libraries exhausts glibc's static TLS
// surplus ("cannot allocate memory in static TLS block").
extern Worker* tls_worker;

// executor.cpp
void forget_simd_loads(Worker& w, unsigned simd);
std::string thread_name(const Worker& w, unsigned tid);
void add_report(Worker& w, const std::string& kind, const std::string& key, const std::string& message,
                std::vector<uint64_t> pcs);
[[noreturn]] void fatal(Worker& w, const std::string& kind, const std::string& message, std::vector<uint64_t> pcs = {});
uint64_t pc_offset(const void* pc);

// memory.cpp
void map_device_buffers(Worker& w, const fm_buffer_desc* bufs, int n);
void unmap_device_buffers(Worker& w, bool copy_back);
void reset_threadgroup_memory(Worker& w, const uint64_t* lengths, int n);
void begin_group_memory(Worker& w);
std::string describe_address(const Worker& w, const char* addr, bool* known);

// sanitizer.cpp
void install_fault_handler();
void remove_fault_handler();
}  // namespace fmrt

