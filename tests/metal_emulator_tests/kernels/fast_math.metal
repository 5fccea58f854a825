// Proof kernel for the fast-math build (never shipped). Per input x[i]:
//   out[3i]     1 if x[i] == -INFINITY, else 0
//   out[3i + 1] 1 if isinf(x[i]), else 0
//   out[3i + 2] -inf made from its bits (as the attention kernels store lse)
// Under fast math the compiler may assume no value is infinite, so the first
// two may read 0 even for x[i] = -inf; the third must survive any build.
#include <metal_stdlib>
using namespace metal;

[[kernel]] void inf_probe(device const float* x [[buffer(0)]], device float* out [[buffer(1)]],
                          uint i [[thread_position_in_grid]]) {
  out[3 * i] = x[i] == -INFINITY ? 1.0f : 0.0f;
  out[3 * i + 1] = isinf(x[i]) ? 1.0f : 0.0f;
  out[3 * i + 2] = as_type<float>(0xff800000u);
}
