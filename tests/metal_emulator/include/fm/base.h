// Scalar and vector types, address spaces, and type traits of the MSL shim.
// Std-free on purpose (see abi.h). Everything here is plain clang C++17.
#pragma once
#include "abi.h"

// ---- address spaces --------------------------------------------------------
// Runtime builds erase them (every pointer is a host pointer). The compile-only
// MSL rules check (FMEMU_CHECK_MSL) maps them to clang address spaces so that
// mixing device/threadgroup/constant/thread pointers and writing through
// constant are compile errors, as on Apple's compiler. The numbers follow
// Apple's AIR convention (1 device, 2 constant, 3 threadgroup); "thread" is
// clang's default address space 0.
#ifdef FMEMU_CHECK_MSL
#define device __attribute__((address_space(1)))
#define constant const __attribute__((address_space(2)))
#define threadgroup __attribute__((address_space(3)))
#define threadgroup_imageblock __attribute__((address_space(3)))
#define thread
#else
#define device
#define constant const
#define threadgroup
#define threadgroup_imageblock
#define thread
#endif
// The bare keyword form `kernel void f(...)`; the pre-pass rewrites [[kernel]].
#define kernel [[clang::annotate("msl", FMEMU_ROLE_KERNEL, 0)]]

// ---- scalar types ----------------------------------------------------------
typedef _Float16 half;
typedef __bf16 bfloat;
typedef unsigned int uint;
typedef unsigned short ushort;
typedef unsigned char uchar;
typedef unsigned long ulong;
typedef signed char int8_t;
typedef unsigned char uint8_t;
typedef short int16_t;
typedef unsigned short uint16_t;
typedef int int32_t;
typedef unsigned int uint32_t;
typedef long int64_t;
typedef unsigned long uint64_t;
typedef unsigned long size_t;
typedef long ptrdiff_t;
typedef long intptr_t;
typedef unsigned long uintptr_t;

// `1.0h` half literals. Reserved literal names are allowed in a system header
// (the shim directory is passed with -isystem).
constexpr half operator""h(long double v) { return (half)v; }
constexpr half operator""h(unsigned long long v) { return (half)v; }

namespace fmemu {
// ---- minimal traits --------------------------------------------------------
template <class T, T v> struct integral_constant { static constexpr T value = v; };
template <class A, class B> struct is_same : integral_constant<bool, false> {};
template <class A> struct is_same<A, A> : integral_constant<bool, true> {};
template <class T> struct remove_ref { using type = T; };
template <class T> struct remove_ref<T&> { using type = T; };
template <class T> struct remove_ref<T&&> { using type = T; };
template <class T> struct remove_cv { using type = T; };
template <class T> struct remove_cv<const T> { using type = T; };
template <class T> struct remove_cv<volatile T> { using type = T; };
template <class T> struct remove_cv<const volatile T> { using type = T; };
template <bool B, class T = void> struct enable_if {};
template <class T> struct enable_if<true, T> { using type = T; };
template <class T> T&& declval();
template <int... I> struct index_seq {};
template <class T, T... I> struct seq_of { using type = index_seq<I...>; };
template <int N> using make_index_seq = typename __make_integer_seq<seq_of, int, N>::type;

// Element type and lane count of a scalar or clang ext_vector.
template <class T> struct vec_info {
  static constexpr int n = 1;
  using elem = T;
};
template <class T, int N> struct vec_info<T __attribute__((ext_vector_type(N)))> {
  static constexpr int n = N;
  using elem = T;
};
template <class T> constexpr bool is_vec = vec_info<T>::n > 1;
template <class T> constexpr bool is_float_scalar =
    is_same<T, float>::value || is_same<T, half>::value || is_same<T, bfloat>::value || is_same<T, double>::value;
template <class T> constexpr bool is_floating = is_float_scalar<typename vec_info<T>::elem>;
}  // namespace fmemu

// ---- vectors ---------------------------------------------------------------
namespace metal {
template <class T, int N> using vec = T __attribute__((ext_vector_type(N)));
}
using metal::vec;

#define FMEMU_VEC_TYPES(T)                                 \
  typedef T T##2 __attribute__((ext_vector_type(2))); \
  typedef T T##3 __attribute__((ext_vector_type(3))); \
  typedef T T##4 __attribute__((ext_vector_type(4))); \
  typedef T T##8 __attribute__((ext_vector_type(8))); \
  typedef T T##16 __attribute__((ext_vector_type(16)));
FMEMU_VEC_TYPES(float)
FMEMU_VEC_TYPES(half)
FMEMU_VEC_TYPES(bfloat)
FMEMU_VEC_TYPES(int)
FMEMU_VEC_TYPES(uint)
FMEMU_VEC_TYPES(short)
FMEMU_VEC_TYPES(ushort)
FMEMU_VEC_TYPES(char)
FMEMU_VEC_TYPES(uchar)
FMEMU_VEC_TYPES(long)
FMEMU_VEC_TYPES(ulong)
#undef FMEMU_VEC_TYPES
typedef float packed_float2 __attribute__((ext_vector_type(2)));
typedef half packed_half2 __attribute__((ext_vector_type(2)));
typedef half packed_half4 __attribute__((ext_vector_type(4)));
typedef float packed_float4 __attribute__((ext_vector_type(4)));

