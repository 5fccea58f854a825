// Rows per SIMD-group of the decode kernels, shared by the kernels
// (attention_decode.h) and the host's planner (csrc/metal_plan_detail.h,
// whose live-value model static_asserts this table against the budget).
// Valid MSL and C++ alike, as params.h.
#pragma once

#include "params.h"

namespace flash_metal {

// The decode kernels' register budget, 32-bit values per lane. Why 72: as
// kBackwardRegisterBudget (csrc/metal_routing.cpp): ~69-72 is what a thread
// gets at 24 resident SIMD-groups per core, the occupancy at which
// metal-benchmarks sees the ALUs saturate (issue 19); 256 threads hold it
// at any allocation (kDecodeMaxThreads, params.h).
FM_PROGRAM_CONSTANT constexpr int kDecodeRegisterBudget = 72;

// Query rows per SIMD-group (RS), per head-dim bucket: the most rows, a
// power of two up to 8, whose live values per lane fit kDecodeRegisterBudget
// by the host's model (decode_live_registers): 4 up to D 64 (70 values with
// a mask at 64), 2 up to 128 (58), 1 at 192 (53 with a mask; 2 rows would
// take 78) and 256 (55). Before issue 19 it was
// 8 / 4 / 2, 114 / 92 / 84 values by the same model.
constexpr int decode_rows_per_simd(int dmax) { return dmax <= 64 ? 4 : (dmax <= 128 ? 2 : 1); }

}  // namespace flash_metal
