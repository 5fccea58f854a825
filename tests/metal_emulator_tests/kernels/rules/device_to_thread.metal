#include <metal_stdlib>
using namespace metal;
inline float first(thread const float* p) { return p[0]; }
[[kernel]] void bad(device const float* in [[buffer(0)]], device float* out [[buffer(1)]]) {
  out[0] = first(in);  // a device pointer where a thread pointer is expected
}
