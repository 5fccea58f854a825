// Planted bugs (never shipped): each *_bug kernel has one, its *_fixed twin
// is the correct version. The tests prove every detector fires on the bug and
// stays quiet on the fix.
#include <metal_stdlib>
using namespace metal;

// 1. Missing barrier: neighbours' slots are read before they are written.
[[kernel]] void missing_barrier_bug(device float* out [[buffer(0)]], uint lid [[thread_index_in_threadgroup]],
                                    uint n [[threads_per_threadgroup]]) {
  threadgroup float tile[64];
  tile[lid] = float(lid);
  out[lid] = tile[(lid + 1) % n];
}
[[kernel]] void missing_barrier_fixed(device float* out [[buffer(0)]], uint lid [[thread_index_in_threadgroup]],
                                      uint n [[threads_per_threadgroup]]) {
  threadgroup float tile[64];
  tile[lid] = float(lid);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  out[lid] = tile[(lid + 1) % n];
}

// 1b. Missing second barrier in a tile loop: the next load overwrites what
// slower threads still read (write-after-read).
[[kernel]] void missing_war_barrier_bug(device const float* in [[buffer(0)]], device float* out [[buffer(1)]],
                                        uint lid [[thread_index_in_threadgroup]]) {
  threadgroup float tile[32];
  float acc = 0.0f;
  for (uint t = 0; t < 4; ++t) {
    tile[lid] = in[t * 32 + lid];
    threadgroup_barrier(mem_flags::mem_threadgroup);
    acc += tile[31 - lid];
  }
  out[lid] = acc;
}

// 2. Off-by-one device read: the guard lets the last thread read in[n].
[[kernel]] void neighbor_sum_bug(device const float* in [[buffer(0)]], device float* out [[buffer(1)]],
                                 constant uint& n [[buffer(2)]], uint gid [[thread_position_in_grid]]) {
  if (gid >= n) return;
  out[gid] = in[gid] + in[gid + 1];
}
[[kernel]] void neighbor_sum_fixed(device const float* in [[buffer(0)]], device float* out [[buffer(1)]],
                                   constant uint& n [[buffer(2)]], uint gid [[thread_position_in_grid]]) {
  if (gid >= n) return;
  out[gid] = in[gid] + (gid + 1 < n ? in[gid + 1] : 0.0f);
}

// 3. Early return before a barrier: threads past n leave, the rest wait forever.
[[kernel]] void early_return_bug(device const float* in [[buffer(0)]], device float* out [[buffer(1)]],
                                 constant uint& n [[buffer(2)]], uint gid [[thread_position_in_grid]],
                                 uint lid [[thread_index_in_threadgroup]]) {
  threadgroup float tile[32];
  if (gid >= n) return;
  tile[lid] = in[gid];
  threadgroup_barrier(mem_flags::mem_threadgroup);
  out[gid] = tile[31 - lid];
}
[[kernel]] void early_return_fixed(device const float* in [[buffer(0)]], device float* out [[buffer(1)]],
                                   constant uint& n [[buffer(2)]], uint gid [[thread_position_in_grid]],
                                   uint lid [[thread_index_in_threadgroup]]) {
  threadgroup float tile[32];
  tile[lid] = gid < n ? in[gid] : 0.0f;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (gid >= n) return;
  out[gid] = tile[31 - lid];
}

// 4. A collective inside a lane-divergent branch.
[[kernel]] void divergent_collective_bug(device float* out [[buffer(0)]], uint lane [[thread_index_in_simdgroup]]) {
  float x = float(lane);
  if (lane < 16) x = simd_sum(x);
  out[lane] = x;
}
[[kernel]] void divergent_collective_fixed(device float* out [[buffer(0)]], uint lane [[thread_index_in_simdgroup]]) {
  float x = float(lane);
  float s = simd_sum(x);
  if (lane < 16) x = s;
  out[lane] = x;
}

// 4b. Lanes at two different collectives.
[[kernel]] void mismatched_collectives_bug(device float* out [[buffer(0)]], uint lane [[thread_index_in_simdgroup]]) {
  float x = float(lane);
  out[lane] = lane % 2 ? simd_max(x) : simd_min(x);
}

// 5. Threadgroup array overflow: thread 31 writes tile[32].
[[kernel]] void tg_overflow_bug(device float* out [[buffer(0)]], uint lid [[thread_index_in_threadgroup]]) {
  threadgroup float tile[32];
  threadgroup float other[32];
  tile[lid + 1] = float(lid);
  other[lid] = 1.0f;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  out[lid] = other[lid];
}
[[kernel]] void tg_overflow_fixed(device float* out [[buffer(0)]], uint lid [[thread_index_in_threadgroup]]) {
  threadgroup float tile[32];
  threadgroup float other[32];
  tile[(lid + 1) % 32] = float(lid);
  other[lid] = 1.0f;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  out[lid] = other[lid];
}

// Too much threadgroup memory: 40 KiB of static arrays.
[[kernel]] void tg_too_big(device float* out [[buffer(0)]], uint lid [[thread_index_in_threadgroup]]) {
  threadgroup float big[10240];
  big[lid] = 1.0f;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  out[lid] = big[lid];
}

// A barrier without mem_threadgroup does not order threadgroup memory.
[[kernel]] void barrier_wrong_flags_bug(device float* out [[buffer(0)]], uint lid [[thread_index_in_threadgroup]]) {
  threadgroup float tile[32];
  tile[lid] = float(lid);
  threadgroup_barrier(mem_flags::mem_device);
  out[lid] = tile[31 - lid];
}

// Simdgroup-local exchange ordered by simdgroup_barrier: clean.
[[kernel]] void simdgroup_exchange(device float* out [[buffer(0)]], uint lid [[thread_index_in_threadgroup]]) {
  threadgroup float tile[64];
  tile[lid] = float(lid);
  simdgroup_barrier(mem_flags::mem_threadgroup);
  out[lid] = tile[(lid & ~31u) + (31u - (lid & 31u))];
}
