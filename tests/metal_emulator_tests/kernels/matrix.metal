// Proof kernels for simdgroup_matrix (never shipped). One SIMD-group.
#include <metal_stdlib>
using namespace metal;

// d = a * b + c for 8x8 row-major matrices; also records, per lane, the
// (row, col) of the two thread_elements() of a matrix loaded from m[r][c] = 8r + c.
template <typename T>
[[kernel]] void mma(device const T* a [[buffer(0)]], device const T* b [[buffer(1)]],
                    device const float* c [[buffer(2)]], device float* d [[buffer(3)]],
                    device float* layout [[buffer(4)]], device const float* index_matrix [[buffer(5)]],
                    device float* transposed [[buffer(6)]],
                    uint lane [[thread_index_in_simdgroup]]) {
  simdgroup_matrix<T, 8, 8> ma, mb;
  simdgroup_float8x8 mc, md;
  simdgroup_load(ma, a, 8);
  simdgroup_load(mb, b, 8);
  simdgroup_load(mc, c, 8);
  simdgroup_multiply_accumulate(md, ma, mb, mc);
  simdgroup_store(md, d, 8);

  simdgroup_float8x8 idx;
  simdgroup_load(idx, index_matrix, 16, ulong2(8, 0));  // columns 8..15 of a 8x16 matrix
  layout[lane * 2 + 0] = idx.thread_elements()[0];
  layout[lane * 2 + 1] = idx.thread_elements()[1];

  simdgroup_float8x8 t;
  simdgroup_load(t, index_matrix, 16, ulong2(0, 0), true);
  simdgroup_store(t, transposed, 8);
}
template [[host_name("mma_float")]] [[kernel]] decltype(mma<float>) mma<float>;
template [[host_name("mma_half")]] [[kernel]] decltype(mma<half>) mma<half>;
