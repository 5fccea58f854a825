// Cooperative tensors and their reductions, for mpp.h (included at its end):
// an op's destination, row / column reduction destinations and input
// operands, their accessors, load / store, reduce_rows / reduce_columns.
// Rules cite Apple's MPP headers ([H], mpp_rules.h); the layouts are
// mpp_layout.h's. The code is the emulator's own.
#pragma once

namespace mpp {
namespace tensor_ops {

template <class Elem, class Op, int Kind, class LeftT, class RightT>
struct cooperative_tensor {
  using value_type = Elem;
  using element_type = Elem;
  using op_type = Op;
  using left_type = LeftT;
  using right_type = RightT;
  using scope_check = typename Op::scope;
  static constexpr int kKind = Kind;
  static constexpr int M = Op::M, N = Op::N, S = Op::S;
  static constexpr bool kReduction = Kind == fm_detail::kRows || Kind == fm_detail::kCols;
  static_assert(!(Kind == fm_detail::kLeft || Kind == fm_detail::kRight) || Op::K > 0,
                "input cooperative tensors need a static k in the descriptor");
  // The matrix the slots cover: M x N (destinations and reductions), the
  // left (M x K) or right (K x N) operand as stored (transposed when the
  // descriptor says so: matmul2d::rows_of / cols_of).
  static constexpr int R = Op::rows_of(Kind);
  static constexpr int C = Op::cols_of(Kind);
  static constexpr int kDestCap = ::fmemu::mpp::dest_capacity_max(R, C, S);
  // A reduction destination holds at most the distinct rows (columns) of a
  // thread's destination slots, plus the scrambled layout's invalid slot.
  static constexpr int kCap = kReduction ? kDestCap + 1 : kDestCap;
  using index_array = metal::array<int, kReduction ? 1 : 2>;
  Elem v[kCap];
  int map[kCap];  // kDest: row * C + col; kRows: row; kCols: column; -1 invalid
  int cap = 0;

  // Every slot starts as NaN: Apple leaves a new cooperative tensor's values
  // undefined, so a kernel that accumulates into one without clearing it fails.
  cooperative_tensor() {
    for (int i = 0; i < kCap; ++i) v[i] = fm_detail::poison<Elem>();
    cap = build(Op::scope_thread(), map);
  }
  // The slots of scope thread t (map as above); returns the capacity.
  static int build(unsigned t, int* map) {
    const ::fmemu::mpp::DestLayout lay = Op::layout(Kind);
    int cap = 0;
    for (int i = 0; i < kCap; ++i) map[i] = -1;
    if (!kReduction) {
      cap = lay.capacity();
      for (int i = 0; i < cap; ++i) map[i] = lay.element(t, i);
      return cap;
    }
    // Reduction destinations: the distinct rows (columns) of this thread's
    // destination slots, so every thread holding part of a row gets its
    // reduction (replicated across those threads).
    for (int i = 0, dc = lay.capacity(); i < dc; ++i) {
      int e = lay.element(t, i);
      if (e < 0) continue;
      int x = Kind == fm_detail::kRows ? e / N : e % N;
      bool seen = false;
      for (int j = 0; j < cap; ++j) seen = seen || map[j] == x;
      if (!seen) map[cap++] = x;
    }
    if (lay.layout == FMEMU_MPP_LAYOUT_M5) {  // ascending
      for (int i = 1; i < cap; ++i)
        for (int j = i; j > 0 && map[j - 1] > map[j]; --j) {
          int s = map[j];
          map[j] = map[j - 1];
          map[j - 1] = s;
        }
      return cap;
    }
    // Scrambled: a seeded order plus one invalid slot at a seeded place.
    unsigned long long k = ::fmemu::mpp::mix(lay.key ^ (0x5bd1e995ull * (t + 1)) ^ (unsigned long long)Kind);
    map[cap++] = -1;
    for (int i = cap - 1; i > 0; --i) {
      k = ::fmemu::mpp::mix(k);
      int j = int(k % unsigned(i + 1)), s = map[i];
      map[i] = map[j];
      map[j] = s;
    }
    return cap;
  }

