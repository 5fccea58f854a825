// A minimal float SIMD layer for the CPU attention kernel: one `Vec` type of
// kWidth float32 lanes with exactly the operations the kernel needs.
//
//   x86-64 with AVX2+FMA (-march=native on this project's Linux machines): __m256, 8 lanes
//   arm64 (Apple clang on M-series Macs, Linux aarch64): NEON float32x4_t, 4 lanes
//   anything else: a scalar 1-lane fallback (correct, slow)
// plus MVec, the micro-kernels' wider vector (16 lanes with AVX-512, else Vec).
//
// Why not at::vec::Vectorized: inside an extension it only takes its AVX2
// specialisation if CPU_CAPABILITY_AVX2 is defined by hand, and its register
// footprint is not something the register-tiled micro-kernels can count on.
// Here every Vec is one hardware register, so a 6x2 tile is 12 registers.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define FLASH_METAL_SIMD_AVX2 1
#elif defined(__aarch64__)
#include <arm_neon.h>
#define FLASH_METAL_SIMD_NEON 1
#endif
#if defined(__AVX512F__)
#include <immintrin.h>  // MVec below (the header has an include guard)
#endif

namespace flash_metal {
namespace cpu {

#if defined(FLASH_METAL_SIMD_AVX2)

struct Vec {
  static constexpr int kWidth = 8;
  __m256 v;
  static Vec load(const float* p) { return {_mm256_loadu_ps(p)}; }
  static Vec broadcast(float x) { return {_mm256_set1_ps(x)}; }
  static Vec zero() { return {_mm256_setzero_ps()}; }
  void store(float* p) const { _mm256_storeu_ps(p, v); }
};
inline Vec fmadd(Vec a, Vec b, Vec c) { return {_mm256_fmadd_ps(a.v, b.v, c.v)}; }
inline Vec operator+(Vec a, Vec b) { return {_mm256_add_ps(a.v, b.v)}; }
inline Vec operator-(Vec a, Vec b) { return {_mm256_sub_ps(a.v, b.v)}; }
inline Vec operator*(Vec a, Vec b) { return {_mm256_mul_ps(a.v, b.v)}; }
inline Vec vmax(Vec a, Vec b) { return {_mm256_max_ps(a.v, b.v)}; }
inline Vec vmin(Vec a, Vec b) { return {_mm256_min_ps(a.v, b.v)}; }
inline Vec round_nearest(Vec a) { return {_mm256_round_ps(a.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)}; }
inline Vec operator/(Vec a, Vec b) { return {_mm256_div_ps(a.v, b.v)}; }
inline Vec vabs(Vec a) { return {_mm256_andnot_ps(_mm256_set1_ps(-0.0f), a.v)}; }
// lanes where a < b take x, the others y
inline Vec select_lt(Vec a, Vec b, Vec x, Vec y) {
  return {_mm256_blendv_ps(y.v, x.v, _mm256_cmp_ps(a.v, b.v, _CMP_LT_OQ))};
}
// 2^n for integer-valued n in [-127, 127], built directly in the exponent
// field; n = -127 gives the bit pattern 0, i.e. exactly 0.0f.
inline Vec pow2_int(Vec n) {
  __m256i i = _mm256_cvtps_epi32(n.v);
  i = _mm256_slli_epi32(_mm256_add_epi32(i, _mm256_set1_epi32(127)), 23);
  return {_mm256_castsi256_ps(i)};
}
// lanes where a == b take x, the others y
inline Vec select_eq(Vec a, Vec b, Vec x, Vec y) {
  return {_mm256_blendv_ps(y.v, x.v, _mm256_cmp_ps(a.v, b.v, _CMP_EQ_OQ))};
}

// 8 halves / bfloat16s -> 8 floats
inline Vec load_convert(const c10::Half* p) {
#if defined(__F16C__)
  return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))};
#else
  alignas(32) float tmp[8];
  for (int i = 0; i < 8; ++i) tmp[i] = static_cast<float>(p[i]);
  return Vec::load(tmp);
#endif
}
inline Vec load_convert(const c10::BFloat16* p) {
  // bfloat16 is the top half of a float32: widen to 32 bits and shift up.
  __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return {_mm256_castsi256_ps(_mm256_slli_epi32(w, 16))};
}

#elif defined(FLASH_METAL_SIMD_NEON)