namespace fmemu {
// Component count contributed by one constructor argument.
template <class A> constexpr int ncomp() { return vec_info<typename remove_cv<typename remove_ref<A>::type>::type>::n; }

template <class T, int N, class A>
inline void put(vec<T, N>& r, int& i, const A& a) {
  using AI = vec_info<A>;
  if constexpr (AI::n == 1) {
    r[i++] = (T)a;
  } else {
    for (int k = 0; k < AI::n; ++k) r[i++] = (T)a[k];
  }
}

// MSL vector constructors: float4(x) splat, float4(a, b, c, d), float4(f2, f2),
// float4(half4) conversion. Clang ext_vectors lack constructors, so the type
// names below are also function-like macros that route here (a function-like
// macro fires only before '(', so `float4 v;` still names the type).
template <class T, int N, class... A>
inline vec<T, N> make_vec(const A&... a) {
  vec<T, N> r;
  constexpr int total = (0 + ... + ncomp<A>());
  if constexpr (sizeof...(A) == 1 && total == 1) {
    T s = (T)(a, ...);
    for (int k = 0; k < N; ++k) r[k] = s;
  } else {
    static_assert(total == N, "MSL vector constructor: component count does not match the vector size");
    int i = 0;
    (put<T, N>(r, i, a), ...);
  }
  return r;
}
}  // namespace fmemu

#define float2(...) ::fmemu::make_vec<float, 2>(__VA_ARGS__)
#define float3(...) ::fmemu::make_vec<float, 3>(__VA_ARGS__)
#define float4(...) ::fmemu::make_vec<float, 4>(__VA_ARGS__)
#define float8(...) ::fmemu::make_vec<float, 8>(__VA_ARGS__)
#define float16(...) ::fmemu::make_vec<float, 16>(__VA_ARGS__)
#define half2(...) ::fmemu::make_vec<half, 2>(__VA_ARGS__)
#define half3(...) ::fmemu::make_vec<half, 3>(__VA_ARGS__)
#define half4(...) ::fmemu::make_vec<half, 4>(__VA_ARGS__)
#define half8(...) ::fmemu::make_vec<half, 8>(__VA_ARGS__)
#define bfloat2(...) ::fmemu::make_vec<bfloat, 2>(__VA_ARGS__)
#define bfloat3(...) ::fmemu::make_vec<bfloat, 3>(__VA_ARGS__)
#define bfloat4(...) ::fmemu::make_vec<bfloat, 4>(__VA_ARGS__)
#define bfloat8(...) ::fmemu::make_vec<bfloat, 8>(__VA_ARGS__)
#define int2(...) ::fmemu::make_vec<int, 2>(__VA_ARGS__)
#define int3(...) ::fmemu::make_vec<int, 3>(__VA_ARGS__)
#define int4(...) ::fmemu::make_vec<int, 4>(__VA_ARGS__)
#define uint2(...) ::fmemu::make_vec<uint, 2>(__VA_ARGS__)
#define uint3(...) ::fmemu::make_vec<uint, 3>(__VA_ARGS__)
#define uint4(...) ::fmemu::make_vec<uint, 4>(__VA_ARGS__)
#define short2(...) ::fmemu::make_vec<short, 2>(__VA_ARGS__)
#define short4(...) ::fmemu::make_vec<short, 4>(__VA_ARGS__)
#define ushort2(...) ::fmemu::make_vec<ushort, 2>(__VA_ARGS__)
#define ushort3(...) ::fmemu::make_vec<ushort, 3>(__VA_ARGS__)
#define ushort4(...) ::fmemu::make_vec<ushort, 4>(__VA_ARGS__)
#define ulong2(...) ::fmemu::make_vec<ulong, 2>(__VA_ARGS__)
#define long2(...) ::fmemu::make_vec<long, 2>(__VA_ARGS__)

