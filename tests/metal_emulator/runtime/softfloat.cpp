// float/double -> bfloat conversions that clang emits calls to for __bf16
// but that Debian 12's libgcc lacks. Round to nearest even, NaNs stay NaN.
#include "platform.h"  // first: feature macros for the system headers

#include <cstdint>
#include <cstring>

static inline __bf16 bits_to_bf16(uint16_t b) { return __builtin_bit_cast(__bf16, b); }

static inline uint16_t float_to_bf16_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((u >> 16) | 0x0040u);  // quiet NaN
  u += 0x7FFFu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}

extern "C" __attribute__((visibility("hidden"))) __bf16 __truncsfbf2(float f) { return bits_to_bf16(float_to_bf16_bits(f)); }

// double -> bfloat in one rounding: round to float with round-to-odd (which
// cannot create a false tie), then round that float to bfloat.
extern "C" __attribute__((visibility("hidden"))) __bf16 __truncdfbf2(double d) {
  float f = (float)d;
  if (d == d && (double)f != d) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 1u) == 0) {
      bool up = __builtin_fabs(d) > __builtin_fabs((double)f);
      u = up ? u + 1 : u - 1;
      memcpy(&f, &u, 4);
    }
  }
  return bits_to_bf16(float_to_bf16_bits(f));
}