  // Whether map_iterator of this tensor (a row or column reduction
  // destination) can serve every element of a Src destination (MSL
  // specification 4, section 7.2.1, and Apple's MPPTensorOpsMatMul2d.h:
  // is_iterator_compatible(source, destination), a run-time answer of the
  // implementation, which a kernel must ask before map_iterator and fall
  // back to threadgroup memory where it is false). Here: true iff in every
  // thread of the scope each valid element of Src has its row (column) in
  // one of this tensor's slots of that thread. So a reduction of Src's own
  // op always is; one of another op is under "m5" when both ops give a lane
  // the same rows (every 16-row destination there), and seldom under
  // "scrambled". One answer per dispatch, uniform across the scope.
  template <class Src>
  static bool compatible_with() {
    if constexpr (!kReduction || !fm_detail::is_coop<Src>) {
      return false;
    } else if constexpr (Src::kKind != fm_detail::kDest || Src::S != S) {
      return false;
    } else {
      static unsigned long long seen_seed = 0;
      static int seen_layout = -1;
      static bool answer = false;
      if (seen_layout == fm_rt_mpp.layout && seen_seed == fm_rt_mpp.seed) return answer;
      const ::fmemu::mpp::DestLayout src = Src::op_type::layout(fm_detail::kDest);
      bool ok = true;
      for (unsigned t = 0; ok && t < 32u * unsigned(S); ++t) {
        int mine[kCap];
        const int c = build(t, mine);
        for (int i = 0, sc = src.capacity(); ok && i < sc; ++i) {
          const int e = src.element(t, i);
          if (e < 0) continue;
          const int x = Kind == fm_detail::kRows ? e / Src::C : e % Src::C;
          bool found = false;
          for (int j = 0; j < c; ++j) found = found || mine[j] == x;
          ok = found;
        }
      }
      seen_layout = fm_rt_mpp.layout;
      seen_seed = fm_rt_mpp.seed;
      answer = ok;
      return ok;
    }
  }

  int get_capacity() const { return cap; }
  // The coordinate queries (is_valid_element, get_multidimensional_index,
  // map_iterator) each count one in fm_rt_counts.mpp_coord_queries: the
  // kernel's bookkeeping of the layout (on Apple's GPUs a call of the driver's
  // functions each, unless its compiler folds them); the emulator's own
  // uses go through valid() and coords(), which do not count.
  bool valid(int i) const { return i >= 0 && i < cap && map[i] >= 0; }
  bool is_valid_element(int i) const {
    fm_rt_counts.mpp_coord_queries++;
    return valid(i);
  }
  // [0] the column (innermost extent), [1] the row; a reduction destination
  // has one index, its row (column). -1 for an invalid slot.
  index_array get_multidimensional_index(int i) const {
    fm_rt_counts.mpp_coord_queries++;
    return coords(i);
  }
  index_array coords(int i) const {
    index_array r;
    int e = valid(i) ? map[i] : -1;
    if (!kReduction) {
      r[0] = e < 0 ? -1 : e % C;
      r[1] = e < 0 ? -1 : e / C;
    } else {
      r[0] = e;
    }
    return r;
  }
  Elem& operator[](int i) { return v[i]; }
  const Elem& operator[](int i) const { return v[i]; }

  // Iteration visits the valid slots only (Apple does not say; a kernel that
  // needs the invalid ones cannot name them through the iterator anyway).
  struct iterator {
    using owner = cooperative_tensor;
    cooperative_tensor* ct;
    int i;
    void skip() {
      while (i < ct->cap && !ct->valid(i)) ++i;
    }
    Elem& operator*() const { return ct->v[i]; }
    iterator& operator++() {
      ++i;
      skip();
      return *this;
    }
    iterator operator++(int) {  // it++, as Apple's examples write it
      iterator was = *this;
      ++*this;
      return was;
    }
    bool operator==(const iterator& o) const { return i == o.i; }
    bool operator!=(const iterator& o) const { return i != o.i; }
    index_array get_multidimensional_index() const { return ct->get_multidimensional_index(i); }
  };
  iterator begin() {
    iterator it{this, 0};
    it.skip();
    return it;
  }
  iterator end() { return iterator{this, cap}; }

  // red.map_iterator(it): the slot of this reduction destination that holds
  // the row (column) of the element `it` points at, in a destination
  // cooperative tensor (MSL specification 4, section 7.2.1, the gemm_map
  // example: `auto cTred_it = cTred.map_iterator(it); *it += *cTred_it;`).
  // Only where is_iterator_compatible(source, this) is true: anywhere else
  // the result is not defined (the spec: "check if the iterators are
  // compatible"; the header: "fall back to storing sourceCT to threadgroup
  // memory"), and here it is a failure, whatever this thread holds.
  template <class It>
  iterator map_iterator(const It& src, FMEMU_MPP_SITE_PARAMS) {
    using Src = typename It::owner;
    static_assert(kReduction, "map_iterator is a member of a row or column reduction destination cooperative tensor "
                  "(MSL specification 4, section 7.2.1: the result of a reduction used with another tensor)");
    static_assert(Src::kKind == fm_detail::kDest, "map_iterator takes an iterator over a matmul2d destination "
                  "cooperative tensor (MSL specification 4, section 7.2.1)");
    fm_rt_counts.mpp_coord_queries++;
    if (!compatible_with<Src>())
      fm_rt_fail("map_iterator on cooperative tensors that are not iterator-compatible in this layout: ask "
                 "is_iterator_compatible(source, destination) first and fall back to threadgroup memory where it "
                 "is false (MSL specification 4, section 7.2.1; Apple's MPPTensorOpsMatMul2d.h)", file, line);
    const int e = src.ct->map[src.i];
    const int x = Kind == fm_detail::kRows ? e / Src::C : e % Src::C;
    for (int j = 0; j < cap; ++j)
      if (map[j] == x) return iterator{this, j};
    fm_rt_fail("map_iterator: an iterator at an invalid slot or past the end", file, line);
    return end();
  }

