// Checks csrc/cpu/kv_dequant.h in whatever ISA this file is compiled for
// (tests/cpu/test_kv_dequant_isa.py builds it for AVX-512, AVX2 and the scalar
// fallback): every vector load equals the scalar decode lane by lane, for
// every format, and reduce_lanes puts each sum where reduce_lanes_perm says.
// Prints the fp8 table (decode_one times 256 for codes 0..255) for the test
// to compare with torch's float8_e4m3fn, then "ok" (or the first mismatch).
#include "../csrc/cpu/kv_dequant.h"

#include <cstdio>
#include <cstring>
#include <random>

using namespace flash_metal::cpu;

template <CodeFmt F>
bool check_format(const char* name, std::mt19937& rng) {
  alignas(64) uint8_t row[1024];
  for (int rep = 0; rep < 64; ++rep) {
    for (auto& b : row) b = static_cast<uint8_t>(rng());
    if (F == CodeFmt::F32) {  // finite floats only (random bits make NaNs whose payloads differ)
      for (int i = 0; i < 256; ++i) {
        const float x = static_cast<float>(static_cast<int>(rng() % 20001) - 10000) / 64.0f;
        std::memcpy(row + 4 * i, &x, 4);
      }
    }
    for (int d = 0; d + kQW <= 128; d += kQW) {
      alignas(64) float got[kQW];
      load_codes<F>(row, d).store(got);
      for (int i = 0; i < kQW; ++i) {
        const float want = decode_one<F>(row, d + i);
        const bool same = (std::isnan(want) && std::isnan(got[i])) || std::memcmp(&want, &got[i], 4) == 0;
        if (!same) {
          std::printf("%s: element %d: vector %g, scalar %g\n", name, d + i, got[i], want);
          return false;
        }
      }
    }
  }
  return true;
}

int main() {
  std::mt19937 rng(1234);
  for (int b = 0; b < 256; ++b) std::printf("%.9g\n", fp8_e4m3fn_scaled(static_cast<uint8_t>(b)) * 256.0f);
  bool ok = check_format<CodeFmt::F32>("f32", rng) && check_format<CodeFmt::F16>("f16", rng) &&
            check_format<CodeFmt::BF16>("bf16", rng) && check_format<CodeFmt::I8>("i8", rng) &&
            check_format<CodeFmt::Q4>("q4", rng) && check_format<CodeFmt::F8>("f8", rng);
  // Q4 by hand: byte 0x21 holds element 0 = 1 (low nibble), element 1 = 2.
  const uint8_t q4[8] = {0x21, 0x43, 0, 0, 0, 0, 0, 0};
  ok = ok && decode_one<CodeFmt::Q4>(q4, 0) == 1.0f && decode_one<CodeFmt::Q4>(q4, 1) == 2.0f &&
       decode_one<CodeFmt::Q4>(q4, 3) == 4.0f;
  // reduce_lanes: acc[i] = i + lane / 100 in each lane; its sum lands at perm[i].
  QV acc[kQW];
  float want[kQW];
  for (int i = 0; i < kQW; ++i) {
    alignas(64) float lanes[kQW];
    want[i] = 0;
    for (int l = 0; l < kQW; ++l) {
      lanes[l] = static_cast<float>(i) + static_cast<float>(l) / 128.0f;
      want[i] += lanes[l];
    }
    acc[i] = QV::load(lanes);
  }
  alignas(64) float out[kQW];
  reduce_lanes(acc, out);
  const int* perm = reduce_lanes_perm();
  for (int i = 0; i < kQW && ok; ++i) {
    if (out[perm[i]] != want[i]) {
      std::printf("reduce_lanes: sum %d landed as %g, want %g\n", i, out[perm[i]], want[i]);
      ok = false;
    }
  }
  std::printf("%s width=%d\n", ok ? "ok" : "FAIL", kQW);
  return ok ? 0 : 1;
}
