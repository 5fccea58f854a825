// Proof kernels for the emulator's MPP tensor ops (MSL 4; never shipped):
// compile_library(..., msl=4). test_emu_mpp.py runs them under both lane
// layouts ("m5", "scrambled"); the *_bug kernels are planted bugs.
#include <metal_stdlib>
#include <metal_tensor>
#include <MetalPerformancePrimitives/MetalPerformancePrimitives.h>
using namespace metal;
using namespace mpp::tensor_ops;

// p (int32): K, lda, ldb, ldc, a_x, a_y, b_x, b_y. A is M x K (K x M when TL),
// B is K x N (N x K when TR), both row-major with leading dimensions lda / ldb,
// read from column a_x / b_x, row a_y / b_y on (slices). C and out are M x N
// with leading dimension ldc. out = A B (+ C when ACC), written through the
// cooperative tensor's iterator.
template <typename T, int M, int N, bool TL, bool TR, bool ACC>
[[kernel]] void mpp_gemm(device T* a [[buffer(0)]], device T* b [[buffer(1)]], device float* c [[buffer(2)]],
                         device float* out [[buffer(3)]], constant int* p [[buffer(4)]]) {
  const int K = p[0];
  auto ta = tensor(a, dextents<int, 2>(p[4] + (TL ? M : K), p[5] + (TL ? K : M)), array<int, 2>{1, p[1]})
                .slice(p[4], p[5]);
  auto tb = tensor(b, dextents<int, 2>(p[6] + (TR ? K : N), p[7] + (TR ? N : K)), array<int, 2>{1, p[2]})
                .slice(p[6], p[7]);
  constexpr auto desc = matmul2d_descriptor(M, N, static_cast<int>(dynamic_extent), TL, TR, false,
                                            ACC ? matmul2d_descriptor::mode::multiply_accumulate
                                                : matmul2d_descriptor::mode::multiply);
  matmul2d<desc, execution_simdgroup> op;
  auto ct = op.template get_destination_cooperative_tensor<decltype(ta), decltype(tb), float>();
  if (ACC) ct.load(tensor(c, dextents<int, 2>(N, M), array<int, 2>{1, p[3]}));
  op.run(ta, tb, ct);
  for (auto it = ct.begin(); it != ct.end(); ++it) {
    auto idx = it.get_multidimensional_index();
    out[idx[1] * p[3] + idx[0]] = *it;
  }
}
template [[host_name("mpp_gemm_half_16x32_nt_mul")]] [[kernel]] decltype(mpp_gemm<half, 16, 32, false, true, false>)
    mpp_gemm<half, 16, 32, false, true, false>;
template [[host_name("mpp_gemm_bfloat_16x32_tn_acc")]] [[kernel]] decltype(mpp_gemm<bfloat, 16, 32, true, false, true>)
    mpp_gemm<bfloat, 16, 32, true, false, true>;
template [[host_name("mpp_gemm_float_20x32_nn_acc")]] [[kernel]] decltype(mpp_gemm<float, 20, 32, false, false, true>)
    mpp_gemm<float, 20, 32, false, false, true>;
template [[host_name("mpp_gemm_float_20x32_tt_mul")]] [[kernel]] decltype(mpp_gemm<float, 20, 32, true, true, false>)
    mpp_gemm<float, 20, 32, true, true, false>;

// Planted bug: the 16 x 32 product written out through MLX's hard-coded
// Apple10 lane map (nax.h get_coord) instead of get_multidimensional_index:
// right under "m5" only.
[[kernel]] void mpp_hardcoded_map_bug(device half* a [[buffer(0)]], device half* b [[buffer(1)]],
                                      device float* out [[buffer(2)]], uint lane [[thread_index_in_simdgroup]]) {
  auto ta = tensor(a, dextents<int, 2>(16, 16));
  auto tb = tensor(b, dextents<int, 2>(32, 16));
  constexpr auto desc = matmul2d_descriptor(16, 32, 16);
  matmul2d<desc, execution_simdgroup> op;
  auto ct = op.template get_destination_cooperative_tensor<decltype(ta), decltype(tb), float>();
  op.run(ta, tb, ct);
  const uint qid = lane / 4, row = (qid & 4) | ((lane / 2) & 3), col = ((qid & 2) | (lane & 1)) * 4;
  for (uint i = 0; i < 16; ++i)
    out[(row + 8 * ((i % 8) / 4)) * 32 + (i / 8) * 16 + col + i % 4] = ct[i];
}

