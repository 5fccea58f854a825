// Device buffers and threadgroup memory.
//
// Device buffers: each bound buffer is copied into its own mapping that ends
// exactly (to 16 bytes) at an inaccessible page, with another inaccessible
// page before it, so an overrun faults in every build at no cost per access;
// the instrumented build also checks every access against the exact bounds.
// Results are copied back into the caller's memory after the run.
//
// Threadgroup memory: one arena per worker. Dynamic [[threadgroup(n)]]
// buffers come first, then the `threadgroup T x[N];` variables as their
// declarations first execute; each allocation is followed by a redzone. The
// arena is filled with 0xFF bytes (a NaN in half, bfloat and float) when each
// threadgroup starts, so reads of never-written memory show up.
#include "platform.h"  // first: feature macros for the system headers

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>

#include "internal.h"

namespace fmrt {

static size_t page_size() {
  static size_t p = sysconf(_SC_PAGESIZE);
  return p;
}

void map_device_buffers(Worker& w, const fm_buffer_desc* bufs, int n) {
  w.dev.clear();
  size_t page = page_size();
  for (int i = 0; i < n; ++i) {
    const fm_buffer_desc& b = bufs[i];
    if (b.index < 0 || b.index >= 32) fatal(w, "usage", "buffer index out of range 0..31");
    DeviceBuffer db;
    db.index = b.index;
    db.size = b.size;
    db.host = b.data;
    db.writable = b.writable != 0;
    size_t data_pages = (b.size + 16 + page - 1) / page;
    db.map_len = (data_pages + 2) * page;
    char* base = static_cast<char*>(
        mmap(nullptr, db.map_len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0));
    if (base == MAP_FAILED) fatal(w, "emulator", "cannot map a device buffer");
    mprotect(base, page, PROT_NONE);
    char* tail_guard = base + page + data_pages * page;
    mprotect(tail_guard, page, PROT_NONE);
    // End exactly at the guard page, keeping the caller's address modulo A,
    // the largest power of two (at most 16) dividing the size: any element
    // type whose size divides the buffer keeps its natural alignment.
    uintptr_t align = b.size ? (b.size & (~b.size + 1)) : 16;
    if (align > 16) align = 16;
    uintptr_t want = reinterpret_cast<uintptr_t>(b.data) & (align - 1);
    uintptr_t start = reinterpret_cast<uintptr_t>(tail_guard) - b.size;
    start -= (start - want) & (align - 1);
    db.region_lo = base;
    db.region_hi = base + db.map_len;
    db.start = reinterpret_cast<char*>(start);
    if (b.size) memcpy(db.start, b.data, b.size);
    w.buffers[b.index] = db.start;
    w.dev.push_back(db);
  }
  std::sort(w.dev.begin(), w.dev.end(), [](const DeviceBuffer& a, const DeviceBuffer& b) { return a.region_lo < b.region_lo; });
  w.dev_lo = w.dev.empty() ? nullptr : w.dev.front().region_lo;
  w.dev_hi = w.dev.empty() ? nullptr : w.dev.back().region_hi;
}

void unmap_device_buffers(Worker& w, bool copy_back) {
  for (DeviceBuffer& db : w.dev) {
    if (copy_back && db.writable && db.size) memcpy(db.host, db.start, db.size);
    munmap(db.region_lo, db.map_len);
  }
  w.dev.clear();
  w.dev_lo = w.dev_hi = nullptr;
}

// Arena capacity: the 32 KiB limit plus redzones for up to ~1000 allocations.
constexpr unsigned long kArenaCapacity = 128 * 1024;

static unsigned long add_alloc(Worker& w, const std::string& name, const std::string& where, unsigned long size,
                               unsigned long align) {
  if (align < 16) align = 16;  // Metal aligns threadgroup allocations to 16 bytes
  unsigned long off = (w.arena_used + align - 1) / align * align;
  w.user_bytes += size;
  if (w.user_bytes > kMaxThreadgroupMemory)
    fatal(w, "limits",
          "threadgroup memory of " + std::to_string(w.user_bytes) + " bytes (after adding " + name + " of " +
              std::to_string(size) + " bytes" + (where.empty() ? "" : " at " + where) + ") exceeds the " +
              std::to_string(kMaxThreadgroupMemory) + "-byte limit");
  if (off + size + kRedzone > w.arena_cap) fatal(w, "limits", "too many threadgroup allocations for the emulator arena");
  w.allocs.push_back(TgAlloc{name, where, off, size});
  uint16_t id = (uint16_t)w.allocs.size();
  std::fill(w.owner.begin() + off, w.owner.begin() + off + size, id);
  memset(w.arena + off, 0xFF, size);
  w.arena_used = off + size + kRedzone;
  return off;
}

void reset_threadgroup_memory(Worker& w, const uint64_t* lengths, int n) {
  if (!w.arena) {
    w.arena_cap = kArenaCapacity;
    w.arena = static_cast<char*>(aligned_alloc(4096, w.arena_cap));
    w.owner.assign(w.arena_cap, 0);
    w.shadow.assign(w.arena_cap, Shadow{});
  }
  std::fill(w.owner.begin(), w.owner.end(), 0);
  w.allocs.clear();
  w.static_index.clear();
  w.arena_used = kRedzone;  // a redzone before the first allocation too
  w.user_bytes = 0;
  for (int i = 0; i < 32; ++i) w.tg_ptrs[i] = nullptr;
  for (int i = 0; i < n && i < 32; ++i) {
    if (lengths[i] == UINT64_MAX) continue;  // not set
    if (lengths[i] % kThreadgroupLengthAlign)
      fatal(w, "usage", "setThreadgroupMemoryLength for index " + std::to_string(i) + " is " +
                            std::to_string(lengths[i]) + " bytes, not a multiple of 16");
    unsigned long off = add_alloc(w, "[[threadgroup(" + std::to_string(i) + ")]] buffer", "", lengths[i], 16);
    w.tg_ptrs[i] = w.arena + off;
  }
}

void begin_group_memory(Worker& w) {
  memset(w.arena, 0xFF, w.arena_used);
  w.epoch++;  // accesses of the previous threadgroup no longer conflict
}

std::string describe_address(const Worker& w, const char* addr, bool* known) {
  *known = true;
  for (const DeviceBuffer& db : w.dev) {
    if (addr >= db.region_lo && addr < db.region_hi) {
      long off = addr - db.start;
      char buf[200];
      snprintf(buf, sizeof buf, "byte offset %ld of device buffer(%d), whose bound length is %llu bytes", off, db.index,
               (unsigned long long)db.size);
      return buf;
    }
  }
  if (w.stacks && addr >= w.stacks && addr < w.stacks + w.stacks_len) {
    unsigned t = (unsigned)((addr - w.stacks) / w.stack_stride);
    return "the stack guard of " + thread_name(w, t) + " (stack overflow: too-large thread arrays or recursion)";
  }
  *known = false;
  return "an address outside every buffer";
}

}  // namespace fmrt

using namespace fmrt;

extern "C" void* fm_rt_threadgroup_var(void* key, unsigned long size, unsigned long align, const char* name,
                                       const char* file, int line) {
  Worker& w = *tls_worker;
  auto it = w.static_index.find(key);
  if (it != w.static_index.end()) return w.arena + w.allocs[it->second].offset;
  unsigned long off = add_alloc(w, std::string("threadgroup variable '") + name + "'",
                                std::string(file) + ":" + std::to_string(line), size, align);
  w.static_index[key] = w.allocs.size() - 1;
  return w.arena + off;
}
