// Detectors.
//
// * Fault handler (every build): a fault while a kernel runs (device-buffer
//   guard page, fiber stack guard, wild pointer) becomes a report and aborts
//   the dispatch instead of killing the Python process.
// * Load/store callbacks (instrumented build only): the kernel translation
//   unit is compiled with -fsanitize-coverage=trace-loads,trace-stores, so
//   every memory access calls __sanitizer_cov_load<N>/store<N> below. They
//   check device accesses against the exact buffer bounds, threadgroup
//   accesses against the allocation they fall in (overflow into a redzone),
//   and run the race detector: for every threadgroup byte the last write and
//   up to two reads of the current barrier interval are kept; a write and any
//   other access by different threads in the same interval, not ordered by a
//   threadgroup_barrier(mem_threadgroup) (or a simdgroup_barrier within one
//   SIMD-group), is reported whatever the schedule was.
#include "platform.h"  // first: feature macros for the system headers

#include <signal.h>
#include <ucontext.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "internal.h"

namespace fmrt {

// Alternate signal stack: the fault may be a fiber stack overflow.
constexpr size_t kAltStackSize = 64 * 1024;
static struct sigaction old_segv, old_bus;
static stack_t old_altstack;
static bool handler_installed = false;

static void on_fault(int sig, siginfo_t* info, void* uctx) {
  Worker* w = tls_worker;
  if (!w || !w->instrument_active) {
    // Not ours: restore the previous handler and let the access fault again.
    sigaction(SIGSEGV, &old_segv, nullptr);
    sigaction(SIGBUS, &old_bus, nullptr);
    return;
  }
  const char* addr = static_cast<const char*>(info->si_addr);
  const void* pc = nullptr;
  bool write = false;
#if defined(__x86_64__) && defined(__linux__)
  ucontext_t* uc = static_cast<ucontext_t*>(uctx);
  pc = reinterpret_cast<const void*>(uc->uc_mcontext.gregs[REG_RIP]);
  write = (uc->uc_mcontext.gregs[REG_ERR] & 2) != 0;  // page-fault error code bit 1: write access
#elif defined(__APPLE__) && defined(__aarch64__)
  ucontext_t* uc = static_cast<ucontext_t*>(uctx);
#if defined(__darwin_arm_thread_state64_get_pc)
  pc = reinterpret_cast<const void*>(__darwin_arm_thread_state64_get_pc(uc->uc_mcontext->__ss));
#else
  pc = reinterpret_cast<const void*>(uc->uc_mcontext->__ss.__pc);
#endif
  write = ((uc->uc_mcontext->__es.__esr >> 6) & 1) != 0;  // ESR of a data abort, bit 6 (WnR): write access
#else
  (void)uctx;
#endif
  bool known = false;
  std::string what = describe_address(*w, addr, &known);
  std::string who = w->current ? thread_name(*w, w->current->tid) : std::string("the emulator");
  w->instrument_active = false;
  fatal(*w, "out-of-bounds",
        std::string(sig == SIGBUS ? "bus error" : "invalid memory access") + " (" +
            (write ? "write" : "read") + ") at " + what + ", by " + who + " at {pc0}",
        {pc_offset(pc)});
}

void install_fault_handler() {
  static char* alt = nullptr;
  if (!alt) alt = static_cast<char*>(malloc(kAltStackSize));
  stack_t ss{};
  ss.ss_sp = alt;
  ss.ss_size = kAltStackSize;
  sigaltstack(&ss, &old_altstack);  // per OS thread: set on every dispatch
  struct sigaction sa {};
  sa.sa_sigaction = on_fault;
  sa.sa_flags = SA_SIGINFO | SA_ONSTACK | SA_NODEFER;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGSEGV, &sa, &old_segv);
  sigaction(SIGBUS, &sa, &old_bus);
  handler_installed = true;
}

