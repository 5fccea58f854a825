// Proof kernels for private_arrays() (never shipped). Both compute
// out[0] = sum over c < n of (2 x[c]) * (2 x[n - 1 - c]) for n <= 16, with a
// private array a[16]: one indexes it with runtime values (so it must stay in
// memory), the other only with constants after full unrolling (so it can be
// split into scalars), zero-padding lanes c >= n.
#include <metal_stdlib>
using namespace metal;

[[kernel]] void runtime_index(device const float* x [[buffer(0)]], device float* out [[buffer(1)]],
                              constant int& n [[buffer(2)]], uint i [[thread_position_in_grid]]) {
  float a[16];
  for (int c = 0; c < n; ++c) a[c] = 2.0f * x[c];
  float s = 0.0f;
  for (int c = 0; c < n; ++c) s += a[c] * a[n - 1 - c];
  out[i] = s;
}

[[kernel]] void constant_index(device const float* x [[buffer(0)]], device float* out [[buffer(1)]],
                               constant int& n [[buffer(2)]], uint i [[thread_position_in_grid]]) {
  float a[16];
  _Pragma("clang loop unroll(full)") for (int c = 0; c < 16; ++c) a[c] = c < n ? 2.0f * x[c] : 0.0f;
  float s = 0.0f;
  // a[n - 1 - c] as a select over the constant lanes: every index is constant.
  _Pragma("clang loop unroll(full)") for (int c = 0; c < 16; ++c) {
    float mirror = 0.0f;
    _Pragma("clang loop unroll(full)") for (int e = 0; e < 16; ++e) mirror = e == n - 1 - c ? a[e] : mirror;
    s += a[c] * mirror;
  }
  out[i] = s;
}
