// metal:: math, metal::fast:: and metal::precise:: (metal_math, metal_common,
// metal_relational, metal_geometric, metal_integer).
//
// Model: a half or bfloat argument is widened to float, the float libm
// function runs, and the result is rounded once to the argument type. fast::
// and precise:: are the same functions here: Apple documents fast:: as less
// accurate, and the emulator cannot reproduce its exact error, so tests must
// use tolerances that cover the documented ULP bounds, not these results.
#pragma once
#include "base.h"

extern "C" {
float expf(float);
float exp2f(float);
float logf(float);
float log2f(float);
float log10f(float);
float powf(float, float);
float sqrtf(float);
float sinf(float);
float cosf(float);
float tanf(float);
float asinf(float);
float acosf(float);
float atanf(float);
float atan2f(float, float);
float sinhf(float);
float coshf(float);
float tanhf(float);
float fmodf(float, float);
}

namespace fmemu {
template <class T, class F>
inline T map1(const T& x, F f) {
  using I = vec_info<T>;
  if constexpr (I::n == 1) {
    return f(x);
  } else {
    T r;
    for (int i = 0; i < I::n; ++i) r[i] = f(x[i]);
    return r;
  }
}
template <class T, class F>
inline T map2(const T& x, const T& y, F f) {
  using I = vec_info<T>;
  if constexpr (I::n == 1) {
    return f(x, y);
  } else {
    T r;
    for (int i = 0; i < I::n; ++i) r[i] = f(x[i], y[i]);
    return r;
  }
}
template <class T, class F>
inline T map3(const T& x, const T& y, const T& z, F f) {
  using I = vec_info<T>;
  if constexpr (I::n == 1) {
    return f(x, y, z);
  } else {
    T r;
    for (int i = 0; i < I::n; ++i) r[i] = f(x[i], y[i], z[i]);
    return r;
  }
}
template <class T> inline T splat(typename vec_info<T>::elem s) {
  if constexpr (vec_info<T>::n == 1) {
    return s;
  } else {
    return make_vec<typename vec_info<T>::elem, vec_info<T>::n>(s);
  }
}
}  // namespace fmemu

// A float function applied element-wise, rounding once to the element type.
#define FMEMU_MATH1(name, expr)                                                                             \
  template <class T, class = typename ::fmemu::enable_if<::fmemu::is_floating<T>>::type>                      \
  inline T name(T x) {                                                                                   \
    using E = typename ::fmemu::vec_info<T>::elem;                                                          \
    return ::fmemu::map1(x, [](E e) -> E { float v = (float)e; return (E)(expr); });                         \
  }
#define FMEMU_MATH2(name, expr)                                                                             \
  template <class T, class = typename ::fmemu::enable_if<::fmemu::is_floating<T>>::type>                      \
  inline T name(T x, T y) {                                                                              \
    using E = typename ::fmemu::vec_info<T>::elem;                                                          \
    return ::fmemu::map2(x, y, [](E ex, E ey) -> E { float a = (float)ex, b = (float)ey; return (E)(expr); }); \
  }

// An exponential: FMEMU_MATH1 plus one count per element in fm_rt_counts
// (Library.dispatch's exp2_calls). The compile-only rules check has no runtime.
#ifdef FMEMU_CHECK_MSL
#define FMEMU_COUNT_EXP(n)
#else
#define FMEMU_COUNT_EXP(n) (fm_rt_counts.exp2_calls += (n))
#endif
#define FMEMU_MATH1_EXP(name, expr)                                                                         \
  template <class T, class = typename ::fmemu::enable_if<::fmemu::is_floating<T>>::type>                      \
  inline T name(T x) {                                                                                   \
    using E = typename ::fmemu::vec_info<T>::elem;                                                          \
    FMEMU_COUNT_EXP(::fmemu::vec_info<T>::n);                                                               \
    return ::fmemu::map1(x, [](E e) -> E { float v = (float)e; return (E)(expr); });                         \
  }