void remove_fault_handler() {
  if (!handler_installed) return;
  sigaction(SIGSEGV, &old_segv, nullptr);
  sigaction(SIGBUS, &old_bus, nullptr);
  sigaltstack(&old_altstack, nullptr);
  handler_installed = false;
}

// ---- instrumented accesses --------------------------------------------------------
static const char* kind_name(bool write) { return write ? "write" : "read"; }

// The traffic model's counts of one device read (fm_dispatch_counts):
// bytes new to the threadgroup, and the broadcast rule's requests.
// (A load is matched by its address: a re-read of the same bytes by a
// load of another width or offset counts as new.)
static void count_read(Worker& w, const DeviceBuffer& db, const char* p, unsigned size, const void* pc) {
  auto seen = w.recent_reads.find(p);
  if (seen != w.recent_reads.end() && w.group_new_bytes - seen->second < kL1WindowBytes) {
    seen->second = w.group_new_bytes;  // a hit: the line stays recent
  } else {
    w.group_new_bytes += size;
    w.recent_reads[p] = w.group_new_bytes;
    w.counts.device_unique_bytes_read[db.index] += size;
  }
  Fiber& f = *w.current;
  std::vector<std::pair<const char*, unsigned>>& lanes = w.simds[f.simd].loads[{pc, f.load_seq[pc]++}];
  if (lanes.empty()) w.simds[f.simd].window_loads[db.index]++;  // a new load instruction of its window
  for (const auto& a : lanes)
    if (a.first == p && a.second == size) return;  // a lane before it read the same address: broadcast
  lanes.emplace_back(p, size);
  w.counts.device_load_requests[db.index]++;
  w.counts.device_request_bytes[db.index] += size;
}

static void device_access(Worker& w, const char* p, unsigned size, bool write, const void* pc) {
  for (const DeviceBuffer& db : w.dev) {
    if (p < db.region_lo || p >= db.region_hi) continue;
    if (p >= db.start && p + size <= db.start + db.size) {
      (write ? w.counts.device_bytes_written : w.counts.device_bytes_read)[db.index] += size;
      if (!write) {
        w.counts.device_loads[db.index][fm_width_slot(size)]++;
        count_read(w, db, p, size, pc);
      }
      return;
    }
    char buf[256];
    snprintf(buf, sizeof buf, "out-of-bounds %s of %u bytes at byte offset %ld of device buffer(%d) (bound length %llu bytes)",
             kind_name(write), size, (long)(p - db.start), db.index, (unsigned long long)db.size);
    w.instrument_active = false;
    fatal(w, "out-of-bounds", std::string(buf) + ", by " + thread_name(w, w.current->tid) + " at {pc0}",
          {pc_offset(pc)});
  }
}

static bool ordered(const Worker& w, const Access& a, const Fiber& f) {
  if (a.epoch != w.epoch || a.tid == f.tid) return true;
  // a simdgroup_barrier(mem_threadgroup) orders accesses within one SIMD-group
  return a.tid / FMEMU_SIMD_WIDTH == f.simd && a.simd_epoch != (uint16_t)f.simd_epoch;
}

static std::string tg_location(const Worker& w, unsigned long off) {
  uint16_t id = w.owner[off];
  if (!id) return "threadgroup redzone";
  const TgAlloc& a = w.allocs[id - 1];
  std::string s = a.name + " byte " + std::to_string(off - a.offset);
  if (!a.where.empty()) s += " (declared at " + a.where + ")";
  return s;
}

static void race(Worker& w, const char* kind, unsigned long off, const Access& prev, bool prev_write,
                 const Fiber& f, bool write, const void* pc) {
  uint64_t now = pc_offset(pc), before = pc_offset(reinterpret_cast<const void*>(prev.pc));
  std::string key = std::to_string(before) + ":" + std::to_string(now);
  if (w.report_keys.count(std::string("race|") + key)) return;
  std::string msg = std::string("threadgroup memory race (") + kind + ") on " + tg_location(w, off) + ": " +
                    thread_name(w, prev.tid) + " " + kind_name(prev_write) + " it at {pc0}, then " +
                    thread_name(w, f.tid) + " " + kind_name(write) + " it at {pc1}, with no threadgroup_barrier(mem_flags::mem_threadgroup) between";
  add_report(w, "race", key, msg, {before, now});
}