// Two phases through threadgroup memory on two SIMD-groups: P = A B (32 x 16,
// K = 16) into a cooperative tensor, stored to threadgroup memory, then
// out += P V (32 x 16, K = 16) from there. BARRIER false is the planted bug:
// SIMD-group 1's run() reads rows of P that SIMD-group 0 stored.
template <bool BARRIER>
[[kernel]] void mpp_two_phase(device half* a [[buffer(0)]], device half* b [[buffer(1)]], device half* v [[buffer(2)]],
                              device float* out [[buffer(3)]]) {
  threadgroup float pbuf[32 * 16];
  auto ta = tensor(a, dextents<int, 2>(16, 32));
  auto tb = tensor(b, dextents<int, 2>(16, 16));
  auto tv = tensor(v, dextents<int, 2>(16, 16));
  auto tp = tensor(pbuf, dextents<int, 2>(16, 32));
  auto to = tensor(out, dextents<int, 2>(16, 32));
  constexpr auto d1 = matmul2d_descriptor(32, 16, 16);
  constexpr auto d2 = matmul2d_descriptor(32, 16, 16, false, false, false, matmul2d_descriptor::mode::multiply_accumulate);
  matmul2d<d1, execution_simdgroups<2>> op1;
  matmul2d<d2, execution_simdgroups<2>> op2;
  auto ct = op1.get_destination_cooperative_tensor<decltype(ta), decltype(tb), float>();
  op1.run(ta, tb, ct);
  ct.store(tp);
  if (BARRIER) threadgroup_barrier(mem_flags::mem_threadgroup);
  op2.run(tp, tv, to);
}
template [[host_name("mpp_two_phase")]] [[kernel]] decltype(mpp_two_phase<true>) mpp_two_phase<true>;
template [[host_name("mpp_two_phase_bug")]] [[kernel]] decltype(mpp_two_phase<false>) mpp_two_phase<false>;

// Planted bugs: run() reached by part of its scope (lanes 0..15 of one
// SIMD-group; SIMD-group 0 of two).
template <bool MULTI>
[[kernel]] void mpp_divergent_bug(device half* a [[buffer(0)]], device float* out [[buffer(1)]],
                                  uint lane [[thread_index_in_simdgroup]], uint sg [[simdgroup_index_in_threadgroup]]) {
  auto ta = tensor(a, dextents<int, 2>(16, 16));
  auto to = tensor(out, dextents<int, 2>(16, 16));
  constexpr auto desc = matmul2d_descriptor(16, 16, 16);
  if (MULTI) {
    matmul2d<desc, execution_simdgroups<2>> op;
    if (sg == 0) op.run(ta, ta, to);
  } else {
    matmul2d<desc, execution_simdgroup> op;
    if (lane < 16) op.run(ta, ta, to);
  }
}
template [[host_name("mpp_divergent_lanes_bug")]] [[kernel]] decltype(mpp_divergent_bug<false>) mpp_divergent_bug<false>;
template [[host_name("mpp_divergent_simdgroups_bug")]] [[kernel]] decltype(mpp_divergent_bug<true>)
    mpp_divergent_bug<true>;