#define FMEMU_MATH_FUNCTIONS                                                                      \
  FMEMU_MATH1_EXP(exp, expf(v))                                                                   \
  FMEMU_MATH1_EXP(exp2, exp2f(v))                                                                 \
  FMEMU_MATH1(exp10, powf(10.0f, v))                                                              \
  FMEMU_MATH1(log, logf(v))                                                                       \
  FMEMU_MATH1(log2, log2f(v))                                                                     \
  FMEMU_MATH1(log10, log10f(v))                                                                   \
  FMEMU_MATH1(sqrt, sqrtf(v))                                                                     \
  FMEMU_MATH1(rsqrt, 1.0f / sqrtf(v))                                                             \
  FMEMU_MATH1(sin, sinf(v))                                                                       \
  FMEMU_MATH1(cos, cosf(v))                                                                       \
  FMEMU_MATH1(tan, tanf(v))                                                                       \
  FMEMU_MATH1(asin, asinf(v))                                                                     \
  FMEMU_MATH1(acos, acosf(v))                                                                     \
  FMEMU_MATH1(atan, atanf(v))                                                                     \
  FMEMU_MATH1(sinh, sinhf(v))                                                                     \
  FMEMU_MATH1(cosh, coshf(v))                                                                     \
  FMEMU_MATH1(tanh, tanhf(v))                                                                     \
  FMEMU_MATH2(pow, powf(a, b))                                                                    \
  FMEMU_MATH2(powr, powf(a, b))                                                                   \
  FMEMU_MATH2(atan2, atan2f(a, b))                                                                \
  FMEMU_MATH2(fmod, fmodf(a, b))                                                                  \
  FMEMU_MATH2(divide, a / b)                                                                      \
  FMEMU_MATH1(floor, __builtin_floorf(v))                                                         \
  FMEMU_MATH1(ceil, __builtin_ceilf(v))                                                           \
  FMEMU_MATH1(trunc, __builtin_truncf(v))                                                         \
  FMEMU_MATH1(round, __builtin_roundf(v))                                                         \
  FMEMU_MATH1(rint, __builtin_rintf(v))                                                           \
  FMEMU_MATH1(fract, __builtin_fminf(v - __builtin_floorf(v), 0x1.fffffep-1f))                    \
  FMEMU_MATH1(fabs, __builtin_fabsf(v))                                                           \
  FMEMU_MATH1(saturate, __builtin_fminf(__builtin_fmaxf(v, 0.0f), 1.0f))                          \
  FMEMU_MATH1(sign, v > 0.0f ? 1.0f : (v < 0.0f ? -1.0f : (v != v ? 0.0f : v)))                   \
  FMEMU_MATH2(fmax, __builtin_fmaxf(a, b))                                                        \
  FMEMU_MATH2(fmin, __builtin_fminf(a, b))                                                        \
  FMEMU_MATH2(copysign, __builtin_copysignf(a, b))                                                \
  FMEMU_MATH2(fdim, a > b ? a - b : 0.0f)                                                         \
  FMEMU_MATH2(step, b < a ? 0.0f : 1.0f)