static void overflow(Worker& w, unsigned long off, unsigned size, bool write, const void* pc) {
  // name the allocation just below the redzone that was hit
  std::string below = "the start of threadgroup memory";
  for (const TgAlloc& a : w.allocs)
    if (a.offset + a.size <= off) below = a.name + (a.where.empty() ? "" : " (declared at " + a.where + ")") +
                                          " of " + std::to_string(a.size) + " bytes, " +
                                          std::to_string(off - a.offset - a.size) + " bytes past its end";
  uint64_t now = pc_offset(pc);
  add_report(w, "threadgroup-overflow", std::to_string(now),
             std::string("threadgroup memory overflow: ") + kind_name(write) + " of " + std::to_string(size) +
                 " bytes outside every threadgroup allocation, after " + below + ", by " +
                 thread_name(w, w.current->tid) + " at {pc0}",
             {now});
}

static void tg_access(Worker& w, unsigned long off, unsigned size, bool write, const void* pc) {
  const Fiber& f = *w.current;
  for (unsigned i = 0; i < size; ++i) {
    unsigned long o = off + i;
    if (o >= w.arena_cap || !w.owner[o]) {
      overflow(w, o, size, write, pc);
      return;
    }
    Shadow& s = w.shadow[o];
    if (!ordered(w, s.write, f)) race(w, write ? "write-after-write" : "read-after-write", o, s.write, true, f, write, pc);
    if (write) {
      if (!ordered(w, s.read1, f)) race(w, "write-after-read", o, s.read1, false, f, write, pc);
      else if (!ordered(w, s.read2, f)) race(w, "write-after-read", o, s.read2, false, f, write, pc);
      s.write = Access{reinterpret_cast<uint64_t>(pc), w.epoch, (uint16_t)f.tid, (uint16_t)f.simd_epoch};
      s.read1 = s.read2 = Access{};
    } else {
      Access a{0, w.epoch, (uint16_t)f.tid, (uint16_t)f.simd_epoch};
      if (s.read1.epoch != w.epoch) {
        a.pc = reinterpret_cast<uint64_t>(pc);
        s.read1 = a;
      } else if (s.read1.tid != f.tid && (s.read2.epoch != w.epoch)) {
        a.pc = reinterpret_cast<uint64_t>(pc);
        s.read2 = a;
      }
    }
  }
}

static inline void on_access(const void* addr, unsigned size, bool write, const void* pc) {
  Worker* w = tls_worker;
  if (!w || !w->instrument_active || !w->current) return;
  const char* p = static_cast<const char*>(addr);
  uintptr_t off = reinterpret_cast<uintptr_t>(p) - reinterpret_cast<uintptr_t>(w->arena);
  if (off < w->arena_cap) {
    (write ? w->counts.threadgroup_bytes_written : w->counts.threadgroup_bytes_read) += size;
    if (!write) w->counts.threadgroup_loads[fm_width_slot(size)]++;
    tg_access(*w, off, size, write, pc);
  } else if (p >= w->dev_lo && p < w->dev_hi) {
    device_access(*w, p, size, write, pc);
  }
}

}  // namespace fmrt

#define FMEMU_COV(n, T)                                                                                              \
  FMEMU_EXPORT void __sanitizer_cov_load##n(T* addr) { fmrt::on_access(addr, n, false, __builtin_return_address(0)); } \
  FMEMU_EXPORT void __sanitizer_cov_store##n(T* addr) { fmrt::on_access(addr, n, true, __builtin_return_address(0)); }
FMEMU_COV(1, uint8_t)
FMEMU_COV(2, uint16_t)
FMEMU_COV(4, uint32_t)
FMEMU_COV(8, uint64_t)
FMEMU_COV(16, __int128)
#undef FMEMU_COV