// Row max (identity -inf), row sum and column max of an M x N float tile s,
// loaded into an M x N destination cooperative tensor. Every lane writes its
// valid reduction slots to its own row of the outputs (lane * M + row), so the
// test sees each replica. COLUMNS_BUG: the planted bug, the "row" max taken
// with reduce_columns (the wrong dimension).
template <int M, int N, bool COLUMNS_BUG>
[[kernel]] void mpp_reduce(device float* s [[buffer(0)]], device float* row_max [[buffer(1)]],
                           device float* row_sum [[buffer(2)]], device float* col_max [[buffer(3)]],
                           uint lane [[thread_index_in_simdgroup]]) {
  auto ts = tensor(s, dextents<int, 2>(N, M));
  constexpr auto desc = matmul2d_descriptor(M, N, 16);
  matmul2d<desc, execution_simdgroup> op;
  auto ct = op.template get_destination_cooperative_tensor<decltype(ts), decltype(ts), float>();
  ct.load(ts);
  auto rs = op.template get_row_reduction_destination_cooperative_tensor<decltype(ts), decltype(ts), float>();
  auto cm = op.template get_column_reduction_destination_cooperative_tensor<decltype(ts), decltype(ts), float>();
  reduce_rows(ct, rs, reduction_operation::sum);
  reduce_columns(ct, cm, reduction_operation::max, reduction_operation_identity<float>::max_identity);
  for (int i = 0; i < rs.get_capacity(); ++i)
    if (rs.is_valid_element(i)) row_sum[lane * M + rs.get_multidimensional_index(i)[0]] = rs[i];
  for (int i = 0; i < cm.get_capacity(); ++i)
    if (cm.is_valid_element(i)) col_max[lane * N + cm.get_multidimensional_index(i)[0]] = cm[i];
  if (COLUMNS_BUG) {
    auto rm = op.template get_column_reduction_destination_cooperative_tensor<decltype(ts), decltype(ts), float>();
    reduce_columns(ct, rm, reduction_operation::max, -INFINITY);
    for (int i = 0; i < rm.get_capacity(); ++i)
      if (rm.is_valid_element(i)) row_max[lane * M + rm.get_multidimensional_index(i)[0]] = rm[i];
  } else {
    auto rm = op.template get_row_reduction_destination_cooperative_tensor<decltype(ts), decltype(ts), float>();
    reduce_rows(ct, rm, reduction_operation::max, -INFINITY);
    for (int i = 0; i < rm.get_capacity(); ++i)
      if (rm.is_valid_element(i)) row_max[lane * M + rm.get_multidimensional_index(i)[0]] = rm[i];
  }
}
template [[host_name("mpp_reduce_16x32")]] [[kernel]] decltype(mpp_reduce<16, 32, false>) mpp_reduce<16, 32, false>;
template [[host_name("mpp_reduce_16x16")]] [[kernel]] decltype(mpp_reduce<16, 16, false>) mpp_reduce<16, 16, false>;
template [[host_name("mpp_reduce_16x16_columns_bug")]] [[kernel]] decltype(mpp_reduce<16, 16, true>)
    mpp_reduce<16, 16, true>;

// A 16 x 16 float tile s: copied through a destination cooperative tensor
// (IGNORE_VALID: the planted bug, every slot below the capacity written,
// is_valid_element never asked), and A B with relaxed_precision into out2.
// UNCLEARED: the planted bug, multiply_accumulate into a cooperative tensor
// that was never cleared or loaded.
template <bool IGNORE_VALID, bool UNCLEARED>
[[kernel]] void mpp_slots(device float* s [[buffer(0)]], device float* out [[buffer(1)]],
                          device float* a [[buffer(2)]], device float* b [[buffer(3)]],
                          device float* out2 [[buffer(4)]]) {
  auto ts = tensor(s, dextents<int, 2>(16, 16));
  auto ta = tensor(a, dextents<int, 2>(16, 16));
  auto tb = tensor(b, dextents<int, 2>(16, 16));
  constexpr auto copy = matmul2d_descriptor(16, 16, 16);
  matmul2d<copy, execution_simdgroup> op;
  auto ct = op.template get_destination_cooperative_tensor<decltype(ts), decltype(ts), float>();
  ct.load(ts);
  for (int i = 0; i < ct.get_capacity(); ++i) {
    if (!IGNORE_VALID && !ct.is_valid_element(i)) continue;
    auto idx = ct.get_multidimensional_index(i);
    out[idx[1] * 16 + idx[0]] = ct[i];
  }
  constexpr auto relaxed = matmul2d_descriptor(16, 16, 16, false, false, true,
                                               UNCLEARED ? matmul2d_descriptor::mode::multiply_accumulate
                                                         : matmul2d_descriptor::mode::multiply);
  matmul2d<relaxed, execution_simdgroup> op2;
  auto ct2 = op2.template get_destination_cooperative_tensor<decltype(ta), decltype(tb), float>();
  op2.run(ta, tb, ct2);
  ct2.store(tensor(out2, dextents<int, 2>(16, 16)));
}
template [[host_name("mpp_slots")]] [[kernel]] decltype(mpp_slots<false, false>) mpp_slots<false, false>;
template [[host_name("mpp_slots_ignore_valid_bug")]] [[kernel]] decltype(mpp_slots<true, false>)
    mpp_slots<true, false>;
