// A tuning aid: where the forward's time goes, phase by phase, in TSC ticks.
// Compiled out (every macro empty) unless the build defines
// FLASH_METAL_CPU_PHASES, e.g.
//   CFLAGS=-DFLASH_METAL_CPU_PHASES python setup.py build_ext --inplace
// Then every process that ran the CPU forward prints its per-phase totals
// to stderr at exit. Used to find what the AMX Xeon's bfloat16 forward
// spent around its matrix products (issue 39); never in a default build.
#pragma once

#if defined(FLASH_METAL_CPU_PHASES) && (defined(__x86_64__) || defined(_M_X64))
#include <x86intrin.h>

#include <atomic>
#include <cstdint>
#include <cstdio>

namespace flash_metal {
namespace cpu {

enum Phase : int { kPhQ, kPhK, kPhV, kPhQK, kPhOpts, kPhMax, kPhExp, kPhPack, kPhPV, kPhOut, kPhCount };

struct PhaseTotals {
  std::atomic<uint64_t> ticks[kPhCount] = {};
  ~PhaseTotals() {
    static const char* names[kPhCount] = {"q load", "k operand", "v operand", "q.k product", "score options",
                                          "row max", "exp", "p round", "p.v product", "write out"};
    uint64_t total = 0;
    for (auto& t : ticks) total += t.load();
    if (total == 0) return;
    for (int i = 0; i < kPhCount; ++i)
      std::fprintf(stderr, "flash_metal phase %-14s %14llu ticks %5.1f%%\n", names[i],
                   static_cast<unsigned long long>(ticks[i].load()), 100.0 * ticks[i].load() / total);
  }
};
inline PhaseTotals& phase_totals() {
  static PhaseTotals t;
  return t;
}
struct PhaseClock {
  uint64_t t = __rdtsc();
  void lap(int phase) {
    const uint64_t now = __rdtsc();
    phase_totals().ticks[phase].fetch_add(now - t, std::memory_order_relaxed);
    t = now;
  }
};

}  // namespace cpu
}  // namespace flash_metal
#define FM_PHASE_START ::flash_metal::cpu::PhaseClock fm_phase_clock_
#define FM_PHASE(ph) fm_phase_clock_.lap(::flash_metal::cpu::ph)
#else
#define FM_PHASE_START
#define FM_PHASE(ph)
#endif
