// Test-only kernel (never shipped): the prefill kernel's fragment helpers
// (shaders/prefill/attention_prefill.h), lane by lane, for the lane-layout pin test
// in tests/metal/test_metal_prefill.py. One SIMD-group.
#include "../shaders/prefill/attention_prefill.h"

namespace flash_metal {

// index: an 8 x 16 row-major float matrix. Writes, per lane:
//   coords[2l], coords[2l + 1]: prefill_frag_row / prefill_frag_col;
//   read:     prefill_read_frag of block (rows 0..7, cols 8..15), staged in threadgroup memory;
//   loaded:   thread_elements() of simdgroup_load of the same block from device memory;
//   read_t:   prefill_read_frag_t of the same staged matrix (the transpose of that block);
//   loaded_t: thread_elements() of the transposed simdgroup_load of that block.
[[kernel]] void prefill_lanes(device const float* index [[buffer(0)]], device int* coords [[buffer(1)]],
                              device float* read [[buffer(2)]], device float* loaded [[buffer(3)]],
                              device float* read_t [[buffer(4)]], device float* loaded_t [[buffer(5)]],
                              threadgroup float* tile [[threadgroup(0)]],
                              uint lane [[thread_index_in_simdgroup]]) {
  for (uint i = lane; i < 8 * 16; i += 32) tile[i] = index[i];
  threadgroup_barrier(mem_flags::mem_threadgroup);
  const int fr = prefill_frag_row(lane);
  const int fc = prefill_frag_col(lane);
  coords[2 * lane] = fr;
  coords[2 * lane + 1] = fc;

  PrefillFrag a, b, at, bt;
  prefill_read_frag(a, tile, 16, 0, 8, fr, fc);
  simdgroup_load(b, index, 16, ulong2(8, 0));
  prefill_read_frag_t(at, tile, 16, 8, 0, fr, fc);
  simdgroup_load(bt, index, 16, ulong2(8, 0), true);
  for (int j = 0; j < 2; ++j) {
    read[2 * lane + j] = a.thread_elements()[j];
    loaded[2 * lane + j] = b.thread_elements()[j];
    read_t[2 * lane + j] = at.thread_elements()[j];
    loaded_t[2 * lane + j] = bt.thread_elements()[j];
  }
}

}  // namespace flash_metal