template [[host_name("mpp_slots_uncleared_bug")]] [[kernel]] decltype(mpp_slots<false, true>) mpp_slots<false, true>;

// S = Q K^T (16 x 16, K = 16) into a destination cooperative tensor, then
// out = P V on a second op with P = S as its left-input cooperative tensor
// and V loaded into its right-input one. CONVERT: P converted through
// get_left_input_cooperative_tensor(S). The planted bug: P filled slot by
// slot from S (MLX's ct[i] = frag[i]), right only where both layouts agree.
template <bool CONVERT>
[[kernel]] void mpp_chain(device half* q [[buffer(0)]], device half* k [[buffer(1)]], device half* v [[buffer(2)]],
                          device float* out [[buffer(3)]]) {
  auto tq = tensor(q, dextents<int, 2>(16, 16));
  auto tk = tensor(k, dextents<int, 2>(16, 16));
  auto tv = tensor(v, dextents<int, 2>(16, 16));
  constexpr auto d1 = matmul2d_descriptor(16, 16, 16, false, true);
  constexpr auto d2 = matmul2d_descriptor(16, 16, 16);
  matmul2d<d1, execution_simdgroup> qk;
  matmul2d<d2, execution_simdgroup> pv;
  auto s = qk.template get_destination_cooperative_tensor<decltype(tq), decltype(tk), float>();
  qk.run(tq, tk, s);
  auto vin = pv.template get_right_input_cooperative_tensor<float, half, float>();
  vin.load(tv);
  auto o = pv.template get_destination_cooperative_tensor<decltype(tq), decltype(tv), float>();
  if (CONVERT) {
    auto p = pv.template get_left_input_cooperative_tensor<float, half, float>(s);
    pv.run(p, vin, o);
  } else {
    auto p = pv.template get_left_input_cooperative_tensor<float, half, float>();
    for (int i = 0; i < p.get_capacity(); ++i) p[i] = s[i];
    pv.run(p, vin, o);
  }
  o.store(tensor(out, dextents<int, 2>(16, 16)));
}
template [[host_name("mpp_chain")]] [[kernel]] decltype(mpp_chain<true>) mpp_chain<true>;
template [[host_name("mpp_chain_slot_copy_bug")]] [[kernel]] decltype(mpp_chain<false>) mpp_chain<false>;

// out = (A B^T) * (A2 B2^T) elementwise, the two products in two destination
// cooperative tensors combined slot by slot (the tensor-op backward's dS =
// P * (dP - Delta), shaders/tensor_ops/attention_backward_mpp.h). SAME: both from one
// op type (same descriptor, scope, operand and element types), whose slots
// hold the same elements. The planted bug: the second product from an op of
// another descriptor (B2 read untransposed, same 16 x 32 shape), whose
// layout need not match: right under "m5" only.
template <bool SAME>
[[kernel]] void mpp_same_op_slots(device half* a [[buffer(0)]], device half* b [[buffer(1)]],
                                  device half* a2 [[buffer(2)]], device half* b2 [[buffer(3)]],
                                  device float* out [[buffer(4)]]) {
  auto ta = tensor(a, dextents<int, 2>(16, 16));
  auto tb = tensor(b, dextents<int, 2>(16, 32));   // 32 x 16, read transposed
  auto ta2 = tensor(a2, dextents<int, 2>(16, 16));
  auto tb2 = tensor(b2, dextents<int, 2>(16, 32));  // as b (SAME); the bug reads it as 16 x 32 below
  auto tb2n = tensor(b2, dextents<int, 2>(32, 16));
  constexpr auto dt = matmul2d_descriptor(16, 32, 16, false, true);
  constexpr auto dn = matmul2d_descriptor(16, 32, 16, false, false);
  matmul2d<dt, execution_simdgroup> op;
  matmul2d<dn, execution_simdgroup> other;
  auto x = op.template get_destination_cooperative_tensor<decltype(ta), decltype(tb), float>();
  op.run(ta, tb, x);
  if (SAME) {
    auto y = op.template get_destination_cooperative_tensor<decltype(ta), decltype(tb), float>();
    op.run(ta2, tb2, y);
    for (int i = 0; i < x.get_capacity(); ++i) {
      if (!x.is_valid_element(i)) continue;
      auto idx = x.get_multidimensional_index(i);
      out[idx[1] * 32 + idx[0]] = x[i] * y[i];
    }
  } else {
    auto y = other.template get_destination_cooperative_tensor<decltype(ta), decltype(tb2n), float>();
    other.run(ta2, tb2n, y);
    for (int i = 0; i < x.get_capacity(); ++i) {
      if (!x.is_valid_element(i)) continue;
      auto idx = x.get_multidimensional_index(i);
      out[idx[1] * 32 + idx[0]] = x[i] * y[i];
    }
  }
}
template [[host_name("mpp_same_op_slots")]] [[kernel]] decltype(mpp_same_op_slots<true>) mpp_same_op_slots<true>;
template [[host_name("mpp_other_op_slots_bug")]] [[kernel]] decltype(mpp_same_op_slots<false>)
    mpp_same_op_slots<false>;

