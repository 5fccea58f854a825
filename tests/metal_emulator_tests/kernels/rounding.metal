// Proof kernel: per-operation rounding of half and bfloat (never shipped).
// out[op * n + i] for op in: a+b, a-b, a*b, a/b, a*b+c (two roundings), T(float x).
#include <metal_stdlib>
using namespace metal;

template <typename T>
[[kernel]] void arith(device const T* a [[buffer(0)]], device const T* b [[buffer(1)]], device const T* c [[buffer(2)]],
                      device const float* x [[buffer(3)]], device T* out [[buffer(4)]],
                      uint i [[thread_position_in_grid]], uint n [[threads_per_grid]]) {
  T va = a[i], vb = b[i], vc = c[i];
  out[0 * n + i] = va + vb;
  out[1 * n + i] = va - vb;
  out[2 * n + i] = va * vb;
  out[3 * n + i] = va / vb;
  out[4 * n + i] = va * vb + vc;
  out[5 * n + i] = static_cast<T>(x[i]);
}
template [[host_name("arith_half")]] [[kernel]] decltype(arith<half>) arith<half>;
template [[host_name("arith_bfloat")]] [[kernel]] decltype(arith<bfloat>) arith<bfloat>;
