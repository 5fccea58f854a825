// <metal_tensor> (MSL 4): extents, inline tensors over device and threadgroup
// pointers, slices. The subset that MPP tensor-op kernels use (see
// ../../README.md, "MPP tensor ops"). Names and argument orders follow Apple's
// headers as public kernels spell them (notes/metal4-tensor-ops.md, "Tensor
// types"); the code is the emulator's own. Needs C++20 (compile_library(msl=4)).
#pragma once
#include "base.h"

namespace metal {
// Apple spells it size_t(-1); kernels write static_cast<int>(dynamic_extent).
constexpr size_t dynamic_extent = size_t(-1);

// MSL's array<T, N>: what the stride argument of a tensor constructor takes.
template <class T, size_t N>
struct array {
  T v[N];
  constexpr T& operator[](size_t i) { return v[i]; }
  constexpr const T& operator[](size_t i) const { return v[i]; }
  static constexpr size_t size() { return N; }
};

// extents<I, E0, E1, ...>: E0 is the innermost (fastest-varying) extent.
template <class I, size_t... E>
struct extents {
  using index_type = I;
  static constexpr int rank_v = int(sizeof...(E));
  static constexpr size_t static_v[rank_v] = {E...};
  I e[rank_v];
  constexpr extents() : e{I(E == dynamic_extent ? 0 : E)...} {}
  // One value per extent (dextents<int, 2>(K, M) or {K, M}); a static extent
  // must be given its own value.
  template <class... A, class = decltype(sizeof(char[sizeof...(A) == sizeof...(E) && sizeof...(A) > 0 ? 1 : -1]))>
  constexpr extents(A... a) : e{I(a)...} {}
  static constexpr int rank() { return rank_v; }
  static constexpr size_t static_extent(int r) { return static_v[r]; }
  constexpr I extent(int r) const { return e[r]; }
};

namespace fm_tensor_detail {
template <class I, int R, size_t... E>
struct dext {
  using type = typename dext<I, R - 1, dynamic_extent, E...>::type;
};
template <class I, size_t... E>
struct dext<I, 0, E...> {
  using type = extents<I, E...>;
};
template <class T> struct strip { using type = T; };
template <class T> struct strip<const T> { using type = T; };
// The address space of a type and the type without it: 0 is `thread`
// (clang's default), 1 device, 2 constant, 3 threadgroup (base.h's numbers
// under FMEMU_CHECK_MSL). Runtime builds erase address spaces, so there
// every type is 0. A const-qualified type is matched through `const T`
// first: clang does not match `address_space(N) T` against it.
template <class T> struct space {
  static constexpr int value = 0;
  using type = T;
};
template <class T> struct space<const T> {
  static constexpr int value = space<T>::value;
  using type = const typename space<T>::type;
};
template <class T, int N> struct space<__attribute__((address_space(N))) T> {
  static constexpr int value = N;
  using type = T;
};
}  // namespace fm_tensor_detail

template <class I, int R>
using dextents = typename fm_tensor_detail::dext<I, R>::type;

// metal::remove_addrspace_t: the type without its address space, cv kept
// (Apple's MPP headers strip the address space alone before comparing
// element types: MPPTensorOpsMatMul2dImpl.h, __run and load / store).
template <class T> struct remove_addrspace { using type = typename fm_tensor_detail::space<T>::type; };
template <class T> using remove_addrspace_t = typename remove_addrspace<T>::type;

// Tags: an MTLTensor bound by the host, a tensor built in the shader from a
// pointer, and the result of slicing.
struct tensor_handle {};
struct tensor_inline {};
struct tensor_offset {};

// A rank-R view: element (x0, x1, ...) lives at data[sum x_r * stride_r].
// value_type is the element type without address space and cv (what Apple's
// MPP layouts read the operand data type from); element_type keeps both.
template <class T, class Ext, class Tag = tensor_inline>
struct tensor {
  using element_type = T;
  using value_type = typename fm_tensor_detail::strip<typename fm_tensor_detail::space<T>::type>::type;
  using data_handle_type = T*;
  using extents_type = Ext;
  using index_type = typename Ext::index_type;
  using tag_type = Tag;
  static constexpr int rank_v = Ext::rank_v;
  T* data = nullptr;
  Ext ext;
  index_type stride[rank_v];

