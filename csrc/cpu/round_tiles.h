// Rounding float32 tiles to the 16-bit input dtype on the brgemm path
// (issue 39): the forward's P^T and the backward's P, dS^T and dS go to the
// matrix units in the input dtype, rounded to nearest even as c10's
// conversions round (NaN -> 0x7FC0). Scalar for any T; with AVX2 and
// bfloat16, 8 floats at a time, transposes in 8 x 8 register tiles. On an
// AMX Xeon these scalar loops (one strided load and one scalar rounding per
// element) were the hottest code around the products.
#pragma once

#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace flash_metal {
namespace cpu {
namespace {

// dst[i] = T(src[i]) for i < n.
template <typename T>
inline void round_row(const float* src, int64_t n, T* dst) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<T>(src[i]);
}

// dst[c * ld_dst + r] = T(src[r * ld_src + c]) for r < rows, c < cols. The
// vectorized form may also read src columns [cols, round_up(cols, 8)) and
// write the matching dst rows: callers' buffers hold them, and nothing reads
// those rows.
template <typename T>
inline void transpose_round(const float* src, int64_t ld_src, int64_t rows, int64_t cols, T* dst, int64_t ld_dst) {
  for (int64_t c = 0; c < cols; ++c)
    for (int64_t r = 0; r < rows; ++r) dst[c * ld_dst + r] = static_cast<T>(src[r * ld_src + c]);
}

#if defined(__AVX2__)
inline __m128i round_bf16x8(__m256 v) {
  const __m256i x = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(x, 16), _mm256_set1_epi32(1));
  __m256i h = _mm256_srli_epi32(_mm256_add_epi32(x, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
  h = _mm256_blendv_epi8(h, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
  return _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(h, h), 0xD8));
}

template <>
inline void round_row<c10::BFloat16>(const float* src, int64_t n, c10::BFloat16* dst) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), round_bf16x8(_mm256_loadu_ps(src + i)));
  for (; i < n; ++i) dst[i] = static_cast<c10::BFloat16>(src[i]);
}

template <>
inline void transpose_round<c10::BFloat16>(const float* src, int64_t ld_src, int64_t rows, int64_t cols,
                                           c10::BFloat16* dst, int64_t ld_dst) {
  const int64_t rows8 = rows / 8 * 8;
  for (int64_t c0 = 0; c0 < cols; c0 += 8) {
    for (int64_t r0 = 0; r0 < rows8; r0 += 8) {
      __m256 a[8], t[8];
      for (int i = 0; i < 8; ++i) a[i] = _mm256_loadu_ps(src + (r0 + i) * ld_src + c0);
      for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_ps(a[i], a[i + 1]);
        t[i + 1] = _mm256_unpackhi_ps(a[i], a[i + 1]);
      }
      for (int i = 0; i < 8; i += 4) {
        a[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
        a[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
        a[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
        a[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
      }
      for (int i = 0; i < 4; ++i) {  // column c0 + i: lanes 0-3 of a[i] and a[i + 4]; column c0 + 4 + i: lanes 4-7
        _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + (c0 + i) * ld_dst + r0),
                         round_bf16x8(_mm256_permute2f128_ps(a[i], a[i + 4], 0x20)));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + (c0 + 4 + i) * ld_dst + r0),
                         round_bf16x8(_mm256_permute2f128_ps(a[i], a[i + 4], 0x31)));
      }
    }
    for (int64_t c = c0; c < std::min(cols, c0 + 8); ++c)
      for (int64_t r = rows8; r < rows; ++r) dst[c * ld_dst + r] = static_cast<c10::BFloat16>(src[r * ld_src + c]);
  }
}
#endif

}  // namespace
}  // namespace cpu
}  // namespace flash_metal
