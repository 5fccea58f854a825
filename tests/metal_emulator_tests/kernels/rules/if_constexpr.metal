#include <metal_stdlib>
using namespace metal;
// `if constexpr` is C++17; MSL 3.1 is C++14-based (Apple's compiler warns,
// and the metallib build treats warnings as errors).
template <int N>
inline float pick(float x) {
  if constexpr (N > 1) {
    return x * float(N);
  } else {
    return x;
  }
}
[[kernel]] void bad(device float* out [[buffer(0)]], uint lid [[thread_index_in_threadgroup]]) {
  out[lid] = pick<2>(float(lid));
}