struct Vec {
  static constexpr int kWidth = 4;
  float32x4_t v;
  static Vec load(const float* p) { return {vld1q_f32(p)}; }
  static Vec broadcast(float x) { return {vdupq_n_f32(x)}; }
  static Vec zero() { return {vdupq_n_f32(0.0f)}; }
  void store(float* p) const { vst1q_f32(p, v); }
};
inline Vec fmadd(Vec a, Vec b, Vec c) { return {vfmaq_f32(c.v, a.v, b.v)}; }
inline Vec operator+(Vec a, Vec b) { return {vaddq_f32(a.v, b.v)}; }
inline Vec operator-(Vec a, Vec b) { return {vsubq_f32(a.v, b.v)}; }
inline Vec operator*(Vec a, Vec b) { return {vmulq_f32(a.v, b.v)}; }
inline Vec vmax(Vec a, Vec b) { return {vmaxq_f32(a.v, b.v)}; }
inline Vec vmin(Vec a, Vec b) { return {vminq_f32(a.v, b.v)}; }
inline Vec round_nearest(Vec a) { return {vrndnq_f32(a.v)}; }
inline Vec operator/(Vec a, Vec b) { return {vdivq_f32(a.v, b.v)}; }
inline Vec vabs(Vec a) { return {vabsq_f32(a.v)}; }
inline Vec select_lt(Vec a, Vec b, Vec x, Vec y) { return {vbslq_f32(vcltq_f32(a.v, b.v), x.v, y.v)}; }
inline Vec pow2_int(Vec n) {
  int32x4_t i = vcvtq_s32_f32(n.v);
  i = vshlq_n_s32(vaddq_s32(i, vdupq_n_s32(127)), 23);
  return {vreinterpretq_f32_s32(i)};
}
inline Vec select_eq(Vec a, Vec b, Vec x, Vec y) { return {vbslq_f32(vceqq_f32(a.v, b.v), x.v, y.v)}; }
inline Vec load_convert(const c10::Half* p) {
  return {vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(reinterpret_cast<const uint16_t*>(p))))};
}
inline Vec load_convert(const c10::BFloat16* p) {
  uint32x4_t w = vshll_n_u16(vld1_u16(reinterpret_cast<const uint16_t*>(p)), 16);
  return {vreinterpretq_f32_u32(w)};
}

#else  // portable scalar fallback

struct Vec {
  static constexpr int kWidth = 1;
  float v;
  static Vec load(const float* p) { return {*p}; }
  static Vec broadcast(float x) { return {x}; }
  static Vec zero() { return {0.0f}; }
  void store(float* p) const { *p = v; }
};
inline Vec fmadd(Vec a, Vec b, Vec c) { return {std::fma(a.v, b.v, c.v)}; }
inline Vec operator+(Vec a, Vec b) { return {a.v + b.v}; }
inline Vec operator-(Vec a, Vec b) { return {a.v - b.v}; }
inline Vec operator*(Vec a, Vec b) { return {a.v * b.v}; }
inline Vec vmax(Vec a, Vec b) { return {a.v > b.v ? a.v : b.v}; }
inline Vec vmin(Vec a, Vec b) { return {a.v < b.v ? a.v : b.v}; }
inline Vec round_nearest(Vec a) { return {std::nearbyint(a.v)}; }
inline Vec operator/(Vec a, Vec b) { return {a.v / b.v}; }
inline Vec vabs(Vec a) { return {std::fabs(a.v)}; }
inline Vec select_lt(Vec a, Vec b, Vec x, Vec y) { return a.v < b.v ? x : y; }
inline Vec pow2_int(Vec n) {
  uint32_t bits = static_cast<uint32_t>(static_cast<int32_t>(n.v) + 127) << 23;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return {f};
}
inline Vec select_eq(Vec a, Vec b, Vec x, Vec y) { return a.v == b.v ? x : y; }
inline Vec load_convert(const c10::Half* p) { return {static_cast<float>(*p)}; }
inline Vec load_convert(const c10::BFloat16* p) { return {static_cast<float>(*p)}; }

#endif

inline Vec load_convert(const float* p) { return Vec::load(p); }

constexpr int kW = Vec::kWidth;

