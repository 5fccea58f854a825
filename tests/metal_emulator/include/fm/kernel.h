// Kernel registration: the pre-pass turns each
//   template [[host_name("x")]] [[kernel]] decltype(f<A>) f<A>;
// into FMEMU_INSTANTIATE(decltype(f<A>) f<A>) FMEMU_REGISTER_KERNEL("x", f<A>), and
// appends FMEMU_REGISTER_KERNEL("f", f) after a non-template kernel's body. The
// registrar stores a typed invoker that builds each argument from the role the
// registry scan found for that parameter ([[buffer(n)]], a position, ...).
#pragma once
#include "base.h"

namespace fmemu {
template <class P>
inline P kernel_arg(const fm_invocation* inv, int i) {
  const fm_role& role = inv->roles[i];
  if constexpr (__is_pointer(P)) {
    void* p = role.kind == FMEMU_ROLE_THREADGROUP ? inv->tgmem[role.index] : inv->buffers[role.index];
    return reinterpret_cast<P>(p);
  } else if constexpr (__is_reference(P)) {
    return *reinterpret_cast<typename remove_ref<P>::type*>(inv->buffers[role.index]);
  } else {
    using E = typename vec_info<P>::elem;
    const unsigned* v = inv->pos[role.kind - FMEMU_ROLE_POS_FIRST];
    if constexpr (vec_info<P>::n == 1) {
      return (P)v[0];
    } else {
      P r;
      for (int k = 0; k < vec_info<P>::n; ++k) r[k] = (E)v[k];
      return r;
    }
  }
}

template <class... P>
struct invoker {
  template <int... I>
  static void run(void (*f)(P...), const fm_invocation* inv, index_seq<I...>) {
    f(kernel_arg<P>(inv, I)...);
  }
  static void call(void* f, const fm_invocation* inv) {
    run(reinterpret_cast<void (*)(P...)>(f), inv, make_index_seq<sizeof...(P)>{});
  }
};

struct kernel_registrar {
  template <class... P>
  kernel_registrar(const char* host_name, const char* expr, void (*f)(P...), const char* file, int line) {
    fm_rt_register_kernel(host_name, expr, reinterpret_cast<void*>(f), &invoker<P...>::call, (int)sizeof...(P), file,
                          line);
  }
};
}  // namespace fmemu

// A partial build: compile_library(only=...) passes -DFMEMU_ONLY="p1","p2",...,
// and compile_library(exclude=...) -DFMEMU_EXCEPT="p1",..., glob patterns ('*'
// matches any run of characters) over host names. A registration site is
// built when its host name matches some FMEMU_ONLY pattern (or there is none)
// and no FMEMU_EXCEPT pattern; any other site is never instantiated, so a test
// needing a few kernels of a big library does not compile the rest, and a
// default build can leave out kernels only a few tests run. A left-out site
// still registers its host name and expression (fm_rt_register_omitted_kernel:
// strings only), so the library can name every kernel its source holds.
namespace fmemu {
constexpr bool glob_match(const char* p, const char* s) {
  // Iterative '*' matching with one backtrack point (linear for our patterns).
  const char* star = nullptr;
  const char* resume = nullptr;
  while (*s) {
    if (*p == '*') {
      star = p++;
      resume = s;
    } else if (*p == *s) {
      ++p;
      ++s;
    } else if (star) {
      p = star + 1;
      s = ++resume;
    } else {
      return false;
    }
  }
  while (*p == '*') ++p;
  return *p == 0;
}
#ifdef FMEMU_ONLY
constexpr const char* only_patterns[] = {FMEMU_ONLY};
constexpr bool in_only(const char* host_name) {
  for (const char* p : only_patterns)
    if (glob_match(p, host_name)) return true;
  return false;
}
#else
constexpr bool in_only(const char*) { return true; }
#endif
#ifdef FMEMU_EXCEPT
constexpr const char* except_patterns[] = {FMEMU_EXCEPT};
constexpr bool in_except(const char* host_name) {
  for (const char* p : except_patterns)
    if (glob_match(p, host_name)) return true;
  return false;
}
#else
constexpr bool in_except(const char*) { return false; }
#endif
constexpr bool wanted(const char* host_name) { return in_only(host_name) && !in_except(host_name); }
// A registration site's part in this translation unit: not its shard's
// (nothing), built, or left out by the filters (its name only).
enum site_mode : int { site_elsewhere = 0, site_built = 1, site_omitted = 2 };
constexpr int site_mode_of(bool mine, const char* host_name) {
  return !mine ? site_elsewhere : wanted(host_name) ? site_built : site_omitted;
}
}  // namespace fmemu

