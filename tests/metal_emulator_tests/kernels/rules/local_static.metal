#include <metal_stdlib>
using namespace metal;
// A function-local static outside the constant address space.
inline float offset() {
  static constexpr float kOffset = 1.5f;
  return kOffset;
}
[[kernel]] void bad(device float* out [[buffer(0)]], uint lid [[thread_index_in_threadgroup]]) {
  out[lid] = offset() + float(lid);
}