// The register-tiled micro-kernels' vector type (forward and backward
// products). With AVX-512 (-march=native on this project's Xeon) it is a
// 16-lane zmm register: float32 SDPA on this machine runs on MKL's AVX-512
// GEMMs, and an 8-lane AVX2 tile tops out at half their rate (the backward
// measured 150 GFLOP/s on 2 cores with AVX2, about the AVX2 FMA peak).
// Elsewhere it is Vec itself. The element-wise passes always keep Vec; kMW is
// a multiple of kW, so a width that divides by kMW divides by kW too.
#if defined(__AVX512F__)
struct MVec {
  static constexpr int kWidth = 16;
  __m512 v;
  static MVec load(const float* p) { return {_mm512_loadu_ps(p)}; }
  static MVec broadcast(float x) { return {_mm512_set1_ps(x)}; }
  static MVec zero() { return {_mm512_setzero_ps()}; }
  void store(float* p) const { _mm512_storeu_ps(p, v); }
};
inline MVec fmadd(MVec a, MVec b, MVec c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
inline MVec operator*(MVec a, MVec b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline MVec operator+(MVec a, MVec b) { return {_mm512_add_ps(a.v, b.v)}; }
#else
using MVec = Vec;
#endif
constexpr int kMW = MVec::kWidth;
static_assert(kMW % kW == 0, "micro-kernel vectors must hold whole Vecs");

// c + x as hi + lo exactly (Knuth's branch-free TwoSum, 6 additions, for
// float, Vec or MVec): returns hi = fl(c + x) and adds lo, its rounding
// error, to *e. Needs IEEE additions as written (no -ffast-math
// reassociation; the build has none).
template <typename V>
inline V two_sum(V c, V x, V* e) {
  const V hi = c + x;
  const V z = hi - c;
  *e = *e + ((c - (hi - z)) + (x - z));
  return hi;
}

// 2^x for x <= 0 (the kernel only ever exponentiates differences to the
// running max), including x = -inf -> 0. Split x = n + f with n = round(x),
// f in [-1/2, 1/2]; 2^f is a degree-6 polynomial and 2^n goes straight into the
// exponent bits. The coefficients are our own relative-error minimax-style fit
// of 2^f on [-1/2, 1/2] (iteratively reweighted least squares, rounded to
// float): max relative error 1.6e-8, below float32's half-ulp (6e-8), so the
// approximation adds nothing visible next to the float32 rounding of the
// scores themselves. Measured with its float32 evaluation against double
// exp2 on every float of [-2, 0) and every 97th of [-127, 0): at most 0.95
// ulp (faithfully rounded), 0.06 ulp on average. The forward's softmax and
// the backward's P rebuild both use it (issue 24 suspected the backward's
// exp2; the error was the group's summation, see attention_backward_cpu.cpp).
// The clamp at -127 maps every x below it (and -inf) to
// exactly 0; true values there are < 2^-126, far below anything that can
// change a float32 sum whose largest term is 2^0 = 1.
inline Vec exp2_approx(Vec x) {
  x = vmin(vmax(x, Vec::broadcast(-127.0f)), Vec::broadcast(127.0f));
  const Vec n = round_nearest(x);
  const Vec f = x - n;
  Vec p = Vec::broadcast(1.5345799e-04f);
  p = fmadd(p, f, Vec::broadcast(1.3399932e-03f));
  p = fmadd(p, f, Vec::broadcast(9.6184891e-03f));
  p = fmadd(p, f, Vec::broadcast(5.5503286e-02f));
  p = fmadd(p, f, Vec::broadcast(2.4022646e-01f));
  p = fmadd(p, f, Vec::broadcast(6.9314718e-01f));
  p = fmadd(p, f, Vec::broadcast(1.0f));
  return p * pow2_int(n);
}

// tanh(x) (the softcap). For |x| >= 0.4: (1 - e) / (1 + e) with
// e = exp(-2|x|) = exp2_approx(-2 log2(e) |x|), where 1 - e >= 0.55 loses
// nothing to cancellation; large |x| gives e = 0, tanh = 1 exactly. Below
// 0.4, where 1 - e would cancel, tanh's Taylor series through x^13 (the
// textbook coefficients 1, -1/3, 2/15, -17/315, 62/2835, -1382/155925,
// 21844/6081075): the first omitted term, 929569/638512875 x^15, is below
// 1.6e-9 there, under float32's half-ulp relative to tanh(x) ~ x. Both
// branches are computed and blended (no per-lane branches). Measured
// against double tanh on 64M points of [-20, 20]: max relative error 2.0e-7
// (about 2 float32 ulps, at |x| ~ 0.42 where the exp branch starts), max
// absolute error 1.1e-7.
inline Vec tanh_approx(Vec x) {
  const Vec a = vabs(x);
  const Vec e = exp2_approx(a * Vec::broadcast(-2.8853900817779268f));  // -2 log2(e)
  const Vec one = Vec::broadcast(1.0f);
  const Vec big = (one - e) / (one + e);
  const Vec a2 = a * a;
  Vec p = Vec::broadcast(21844.0f / 6081075.0f);
  p = fmadd(p, a2, Vec::broadcast(-1382.0f / 155925.0f));
  p = fmadd(p, a2, Vec::broadcast(62.0f / 2835.0f));
  p = fmadd(p, a2, Vec::broadcast(-17.0f / 315.0f));
  p = fmadd(p, a2, Vec::broadcast(2.0f / 15.0f));
  p = fmadd(p, a2, Vec::broadcast(-1.0f / 3.0f));
  const Vec small = fmadd(p * a2, a, a);
  const Vec t = select_lt(a, Vec::broadcast(0.4f), small, big);
  return select_lt(x, Vec::zero(), Vec::zero() - t, t);
}
}  // namespace cpu
}  // namespace flash_metal
