// A 16 x 16 transpose of 32-bit lanes in AVX-512 registers, for the column
// form's two scalar hot spots on the AMX Xeon (issue 39): Q^T's VNNI pack
// (pairs of 16-bit features are one 32-bit lane) and the write-out of O^T's
// columns as output rows. Four rounds (32-bit unpacks, 64-bit shuffles, two
// rounds of 128-bit lane shuffles), 64 instructions for 256 lanes; the usual
// construction, written here for this project.
#pragma once

#if defined(__AVX512F__)
#include <immintrin.h>

namespace flash_metal {
namespace cpu {

inline void transpose16x16_ps(__m512 r[16]) {
  __m512 t[16];
  for (int i = 0; i < 8; ++i) {  // rows 2i, 2i+1 interleaved by 32-bit lane
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // 64-bit pairs of four rows
    r[4 * i] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
    r[4 * i + 1] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
    r[4 * i + 2] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
    r[4 * i + 3] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
  }
  for (int h = 0; h < 2; ++h)  // 128-bit lanes of rows 8h..8h+7
    for (int i = 0; i < 4; ++i) {
      t[8 * h + i] = _mm512_shuffle_f32x4(r[8 * h + i], r[8 * h + 4 + i], 0x88);
      t[8 * h + 4 + i] = _mm512_shuffle_f32x4(r[8 * h + i], r[8 * h + 4 + i], 0xDD);
    }
  for (int i = 0; i < 8; ++i) {  // 128-bit lanes across the two halves
    r[i] = _mm512_shuffle_f32x4(t[i], t[8 + i], 0x88);
    r[8 + i] = _mm512_shuffle_f32x4(t[i], t[8 + i], 0xDD);
  }
}

}  // namespace cpu
}  // namespace flash_metal
#endif
