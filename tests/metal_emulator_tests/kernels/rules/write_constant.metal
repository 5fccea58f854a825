#include <metal_stdlib>
using namespace metal;
[[kernel]] void bad(constant float* params [[buffer(0)]], device float* out [[buffer(1)]]) {
  params[0] = 2.0f;  // a write through constant
  out[0] = params[0];
}
