// The C ABI between the kernel translation unit (shaders + this shim) and the
// emulator runtime (runtime/*.cpp). Both sides include this file; it must stay
// free of the C++ standard library because the shim avoids it (a std-free shim
// keeps the clang AST dump that the registry scan reads small).
#pragma once

#define FMEMU_ABI_VERSION 5

// Bytes one lane may contribute to a SIMD collective. 64 covers the widest
// operand we support (a 16-element float vector) and the three 2-element
// fragments that simdgroup_multiply_accumulate exchanges.
#define FMEMU_SIMD_SLOT_BYTES 64
// Lanes per SIMD-group on every Apple GPU (Metal's threads_per_simdgroup).
#define FMEMU_SIMD_WIDTH 32

// Parameter roles, the codes the pre-pass writes into clang::annotate.
#define FMEMU_ROLE_KERNEL 1
#define FMEMU_ROLE_BUFFER 2
#define FMEMU_ROLE_THREADGROUP 3
// [[max_total_threads_per_threadgroup(n)]] on a kernel.
#define FMEMU_ROLE_MAX_THREADS 4
// Position attributes: FMEMU_ROLE_POS_FIRST + the index in fm_pos_kind.
#define FMEMU_ROLE_POS_FIRST 16

// The position attributes a kernel parameter can carry. The runtime fills one
// uint3 per kind for every emulated thread; scalars use .x.
enum fm_pos_kind {
  FMEMU_POS_THREAD_POSITION_IN_GRID = 0,
  FMEMU_POS_THREAD_POSITION_IN_THREADGROUP,
  FMEMU_POS_THREADGROUP_POSITION_IN_GRID,
  FMEMU_POS_THREADS_PER_THREADGROUP,
  FMEMU_POS_THREADGROUPS_PER_GRID,
  FMEMU_POS_THREADS_PER_GRID,
  FMEMU_POS_THREAD_INDEX_IN_THREADGROUP,
  FMEMU_POS_THREAD_INDEX_IN_SIMDGROUP,
  FMEMU_POS_SIMDGROUP_INDEX_IN_THREADGROUP,
  FMEMU_POS_THREADS_PER_SIMDGROUP,
  FMEMU_POS_SIMDGROUPS_PER_THREADGROUP,
  FMEMU_POS_DISPATCH_THREADS_PER_THREADGROUP,
  FMEMU_POS_THREAD_INDEX_IN_QUADGROUP,
  FMEMU_POS_QUADGROUP_INDEX_IN_THREADGROUP,
  FMEMU_POS_COUNT
};

// Type codes of function constants (what Python may set).
#define FMEMU_FC_BOOL 1
#define FMEMU_FC_INT 2
#define FMEMU_FC_UINT 3
#define FMEMU_FC_FLOAT 4
#define FMEMU_FC_HALF 5
#define FMEMU_FC_SHORT 6
#define FMEMU_FC_USHORT 7
#define FMEMU_FC_BFLOAT 8

struct fm_role {
  int kind;   // FMEMU_ROLE_BUFFER, FMEMU_ROLE_THREADGROUP or FMEMU_ROLE_POS_FIRST + fm_pos_kind
  int index;  // buffer / threadgroup index; unused for positions
};

// What one emulated thread's kernel call receives.
struct fm_invocation {
  const struct fm_role* roles;      // one per kernel parameter
  void* const* buffers;             // indexed by [[buffer(n)]]
  void* const* tgmem;               // indexed by [[threadgroup(n)]]
  unsigned pos[FMEMU_POS_COUNT][3];    // position attribute values
};

typedef void (*fm_invoker)(void* fn, const struct fm_invocation* inv);

