#include <metal_stdlib>
using namespace metal;
// Variables with static storage, in the constant address space as MSL requires.
constant constexpr float kScale = 2.0f;
template <int N>
struct Shape {
  static constexpr constant int kHalf = N / 2;
};
inline void stage(threadgroup float* dst, device const float* src, uint i) { dst[i] = src[i]; }
[[kernel]] void good(device const float* in [[buffer(0)]], device float* out [[buffer(1)]],
                     constant float& scale [[buffer(2)]], threadgroup float* tg [[threadgroup(0)]],
                     uint lid [[thread_index_in_threadgroup]]) {
  threadgroup float local[32];
  stage(local, in, lid);
  stage(tg, in, lid);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  out[lid] = (local[lid] + tg[lid]) * scale * kScale + float(Shape<4>::kHalf);
}