// out (16 x 32) = A B over the first `kv` (p[0]) columns of A (16 x 32
// stored, lda 32) and rows of B (32 x 32 stored), both operands' K extents
// ending at kv, as a ragged last key block's are. DYNAMIC: K read from the
// operands (edge-checked: nothing past kv is read). The planted bug: a
// static K = 32 with the same operands, which reads past both K extents
// (undefined on Apple: NaN here, as on M5s in llama.cpp PR #27450).
template <bool DYNAMIC>
[[kernel]] void mpp_k_edge(device half* a [[buffer(0)]], device half* b [[buffer(1)]], device float* out [[buffer(2)]],
                           constant int* p [[buffer(3)]]) {
  const int kv = p[0];
  tensor<device half, dextents<int, 2>, tensor_inline> ta(a, dextents<int, 2>(kv, 16), array<int, 2>{1, 32});
  tensor<device half, dextents<int, 2>, tensor_inline> tb(b, dextents<int, 2>(32, kv), array<int, 2>{1, 32});
  constexpr auto desc = matmul2d_descriptor(16, 32, DYNAMIC ? static_cast<int>(dynamic_extent) : 32);
  matmul2d<desc, execution_simdgroup> op;
  auto ct = op.template get_destination_cooperative_tensor<decltype(ta), decltype(tb), float>();
  op.run(ta, tb, ct);
  ct.store(tensor(out, dextents<int, 2>(32, 16)));
}
template [[host_name("mpp_k_edge")]] [[kernel]] decltype(mpp_k_edge<true>) mpp_k_edge<true>;
template [[host_name("mpp_k_edge_static_bug")]] [[kernel]] decltype(mpp_k_edge<false>) mpp_k_edge<false>;

// execution_simdgroups<1> is execution_simdgroup (Apple's traits: one type),
// so on a threadgroup of two SIMD-groups each runs its own 32 x 16 op. The
// planted bug: a kernel that meant the two to share one 32 x 16 tile (each
// half of it), as execution_simdgroups<2> would: both write all of the
// threadgroup tile, which is then copied out.
[[kernel]] void mpp_one_as_many_bug(device half* a [[buffer(0)]], device half* b [[buffer(1)]],
                                    device float* out [[buffer(2)]], uint tid [[thread_index_in_threadgroup]]) {
  threadgroup float tile[32 * 16];
  auto ta = tensor(a, dextents<int, 2>(16, 32));
  auto tb = tensor(b, dextents<int, 2>(16, 16));
  auto tt = tensor(tile, dextents<int, 2>(16, 32));
  constexpr auto desc = matmul2d_descriptor(32, 16, 16);
  matmul2d<desc, execution_simdgroups<1>> op;
  op.run(ta, tb, tt);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (uint e = tid; e < 32 * 16; e += 64) out[e] = tile[e];
}