#ifdef __cplusplus
extern "C" {
#endif
// Registration (static initializers of the kernel TU).
void fm_rt_register_kernel(const char* host_name, const char* expr, void* fn, fm_invoker invoke, int nparams,
                           const char* file, int line);
// A registration site a partial build filtered out (FMEMU_ONLY / FMEMU_EXCEPT):
// its name and expression, nothing instantiated.
void fm_rt_register_omitted_kernel(const char* host_name, const char* expr);
void fm_rt_register_function_constant(int index, int type_code, void* value, bool* defined, const char* name);

// Synchronisation. kind: 0 = threadgroup_barrier, 1 = simdgroup_barrier.
void fm_rt_barrier(int kind, unsigned flags, const char* file, int line, int col);
// SIMD collective: deposit `size` bytes, wait for the whole SIMD-group at the
// same call site, return the 32 slots (FMEMU_SIMD_SLOT_BYTES apart) in lane order.
const unsigned char* fm_rt_simd_exchange(const void* data, unsigned size, const char* what, const char* file,
                                         int line, int col);
unsigned fm_rt_simd_lane(void);
unsigned fm_rt_simd_width(void);  // lanes present in this SIMD-group (< 32 only for a ragged last group)

// SIMD-groups in the current thread's threadgroup (the MPP shim checks
// execution_simdgroups<N> against it).
unsigned fm_rt_simd_groups(void);
unsigned fm_rt_simd_group_index(void);  // simdgroup_index_in_threadgroup of the current thread
// fm_rt_barrier flag: a threadgroup-wide rendezvous that is not a barrier (an
// MPP collective, include/fm/mpp.h): divergence is checked, no memory is
// ordered, and threadgroup_barriers does not count it.
#define FMEMU_RENDEZVOUS_ONLY 0x40000000u

// The cooperative-tensor lane layout of the current dispatch (include/fm/mpp.h),
// set by Library.dispatch(mpp_layout=, mpp_seed=) through fm_set_mpp_layout.
#define FMEMU_MPP_LAYOUT_M5 0
#define FMEMU_MPP_LAYOUT_SCRAMBLED 1
struct fm_mpp_config {
  int layout;
  unsigned long long seed;
};
extern struct fm_mpp_config fm_rt_mpp;

// Events the shim counts on the kernel side (the runtime counts the rest):
// the runtime zeroes this before a dispatch and reads it after. One object per
// library; a library runs one dispatch at a time on one OS thread, fibers
// switch only at rendezvous, so a plain increment is exact and deterministic
// (and costs one add in the fast build).
struct fm_kernel_counts {
  unsigned long long simdgroup_mmas;    // simdgroup_multiply(_accumulate), once per SIMD-group per call
  unsigned long long simdgroup_loads;   // simdgroup_load, once per SIMD-group per call
  unsigned long long simdgroup_stores;  // simdgroup_store, once per SIMD-group per call
  unsigned long long exp2_calls;        // exp / exp2 (metal::, fast::, precise::), per thread per element
  unsigned long long mpp_runs;          // MPP matmul2d run(), once per scope (1 or N SIMD-groups) per call
  unsigned long long mpp_flops;         // 2 M N K of each counted run() (K as run() read it)
  // Cooperative-tensor bookkeeping, per thread per call: get_multidimensional_index (of a cooperative
  // tensor or its iterator), is_valid_element and map_iterator, each one coordinate query of the
  // layout (Apple: the driver's get_coordinate / is_valid_element / map_index functions).
  unsigned long long mpp_coord_queries;
  // MPP matmul2d runs (counted as mpp_runs) with a tensor operand of some dynamic extent, which the op
  // edge-checks against (Apple's header: static slices spare inside tiles the check), and runs whose
  // descriptor sets relaxed_precision.
  unsigned long long mpp_checked_runs;
  unsigned long long mpp_relaxed_runs;
};
extern struct fm_kernel_counts fm_rt_counts;

// Threadgroup variable declared in a kernel body: storage shared by the group.
void* fm_rt_threadgroup_var(void* key, unsigned long size, unsigned long align, const char* name, const char* file,
                            int line);
// A function constant was read but the dispatch did not set it.
void fm_rt_undefined_function_constant(const char* name, int index);
// A shim-level error (misuse of an API) at a source location: reports and aborts the dispatch.
void fm_rt_fail(const char* message, const char* file, int line);
#ifdef __cplusplus
}
#endif