  tensor() = default;
  // Packed strides: the innermost extent is contiguous.
  tensor(T* p, Ext e) : data(p), ext(e) {
    index_type s = 1;
    for (int r = 0; r < rank_v; ++r) {
      stride[r] = s;
      s *= e.extent(r);
    }
  }
  // Strides as given, the innermost one 1: Apple documents that rule for a
  // tensor's strides ("The stride value of the array's first element needs
  // to be exactly 1, because it is the innermost dimension":
  // developer.apple.com/documentation/metal/mtltensordescriptor/strides),
  // and every public MPP kernel builds its inline tensors with {1, ld}
  // (mtlattn src/attn_mpp.metal, llama.cpp's kernel_mul_mm tensor path). The
  // emulator refuses any other at run time rather than guess what matmul2d
  // makes of it (the host routes such views away: csrc/metal/families/tensor_ops.cpp).
  tensor(T* p, Ext e, array<index_type, size_t(rank_v)> s, const char* file = __builtin_FILE(),
         int line = __builtin_LINE())
      : data(p), ext(e) {
    for (int r = 0; r < rank_v; ++r) stride[r] = s[r];
    if (stride[0] != 1)
      fm_rt_fail("a tensor's innermost stride must be 1 (Apple, MTLTensorDescriptor.strides); this one's is not",
                 file, line);
  }
  static constexpr int get_rank() { return rank_v; }
  index_type get_extent(int r) const { return ext.extent(r); }
  index_type get_stride(int r) const { return stride[r]; }
  Ext extents() const { return ext; }
  T* get_data_pointer() const { return data; }
  // Element (x, y) of a rank-2 tensor: x the column (innermost), y the row.
  T& at(index_type x, index_type y) const { return data[x * stride[0] + y * stride[1]]; }

  // slice(x, y): the tensor from column x, row y on (extents shrink, strides stay).
  tensor<T, dextents<index_type, rank_v>, tensor_offset> slice(index_type x, index_type y) const {
    static_assert(rank_v == 2, "the emulator slices rank-2 tensors only");
    tensor<T, dextents<index_type, rank_v>, tensor_offset> t;
    t.data = data + x * stride[0] + y * stride[1];
    t.ext = dextents<index_type, rank_v>(ext.extent(0) - x, ext.extent(1) - y);
    t.stride[0] = stride[0];
    t.stride[1] = stride[1];
    return t;
  }
  // slice<W, H>(x, y): a W-column, H-row tile at (x, y), its size fixed at
  // compile time; a dynamic_extent W or H runs to the end of that extent, as
  // the K loop of Apple's header example does with
  // A.static_slice<dynamic_extent, 64>(k, ...) (MPPTensorOpsMatMul2d.h).
  // A static extent past the tensor's own is refused: the tile would claim
  // elements the tensor does not have, and the op would not edge-check them
  // (Apple's header uses static slices for inside tiles only).
  template <size_t W, size_t H>
  tensor<T, metal::extents<index_type, W, H>, tensor_offset> slice(index_type x, index_type y,
                                                                   const char* file = __builtin_FILE(),
                                                                   int line = __builtin_LINE()) const {
    static_assert(rank_v == 2, "the emulator slices rank-2 tensors only");
    if ((W != dynamic_extent && (long long)x + (long long)W > (long long)ext.extent(0)) ||
        (H != dynamic_extent && (long long)y + (long long)H > (long long)ext.extent(1)))
      fm_rt_fail("a static slice past its tensor's extents (static extents are for inside tiles: Apple's "
                 "MPPTensorOpsMatMul2d.h, static_slice)", file, line);
    tensor<T, metal::extents<index_type, W, H>, tensor_offset> t;
    t.data = data + x * stride[0] + y * stride[1];
    if (W == dynamic_extent) t.ext.e[0] = ext.extent(0) - x;
    if (H == dynamic_extent) t.ext.e[1] = ext.extent(1) - y;
    t.stride[0] = stride[0];
    t.stride[1] = stride[1];
    return t;
  }
  template <size_t W, size_t H>
  tensor<T, metal::extents<index_type, W, H>, tensor_offset> static_slice(index_type x, index_type y,
                                                                          const char* file = __builtin_FILE(),
                                                                          int line = __builtin_LINE()) const {
    return slice<W, H>(x, y, file, line);
  }
};

// Deduction: tensor(ptr, extents) and tensor(ptr, extents, strides) build
// inline tensors (llama.cpp's kernel_mul_mm tensor path writes
// `auto tA = tensor(sa, dextents<int32_t, 2>(NK, NR0))`: Apple's header deduces too).
template <class T, class Ext>
tensor(T*, Ext) -> tensor<T, Ext, tensor_inline>;
template <class T, class Ext, class S, size_t R>
tensor(T*, Ext, array<S, R>) -> tensor<T, Ext, tensor_inline>;

// Free-function spellings of slicing (Apple's headers offer both).
template <class T, class E, class G, class I>
auto slice(const tensor<T, E, G>& t, I x, I y) { return t.slice(x, y); }
template <size_t W, size_t H, class T, class E, class G, class I>
auto slice(const tensor<T, E, G>& t, I x, I y) { return t.template slice<W, H>(x, y); }
}  // namespace metal