// out (16 x 32) = A B with transposed input cooperative tensors (MLX's nax.h
// runs such with transpose flags): the left input holds A as stored (16 x 16,
// read as A^T when TL), the right input B as stored (32 x 16, N x K, read as
// B^T), each filled by load() from its stored tensor.
template <bool TL>
[[kernel]] void mpp_transposed_inputs(device half* a [[buffer(0)]], device half* b [[buffer(1)]],
                                      device float* out [[buffer(2)]]) {
  auto ta = tensor(a, dextents<int, 2>(16, 16));
  auto tb = tensor(b, dextents<int, 2>(16, 32));
  constexpr auto desc = matmul2d_descriptor(16, 32, 16, TL, true, false, matmul2d_descriptor::mode::multiply);
  matmul2d<desc, execution_simdgroup> op;
  auto ca = op.template get_left_input_cooperative_tensor<half, half, float>();
  auto cb = op.template get_right_input_cooperative_tensor<half, half, float>();
  ca.load(ta);
  cb.load(tb);
  auto ct = op.template get_destination_cooperative_tensor<decltype(ca), decltype(cb), float>();
  op.run(ca, cb, ct);
  ct.store(tensor(out, dextents<int, 2>(32, 16)));
}
template [[host_name("mpp_transposed_inputs_tt")]] [[kernel]] decltype(mpp_transposed_inputs<true>)
    mpp_transposed_inputs<true>;
template [[host_name("mpp_transposed_inputs_nt")]] [[kernel]] decltype(mpp_transposed_inputs<false>)
    mpp_transposed_inputs<false>;

// The planted bug: an operand tensor with an innermost stride of 2 (every
// other feature), which Apple's tensors do not take.
[[kernel]] void mpp_strided_bug(device half* a [[buffer(0)]], device float* out [[buffer(1)]]) {
  tensor<device half, dextents<int, 2>, tensor_inline> ta(a, dextents<int, 2>(16, 16), array<int, 2>{2, 32});
  auto to = tensor(out, dextents<int, 2>(16, 16));
  constexpr auto desc = matmul2d_descriptor(16, 16, 16);
  matmul2d<desc, execution_simdgroup> op;
  op.run(ta, ta, to);
}

// map_iterator (MSL specification 4, section 7.2.1): s (16 x 32) loaded into a
// destination of op `a`, its row max into a row reduction of `a`; then out =
// s - rowmax(s) through a.map_iterator over s's iterator (SAME: always
// iterator-compatible), and out2 = t - rowmax(s) for a 16 x 16 tile t of
// another op, `b` (compatible only where b's layout gives a lane the rows a's
// does). CHECKED: out2 asks is_iterator_compatible first, and flag[0] says
// what it answered (where false, out2 stays NaN: the fallback is the
// kernel's business); unchecked, the planted bug, maps whatever the answer.
template <bool CHECKED>
[[kernel]] void mpp_map_iterator(device float* s [[buffer(0)]], device float* t [[buffer(1)]],
                                 device float* out [[buffer(2)]], device float* out2 [[buffer(3)]],
                                 device int* flag [[buffer(4)]], uint lane [[thread_index_in_simdgroup]]) {
  auto ts = tensor(s, dextents<int, 2>(32, 16));
  auto tt = tensor(t, dextents<int, 2>(16, 16));
  auto to = tensor(out, dextents<int, 2>(32, 16));
  auto to2 = tensor(out2, dextents<int, 2>(16, 16));
  constexpr auto da = matmul2d_descriptor(16, 32, 16);
  constexpr auto db = matmul2d_descriptor(16, 16, 16);
  matmul2d<da, execution_simdgroup> a;
  matmul2d<db, execution_simdgroup> b;
  auto cs = a.template get_destination_cooperative_tensor<decltype(ts), decltype(ts), float>();
  auto ct = b.template get_destination_cooperative_tensor<decltype(tt), decltype(tt), float>();
  auto mx = a.template get_row_reduction_destination_cooperative_tensor<decltype(ts), decltype(ts), float>();
  cs.load(ts);
  ct.load(tt);
  reduce_rows(cs, mx, reduction_operation::max, -INFINITY);
  if (is_iterator_compatible(cs, mx)) {
    for (auto it = cs.begin(); it != cs.end(); it++) *it -= *mx.map_iterator(it);
  }
  cs.store(to);
  const bool ok = is_iterator_compatible(ct, mx);
  if (lane == 0) flag[0] = ok ? 1 : 0;
  if (CHECKED && !ok) return;
  for (auto it = ct.begin(); it != ct.end(); it++) *it -= *mx.map_iterator(it);
  ct.store(to2);
}
template [[host_name("mpp_map_iterator")]] [[kernel]] decltype(mpp_map_iterator<true>) mpp_map_iterator<true>;
template [[host_name("mpp_map_iterator_unchecked_bug")]] [[kernel]] decltype(mpp_map_iterator<false>)
    mpp_map_iterator<false>;
