// Proof kernels for the per-dispatch counters (never shipped). Each one does
// a number of loads, stores, barriers, matrix operations or exponentials that
// test_emu_counts.py works out by arithmetic.
#include <metal_stdlib>
using namespace metal;

// Thread i < n reads one float and writes one half; every thread reads n.
[[kernel]] void copy_to_half(device const float* src [[buffer(0)]], device half* dst [[buffer(1)]],
                             constant uint& n [[buffer(2)]], uint gid [[thread_position_in_grid]]) {
  if (gid < n) dst[gid] = half(src[gid]);
}

// The same with 16-byte loads and 8-byte stores: one float4 in, one half4 out.
[[kernel]] void copy4_to_half4(device const float4* src [[buffer(0)]], device half4* dst [[buffer(1)]],
                               uint gid [[thread_position_in_grid]]) {
  dst[gid] = half4(src[gid]);
}

// k threadgroup barriers and j simdgroup barriers in loops; the stores read
// nothing, so the only device reads are k and j.
[[kernel]] void barriers(device uint* out [[buffer(0)]], constant uint& k [[buffer(1)]],
                         constant uint& j [[buffer(2)]], uint gid [[thread_position_in_grid]]) {
  for (uint i = 0; i < k; ++i) threadgroup_barrier(mem_flags::mem_threadgroup);
  for (uint i = 0; i < j; ++i) simdgroup_barrier(mem_flags::mem_none);
  out[gid] = 1u;
}

// Every SIMD-group loads a and b (8x8 floats) once, multiplies m times (the
// first without accumulating), and stores its result in its own 8x8 block.
[[kernel]] void mmas(device const float* a [[buffer(0)]], device const float* b [[buffer(1)]],
                     device float* out [[buffer(2)]], constant uint& m [[buffer(3)]],
                     uint sg [[simdgroup_index_in_threadgroup]], uint sgs [[simdgroups_per_threadgroup]],
                     uint group [[threadgroup_position_in_grid]]) {
  simdgroup_float8x8 ma, mb, acc;
  simdgroup_load(ma, a, 8);
  simdgroup_load(mb, b, 8);
  simdgroup_multiply(acc, ma, mb);
  for (uint i = 1; i < m; ++i) simdgroup_multiply_accumulate(acc, ma, mb, acc);
  simdgroup_store(acc, out + (group * sgs + sg) * 64, 8);
}

// Divergent exponentials: threads with lid % 3 == 0 call exp2 on a float2,
// lid % 3 == 1 call exp on a float, lid % 3 == 2 call fast::exp2 on a half4
// only when lid % 5 == 0 too.
[[kernel]] void exps(device const float* x [[buffer(0)]], device float* out [[buffer(1)]],
                     uint gid [[thread_position_in_grid]], uint lid [[thread_index_in_threadgroup]]) {
  const float v = x[gid];
  float r = 0.0f;
  if (lid % 3 == 0) {
    const float2 e = exp2(float2(v, -v));
    r = e.x + e.y;
  } else if (lid % 3 == 1) {
    r = exp(v);
  } else if (lid % 5 == 0) {
    const half4 e = fast::exp2(half4(half(v)));
    r = float(e.w);
  }
  out[gid] = r;
}

// Threadgroup traffic: every thread writes one float of the dynamic buffer and
// one ushort of a body variable, then reads two floats and one ushort.
[[kernel]] void tg_traffic(device float* out [[buffer(0)]], threadgroup float* dyn [[threadgroup(0)]],
                           uint lid [[thread_index_in_threadgroup]], uint tpg [[threads_per_threadgroup]],
                           uint gid [[thread_position_in_grid]]) {
  threadgroup ushort tag[256];
  dyn[lid] = float(gid);
  tag[lid] = ushort(lid);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  out[gid] = dyn[lid] + dyn[(lid + 1) % tpg] + float(tag[(lid + 2) % tpg]);
}

// The dense tile loader's MSL forms (shaders/prefill/attention_prefill.h): half rows
// read and written as raw 16-byte uint4 chunks through reinterpret_cast
// pointers, staged in threadgroup memory, then read back as halves. Thread i
// copies chunk i (8 halves) of src with one 16-byte device load; then writes
// dst[8 i + j] = 2 * tile[8 i + j] with 8 two-byte threadgroup loads.
[[kernel]] void half_rows_as_uint4(device const half* src [[buffer(0)]], device half* dst [[buffer(1)]],
                                   threadgroup half* tile [[threadgroup(0)]],
                                   uint lid [[thread_index_in_threadgroup]], uint group [[threadgroup_position_in_grid]],
                                   uint tpg [[threads_per_threadgroup]]) {
  device const uint4* s = reinterpret_cast<device const uint4*>(src + group * tpg * 8);
  threadgroup uint4* t = reinterpret_cast<threadgroup uint4*>(tile);
  uint4 x = uint4(0u);
  x = s[lid];
  t[lid] = x;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (uint j = 0; j < 8; ++j) dst[(group * tpg + lid) * 8 + j] = tile[lid * 8 + j] * half(2.0f);
}

// The traffic model's rules (issue 19): every lane runs 4 loads of src, at
// address i (spread == 0: the 32 lanes of a SIMD-group at one address, a
// broadcast) or i * 32 + lane (spread != 0: 32 distinct addresses per load
// instruction); and a simd_sum between the 2nd and 3rd, so the broadcast
// rule's record of a SIMD-group's loads survives a meeting of its lanes.
// Every SIMD-group of a threadgroup reads the same addresses.
[[kernel]] void broadcast_loads(device const float* src [[buffer(0)]], device float* dst [[buffer(1)]],
                                constant uint& spread [[buffer(2)]], uint gid [[thread_position_in_grid]],
                                uint lane [[thread_index_in_simdgroup]]) {
  const uint s = spread;
  float acc = 0.0f;
  for (uint i = 0; i < 2; ++i) acc += src[s ? i * 32 + lane : i];
  acc = simd_sum(acc);
  for (uint i = 2; i < 4; ++i) acc += src[s ? i * 32 + lane : i];
  dst[gid] = acc;
}
