// Planted violations of Apple's MPP API (MSL 4; never shipped), compiled
// syntax-only by test_emu_mpp_rules.py: with no PLANT defined the kernel is
// clean (it uses the constructs the shipped tensor-op kernels use), with
// -DPLANT=n exactly one line breaks one rule of Apple's headers
// (include/fm/mpp_rules.h cites each). PLANT 9 and 10 need the address
// spaces of the FMEMU_CHECK_MSL compile.
#include <metal_stdlib>
#include <metal_tensor>
#include <MetalPerformancePrimitives/MetalPerformancePrimitives.h>
using namespace metal;
using namespace mpp::tensor_ops;

#ifndef PLANT
#define PLANT 0
#endif

// execution_simdgroup is execution_simdgroups<1> (MPPTensorOpsTraits.h).
static_assert(fmemu::is_same<execution_simdgroups<1>, execution_simdgroup>::value, "one scope type");

[[kernel]] void mpp_rules(device const half* a [[buffer(0)]], device const half* b [[buffer(1)]],
                          device float* out [[buffer(2)]], threadgroup half* tile [[threadgroup(0)]]) {
  using DevT = tensor<device half, dextents<int, 2>, tensor_inline>;
  using TgT = tensor<threadgroup half, dextents<int, 2>, tensor_inline>;
  DevT ta(const_cast<device half*>(a), dextents<int, 2>(16, 16), array<int, 2>{1, 16});
  DevT tb(const_cast<device half*>(b), dextents<int, 2>(16, 64), array<int, 2>{1, 16});
  TgT tt(tile, dextents<int, 2>(16, 16), array<int, 2>{1, 16});
  auto to = tensor(out, dextents<int, 2>(32, 16));
  constexpr auto desc = matmul2d_descriptor(16, 32, 16, false, true, false, matmul2d_descriptor::mode::multiply);
  matmul2d<desc, execution_simdgroups<1>> op;
#if PLANT == 14  // the mode where Apple's sixth field, relaxed_precision, goes (MPPTensorOpsMatMul2d.h's order)
  constexpr auto swapped = matmul2d_descriptor(16, 32, 16, false, true, matmul2d_descriptor::mode::multiply);
#endif
  auto s = op.get_destination_cooperative_tensor<DevT, DevT, float>();
  auto rows = op.get_row_reduction_destination_cooperative_tensor<DevT, DevT, float>();
  auto b_blk = tb.slice(0, 16);
#if PLANT == 1  // a prvalue slice passed to run()
  op.run(ta, tb.slice(0, 16), s);
#elif PLANT == 2  // a tensor over a const element type
  auto tc = tensor(a, dextents<int, 2>(16, 16));
  op.run(tc, b_blk, s);
#elif PLANT == 3  // neither M nor N a multiple of 16
  constexpr auto small = matmul2d_descriptor(8, 8, 16);
  matmul2d<small, execution_simdgroup> op8;
  auto s8 = op8.get_destination_cooperative_tensor<DevT, DevT, float>();
  op8.run(ta, ta, s8);
#elif PLANT == 4  // uint indices
  tensor<device half, dextents<uint, 2>, tensor_inline> tu(const_cast<device half*>(a), dextents<uint, 2>(16u, 16u));
  op.run(tu, b_blk, s);
#elif PLANT == 5  // a destination cooperative tensor of another op
  constexpr auto other = matmul2d_descriptor(16, 32, 16, false, false);
  matmul2d<other, execution_simdgroup> op2;
  auto s2 = op2.get_destination_cooperative_tensor<DevT, DevT, float>();
  op.run(ta, b_blk, s2);
#else
  op.run(ta, b_blk, s);
#endif
#if PLANT == 6  // a reduction destination of another element type than its source
  auto hrows = op.get_row_reduction_destination_cooperative_tensor<DevT, DevT, half>();
  reduce_rows(s, hrows, reduction_operation::max, half(-65504.0f));
#elif PLANT == 7  // an identity of another type than the elements (int 0 for float)
  reduce_rows(s, rows, reduction_operation::sum, 0);
#elif PLANT == 8  // a row reduction of an execution_simdgroups<2> op
  constexpr auto two = matmul2d_descriptor(32, 32, 16);
  matmul2d<two, execution_simdgroups<2>> op_two;
  auto s_two = op_two.get_destination_cooperative_tensor<DevT, DevT, float>();
  auto r_two = op_two.get_row_reduction_destination_cooperative_tensor<DevT, DevT, float>();
  reduce_rows(s_two, r_two, reduction_operation::sum);
#else
  reduce_rows(s, rows, reduction_operation::max, float(-INFINITY));
#endif
#if PLANT == 9  // a tensor over thread memory as an operand (FMEMU_CHECK_MSL)
  half local[256];
  auto tl = tensor(local, dextents<int, 2>(16, 16));
  op.run(tl, b_blk, s);
#elif PLANT == 10  // a cooperative load from a tensor of another element type
  auto h = op.get_destination_cooperative_tensor<DevT, DevT, float>();
  h.load(ta);
#elif PLANT == 11  // a destination cooperative tensor of bfloat elements
  auto bf = op.get_destination_cooperative_tensor<DevT, DevT, bfloat>();
#else
  op.run(tt, b_blk, s);  // a threadgroup left operand
#endif
  for (int i = 0; i < s.get_capacity(); ++i) {
    if (!s.is_valid_element(i)) continue;
    const auto idx = s.get_multidimensional_index(i);
    float m = 0.0f;
    for (int j = 0; j < rows.get_capacity(); ++j)
      if (rows.is_valid_element(j) && rows.get_multidimensional_index(j)[0] == idx[1]) m = rows[j];
    to.at(idx[0], idx[1]) = s[i] - m;
  }
#if PLANT == 12  // map_iterator of a destination (not a reduction) cooperative tensor
  auto s_copy = op.get_destination_cooperative_tensor<DevT, DevT, float>();
  for (auto it = s.begin(); it != s.end(); it++) *it -= *s_copy.map_iterator(it);
#elif PLANT == 13  // map_iterator over the iterator of a reduction, not of a destination
  for (auto it = rows.begin(); it != rows.end(); it++) *it -= *rows.map_iterator(it);
#else
  if (is_iterator_compatible(s, rows)) {  // map_iterator as the MSL specification (7.2.1) writes it
    for (auto it = s.begin(); it != s.end(); it++) *it -= *rows.map_iterator(it);
  }
#endif
  s.store(to);
}
