// Barriers, threadgroup variables declared in kernel bodies, and function
// constants. The pre-pass (_prepass.py) rewrites the MSL declaration forms
// into the FMEMU_* macros below, keeping every line where it was.
#pragma once
#include "base.h"

namespace metal {
// Every call site is a distinct rendezvous: the runtime reports threads that
// wait at different barriers (or returned) as barrier divergence, naming the
// kernel source lines that __builtin_LINE() captures at the call.
inline void threadgroup_barrier(mem_flags flags, const char* file = __builtin_FILE(), int line = __builtin_LINE(),
                                int col = __builtin_COLUMN()) {
#ifndef FMEMU_CHECK_MSL
  fm_rt_barrier(0, (unsigned)flags, file, line, col);
#endif
}
inline void simdgroup_barrier(mem_flags flags, const char* file = __builtin_FILE(), int line = __builtin_LINE(),
                              int col = __builtin_COLUMN()) {
#ifndef FMEMU_CHECK_MSL
  fm_rt_barrier(1, (unsigned)flags, file, line, col);
#endif
}
}  // namespace metal

#ifdef FMEMU_CHECK_MSL
// Compile-only check: a threadgroup variable is a threadgroup-address-space
// object, so taking a thread pointer to it is an error.
#define FMEMU_TG_VAR(name, dims, ...) static threadgroup __VA_ARGS__ name dims
#else
// `threadgroup T name[N];` in a kernel body: one object per threadgroup, keyed
// by this static (one per declaration site and template instantiation).
#define FMEMU_TG_VAR(name, dims, ...)                                                                        \
  static char fm_tg_key_##name;                                                                          \
  __VA_ARGS__(&name) dims = *reinterpret_cast<__VA_ARGS__(*) dims>(fm_rt_threadgroup_var(                \
      &fm_tg_key_##name, sizeof(__VA_ARGS__ dims), alignof(__VA_ARGS__), #name, __FILE__, __LINE__))
#endif

namespace fmemu {
template <class T> constexpr int fc_type_code() {
  if constexpr (is_same<T, bool>::value) return FMEMU_FC_BOOL;
  else if constexpr (is_same<T, int>::value) return FMEMU_FC_INT;
  else if constexpr (is_same<T, uint>::value) return FMEMU_FC_UINT;
  else if constexpr (is_same<T, float>::value) return FMEMU_FC_FLOAT;
  else if constexpr (is_same<T, half>::value) return FMEMU_FC_HALF;
  else if constexpr (is_same<T, short>::value) return FMEMU_FC_SHORT;
  else if constexpr (is_same<T, ushort>::value) return FMEMU_FC_USHORT;
  else if constexpr (is_same<T, bfloat>::value) return FMEMU_FC_BFLOAT;
  else return 0;
}

// A program-scope `constant T name [[function_constant(i)]];`. Reading it
// while the dispatch left it unset is reported, as pipeline creation would
// fail on Metal.
template <class T>
struct function_constant {
  T value;
  bool defined;
  int index;
  const char* name;
  function_constant(int i, const char* n) : value(), defined(false), index(i), name(n) {
    static_assert(fc_type_code<T>() != 0, "unsupported function constant type");
#ifndef FMEMU_CHECK_MSL
    fm_rt_register_function_constant(i, fc_type_code<T>(), &value, &defined, n);
#endif
  }
  operator T() const {
#ifndef FMEMU_CHECK_MSL
    if (!defined) fm_rt_undefined_function_constant(name, index);
#endif
    return value;
  }
};
}  // namespace fmemu

#ifdef FMEMU_CHECK_MSL
// The compile-only rules check sees what Apple's compiler sees: a
// program-scope variable in the constant address space, declared in plain
// C++14 (MSL 3.1's base language has no inline variables). Never defined:
// the check only parses.
#define FMEMU_FUNCTION_CONSTANT(name, idx, ...) extern constant __VA_ARGS__ name
#define FMEMU_DERIVED_CONSTANT(name, expr, ...) constant __VA_ARGS__ name = (__VA_ARGS__)(expr)
#define is_function_constant_defined(x) ((void)(x), true)
#else
// Inline variables: several .metal translation units may include the header
// that declares a function constant, and they must share one.
#define FMEMU_FUNCTION_CONSTANT(name, idx, ...) inline ::fmemu::function_constant<__VA_ARGS__> name{(idx), #name}
// A program-scope constant computed from function constants, re-evaluated on
// every read so that it follows the values of the current dispatch.
#define FMEMU_DERIVED_CONSTANT(name, expr, ...)                            \
  struct fm_derived_##name##_t {                                        \
    operator __VA_ARGS__() const { return (__VA_ARGS__)(expr); }        \
  };                                                                    \
  inline constexpr fm_derived_##name##_t name {}
#define is_function_constant_defined(x) ((x).defined)
#endif
