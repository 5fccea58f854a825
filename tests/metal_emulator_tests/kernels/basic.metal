#include <metal_stdlib>
using namespace metal;

constant bool fc_double [[function_constant(0)]];

[[kernel]] void add_one(device float* out [[buffer(0)]], device const float* in [[buffer(1)]],
                        constant uint& n [[buffer(2)]], uint gid [[thread_position_in_grid]]) {
  if (gid >= n) return;
  float v = in[gid] + 1.0f;
  out[gid] = fc_double ? v * 2.0f : v;
}

template <typename T>
[[kernel]] void reverse_tg(device T* data [[buffer(0)]], threadgroup T* scratch [[threadgroup(0)]],
                           uint lid [[thread_index_in_threadgroup]], uint tpg [[threads_per_threadgroup]],
                           uint3 tgid [[threadgroup_position_in_grid]]) {
  threadgroup T local[1024];
  uint base = tgid.x * tpg;
  local[lid] = data[base + lid];
  scratch[lid] = T(1);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  data[base + lid] = local[tpg - 1 - lid] + scratch[lid] - T(1);
}
template [[host_name("reverse_tg_float")]] [[kernel]] decltype(reverse_tg<float>) reverse_tg<float>;
template [[host_name("reverse_tg_half")]] [[kernel]] decltype(reverse_tg<half>) reverse_tg<half>;
