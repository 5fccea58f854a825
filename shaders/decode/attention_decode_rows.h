// Rows per SIMD-group of the decode kernels, shared by the kernels
// (attention_decode.h) and the host's planner (csrc/metal/plan_detail.h,
// whose live-value model static_asserts this table against the budget).
// Valid MSL and C++ alike, as params.h.
#pragma once

#include "../common/params.h"

namespace flash_metal {

// The decode kernels' register budget, 32-bit values per lane. Why 72: as
// kBackwardRegisterBudget (csrc/metal/routing.cpp): ~69-72 is what a thread
// gets at 24 resident SIMD-groups per core, the occupancy at which
// metal-benchmarks sees the ALUs saturate (issue 19); 256 threads hold it
// at any allocation (kDecodeMaxThreads, params.h).
FM_PROGRAM_CONSTANT constexpr int kDecodeRegisterBudget = 72;

// Query rows per SIMD-group (RS), per head-dim bucket: the most rows, a
// power of two up to 8, whose live values per lane fit kDecodeRegisterBudget
// by the host's model (decode_live_registers, with
// decode_keys_in_flight's K/V slices): 4 up to D 64 (72 values with a mask
// at 64), 2 up to 128 (68), 1 at 192 (64) and 256 (78: one row already
// exceeds the budget there, so D 256 runs at the lower occupancy
// estimate_launch counts; issue 43). Before issue 19 it was 8 / 4 / 2,
// 114 / 92 / 84 values by the model of the time.
constexpr int decode_rows_per_simd(int dmax) { return dmax <= 64 ? 4 : (dmax <= 128 ? 2 : 1); }

// K (and V) rows a decode SIMD-group loads before it uses the first of
// them (attention_decode.h, decode_attend: the key loop unrolled by this
// many keys, every load of a step issued before its first product). Why 4
// (issue 43): llama.cpp's flash_attn_ext_vec keeps whole 32-key phases in
// flight; with one key prefetched a SIMD-group had 2 rows in flight, and a
// decode core has nothing but loads to overlap. 4 more rows cost 2 slices
// of registers over the prefetch (decode_live_registers) and fit the budget
// with the rows above up to D 192. The wide buckets (512, 576: slices of 16
// and 18 values) keep 2, which holds them within the 128 registers a thread
// addresses.
constexpr int decode_keys_in_flight(int dmax) { return dmax <= 256 ? 4 : 2; }

}  // namespace flash_metal
