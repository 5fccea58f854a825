// What the Metal 4 tensor-op kernels (issue 21) share: the forward
// (attention_prefill_mpp.h) and both backward kernels
// (attention_backward_mpp.h) are built from one 16-row step on MPP
// matmul2d, run by each SIMD-group on its own 16 rows:
//
//   scores      C = A.B^T      16 x 32, K = D, the right operand transposed
//                              (forward S = Q.K^T; dQ kernel S = Q.K^T and
//                              dP = dO.V^T; dK/dV kernel S^T = K.Q^T and
//                              dP^T = V.dO^T)
//   accumulate  C += A.B       16 x D, K = 32, into a float destination
//                              (forward O += P.V and dQ += dS.K with K
//                              dynamic, the block's valid keys:
//                              mpp_accumulate_descriptor; dV += P^T.dO, dK += dS^T.Q
//                              with K = 32 static over staged tiles)
//
// with A's rows staged in threadgroup memory (mpp_stage_rows) or read from
// device memory, and B's rows a tensor over device memory whose row extent
// ends at the sequence or the block's last valid key (mpp_device_rows), or a
// staged tile. Every operand is a named tensor (run() takes non-const
// lvalue references) over a non-const element type (Apple's __run has no
// branch for a const one): tests/metal_emulator_tests/test_emu_mpp_rules.py
// holds the shim to Apple's rules. Two ops of one
// type (same descriptor, scope and operand types) have one destination
// layout, which the backward's slot-by-slot dS relies on (notes
// "Cooperative tensors"; tests/metal_emulator/README.md).
//
// MSL 4 only, as the kernels: shaders/attention_mpp.metal includes this
// first (tests/test_mps_host.py checks that no MSL 4 header reaches the
// MSL 3.1 library).
#pragma once

#include <metal_tensor>
#include <MetalPerformancePrimitives/MetalPerformancePrimitives.h>
#include "attention_features.h"

