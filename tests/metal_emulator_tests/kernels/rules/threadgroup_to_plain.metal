#include <metal_stdlib>
using namespace metal;
[[kernel]] void bad(device float* out [[buffer(0)]], uint lid [[thread_index_in_threadgroup]]) {
  threadgroup float tile[32];
  float* p = tile;  // a threadgroup array assigned to a (thread) pointer
  p[lid] = 1.0f;
  out[lid] = tile[lid];
}
