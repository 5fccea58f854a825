// The executor: kernel registry, fibers (one per emulated GPU thread), the
// cooperative scheduler that implements barriers and SIMD collectives as
// rendezvous, and the C API that Python calls through ctypes.
//
// Threads of a threadgroup run one at a time on the calling OS thread and
// switch only at barriers and collectives, so a run is deterministic; with a
// nonzero seed the order in which ready threads resume is shuffled per round.
#include "platform.h"  // first: feature macros for the system headers

#include <dlfcn.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <map>
#include <utility>

#include "internal.h"

// The hand-written switch is x86-64 ELF assembly (Linux); anything else,
// macOS on Apple silicon included, switches fibers with ucontext
// (FMEMU_FORCE_UCONTEXT: on Linux too, to test that path).
#if defined(__x86_64__) && defined(__ELF__) && !defined(FMEMU_FORCE_UCONTEXT)
#define FMEMU_ASM_SWITCH 1
#else
#define FMEMU_ASM_SWITCH 0
#include <ucontext.h>
#endif

namespace fmrt {

Worker* tls_worker = nullptr;

static std::vector<KernelEntry>& kernels() {
  static std::vector<KernelEntry> k;
  return k;
}
// Registration sites a partial build left out (include/fm/kernel.h: host name
// and expression only, the kernel never instantiated), so a library can name
// what its source holds beyond what it built.
static std::vector<std::pair<std::string, std::string>>& omitted_kernels() {
  static std::vector<std::pair<std::string, std::string>> k;
  return k;
}
static std::vector<FunctionConstant>& function_constants() {
  static std::vector<FunctionConstant> f;
  return f;
}
static fm_dispatch_counts& last_counts() {
  static fm_dispatch_counts c{};
  return c;
}
static std::string& last_report_json() {
  static std::string s;
  return s;
}

// ---- context switch -----------------------------------------------------------
// Stack size per emulated thread. Kernels keep per-thread arrays such as
// float acc[256] (1 KiB) plus matrix fragments; 256 KiB leaves room for an
// -O0 instrumented build. Pages are committed only when touched.
constexpr size_t kStackSize = 256 * 1024;

#if FMEMU_ASM_SWITCH
// fm_ctx_switch(save, next): push the callee-saved registers, store the stack
// pointer in *save, load `next`, pop and return into the other context. About
// 20 ns, against ~0.45 us for swapcontext (which makes a sigprocmask syscall).
asm(R"(
  .text
  .p2align 4
  .type fm_ctx_switch,@function
fm_ctx_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size fm_ctx_switch, .-fm_ctx_switch
  .p2align 4
  .type fm_ctx_entry,@function
fm_ctx_entry:
  movq %r12, %rdi
  callq *%r13
  ud2
  .size fm_ctx_entry, .-fm_ctx_entry
)");
extern "C" void fm_ctx_switch(void** save, void* next);
extern "C" void fm_ctx_entry();

static void fiber_main(Fiber* f);

static void* initial_stack(Fiber* f, char* stack_hi) {
  uintptr_t top = reinterpret_cast<uintptr_t>(stack_hi) & ~uintptr_t(15);
  void** sp = reinterpret_cast<void**>(top);
  *--sp = reinterpret_cast<void*>(&fm_ctx_entry);  // `ret` lands here with rsp 16-aligned
  *--sp = nullptr;                                  // rbp
  *--sp = nullptr;                                  // rbx
  *--sp = f;                                        // r12: argument of fiber_main
  *--sp = reinterpret_cast<void*>(&fiber_main);     // r13: called by fm_ctx_entry
  *--sp = nullptr;                                  // r14
  *--sp = nullptr;                                  // r15
  return sp;
}
static inline void switch_to(void** save, void* next) { fm_ctx_switch(save, next); }
#else
// Portable fallback: one ucontext per fiber, stored at the bottom of its stack.
static void fiber_main(Fiber* f);
static ucontext_t sched_uc;
static void uc_entry(unsigned lo, unsigned hi) {
  fiber_main(reinterpret_cast<Fiber*>((uintptr_t(hi) << 32) | lo));
}
static void* initial_stack(Fiber* f, char* stack_hi) {
  ucontext_t* uc = reinterpret_cast<ucontext_t*>(f->stack_lo);
  getcontext(uc);
  uc->uc_stack.ss_sp = f->stack_lo + sizeof(ucontext_t);
  uc->uc_stack.ss_size = stack_hi - f->stack_lo - sizeof(ucontext_t);
  uc->uc_link = nullptr;
  uintptr_t p = reinterpret_cast<uintptr_t>(f);
  makecontext(uc, (void (*)())uc_entry, 2, unsigned(p), unsigned(p >> 32));
  return uc;
}
static inline void switch_to(void** save, void* next) {
  ucontext_t* from = *save ? reinterpret_cast<ucontext_t*>(*save) : &sched_uc;
  if (!*save) *save = &sched_uc;
  swapcontext(from, reinterpret_cast<ucontext_t*>(next));
}
#endif

static void yield_to_scheduler(Worker& w) {
  Fiber* f = w.current;
  switch_to(&f->sp, w.sched_sp);
}

static void fiber_main(Fiber* f) {
  Worker& w = *tls_worker;
  w.kernel->invoke(w.kernel->fn, &f->inv);
  f->state = FiberState::Done;
  f->site = Site{};
  switch_to(&f->sp, w.sched_sp);
  __builtin_trap();  // a finished fiber is never resumed
}

// ---- reports -------------------------------------------------------------------
uint64_t pc_offset(const void* pc) {
  Dl_info info;
  if (pc && dladdr(pc, &info) && info.dli_fbase)
    return reinterpret_cast<uintptr_t>(pc) - reinterpret_cast<uintptr_t>(info.dli_fbase);
  return 0;
}

std::string Site::describe() const {
  char buf[512];
  snprintf(buf, sizeof buf, "%s at %s:%d:%d", what, file, line, col);
  return buf;
}

std::string thread_name(const Worker& w, unsigned tid) {
  unsigned x = tid % w.tpg[0], y = (tid / w.tpg[0]) % w.tpg[1], z = tid / (w.tpg[0] * w.tpg[1]);
  char buf[160];
  snprintf(buf, sizeof buf, "thread (%u,%u,%u) [index %u, simdgroup %u lane %u] of threadgroup (%u,%u,%u)", x, y, z,
           tid, tid / FMEMU_SIMD_WIDTH, tid % FMEMU_SIMD_WIDTH, w.group[0], w.group[1], w.group[2]);
  return buf;
}

// Distinct findings are kept once (by `key`); a kernel that races in a loop
// would otherwise produce millions of identical reports.
constexpr size_t kMaxReports = 64;
void add_report(Worker& w, const std::string& kind, const std::string& key, const std::string& message,
                std::vector<uint64_t> pcs) {
  if (!w.report_keys.insert(kind + "|" + key).second) return;
  if (w.reports.size() >= kMaxReports) return;
  w.reports.push_back(Report{kind, message, std::move(pcs)});
}

void fatal(Worker& w, const std::string& kind, const std::string& message, std::vector<uint64_t> pcs) {
  add_report(w, kind, message, message, std::move(pcs));
  w.fatal = true;
  siglongjmp(w.abort_env, 1);
}

static std::string json_escape(const std::string& s) {
  std::string o;
  for (char c : s) {
    if (c == '"' || c == '\\') {
      o += '\\';
      o += c;
    } else if (c == '\n') {
      o += "\\n";
    } else if ((unsigned char)c < 0x20) {
      char b[8];
      snprintf(b, sizeof b, "\\u%04x", c);
      o += b;
    } else {
      o += c;
    }
  }
  return o;
}

static void publish_reports(const Worker& w) {
  std::string j = "[";
  for (size_t i = 0; i < w.reports.size(); ++i) {
    const Report& r = w.reports[i];
    if (i) j += ",";
    j += "{\"kind\":\"" + json_escape(r.kind) + "\",\"message\":\"" + json_escape(r.message) + "\",\"pcs\":[";
    for (size_t k = 0; k < r.pcs.size(); ++k) j += (k ? "," : "") + std::to_string(r.pcs[k]);
    j += "]}";
  }
  j += "]";
  last_report_json() = j;
}

// ---- scheduler -------------------------------------------------------------------
static std::string lane_list(const std::vector<unsigned>& ids, const Worker& w, bool lanes) {
  std::string s;
  size_t shown = 0;
  for (unsigned id : ids) {
    if (shown == 3) {
      s += ", ... (" + std::to_string(ids.size()) + " in all)";
      break;
    }
    s += (shown ? "; " : "") + (lanes ? "lane " + std::to_string(id % FMEMU_SIMD_WIDTH) : thread_name(w, id));
    ++shown;
  }
  return s;
}

// Threads grouped by where they wait, for divergence messages.
static std::string where_threads_are(const Worker& w, const std::vector<unsigned>& tids, bool lanes) {
  std::vector<std::pair<std::string, std::vector<unsigned>>> groups;
  for (unsigned t : tids) {
    const Fiber& f = w.fibers[t];
    std::string where = f.state == FiberState::Done ? std::string("returned from the kernel")
                                                    : "waiting at " + f.site.describe();
    auto it = std::find_if(groups.begin(), groups.end(), [&](auto& g) { return g.first == where; });
    if (it == groups.end()) {
      groups.push_back({where, {t}});
    } else {
      it->second.push_back(t);
    }
  }
  std::string s;
  for (auto& g : groups) s += "\n  " + std::to_string(g.second.size()) + " " + g.first + ": " + lane_list(g.second, w, lanes);
  return s;
}

static uint64_t next_random(uint64_t& state) {
  // splitmix64: a tiny, well-mixed generator for the optional shuffled order
  uint64_t z = (state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

static void prepare_fibers(Worker& w) {
  w.fibers.assign(w.nthreads, Fiber{});
  w.simds.resize(w.nsimd);
  for (unsigned s = 0; s < w.nsimd; ++s) {
    w.simds[s].gen = 0;
    w.simds[s].width = std::min<unsigned>(FMEMU_SIMD_WIDTH, w.nthreads - s * FMEMU_SIMD_WIDTH);
  }
  size_t page = sysconf(_SC_PAGESIZE);
  size_t stride = kStackSize + page;
  if (w.stacks_len < stride * w.nthreads) {
    if (w.stacks) munmap(w.stacks, w.stacks_len);
    w.stacks_len = stride * w.nthreads;
    w.stacks = static_cast<char*>(mmap(nullptr, w.stacks_len, PROT_READ | PROT_WRITE,
                                       MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0));
    if (w.stacks == MAP_FAILED) {
      w.stacks = nullptr;
      w.stacks_len = 0;
      fatal(w, "emulator", "cannot map fiber stacks");
    }
    for (unsigned t = 0; t < w.nthreads; ++t) mprotect(w.stacks + t * stride, page, PROT_NONE);  // guard pages
  }
  w.stack_stride = stride;
}

static void start_group(Worker& w) {
  unsigned tx = w.tpg[0], ty = w.tpg[1];
  for (unsigned t = 0; t < w.nthreads; ++t) {
    Fiber& f = w.fibers[t];
    f = Fiber{};
    f.tid = t;
    f.lane = t % FMEMU_SIMD_WIDTH;
    f.simd = t / FMEMU_SIMD_WIDTH;
    f.stack_lo = w.stacks + t * w.stack_stride + (w.stack_stride - kStackSize);
    fm_invocation& inv = f.inv;
    inv.roles = w.roles.data();
    inv.buffers = w.buffers;
    inv.tgmem = w.tg_ptrs;
    unsigned local[3] = {t % tx, (t / tx) % ty, t / (tx * ty)};
    auto set = [&](int k, unsigned a, unsigned b, unsigned c) {
      inv.pos[k][0] = a;
      inv.pos[k][1] = b;
      inv.pos[k][2] = c;
    };
    set(FMEMU_POS_THREAD_POSITION_IN_GRID, w.group[0] * tx + local[0], w.group[1] * ty + local[1],
        w.group[2] * w.tpg[2] + local[2]);
    set(FMEMU_POS_THREAD_POSITION_IN_THREADGROUP, local[0], local[1], local[2]);
    set(FMEMU_POS_THREADGROUP_POSITION_IN_GRID, w.group[0], w.group[1], w.group[2]);
    set(FMEMU_POS_THREADS_PER_THREADGROUP, tx, ty, w.tpg[2]);
    set(FMEMU_POS_DISPATCH_THREADS_PER_THREADGROUP, tx, ty, w.tpg[2]);
    set(FMEMU_POS_THREADGROUPS_PER_GRID, w.grid[0], w.grid[1], w.grid[2]);
    set(FMEMU_POS_THREADS_PER_GRID, w.grid[0] * tx, w.grid[1] * ty, w.grid[2] * w.tpg[2]);
    set(FMEMU_POS_THREAD_INDEX_IN_THREADGROUP, t, 0, 0);
    set(FMEMU_POS_THREAD_INDEX_IN_SIMDGROUP, f.lane, 0, 0);
    set(FMEMU_POS_SIMDGROUP_INDEX_IN_THREADGROUP, f.simd, 0, 0);
    set(FMEMU_POS_THREADS_PER_SIMDGROUP, FMEMU_SIMD_WIDTH, 0, 0);
    set(FMEMU_POS_SIMDGROUPS_PER_THREADGROUP, w.nsimd, 0, 0);
    set(FMEMU_POS_THREAD_INDEX_IN_QUADGROUP, t % 4, 0, 0);
    set(FMEMU_POS_QUADGROUP_INDEX_IN_THREADGROUP, t / 4, 0, 0);
    f.sp = initial_stack(&f, f.stack_lo + kStackSize);
  }
  for (auto& s : w.simds) s.gen = 0;
}

// Release SIMD-groups whose lanes all wait at one collective; report the ones
// whose lanes can never meet. Returns whether anything was released.
static bool resolve_simdgroups(Worker& w) {
  bool released = false;
  for (unsigned s = 0; s < w.nsimd; ++s) {
    SimdGroup& g = w.simds[s];
    unsigned base = s * FMEMU_SIMD_WIDTH;
    bool any_simd = false, all_same = true;
    const Fiber& first = w.fibers[base];
    for (unsigned l = 0; l < g.width; ++l) {
      const Fiber& f = w.fibers[base + l];
      if (f.state == FiberState::AtSimd) any_simd = true;
      if (f.state != FiberState::AtSimd || first.state != FiberState::AtSimd || !f.site.same(first.site))
        all_same = false;
    }
    if (!any_simd) continue;
    if (!all_same) {
      std::vector<unsigned> tids;
      for (unsigned l = 0; l < g.width; ++l) tids.push_back(base + l);
      fatal(w, "simd-divergence",
            "SIMD-group " + std::to_string(s) + " of threadgroup (" + std::to_string(w.group[0]) + "," +
                std::to_string(w.group[1]) + "," + std::to_string(w.group[2]) +
                ") deadlocks: a SIMD-group function needs every lane at the same call site, but" +
                where_threads_are(w, tids, true));
    }
    g.gen++;
    forget_simd_loads(w, s);  // every lane is here: the loads before are complete
    if (first.site.kind == 1) w.counts.simdgroup_barriers++;
    bool orders = first.site.kind == 1 && (first.site.flags & 2u);
    for (unsigned l = 0; l < g.width; ++l) {
      Fiber& f = w.fibers[base + l];
      f.state = FiberState::Ready;
      if (orders) f.simd_epoch++;
    }
    released = true;
  }
  return released;
}

static bool resolve_barrier(Worker& w) {
  bool all_done = true, all_same = true;
  const Fiber* ref = nullptr;
  for (const Fiber& f : w.fibers) {
    if (f.state != FiberState::Done) all_done = false;
    if (f.state != FiberState::AtBarrier) {
      all_same = false;
      continue;
    }
    if (!ref) ref = &f;
    if (!f.site.same(ref->site)) all_same = false;
  }
  if (all_done) return false;
  if (!all_same || !ref) {
    std::vector<unsigned> tids;
    for (unsigned t = 0; t < w.nthreads; ++t) tids.push_back(t);
    fatal(w, "barrier-divergence",
          "barrier divergence in threadgroup (" + std::to_string(w.group[0]) + "," + std::to_string(w.group[1]) + "," +
              std::to_string(w.group[2]) + "): every thread must reach the same threadgroup_barrier, but" +
              where_threads_are(w, tids, false));
  }
  if (ref->site.flags & 2u) w.epoch++;  // mem_threadgroup orders threadgroup memory
  if (!(ref->site.flags & FMEMU_RENDEZVOUS_ONLY)) w.counts.threadgroup_barriers++;
  for (unsigned s = 0; s < w.nsimd; ++s) forget_simd_loads(w, s);
  for (Fiber& f : w.fibers) f.state = FiberState::Ready;
  return true;
}

// The broadcast rule's record of SIMD-group `simd`'s loads, dropped when its
// lanes meet (at a collective or a barrier) or its threadgroup starts.
void forget_simd_loads(Worker& w, unsigned simd) {
  SimdGroup& g = w.simds[simd];
  for (int i = 0; i < 32; ++i) {  // its load window closes (device_load_windows)
    if (!g.window_loads[i]) continue;
    w.counts.device_load_windows[i]++;
    w.counts.device_window_loads[i] += g.window_loads[i];
    if (g.window_loads[i] > w.counts.device_window_max[i]) w.counts.device_window_max[i] = g.window_loads[i];
    g.window_loads[i] = 0;
  }
  g.loads.clear();
  for (unsigned l = 0; l < FMEMU_SIMD_WIDTH; ++l) {
    const unsigned t = simd * FMEMU_SIMD_WIDTH + l;
    if (t < w.nthreads) w.fibers[t].load_seq.clear();
  }
}

static void run_group(Worker& w) {
  start_group(w);
  for (unsigned s = 0; s < w.nsimd; ++s) {
    w.simds[s].loads.clear();
    for (uint32_t& n : w.simds[s].window_loads) n = 0;
  }
  w.recent_reads.clear();  // device_unique_bytes_read: per threadgroup
  w.group_new_bytes = 0;
  w.counts.threadgroups++;
  w.counts.threads += w.nthreads;
  begin_group_memory(w);
  std::vector<unsigned> order(w.nthreads);
  for (unsigned t = 0; t < w.nthreads; ++t) order[t] = t;
  uint64_t rng = w.seed ^ (uint64_t(w.group[0]) << 42) ^ (uint64_t(w.group[1]) << 21) ^ w.group[2];
  for (;;) {
    if (w.seed) {
      for (unsigned i = w.nthreads; i > 1; --i) std::swap(order[i - 1], order[next_random(rng) % i]);
    }
    for (unsigned t : order) {
      Fiber& f = w.fibers[t];
      if (f.state != FiberState::Ready) continue;
      w.current = &f;
      switch_to(&w.sched_sp, f.sp);
      w.current = nullptr;
    }
    if (resolve_simdgroups(w)) continue;
    if (!resolve_barrier(w)) {  // every thread finished: the last load windows close
      for (unsigned s = 0; s < w.nsimd; ++s) forget_simd_loads(w, s);
      return;
    }
  }
}

}  // namespace fmrt

using namespace fmrt;

// The shim's kernel-side counters (abi.h); reset and read by fm_dispatch.
extern "C" fm_kernel_counts fm_rt_counts = {};
// The MPP shim's lane layout, set from Python before a dispatch.
extern "C" fm_mpp_config fm_rt_mpp = {FMEMU_MPP_LAYOUT_SCRAMBLED, 1};

// ---- ABI used by kernel code ----------------------------------------------------
extern "C" {
void fm_rt_register_kernel(const char* host_name, const char* expr, void* fn, fm_invoker invoke, int nparams,
                           const char* file, int line) {
  kernels().push_back(KernelEntry{host_name, expr, file, line, fn, invoke, nparams});
}
void fm_rt_register_omitted_kernel(const char* host_name, const char* expr) {
  omitted_kernels().emplace_back(host_name, expr);
}
void fm_rt_register_function_constant(int index, int type, void* value, bool* defined, const char* name) {
  function_constants().push_back(FunctionConstant{index, type, value, defined, name});
}

void fm_rt_barrier(int kind, unsigned flags, const char* file, int line, int col) {
  Worker& w = *tls_worker;
  Fiber* f = w.current;
  const char* what = (flags & FMEMU_RENDEZVOUS_ONLY) ? "MPP collective (matmul2d run)"
                     : kind == 0                     ? "threadgroup_barrier"
                                                     : "simdgroup_barrier";
  f->site = Site{kind, flags, what, file, line, col};
  f->state = kind == 0 ? FiberState::AtBarrier : FiberState::AtSimd;
  yield_to_scheduler(w);
}

const unsigned char* fm_rt_simd_exchange(const void* data, unsigned size, const char* what, const char* file, int line,
                                         int col) {
  Worker& w = *tls_worker;
  Fiber* f = w.current;
  SimdGroup& g = w.simds[f->simd];
  unsigned char* buf = g.buf[g.gen & 1];
  memcpy(buf + f->lane * FMEMU_SIMD_SLOT_BYTES, data, size);
  f->site = Site{2, 0, what, file, line, col};
  f->state = FiberState::AtSimd;
  yield_to_scheduler(w);
  return buf;
}

unsigned fm_rt_simd_lane(void) { return tls_worker->current->lane; }
unsigned fm_rt_simd_groups(void) { return tls_worker->nsimd; }
unsigned fm_rt_simd_group_index(void) { return tls_worker->current->simd; }
unsigned fm_rt_simd_width(void) { return tls_worker->simds[tls_worker->current->simd].width; }

void fm_rt_undefined_function_constant(const char* name, int index) {
  Worker& w = *tls_worker;
  fatal(w, "function-constant",
        std::string("function constant '") + name + "' (index " + std::to_string(index) +
            ") is read by the kernel at {pc0} but the dispatch did not set it",
        {pc_offset(__builtin_return_address(0))});
}

void fm_rt_fail(const char* message, const char* file, int line) {
  Worker& w = *tls_worker;
  fatal(w, "usage", std::string(message) + " (" + file + ":" + std::to_string(line) + ", " +
                        thread_name(w, w.current ? w.current->tid : 0) + ")");
}
}

// ---- C API for Python ---------------------------------------------------------------
FMEMU_EXPORT int fm_abi_version() { return FMEMU_ABI_VERSION; }
FMEMU_EXPORT void fm_set_mpp_layout(int layout, unsigned long long seed) { fm_rt_mpp = fm_mpp_config{layout, seed}; }
FMEMU_EXPORT int fm_num_kernels() { return (int)kernels().size(); }
FMEMU_EXPORT const char* fm_kernel_host_name(int i) { return kernels()[i].host.c_str(); }
FMEMU_EXPORT const char* fm_kernel_expr(int i) { return kernels()[i].expr.c_str(); }
FMEMU_EXPORT const char* fm_kernel_file(int i) { return kernels()[i].file.c_str(); }
FMEMU_EXPORT int fm_kernel_nparams(int i) { return kernels()[i].nparams; }
FMEMU_EXPORT int fm_num_omitted_kernels() { return (int)omitted_kernels().size(); }
FMEMU_EXPORT const char* fm_omitted_kernel_host_name(int i) { return omitted_kernels()[i].first.c_str(); }
FMEMU_EXPORT const char* fm_omitted_kernel_expr(int i) { return omitted_kernels()[i].second.c_str(); }
FMEMU_EXPORT int fm_num_function_constants() { return (int)function_constants().size(); }
FMEMU_EXPORT int fm_function_constant_index(int i) { return function_constants()[i].index; }
FMEMU_EXPORT int fm_function_constant_type(int i) { return function_constants()[i].type; }
FMEMU_EXPORT const char* fm_function_constant_name(int i) { return function_constants()[i].name.c_str(); }
FMEMU_EXPORT const char* fm_last_reports() { return last_report_json().c_str(); }
// The counts of the last dispatch (clean or not); returns sizeof the struct so
// that Python can check its mirror.
FMEMU_EXPORT unsigned long fm_last_counts(fm_dispatch_counts* out) {
  *out = last_counts();
  return sizeof(fm_dispatch_counts);
}

FMEMU_EXPORT void fm_reset_function_constants() {
  for (auto& fc : function_constants()) *fc.defined = false;
}

// Set every function constant declared with `index` (several translation units
// may each hold one). Returns how many were set.
FMEMU_EXPORT int fm_set_function_constant(int index, double v) {
  int n = 0;
  for (auto& fc : function_constants()) {
    if (fc.index != index) continue;
    switch (fc.type) {
      case FMEMU_FC_BOOL: *static_cast<bool*>(fc.value) = v != 0; break;
      case FMEMU_FC_INT: *static_cast<int*>(fc.value) = (int)v; break;
      case FMEMU_FC_UINT: *static_cast<unsigned*>(fc.value) = (unsigned)v; break;
      case FMEMU_FC_FLOAT: *static_cast<float*>(fc.value) = (float)v; break;
      case FMEMU_FC_HALF: *static_cast<_Float16*>(fc.value) = (_Float16)v; break;
      case FMEMU_FC_SHORT: *static_cast<short*>(fc.value) = (short)v; break;
      case FMEMU_FC_USHORT: *static_cast<unsigned short*>(fc.value) = (unsigned short)v; break;
      case FMEMU_FC_BFLOAT: *static_cast<__bf16*>(fc.value) = (__bf16)(float)v; break;
      default: continue;
    }
    *fc.defined = true;
    ++n;
  }
  return n;
}

// Run one dispatch. Returns 0 when clean, 1 when there are reports (see
// fm_last_reports), 2 on a bad description.
FMEMU_EXPORT int fm_dispatch(const fm_dispatch_desc* d) {
  static Worker* worker = nullptr;  // one dispatch at a time per library
  if (!worker) worker = new Worker();
  Worker& w = *worker;
  w.reports.clear();
  w.report_keys.clear();
  w.fatal = false;
  w.counts = fm_dispatch_counts{};
  fm_rt_counts = fm_kernel_counts{};
  last_report_json() = "[]";
  if (d->kernel < 0 || d->kernel >= (int)kernels().size()) return 2;
  w.kernel = &kernels()[d->kernel];
  w.roles.assign(d->roles, d->roles + d->nroles);
  for (int k = 0; k < 3; ++k) {
    w.grid[k] = d->grid[k];
    w.tpg[k] = d->threadgroup[k];
  }
  w.seed = d->seed;
  uint64_t threads = uint64_t(w.tpg[0]) * w.tpg[1] * w.tpg[2];
  tls_worker = &w;
  bool mapped = false;
  if (sigsetjmp(w.abort_env, 1) == 0) {
    if (threads == 0 || uint64_t(w.grid[0]) * w.grid[1] * w.grid[2] == 0)
      fatal(w, "limits", "empty grid or threadgroup");
    if (threads > kMaxThreadsPerThreadgroup)
      fatal(w, "limits", "threadgroup of " + std::to_string(threads) + " threads exceeds the limit of " +
                             std::to_string(kMaxThreadsPerThreadgroup) + " threads per threadgroup");
    // The kernel's own [[max_total_threads_per_threadgroup(N)]]: Metal's
    // pipeline admits at most N threads, so a bigger dispatch is refused.
    if (d->max_threads && threads > d->max_threads)
      fatal(w, "limits", "threadgroup of " + std::to_string(threads) + " threads exceeds the kernel's " +
                             "[[max_total_threads_per_threadgroup(" + std::to_string(d->max_threads) + ")]]");
    w.nthreads = (unsigned)threads;
    w.nsimd = (w.nthreads + FMEMU_SIMD_WIDTH - 1) / FMEMU_SIMD_WIDTH;
    for (int i = 0; i < 32; ++i) w.buffers[i] = nullptr;
    map_device_buffers(w, d->buffers, d->nbuffers);
    mapped = true;
    reset_threadgroup_memory(w, d->tg_lengths, d->ntg);
    prepare_fibers(w);
    install_fault_handler();
    w.instrument_active = true;
    for (unsigned gz = 0; gz < w.grid[2]; ++gz)
      for (unsigned gy = 0; gy < w.grid[1]; ++gy)
        for (unsigned gx = 0; gx < w.grid[0]; ++gx) {
          w.group[0] = gx;
          w.group[1] = gy;
          w.group[2] = gz;
          run_group(w);
        }
  }
  w.instrument_active = false;
  remove_fault_handler();
  if (mapped) unmap_device_buffers(w, true);
  tls_worker = nullptr;
  w.counts.kernel = fm_rt_counts;
  last_counts() = w.counts;
  publish_reports(w);
  return w.reports.empty() ? 0 : 1;
}
