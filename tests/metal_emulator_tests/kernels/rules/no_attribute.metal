#include <metal_stdlib>
using namespace metal;
[[kernel]] void bad(device float* out [[buffer(0)]], uint lid) {
  out[lid] = 1.0f;
}