  // [H] load / store take `const thread tensor &` (a temporary binds) and
  // static_assert that the tensor's element type, address space removed and
  // cv kept, is the cooperative tensor's ("Source tensor datatype does not
  // match cooperative tensor"); device or threadgroup memory only.
  template <class T>
  static constexpr void check_memory() {
    static_assert(!kReduction, "load/store: destination or input cooperative tensors only (here)");
    static_assert(fm_rules::is_same<typename ::metal::remove_addrspace_t<T>, Elem>::value,
                  "cooperative tensor load / store: the tensor's element type must be the cooperative tensor's "
                  "exactly (Apple's MPPTensorOpsMatMul2dImpl.h: \"Source tensor datatype does not match "
                  "cooperative tensor\"; a const element type does not match either)");
    static_assert(fm_rules::operand_space<T>(), "cooperative tensor load / store: device or threadgroup memory "
                  "only (Apple's header: \"Unsupported address space\")");
  }
  // Copy this thread's valid elements from / to memory (not reductions).
  template <class T, class X, class G>
  void load(const metal::tensor<T, X, G>& t) {
    check_memory<T>();
    for (int i = 0; i < cap; ++i)
      if (map[i] >= 0) v[i] = Elem(t.at(map[i] % C, map[i] / C));
  }
  template <class T, class X, class G>
  void store(const metal::tensor<T, X, G>& t) const {
    check_memory<T>();
    for (int i = 0; i < cap; ++i)
      if (map[i] >= 0) t.at(map[i] % C, map[i] / C) = T(v[i]);
  }
};

namespace fm_detail {
inline float combine(reduction_operation op, float acc, float x) {
  if (op == reduction_operation::sum) return acc + x;
  if (op == reduction_operation::max) return x > acc ? x : acc;
  return x < acc ? x : acc;
}
// The SIMD-group's whole R x C tile of `ct`, from every lane's slots (SIMD
// exchanges of 16 floats per lane, so every lane must call: a collective).
template <class CT>
void gather(const CT& ct, float* tile, const char* what, const char* file, int line, int col) {
  using Op = typename CT::op_type;
  static_assert(Op::S == 1, "the emulator moves cooperative tensors between lanes of one SIMD-group only");
  constexpr int kChunk = FMEMU_SIMD_SLOT_BYTES / 4;
  if (fm_rt_simd_width() != 32) fm_rt_fail("MPP tensor ops need full 32-lane SIMD-groups", file, line);
  const ::fmemu::mpp::DestLayout lay = Op::layout(CT::kKind);
  for (int c = 0; c * kChunk < ct.kCap; ++c) {
    float mine[kChunk];
    for (int j = 0; j < kChunk; ++j) {
      int i = c * kChunk + j;
      mine[j] = i < ct.kCap ? to_float(ct.v[i]) : 0.0f;
    }
    const unsigned char* s = fm_rt_simd_exchange(mine, sizeof mine, what, file, line, col);
    for (unsigned l = 0; l < 32; ++l)
      for (int j = 0; j < kChunk && c * kChunk + j < ct.cap; ++j) {
        int e = lay.element(l, c * kChunk + j);
        if (e >= 0) tile[e] = reinterpret_cast<const float*>(s + l * FMEMU_SIMD_SLOT_BYTES)[j];
      }
  }
}

// What Apple's reduce_rows / reduce_columns accept ([H]: one ElementType
// deduced from the source, the destination and the identity, all three by
// non-const lvalue reference or value; __reduce_rows static_asserts the
// source a destination cooperative tensor, the destination the reduction of
// that dimension, both of execution_simdgroup ("reduce_rows requires a
// single SIMD group"), equal descriptors and operand types, and an element
// type of half, int32_t or float).
template <int Kind, class Src, class Dst, class I>
constexpr void check_reduce() {
  static_assert(!fm_rules::is_const<Src>::value && !fm_rules::is_const<Dst>::value,
                "reduce_rows / reduce_columns take the source and destination by non-const reference (Apple)");
  if constexpr (!is_coop<Src> || !is_coop<Dst>) {
    static_assert(is_coop<Src> && is_coop<Dst>, "reduce_rows / reduce_columns take cooperative tensors");
  } else {
    static_assert(Src::kKind == kDest, "reduce: the source must be a matmul2d destination cooperative tensor "
                  "(Apple's __reduce_rows)");
    static_assert(Dst::kKind == Kind, "reduce_rows needs a row reduction destination "
                  "(get_row_reduction_destination_cooperative_tensor), reduce_columns a column one (Apple)");
    static_assert(fm_rules::is_same<typename Src::scope_check, ::metal::execution_simdgroup>::value,
                  "reduce_rows / reduce_columns require a single SIMD group (Apple's __reduce_rows)");
    static_assert(fm_rules::is_same<typename Src::op_type, typename Dst::op_type>::value,
                  "reduce: source and destination must come from one op (Apple: \"Source and destination matmul2d "
                  "descriptor must match\")");
    static_assert(fm_rules::is_same<typename Src::left_type, typename Dst::left_type>::value &&
                      fm_rules::is_same<typename Src::right_type, typename Dst::right_type>::value,
                  "reduce: \"Source and destination operand types must match\" (Apple's __reduce_rows)");
    static_assert(fm_rules::is_same<typename Src::value_type, typename Dst::value_type>::value,
                  "reduce: the destination's element type must be the source's (Apple deduces one ElementType for "
                  "both: \"Source and destination element types must match\")");
    static_assert(fm_rules::is_same<typename Src::value_type, I>::value,
                  "reduce: the identity's type must be the tensors' element type (Apple deduces ElementType from "
                  "it too): write float(x) for a float reduction");
    static_assert(fm_rules::is_same<typename Src::value_type, half>::value ||
                      fm_rules::is_same<typename Src::value_type, int32_t>::value ||
                      fm_rules::is_same<typename Src::value_type, float>::value,
                  "reduce: half, int32_t or float elements only (Apple's __reduce_rows: \"Unsupported type\")");
  }
}

// Folds each of dst's rows (columns) of the gathered tile from `identity`
// in column (row) order. Apple's reduction order is not documented.
template <int Kind, class Src, class Dst>
inline void reduce(const Src& src, Dst& dst, reduction_operation op, float identity, const char* what,
                   const char* file, int line, int col) {
  using Op = typename Src::op_type;
  constexpr int M = Op::M, N = Op::N;
  float tile[M * N];
  gather(src, tile, what, file, line, col);
  for (int i = 0; i < dst.cap; ++i) {
    int x = dst.map[i];
    if (x < 0) continue;
    float acc = identity;
    if (Kind == kRows)
      for (int n = 0; n < N; ++n) acc = combine(op, acc, tile[x * N + n]);
    else
      for (int m = 0; m < M; ++m) acc = combine(op, acc, tile[m * N + x]);
    dst.v[i] = typename Dst::value_type(acc);
  }
}
template <class T> struct elem_of { using type = float; };
template <class E, class Op, int Kind, class L, class R>
struct elem_of<cooperative_tensor<E, Op, Kind, L, R>> { using type = E; };
}  // namespace fm_detail

// is_iterator_compatible(source, destination) (MSL specification 4, section
// 7.2.1; MPPTensorOpsMatMul2d.h): whether destination.map_iterator(it) is
// valid for the iterators of source. Any two cooperative tensors may be
// asked; the emulator's answer: cooperative_tensor::compatible_with. One
// coordinate query of the layout (mpp_coord_queries).
template <class A, class B>
inline bool is_iterator_compatible(const A& source, const B& destination) {
  static_assert(fm_detail::is_coop<A> && fm_detail::is_coop<B>,
                "is_iterator_compatible takes two cooperative tensors (Apple's MPPTensorOpsMatMul2d.h)");
  (void)source;
  (void)destination;
  fm_rt_counts.mpp_coord_queries++;
  return B::template compatible_with<A>();
}

template <class Src, class Dst, class I = typename fm_detail::elem_of<Src>::type>
inline void reduce_rows(Src& src, Dst& dst, reduction_operation op = reduction_operation::sum, I identity = I(0),
                        FMEMU_MPP_SITE_PARAMS) {
  fm_detail::check_reduce<fm_detail::kRows, Src, Dst, I>();
  fm_detail::reduce<fm_detail::kRows>(src, dst, op, float(identity), "reduce_rows", file, line, col);
}
template <class Src, class Dst, class I = typename fm_detail::elem_of<Src>::type>
inline void reduce_columns(Src& src, Dst& dst, reduction_operation op = reduction_operation::sum, I identity = I(0),
                           FMEMU_MPP_SITE_PARAMS) {
  fm_detail::check_reduce<fm_detail::kCols, Src, Dst, I>();
  fm_detail::reduce<fm_detail::kCols>(src, dst, op, float(identity), "reduce_columns", file, line, col);
}
}  // namespace tensor_ops
}  // namespace mpp