namespace metal {
// Reinterpret the bits of a value as another type of the same size.
template <class To, class From>
inline To as_type(const From& v) {
  static_assert(sizeof(To) == sizeof(From), "as_type: sizes differ");
  return __builtin_bit_cast(To, v);
}
// Element-wise conversion between vector types (clang's static_cast between
// ext_vectors is a bit cast, so MSL code must use this or the T4(x) form).
template <class To, class From>
inline To convert(const From& v) {
  return ::fmemu::make_vec<typename ::fmemu::vec_info<To>::elem, ::fmemu::vec_info<To>::n>(v);
}

enum class mem_flags : unsigned {
  mem_none = 0,
  mem_device = 1,
  mem_threadgroup = 2,
  mem_texture = 4,
  mem_threadgroup_imageblock = 8,
  mem_object_data = 16,
};
constexpr mem_flags operator|(mem_flags a, mem_flags b) { return (mem_flags)((unsigned)a | (unsigned)b); }

template <class T> struct numeric_limits;
template <> struct numeric_limits<float> {
  static constexpr float max() { return 3.40282347e+38f; }
  static constexpr float min() { return 1.17549435e-38f; }
  static constexpr float lowest() { return -3.40282347e+38f; }
  static constexpr float epsilon() { return 1.1920929e-7f; }
  static constexpr float infinity() { return __builtin_inff(); }
  static constexpr float quiet_NaN() { return __builtin_nanf(""); }
  static constexpr bool has_infinity = true;
  static constexpr bool is_signed = true;
};
template <> struct numeric_limits<half> {
  static constexpr half max() { return (half)65504.0f; }
  static constexpr half min() { return (half)6.103515625e-05f; }
  static constexpr half lowest() { return (half)-65504.0f; }
  static constexpr half epsilon() { return (half)0.0009765625f; }
  static constexpr half infinity() { return (half)__builtin_inff(); }
  static constexpr half quiet_NaN() { return (half)__builtin_nanf(""); }
  static constexpr bool has_infinity = true;
  static constexpr bool is_signed = true;
};
template <> struct numeric_limits<bfloat> {
  static constexpr bfloat max() { return __builtin_bit_cast(bfloat, (unsigned short)0x7F7F); }
  static constexpr bfloat min() { return __builtin_bit_cast(bfloat, (unsigned short)0x0080); }
  static constexpr bfloat lowest() { return __builtin_bit_cast(bfloat, (unsigned short)0xFF7F); }
  static constexpr bfloat epsilon() { return __builtin_bit_cast(bfloat, (unsigned short)0x3C00); }
  static constexpr bfloat infinity() { return __builtin_bit_cast(bfloat, (unsigned short)0x7F80); }
  static constexpr bfloat quiet_NaN() { return __builtin_bit_cast(bfloat, (unsigned short)0x7FC0); }
  static constexpr bool has_infinity = true;
  static constexpr bool is_signed = true;
};
#define FMEMU_INT_LIMITS(T, LO, HI)                      \
  template <> struct numeric_limits<T> {              \
    static constexpr T max() { return HI; }           \
    static constexpr T min() { return LO; }           \
    static constexpr T lowest() { return LO; }        \
    static constexpr bool has_infinity = false;       \
    static constexpr bool is_signed = (T)-1 < (T)0;   \
  };
FMEMU_INT_LIMITS(int, (-2147483647 - 1), 2147483647)
FMEMU_INT_LIMITS(uint, 0u, 4294967295u)
FMEMU_INT_LIMITS(short, (short)-32768, (short)32767)
FMEMU_INT_LIMITS(ushort, (ushort)0, (ushort)65535)
FMEMU_INT_LIMITS(char, (char)-128, (char)127)
FMEMU_INT_LIMITS(uchar, (uchar)0, (uchar)255)
FMEMU_INT_LIMITS(long, (-9223372036854775807L - 1), 9223372036854775807L)
FMEMU_INT_LIMITS(ulong, 0ul, 18446744073709551615ul)
#undef FMEMU_INT_LIMITS
}  // namespace metal

// MSL constants (metal_math / metal_types).
#define INFINITY __builtin_inff()
#define NAN __builtin_nanf("")
#define HUGE_VALF __builtin_inff()
#define MAXFLOAT 3.40282347e+38f
#define FLT_MAX 3.40282347e+38f
#define FLT_MIN 1.17549435e-38f
#define FLT_EPSILON 1.1920929e-7f
#define HALF_MAX ((half)65504.0f)
#define HALF_MIN ((half)6.103515625e-05f)
#define HALF_EPSILON ((half)0.0009765625f)
#define MAXHALF ((half)65504.0f)
#define M_E_F 2.71828182845904523536f
#define M_LOG2E_F 1.44269504088896340736f
#define M_LOG10E_F 0.434294481903251827651f
#define M_LN2_F 0.693147180559945309417f
#define M_LN10_F 2.30258509299404568402f
#define M_PI_F 3.14159265358979323846f
#define M_PI_2_F 1.57079632679489661923f
#define M_PI_4_F 0.785398163397448309616f
#define M_1_PI_F 0.318309886183790671538f
#define M_2_PI_F 0.636619772367581343076f
#define M_2_SQRTPI_F 1.12837916709551257390f
#define M_SQRT2_F 1.41421356237309504880f
#define M_SQRT1_2_F 0.707106781186547524401f
#define M_LOG2E_H ((half)1.44269504088896340736f)
#define M_LN2_H ((half)0.693147180559945309417f)
