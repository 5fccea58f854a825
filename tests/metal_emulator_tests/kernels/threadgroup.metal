// Proof kernels for threadgroup memory (never shipped).
#include <metal_stdlib>
using namespace metal;

// Every thread of a (up to 1024-thread) group writes its slot, then reads
// another thread's slot: only shared memory makes this come out right.
[[kernel]] void share(device uint* out [[buffer(0)]], threadgroup uint* dyn [[threadgroup(0)]],
                      uint lid [[thread_index_in_threadgroup]], uint tpg [[threads_per_threadgroup]],
                      uint2 group [[threadgroup_position_in_grid]], uint2 ngroups [[threadgroups_per_grid]]) {
  threadgroup uint stat[1024];
  uint g = group.y * ngroups.x + group.x;
  stat[lid] = lid * 3u + g;
  dyn[lid] = lid + 1000u * g;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  uint other = (lid + 517u) % tpg;
  out[g * tpg + lid] = stat[other] + dyn[(other + 1u) % tpg] * 0u + (dyn[other] - 1000u * g) * 65536u;
}

// Reads threadgroup memory nobody wrote: must see NaN.
[[kernel]] void unwritten(device float* out [[buffer(0)]], device half* hout [[buffer(1)]],
                          uint lid [[thread_index_in_threadgroup]]) {
  threadgroup float f[64];
  threadgroup half h[64];
  out[lid] = f[lid];
  hout[lid] = h[lid];
}

// All position attributes, for one thread per output slot.
[[kernel]] void positions(device uint* out [[buffer(0)]], uint3 tpig [[thread_position_in_grid]],
                          uint3 tpitg [[thread_position_in_threadgroup]], uint3 tgpig [[threadgroup_position_in_grid]],
                          uint3 tptg [[threads_per_threadgroup]], uint3 tgpg [[threadgroups_per_grid]],
                          uint3 tpg [[threads_per_grid]], uint tiitg [[thread_index_in_threadgroup]],
                          ushort lane [[thread_index_in_simdgroup]], ushort sg [[simdgroup_index_in_threadgroup]],
                          uint sgs [[simdgroups_per_threadgroup]], uint tps [[threads_per_simdgroup]]) {
  uint flat = (tpig.z * tpg.y + tpig.y) * tpg.x + tpig.x;
  device uint* o = out + flat * 20;
  o[0] = tpig.x; o[1] = tpig.y; o[2] = tpig.z;
  o[3] = tpitg.x; o[4] = tpitg.y; o[5] = tpitg.z;
  o[6] = tgpig.x; o[7] = tgpig.y; o[8] = tgpig.z;
  o[9] = tptg.x * 10000u + tptg.y * 100u + tptg.z;
  o[10] = tgpg.x * 10000u + tgpg.y * 100u + tgpg.z;
  o[11] = tpg.x * 10000u + tpg.y * 100u + tpg.z;
  o[12] = tiitg; o[13] = lane; o[14] = sg; o[15] = sgs; o[16] = tps;
  o[17] = 7u; o[18] = 7u; o[19] = 7u;
}