#define FMEMU_CAT2(a, b) a##b
#define FMEMU_CAT(a, b) FMEMU_CAT2(a, b)
#if defined(FMEMU_SCAN)
// The registry scan only parses: no instantiation, so the AST dump holds each
// kernel template once.
#define FMEMU_INSTANTIATE(...)
#define FMEMU_REGISTER_KERNEL(host_name, ...)
#elif defined(FMEMU_CHECK_MSL)
// The rules check keeps the explicit instantiation: it type-checks every
// instantiated body with address spaces, and it rejects what C++ rejects
// (e.g. an unqualified name instantiated outside the template's namespace).
#define FMEMU_INSTANTIATE(...) template __VA_ARGS__;
#define FMEMU_REGISTER_KERNEL(host_name, ...)
#else
// Runtime builds: taking the kernel's address instantiates it. A big library
// is compiled as FMEMU_SHARDS translation units side by side (the build
// passes -DFMEMU_SHARDS=S -DFMEMU_SHARD=i; tests/metal_emulator/_library.py):
// registration site n (in __COUNTER__ order, the same in every shard) lives
// in shard n % S. The address is taken only inside a partial specialization
// that the site's own shard instantiates, so the other shards never
// instantiate the kernel (clang instantiates a template referenced from an
// uninstantiated template's body only when that body is instantiated).
#ifndef FMEMU_SHARDS
#define FMEMU_SHARDS 1
#define FMEMU_SHARD 0
#endif
#define FMEMU_INSTANTIATE(...)
#define FMEMU_REGISTER_KERNEL(host_name, ...) FMEMU_REGISTER_AT(__COUNTER__, host_name, __VA_ARGS__)
#define FMEMU_REGISTER_AT(n, host_name, ...) FMEMU_REGISTER_AT2(n, host_name, __VA_ARGS__)
#define FMEMU_REGISTER_AT2(n, host_name, ...)                                                              \
  template <class FMEMU_T, int FMEMU_MODE>                                                                \
  struct FMEMU_CAT(fm_kernel_site_, n) {                                                                  \
    static int add() { return 0; }                                                                        \
  };                                                                                                      \
  template <class FMEMU_T>                                                                                \
  struct FMEMU_CAT(fm_kernel_site_, n)<FMEMU_T, ::fmemu::site_built> {                                    \
    static int add() {                                                                                    \
      static ::fmemu::kernel_registrar r(host_name, #__VA_ARGS__, &__VA_ARGS__, __FILE__, __LINE__);      \
      return 1;                                                                                           \
    }                                                                                                     \
  };                                                                                                      \
  template <class FMEMU_T>                                                                                \
  struct FMEMU_CAT(fm_kernel_site_, n)<FMEMU_T, ::fmemu::site_omitted> {                                  \
    static int add() {                                                                                    \
      fm_rt_register_omitted_kernel(host_name, #__VA_ARGS__);                                             \
      return 2;                                                                                           \
    }                                                                                                     \
  };                                                                                                      \
  static const int FMEMU_CAT(fm_kernel_registrar_, n) =                                                   \
      FMEMU_CAT(fm_kernel_site_, n)<void, ::fmemu::site_mode_of((n) % FMEMU_SHARDS == FMEMU_SHARD,         \
                                                                host_name)>::add();
#endif
