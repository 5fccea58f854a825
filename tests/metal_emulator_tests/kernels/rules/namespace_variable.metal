#include <metal_stdlib>
using namespace metal;
namespace planted {
// A namespace-scope variable outside the constant address space.
constexpr float kScale = 0.5f;
}  // namespace planted
[[kernel]] void bad(device float* out [[buffer(0)]], uint lid [[thread_index_in_threadgroup]]) {
  out[lid] = planted::kScale * float(lid);
}
