// What Apple's MPP headers accept, as compile-time rules for the shim
// (mpp.h, mpp_coop.h): the execution scopes, the matmul2d descriptor and the
// operand types of run(), cooperative-tensor creation, load / store and
// reductions. Each rule cites where Apple (or a public kernel that compiles
// against Apple's headers) says so. Sources, read for this file:
//   [H]  MacOSX26.0.sdk MetalPerformancePrimitives.framework,
//        MPPTensorOpsMatMul2d.h and __impl/MPPTensorOpsMatMul2dImpl.h,
//        __impl/MPPTensorOpsTraits.h, __impl/MPPTensorOpsTypes.h (public
//        mirror: github.com/alexey-lysiuk/macos-sdk);
//   [H26.4] the macOS 26.4 MPPTensorOpsMatMul2dImpl.h static_assert quoted
//        in ggml-org/llama.cpp PR #21048;
//   [MLX] ml-explore/mlx steel/attn/nax.h (transposed input cooperative
//        tensors, later SDKs' get_left/right_input_cooperative_tensor).
// The code is the emulator's own.
#pragma once
#include "base.h"
#include "tensor.h"

namespace metal {
// The execution scopes of a tensor op. [H] MPPTensorOpsTraits.h accepts a
// scope when is_execution_thread_v or is_execution_simdgroups_v holds, and
// __reduce_rows / map_index compare the scope with execution_simdgroup by
// is_same: execution_simdgroup is a scope only because it is
// execution_simdgroups<1>. So here too: one type, each SIMD-group running
// its own op (never "a threadgroup of one SIMD-group").
struct execution_thread {
  static constexpr int simdgroups = 0;
  static constexpr bool multi = false;
};
template <int N>
struct execution_simdgroups {
  static_assert(N >= 1, "execution_simdgroups<N>: N SIMD-groups, N >= 1");
  static constexpr int simdgroups = N;
  static constexpr bool multi = N > 1;  // N > 1: the threadgroup's N SIMD-groups run one op together
};
using execution_simdgroup = execution_simdgroups<1>;
template <class T> inline constexpr bool is_execution_thread_v = false;
template <> inline constexpr bool is_execution_thread_v<execution_thread> = true;
template <class T> inline constexpr bool is_execution_simdgroups_v = false;
template <int N> inline constexpr bool is_execution_simdgroups_v<execution_simdgroups<N>> = true;
}  // namespace metal

namespace mpp {
namespace tensor_ops {
// [H] MPPTensorOpsTypes.h: a dynamic length is numeric_limits<T>::max() in
// the 26.0 SDK, and matmul2d_descriptor's k defaults to it; later headers
// spell the default static_cast<int>(metal::dynamic_extent), i.e. -1
// ([H26.4]'s message prints a default descriptor as {8, 8, -1, ...}). Both
// mean "read K from the operands".
template <class T>
constexpr T dynamic_length_v = T(~0ull >> (65 - 8 * sizeof(T)));  // numeric_limits<T>::max() of a signed T

namespace fm_rules {
using ::fmemu::is_same;
template <class T> using space = ::metal::fm_tensor_detail::space<T>;
template <class T> struct is_const { static constexpr bool value = false; };
template <class T> struct is_const<const T> { static constexpr bool value = true; };
template <class T> struct is_integral { static constexpr bool value = false; };
#define FMEMU_INTEGRAL(T) \
  template <> struct is_integral<T> { static constexpr bool value = true; };
FMEMU_INTEGRAL(short)
FMEMU_INTEGRAL(ushort)
FMEMU_INTEGRAL(int)
FMEMU_INTEGRAL(uint)
FMEMU_INTEGRAL(long)
FMEMU_INTEGRAL(ulong)
#undef FMEMU_INTEGRAL

constexpr bool dynamic_k(int k) { return k == -1 || k == dynamic_length_v<int>; }

template <class T> constexpr bool is_tensor = false;
template <class T, class X, class G> constexpr bool is_tensor<::metal::tensor<T, X, G>> = true;

// The element types Apple's run() pairs ([H] the dtype table atop
// MPPTensorOpsMatMul2d.h and the branches of __run; bfloat x bfloat -> float
// from the later SDKs MLX NAX and PyTorch's MPP attention compile against).
// The emulator's table: 8-bit integers with each other into int32, float or
// half; half x half into half or float; half, float and int8 mixed (float
// among them) into float; bfloat x bfloat into float.
template <class T> constexpr bool is_i8 = is_same<T, int8_t>::value || is_same<T, uint8_t>::value;
template <class L, class R, class D>
constexpr bool supported_types() {
  if constexpr (is_i8<L> && is_i8<R>)
    return is_same<D, int32_t>::value || is_same<D, float>::value || is_same<D, half>::value;
  else if constexpr (is_same<L, half>::value && is_same<R, half>::value)
    return is_same<D, half>::value || is_same<D, float>::value;
  else if constexpr (is_same<L, bfloat>::value && is_same<R, bfloat>::value)
    return is_same<D, float>::value;
  else if constexpr ((is_same<L, half>::value || is_same<L, float>::value || is_same<L, int8_t>::value) &&
                     (is_same<R, half>::value || is_same<R, float>::value || is_same<R, int8_t>::value))
    return is_same<D, float>::value;
  else
    return false;
}

// [H] __operand_layout / __reduction_operand_layout: "cooperative tensor
// data type can only be one of float/half/int32_t".
template <class E>
constexpr bool coop_element = is_same<E, float>::value || is_same<E, half>::value || is_same<E, int32_t>::value;

// Address spaces a tensor operand (or load / store) may be in: device or
// threadgroup ([H] __run's cooperative and simdgroup branches, and load /
// store, dispatch on dv / tg and static_assert "Unsupported address space"
// otherwise; thread tensors are for execution_thread alone, constant
// operands came with a later deployment target). Checkable only in the
// FMEMU_CHECK_MSL compile, where address spaces are clang's; runtime builds
// erase them (every type is in space 0 there).
template <class T>
constexpr bool operand_space() {
#ifdef FMEMU_CHECK_MSL
  return space<T>::value == 1 || space<T>::value == 3;
#else
  return true;
#endif
}

// A tensor operand of run(): [H] __run static_asserts rank 2 and
// "Index type must be int"; it then picks its dtype branch on
// remove_addrspace_t<element_type>, with no remove_cv, so a tensor over
// `device const T` matches no branch ("Unsupported type"): public kernels
// cast the const away (llama.cpp's kernel_mul_mm tensor path builds its B
// tensor over `(device T1 *)` of a const source; mtlattn's `(device T*)K`).
template <class T>
constexpr void check_tensor_operand() {
  static_assert(T::rank_v == 2, "matmul2d run(): operands must have rank 2 (Apple's __run)");
  static_assert(is_same<typename T::index_type, int>::value,
                "matmul2d run(): a tensor's index type must be int (Apple's __run: \"Index type must be int\")");
  static_assert(!is_const<typename space<typename T::element_type>::type>::value,
                "matmul2d run(): a tensor over a const element type (device const T) matches no data type of "
                "Apple's __run, which strips the address space but not const: cast the const away, as "
                "public MPP kernels do (MPPTensorOpsMatMul2dImpl.h)");
  static_assert(operand_space<typename T::element_type>(),
                "matmul2d run(): tensor operands must be in device or threadgroup memory (Apple's __run: "
                "\"Unsupported address space\")");
}
}  // namespace fm_rules
}  // namespace tensor_ops
}  // namespace mpp
