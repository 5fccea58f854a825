// Loads of one vector of KV-cache elements as float32, per storage format
// (issue 44): the quantized decode / chunked-prefill kernel
// (kvcache_quant_cpu.cpp) converts codes in registers with these and never
// writes a dequantized row anywhere. QV is the widest float vector (16 lanes
// with AVX-512, 8 with AVX2, 4 with NEON, 1 in the scalar fallback); a load
// returns elements d .. d + kQW - 1 of a row, in order.
//
//   F32 / F16 / BF16  a cache in q's dtype (the "native" format)
//   I8                int8 codes, as float (the per-token scale is applied outside)
//   Q4                4-bit codes 0..15 (MLX's packing: element 2i is byte i's
//                     low nibble, 2i + 1 its high nibble), as float
//   F8                float8_e4m3fn, as float times 2^-8 (kFp8Unit): the bits
//                     moved into a float16 (sign, then exponent and mantissa
//                     shifted by 7), whose exponent bias (15) exceeds e4m3's
//                     (7) by 8; subnormals land on float16 subnormals with the
//                     same 2^-8 factor, so the conversion is exact. The code
//                     0x7F / 0xFF (e4m3fn's NaN) becomes NaN.
// Scalar decode_one is the same rule element by element (tails, fallback).
#pragma once

#include "simd.h"

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

namespace flash_metal {
namespace cpu {

enum class CodeFmt : int { F32 = 0, F16, BF16, I8, Q4, F8 };
constexpr int kNumCodeFmts = 6;
constexpr float kFp8Unit = 1.0f / 256.0f;  // what an F8 load returns per unit of the true value

#if defined(__AVX512F__)
using QV = MVec;
inline float hsum(QV a) { return _mm512_reduce_add_ps(a.v); }
#else
using QV = Vec;
#if defined(FLASH_METAL_SIMD_AVX2)
inline float hsum(QV a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a.v), _mm256_extractf128_ps(a.v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#elif defined(FLASH_METAL_SIMD_NEON)
inline float hsum(QV a) { return vaddvq_f32(a.v); }
#else
inline float hsum(QV a) { return a.v; }
#endif
#endif
constexpr int kQW = QV::kWidth;

// Horizontal sums of kQW vectors at once: out[perm[i]] = hsum(acc[i]) for
// the permutation reduce_lanes_perm() reports. A tree of lane shuffles and
// adds (AVX-512: 15 shuffle pairs for 16 sums, against 16 x 4 for one sum
// at a time), halving the vector count per level; where each sum lands
// follows from the shuffles, and reduce_lanes_perm() measures it once by
// running the tree on vectors whose lanes all hold their own index.
inline void reduce_lanes(const QV* acc, float* out) {
#if defined(__AVX512F__)
  __m512 r1[8], r2[4], r3[2];
  for (int i = 0; i < 8; ++i) {  // 128-bit quarters: a's q0 + q2, q1 + q3 next to b's
    const __m512 a = acc[2 * i].v, b = acc[2 * i + 1].v;
    r1[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
  }
  for (int i = 0; i < 4; ++i) {  // one 128-bit lane per source vector
    const __m512 x = r1[2 * i], y = r1[2 * i + 1];
    r2[i] = _mm512_add_ps(_mm512_shuffle_f32x4(x, y, 0x88), _mm512_shuffle_f32x4(x, y, 0xDD));
  }
  for (int i = 0; i < 2; ++i) {  // within 128-bit lanes: pairs of floats
    const __m512 x = r2[2 * i], y = r2[2 * i + 1];
    r3[i] = _mm512_add_ps(_mm512_unpacklo_ps(x, y), _mm512_unpackhi_ps(x, y));
  }
  const __m512d u = _mm512_castps_pd(r3[0]), w = _mm512_castps_pd(r3[1]);
  const __m512 s = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(u, w)), _mm512_castpd_ps(_mm512_unpackhi_pd(u, w)));
  _mm512_storeu_ps(out, s);
#elif defined(FLASH_METAL_SIMD_AVX2)
  __m256 r1[4], r2[2];
  for (int i = 0; i < 4; ++i) {
    const __m256 a = acc[2 * i].v, b = acc[2 * i + 1].v;
    r1[i] = _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
  }
  for (int i = 0; i < 2; ++i) {
    const __m256 x = r1[2 * i], y = r1[2 * i + 1];
    r2[i] = _mm256_add_ps(_mm256_unpacklo_ps(x, y), _mm256_unpackhi_ps(x, y));
  }
  const __m256d u = _mm256_castps_pd(r2[0]), w = _mm256_castps_pd(r2[1]);
  _mm256_storeu_ps(out, _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(u, w)),
                                      _mm256_castpd_ps(_mm256_unpackhi_pd(u, w))));
#else
  for (int i = 0; i < kQW; ++i) out[i] = hsum(acc[i]);
#endif
}

// perm[i]: the lane of reduce_lanes' output holding acc[i]'s sum.
inline const int* reduce_lanes_perm() {
  struct Perm {
    int p[kQW];
    Perm() {
      QV acc[kQW];
      for (int i = 0; i < kQW; ++i) acc[i] = QV::broadcast(static_cast<float>(i));
      alignas(64) float out[kQW];
      reduce_lanes(acc, out);
      for (int lane = 0; lane < kQW; ++lane) p[static_cast<int>(out[lane]) / kQW] = lane;
    }
  };
  static const Perm perm;
  return perm.p;
}