namespace metal {
FMEMU_MATH_FUNCTIONS
namespace fast {
FMEMU_MATH_FUNCTIONS
}
namespace precise {
FMEMU_MATH_FUNCTIONS
}

// fma rounds once, in the element type's precision (float fma, then one
// rounding to half/bfloat; that double rounding matches a real half fma except
// in rare ties, which tests must not depend on).
template <class T, class = typename ::fmemu::enable_if<::fmemu::is_floating<T>>::type>
inline T fma(T a, T b, T c) {
  using E = typename ::fmemu::vec_info<T>::elem;
  return ::fmemu::map3(a, b, c, [](E x, E y, E z) -> E { return (E)__builtin_fmaf((float)x, (float)y, (float)z); });
}

// max/min: NaN-ignoring for floating types (Metal's fmax semantics), plain
// comparisons for integers.
template <class T>
inline T max(T a, T b) {
  using E = typename ::fmemu::vec_info<T>::elem;
  if constexpr (::fmemu::is_float_scalar<E>) {
    return ::fmemu::map2(a, b, [](E x, E y) -> E { return (E)__builtin_fmaxf((float)x, (float)y); });
  } else {
    return ::fmemu::map2(a, b, [](E x, E y) -> E { return x < y ? y : x; });
  }
}
template <class T>
inline T min(T a, T b) {
  using E = typename ::fmemu::vec_info<T>::elem;
  if constexpr (::fmemu::is_float_scalar<E>) {
    return ::fmemu::map2(a, b, [](E x, E y) -> E { return (E)__builtin_fminf((float)x, (float)y); });
  } else {
    return ::fmemu::map2(a, b, [](E x, E y) -> E { return y < x ? y : x; });
  }
}
template <class T, class = typename ::fmemu::enable_if<::fmemu::is_vec<T>>::type>
inline T max(T a, typename ::fmemu::vec_info<T>::elem b) { return max(a, ::fmemu::splat<T>(b)); }
template <class T, class = typename ::fmemu::enable_if<::fmemu::is_vec<T>>::type>
inline T min(T a, typename ::fmemu::vec_info<T>::elem b) { return min(a, ::fmemu::splat<T>(b)); }
template <class T>
inline T clamp(T x, T lo, T hi) { return min(max(x, lo), hi); }
template <class T, class = typename ::fmemu::enable_if<::fmemu::is_vec<T>>::type>
inline T clamp(T x, typename ::fmemu::vec_info<T>::elem lo, typename ::fmemu::vec_info<T>::elem hi) {
  return clamp(x, ::fmemu::splat<T>(lo), ::fmemu::splat<T>(hi));
}
template <class T>
inline T abs(T x) {
  using E = typename ::fmemu::vec_info<T>::elem;
  if constexpr (::fmemu::is_float_scalar<E>) {
    return ::fmemu::map1(x, [](E e) -> E { return (E)__builtin_fabsf((float)e); });
  } else {
    return ::fmemu::map1(x, [](E e) -> E { return e < 0 ? (E)-e : e; });
  }
}
template <class T>
inline T mix(T x, T y, T a) { return x + (y - x) * a; }
template <class T, class = typename ::fmemu::enable_if<::fmemu::is_vec<T>>::type>
inline T mix(T x, T y, typename ::fmemu::vec_info<T>::elem a) { return x + (y - x) * a; }

template <class T>
inline bool isnan(T x) { return x != x; }
template <class T>
inline bool isinf(T x) { return __builtin_fabsf((float)x) == __builtin_inff(); }
template <class T>
inline bool isfinite(T x) { return !isnan(x) && !isinf(x); }
template <class T>
inline bool signbit(T x) { return __builtin_signbit((float)x); }

// select(a, b, c): c ? b : a, element-wise for vectors.
template <class T, class C>
inline T select(T a, T b, C c) {
  if constexpr (::fmemu::vec_info<T>::n == 1) {
    return c ? b : a;
  } else {
    T r;
    for (int i = 0; i < ::fmemu::vec_info<T>::n; ++i) r[i] = c[i] ? b[i] : a[i];
    return r;
  }
}
template <class T>
inline bool all(T v) {
  if constexpr (::fmemu::vec_info<T>::n == 1) {
    return (bool)v;
  } else {
    for (int i = 0; i < ::fmemu::vec_info<T>::n; ++i)
      if (!v[i]) return false;
    return true;
  }
}
template <class T>
inline bool any(T v) {
  if constexpr (::fmemu::vec_info<T>::n == 1) {
    return (bool)v;
  } else {
    for (int i = 0; i < ::fmemu::vec_info<T>::n; ++i)
      if (v[i]) return true;
    return false;
  }
}

// dot: element products summed left to right in the element type.
template <class T>
inline typename ::fmemu::vec_info<T>::elem dot(T a, T b) {
  using E = typename ::fmemu::vec_info<T>::elem;
  E s = a[0] * b[0];
  for (int i = 1; i < ::fmemu::vec_info<T>::n; ++i) s = s + a[i] * b[i];
  return s;
}
template <class T>
inline typename ::fmemu::vec_info<T>::elem length(T a) { return sqrt(dot(a, a)); }

// Integer functions.
template <class T>
inline T popcount(T x) { return (T)__builtin_popcountll((unsigned long long)x & (~0ull >> (64 - 8 * sizeof(T)))); }
template <class T>
inline T clz(T x) {
  unsigned long long v = (unsigned long long)x & (~0ull >> (64 - 8 * sizeof(T)));
  return v == 0 ? (T)(8 * sizeof(T)) : (T)(__builtin_clzll(v) - (64 - 8 * sizeof(T)));
}
template <class T>
inline T ctz(T x) {
  unsigned long long v = (unsigned long long)x;
  return v == 0 ? (T)(8 * sizeof(T)) : (T)__builtin_ctzll(v);
}
template <class T>
inline T mulhi(T a, T b) {
  return (T)(((__int128)a * (__int128)b) >> (8 * sizeof(T)));
}
}  // namespace metal
#undef FMEMU_MATH_FUNCTIONS
#undef FMEMU_MATH1
#undef FMEMU_MATH2
