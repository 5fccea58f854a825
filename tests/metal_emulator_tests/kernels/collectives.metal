// Proof kernels for the SIMD-group collectives (never shipped).
#include <metal_stdlib>
using namespace metal;

// out[op * n + tid] = result of collective `op` for thread tid.
[[kernel]] void collectives(device const float* in [[buffer(0)]], device const uint* src_lane [[buffer(1)]],
                            device float* out [[buffer(2)]], device uint* ballots [[buffer(3)]],
                            uint tid [[thread_position_in_grid]], uint lane [[thread_index_in_simdgroup]],
                            uint n [[threads_per_grid]]) {
  float x = in[tid];
  uint k = 0;
  out[k++ * n + tid] = simd_sum(x);
  out[k++ * n + tid] = simd_max(x);
  out[k++ * n + tid] = simd_min(x);
  out[k++ * n + tid] = simd_prefix_inclusive_sum(x);
  out[k++ * n + tid] = simd_prefix_exclusive_sum(x);
  out[k++ * n + tid] = simd_shuffle(x, ushort(src_lane[tid]));
  out[k++ * n + tid] = simd_shuffle_xor(x, ushort(5));
  out[k++ * n + tid] = simd_shuffle_down(x, ushort(3));
  out[k++ * n + tid] = simd_shuffle_up(x, ushort(2));
  out[k++ * n + tid] = simd_broadcast(x, ushort(7));
  out[k++ * n + tid] = simd_broadcast_first(x);
  out[k++ * n + tid] = simd_shuffle_rotate_down(x, ushort(4));
  out[k++ * n + tid] = float(simd_sum(int(x)));
  float2 v2 = simd_shuffle_xor(float2(x, -x), ushort(16));
  out[k++ * n + tid] = v2.y;
  ballots[tid * 3 + 0] = uint(simd_ballot(x > 0.0f));
  ballots[tid * 3 + 1] = simd_all(x > -100.0f) ? 1u : 0u;
  ballots[tid * 3 + 2] = simd_any(x > 2.5f) ? 1u : 0u;
}
