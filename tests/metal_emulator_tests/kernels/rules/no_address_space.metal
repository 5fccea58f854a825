#include <metal_stdlib>
using namespace metal;
[[kernel]] void bad(float* out [[buffer(0)]], uint lid [[thread_index_in_threadgroup]]) {
  out[lid] = 1.0f;
}
