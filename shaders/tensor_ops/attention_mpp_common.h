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
// first (tests/mps/test_mps_host.py checks that no MSL 4 header reaches the
// MSL 3.1 library).
#pragma once

#include <metal_tensor>
#include <MetalPerformancePrimitives/MetalPerformancePrimitives.h>
#include "../common/attention_features.h"

namespace flash_metal {

// Threads per threadgroup: 4 SIMD-groups (MLX NAX's WM = 4, WN = 1). The
// host launches at most this many (csrc/metal/plan_detail.h, kTensorOpsMaxThreads).
constant constexpr int kPrefillMppMaxThreads = 128;
// Rows per SIMD-group. Why 16: one 16-row matmul2d tile, the M of MLX's
// and PyTorch's 16 x 32 MPP fragments.
constant constexpr int kMppRowsPerSimd = 16;

// 16-bit operands take relaxed_precision (the descriptor's sixth field, as
// Apple's MPPTensorOpsMatMul2d.h orders them: m, n, k, transpose_left,
// transpose_right, relaxed_precision, matmul_mode). Apple documents it only
// as letting the implementation "sacrifice accuracy for performance"; MLX's
// NAX attention (nax.h: every MMA descriptor has relaxed = true) and
// PyTorch's MPP attention set it for half and bfloat inputs. The tensor-op
// kernels take half and bfloat only (float32 stays on the simdgroup
// kernels), so it is on in every instantiation; a float instantiation would
// get it off (exact) unless asked. What it changes on an M5 is not
// documented and not measured (the emulator treats half and bfloat operands
// as exact either way, float ones as TF32 under it: tests/metal_emulator/README.md).
// Not yet verified on Apple hardware.
constexpr bool mpp_relaxed(int elem_bytes) { return elem_bytes == 2; }

// The step's two matmul2d types (top of file) for head dim D, BK columns of
// scores (keys, or queries in the dK/dV kernel) and operand type T. The
// descriptors are template argument expressions, not static data members:
// MSL puts every variable with static storage in `constant` (MSL
// specification 4, section 4.2), and a class-type template argument copied
// out of `constant` is an address-space conversion this code need not
// depend on (llama.cpp's kernel_mul_mm writes its descriptor in place the
// same way).
template <int D, int BK, typename T>
struct MppRowStep {
  using Scores = mpp::tensor_ops::matmul2d<
      mpp::tensor_ops::matmul2d_descriptor(kMppRowsPerSimd, BK, D, false, true, mpp_relaxed(sizeof(T)),
                                           mpp::tensor_ops::matmul2d_descriptor::mode::multiply),
      metal::execution_simdgroup>;
  using Accumulate = mpp::tensor_ops::matmul2d<
      mpp::tensor_ops::matmul2d_descriptor(kMppRowsPerSimd, D, BK, false, false, mpp_relaxed(sizeof(T)),
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
// mpp_device_rows), as llama.cpp's fix does; on a full block the operands
// are static slices of BK keys (mpp_static_rows, mpp_static_tile), so K is
// known at compile time there and nothing is edge-checked (Apple's header:
// static_slice on inside tiles). (The dK/dV products along queries keep
// MppRowStep's static K: their operands are staged tiles read within their
// extents, rows past the sequence stored as zeros.) A kernel names its op
// as MLX's nax.h does, a local constexpr descriptor as the template argument:
//   constexpr auto pv_desc = mpp_accumulate_descriptor(DV, mpp_relaxed(sizeof(T)));
//   matmul2d<pv_desc, execution_simdgroup> pv;
constexpr mpp::tensor_ops::matmul2d_descriptor mpp_accumulate_descriptor(int d, bool relaxed) {
  return mpp::tensor_ops::matmul2d_descriptor(kMppRowsPerSimd, d, static_cast<int>(metal::dynamic_extent), false, false,
                                              relaxed, mpp::tensor_ops::matmul2d_descriptor::mode::multiply_accumulate);
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
// csrc/metal/families/tensor_ops.cpp). The row extent ends at the sequence
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

// Static extents (W columns, H rows), for the tiles a kernel knows are
// whole: a key block of BK valid keys, a staged tile. Apple's header: an op
// edge-checks its tile "against extents of original tensor ... In high
// performance code we can avoid edge checking for inside thread groups" with
// static_slice (MPPTensorOpsMatMul2d.h, its matMul example). So full key
// blocks take static slices (static_slice<W, H> of the sequence's rows:
// mpp_device_rows over the sequence) and the ragged last block the dynamic
// tensors above. The emulator refuses a static slice that does not fit
// its tensor's extents, and counts runs over dynamic extents
// (mpp_checked_runs).
template <typename T, int W, int H>
using MppStaticTileTensor = tensor<threadgroup T, extents<int, W, H>, tensor_inline>;
template <int W, int H, typename T>
FM_INLINE MppStaticTileTensor<T, W, H> mpp_static_tile(threadgroup T* base, int ld) {
  return MppStaticTileTensor<T, W, H>(base, extents<int, W, H>(), array<int, 2>{1, ld});
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

// The coordinate bookkeeping of the kernels (issue 40): every element of a
// cooperative tensor learns its (row, column) only through the API
// (get_multidimensional_index, is_valid_element), whose answers are a
// function of the tensor's type and the thread, never of the instance or
// the block (Apple's header: the layout "depends on operation, data type,
// number of threads in opscope"). So the kernels ask once per kernel, before
// their loops, and keep the answers in cooperative tensors of the same types
// ("code" tensors, float, one value per slot: the same slots as the tensors
// they describe, whatever Apple's capacity is), not once per element per
// block. Their price: one register per slot (16 x BK / 32 per lane for S).
// MLX's nax.h pays nothing: it hard-codes the M5 lane map (notes
// "MLX NAX attention"), which this project does not rely on.
//
// Every loop over a cooperative tensor's slots is fully unrolled (FM_UNROLL,
// attention_common.h): "It is imperative for performance to include 'unroll
// pragma' so compiler fully unrolls the loop" (Apple's
// MPPTensorOpsMatMul2d.h, its cooperative-tensor example). The capacity is
// not a constant of the MSL front end (get_capacity() is the driver's
// __tensorops_impl_matmul2d_op_cooperative_tensor_num_elements, and the
// storage a deferred-size alloca in the AIR): the driver resolves both when
// it links its implementation, which is where the unrolling takes effect.
// tests/metal/test_mpp_speed_structure.py checks that every such loop carries it.

// Every slot of a float destination cooperative tensor to 0 (Apple leaves
// a new one's values undefined; the emulator poisons them with NaN).
template <typename C>
FM_INLINE void mpp_clear(thread C& c) {
  FM_UNROLL
  for (int i = 0; i < c.get_capacity(); ++i) c[i] = 0.0f;
}

// A destination's code tensor (a float cooperative tensor of its type):
// slot i holds row * W + column of the element slot i holds, or -1 for an
// invalid slot. W: the destination's columns (a power of two, so the
// kernels' code / W and code % W are shifts).
template <int W, typename C>
FM_INLINE void mpp_slot_codes(thread C& codes) {
  FM_UNROLL
  for (int i = 0; i < codes.get_capacity(); ++i) {
    float code = -1.0f;
    if (codes.is_valid_element(i)) {
      const auto idx = codes.get_multidimensional_index(i);  // [0] the column, [1] the row
      code = float(idx[1] * W + idx[0]);
    }
    codes[i] = code;
  }
}

// A row reduction tensor's code tensor (one of its type): slot j holds the
// row it reduces, or -1.
template <typename R>
FM_INLINE void mpp_row_codes(thread R& rows) {
  FM_UNROLL
  for (int j = 0; j < rows.get_capacity(); ++j)
    rows[j] = rows.is_valid_element(j) ? float(rows.get_multidimensional_index(j)[0]) : -1.0f;
}

// The value a row reduction tensor `r` holds for row `row`, found through
// its code tensor `rows` (one of r's type): no coordinate query. A thread's
// reduction tensor holds the rows of its own destination slots (that is what
// lets the reduction be broadcast back to them).
template <typename R>
FM_INLINE float mpp_row_value(thread const R& r, thread const R& rows, int row) {
  float x = 0.0f;
  FM_UNROLL
  for (int j = 0; j < r.get_capacity(); ++j) x = rows[j] == float(row) ? r[j] : x;
  return x;
}

// Fills the row reduction tensor `r` from a float per row in threadgroup
// memory (its rows from its code tensor `rows`): one load per row held.
template <typename R>
FM_INLINE void mpp_rows_from(thread R& r, thread const R& rows, threadgroup const float* by_row) {
  FM_UNROLL
  for (int j = 0; j < r.get_capacity(); ++j) r[j] = rows[j] >= 0.0f ? by_row[int(rows[j])] : 0.0f;
}

// acc *= the factor of each element's row, held in `f`, a row reduction
// tensor whose map_iterator serves acc's iterators: acc's own op's, or
// another op's where is_iterator_compatible(acc, f) said so (MSL
// specification 4, section 7.2.1; Apple's MPPTensorOpsMatMul2d.h: ask, and
// "fall back to storing sourceCT to threadgroup memory" where it is false).
// One map_iterator per element: Apple's documented broadcast of a row value
// (the emulator counts each as a coordinate query).
template <typename A, typename F>
FM_INLINE void mpp_scale_rows(thread A& acc, thread F& f) {
  FM_UNROLL
  for (auto it = acc.begin(); it != acc.end(); it++) *it *= *f.map_iterator(it);
}

}  // namespace flash_metal
