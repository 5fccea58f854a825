// Proof kernel: metal::, metal::fast:: and metal::precise:: math (never shipped).
// out[f * n + i] = f-th function of x[i] (and y[i] for the binary ones), in
// the order listed in test_emu_math.py.
#include <metal_stdlib>
using namespace metal;

template <typename T>
[[kernel]] void math_fns(device const T* x [[buffer(0)]], device const T* y [[buffer(1)]], device T* out [[buffer(2)]],
                         uint i [[thread_position_in_grid]], uint n [[threads_per_grid]]) {
  const T a = x[i];
  const T b = y[i];
  const T pa = fabs(a);
  out[0 * n + i] = exp(a);
  out[1 * n + i] = exp2(a);
  out[2 * n + i] = log(pa);
  out[3 * n + i] = log2(pa);
  out[4 * n + i] = sqrt(pa);
  out[5 * n + i] = rsqrt(pa);
  out[6 * n + i] = tanh(a);
  out[7 * n + i] = max(a, b);
  out[8 * n + i] = min(a, b);
  out[9 * n + i] = clamp(a, T(-1), T(1));
  out[10 * n + i] = fma(a, b, a);
  out[11 * n + i] = fast::exp(a);
  out[12 * n + i] = fast::exp2(a);
  out[13 * n + i] = fast::log(pa);
  out[14 * n + i] = precise::exp(a);
  out[15 * n + i] = precise::log2(pa);
  out[16 * n + i] = precise::sqrt(pa);
}
template [[host_name("math_float")]] [[kernel]] decltype(math_fns<float>) math_fns<float>;
template [[host_name("math_half")]] [[kernel]] decltype(math_fns<half>) math_fns<half>;