namespace flash_metal {

// Threads per threadgroup: 4 SIMD-groups (MLX NAX's WM = 4, WN = 1). The
// host launches at most this many (csrc/metal_plan_detail.h, kTensorOpsMaxThreads).
constant constexpr int kPrefillMppMaxThreads = 128;
// Rows per SIMD-group. Why 16: one 16-row matmul2d tile, the M of MLX's
// and PyTorch's 16 x 32 MPP fragments.
constant constexpr int kMppRowsPerSimd = 16;

// The step's two matmul2d types (top of file) for head dim D and BK columns
// of scores (keys, or queries in the dK/dV kernel). relaxed_precision off:
// with half / bfloat operands it changes nothing in the emulator (README),
// and Apple documents it only as trading accuracy away; MLX turns it on. To
// revisit with measurements on an M5. The descriptors are template argument
// expressions, not static data members: MSL puts every variable with static
// storage in `constant` (MSL specification 4, section 4.2), and a class-type
// template argument copied out of `constant` is an address-space conversion
// this code need not depend on (llama.cpp's kernel_mul_mm writes its
// descriptor in place the same way).
template <int D, int BK>
struct MppRowStep {
  using Scores = mpp::tensor_ops::matmul2d<
      mpp::tensor_ops::matmul2d_descriptor(kMppRowsPerSimd, BK, D, false, true, false,
                                           mpp::tensor_ops::matmul2d_descriptor::mode::multiply),
      metal::execution_simdgroup>;
  using Accumulate = mpp::tensor_ops::matmul2d<
      mpp::tensor_ops::matmul2d_descriptor(kMppRowsPerSimd, D, BK, false, false, false,
                                           mpp::tensor_ops::matmul2d_descriptor::mode::multiply_accumulate),
      metal::execution_simdgroup>;
};

// C += A.B along keys, 16 x d, K dynamic: O += P.V in the forwards, dQ +=
// dS.K in the dQ kernels. Their reduction runs over a key block, ragged
// when the sequence is not a multiple of the block. With a static K,
// matmul2d does not edge-check K and reads K elements of each operand
// whatever its extents, and a read past an operand is undefined (NaN or
// stale data on M5s: ggml-org/llama.cpp PR #27450, NVIDIA/NeMo-Speech.cpp
// PR #20, both fixed by a dynamic K); with a dynamic K it reads K from the
// operands and edge-checks them. So the kernels give both operands a K
// extent of the block's valid keys, min(BK, kv_len - k0) (mpp_tile,
// mpp_device_rows), as llama.cpp's fix does: on a full block the same
// product as a static K = BK; what the dynamic K costs on an M5 is not
// measured. (The dK/dV products along queries keep MppRowStep's static K:
// their operands are staged tiles read within their extents, rows past the
// sequence stored as zeros.) A kernel names its op as MLX's nax.h does, a
// local constexpr descriptor as the template argument:
//   constexpr auto pv_desc = mpp_accumulate_descriptor(DV);
//   matmul2d<pv_desc, execution_simdgroup> pv;
constexpr mpp::tensor_ops::matmul2d_descriptor mpp_accumulate_descriptor(int d) {
  return mpp::tensor_ops::matmul2d_descriptor(kMppRowsPerSimd, d, static_cast<int>(metal::dynamic_extent), false, false,
                                              false, mpp::tensor_ops::matmul2d_descriptor::mode::multiply_accumulate);
}

// The operand tensors of the kernels, their types spelled out: inline
// tensors over device or threadgroup memory, two dynamic extents (innermost
// first), int32 indices (Apple's __run static_asserts "Index type must be
// int": MPPTensorOpsMatMul2dImpl.h).
template <typename T>
using MppDeviceTensor = tensor<device T, dextents<int, 2>, tensor_inline>;
template <typename T>
using MppTileTensor = tensor<threadgroup T, dextents<int, 2>, tensor_inline>;

// `rows` rows of D features from `base` (a head's first row, or a key
// block's) as a matmul2d operand: extents innermost first (features, rows),
// strides in elements (int32: the host checks that a head's offsets fit;
// the feature stride is 1, the host routes any other away:
// csrc/metal_routing_tensor_ops.cpp). The row extent ends at the sequence
// or the block's last valid key. Along K, only a dynamic-K op edge-checks it
// (mpp_accumulate_descriptor above). Along M and N (the scores' keys or
// queries past the sequence) the static-K score ops rely on what the kernels
// compute there being masked, never used: Apple documents the edge check for
// its dynamic-K examples only (the emulator makes such reads NaN); that M5s
// check M and N under a static K too is what llama.cpp's static-K
// kernel_mul_mm showed, ragged in N for months and wrong only when K was
// ragged (PR #27450). The element type is T, not const T: Apple's __run
// picks its data-type branch on the element type with the address space
// removed and const kept, so a tensor over `device const T` matches none
// (MPPTensorOpsMatMul2dImpl.h); llama.cpp's kernel_mul_mm tensor path and
// mtlattn cast the const away likewise. matmul2d only reads its operands.
template <int D, typename T>
FM_INLINE MppDeviceTensor<T> mpp_device_rows(device const T* base, int rows, int64_t row_stride, int64_t dim_stride) {
  return MppDeviceTensor<T>(const_cast<device T*>(base), dextents<int, 2>(D, rows),
                            array<int, 2>{int(dim_stride), int(row_stride)});
}

// `cols` columns of the first `rows` rows of a row-major tile `ld` wide in
// threadgroup memory, as a matmul2d operand.
template <typename T>
FM_INLINE MppTileTensor<T> mpp_tile(threadgroup T* base, int cols, int rows, int ld) {
  return MppTileTensor<T>(base, dextents<int, 2>(cols, rows), array<int, 2>{1, ld});
}

// Copies a SIMD-group's 16 rows of D features from device memory (`src`
// its first row, strides in elements, int32 within a head) to a row-major
// 16 x D tile of threadgroup memory, zeros past `rows`: lane l copies
// elements l, l + 32, ..., so consecutive lanes read consecutive features.
// The caller's simdgroup_barrier then orders the tile before other lanes
// read it.
template <int D, typename T>
FM_INLINE void mpp_stage_rows(threadgroup T* tile, device const T* src, int rows, int row_stride, int dim_stride,
                              uint lane) {
  for (int e = int(lane); e < kMppRowsPerSimd * D; e += 32) {
    const int r = e / D, c = e - r * D;  // D a template constant: no division at run time
    tile[e] = r < rows ? src[r * row_stride + c * dim_stride] : static_cast<T>(0.0f);
  }
}

// Every slot of a float destination cooperative tensor to 0 (Apple leaves
// a new one's values undefined; the emulator poisons them with NaN).
template <typename C>
FM_INLINE void mpp_clear(thread C& c) {
  for (int i = 0; i < c.get_capacity(); ++i) c[i] = 0.0f;
}

// The value a row reduction tensor `r` holds for row `row`. A thread's
// reduction tensor holds the rows of its own destination slots (that is what
// lets the reduction be broadcast back to them); which slot holds which row
// is the layout's business, so look it up through the API.
template <typename R>
FM_INLINE float mpp_row_value(thread const R& r, int row) {
  float x = 0.0f;
  for (int j = 0; j < r.get_capacity(); ++j) {
    if (r.is_valid_element(j) && r.get_multidimensional_index(j)[0] == row) x = r[j];
  }
  return x;
}

// Fills the row reduction tensor `r` (a value per row its thread holds in
// the destination's layout) from a float per row in threadgroup memory: one
// load per row held, where reading `by_row` for each destination element
// would load 16 x N / 32 floats per lane (O's rescale: D / 2 per key block).
template <typename R>
FM_INLINE void mpp_rows_from(thread R& r, threadgroup const float* by_row) {
  for (int j = 0; j < r.get_capacity(); ++j) {
    if (r.is_valid_element(j)) r[j] = by_row[r.get_multidimensional_index(j)[0]];
  }
}

}  // namespace flash_metal