// Bytes per element of a row, as a fraction: element d starts at byte d * num / den.
template <CodeFmt F>
constexpr int64_t byte_offset(int64_t d) {
  return F == CodeFmt::F32 ? 4 * d : (F == CodeFmt::F16 || F == CodeFmt::BF16) ? 2 * d : F == CodeFmt::Q4 ? d / 2 : d;
}

inline float fp8_e4m3fn_scaled(uint8_t b) {
  // The float16 trick of the header comment, in scalar form.
  if ((b & 0x7F) == 0x7F) return std::numeric_limits<float>::quiet_NaN();
  const uint16_t h = static_cast<uint16_t>(((b & 0x80) << 8) | ((b & 0x7F) << 7));
  c10::Half x;
  x.x = h;
  return static_cast<float>(x);
}

template <CodeFmt F>
inline float decode_one(const uint8_t* row, int64_t d) {
  const uint8_t* p = row + byte_offset<F>(d);
  if (F == CodeFmt::F32) {
    float x;
    std::memcpy(&x, p, 4);
    return x;
  } else if (F == CodeFmt::F16) {
    c10::Half x;
    std::memcpy(&x.x, p, 2);
    return static_cast<float>(x);
  } else if (F == CodeFmt::BF16) {
    c10::BFloat16 x;
    std::memcpy(&x.x, p, 2);
    return static_cast<float>(x);
  } else if (F == CodeFmt::I8) {
    return static_cast<float>(static_cast<int8_t>(*p));
  } else if (F == CodeFmt::Q4) {
    return static_cast<float>((d & 1) ? (*p >> 4) : (*p & 0x0F));
  } else {
    return fp8_e4m3fn_scaled(*p);
  }
}

// Elements d .. d + n - 1 (n < kQW: a row's tail), zeros past them.
template <CodeFmt F>
inline QV load_tail(const uint8_t* row, int64_t d, int64_t n) {
  alignas(64) float tmp[kQW];
  for (int i = 0; i < kQW; ++i) tmp[i] = i < n ? decode_one<F>(row, d + i) : 0.0f;
  return QV::load(tmp);
}

// Elements d .. d + kQW - 1 (d a multiple of kQW; Q4: of 2).
template <CodeFmt F>
inline QV load_codes(const uint8_t* row, int64_t d) {
  const uint8_t* p = row + byte_offset<F>(d);
  if (F == CodeFmt::F32) return QV::load(reinterpret_cast<const float*>(p));
#if defined(__AVX512F__)
  if (F == CodeFmt::F16) return {_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))};
  if (F == CodeFmt::BF16) {
    const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return {_mm512_castsi512_ps(_mm512_slli_epi32(w, 16))};
  }
  if (F == CodeFmt::I8) return {_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))))};
  if (F == CodeFmt::Q4) {
    const __m128i x = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));  // 8 bytes, 16 codes
    const __m128i nib = _mm_set1_epi8(0x0F);
    const __m128i lo = _mm_and_si128(x, nib), hi = _mm_and_si128(_mm_srli_epi16(x, 4), nib);
    return {_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_unpacklo_epi8(lo, hi)))};
  }
  if (F == CodeFmt::F8) {
    const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    const __m256i mag = _mm256_and_si256(b, _mm256_set1_epi16(0x7F));
    __m256i h = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x80)), 8),
                                _mm256_slli_epi16(mag, 7));
    const __m256i nan = _mm256_cmpeq_epi16(mag, _mm256_set1_epi16(0x7F));
    h = _mm256_blendv_epi8(h, _mm256_set1_epi16(0x7E00), nan);
    return {_mm512_cvtph_ps(h)};
  }
#elif defined(FLASH_METAL_SIMD_AVX2)
  if (F == CodeFmt::F16) return load_convert(reinterpret_cast<const c10::Half*>(p));
  if (F == CodeFmt::BF16) return load_convert(reinterpret_cast<const c10::BFloat16*>(p));
  if (F == CodeFmt::I8) return {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))))};
  if (F == CodeFmt::Q4) {
    int32_t word;
    std::memcpy(&word, p, 4);  // 4 bytes, 8 codes
    const __m128i x = _mm_cvtsi32_si128(word);
    const __m128i nib = _mm_set1_epi8(0x0F);
    const __m128i lo = _mm_and_si128(x, nib), hi = _mm_and_si128(_mm_srli_epi16(x, 4), nib);
    return {_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_unpacklo_epi8(lo, hi)))};
  }
#if defined(__F16C__)
  if (F == CodeFmt::F8) {
    const __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    const __m128i mag = _mm_and_si128(b, _mm_set1_epi16(0x7F));
    __m128i h = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x80)), 8), _mm_slli_epi16(mag, 7));
    h = _mm_blendv_epi8(h, _mm_set1_epi16(0x7E00), _mm_cmpeq_epi16(mag, _mm_set1_epi16(0x7F)));
    return {_mm256_cvtph_ps(h)};
  }
#endif
#endif
  return load_tail<F>(row, d, kQW);  // NEON and the scalar fallback: element by element
}

}  // namespace cpu
}  // namespace flash_metal
