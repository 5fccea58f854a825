// <MetalPerformancePrimitives/MetalPerformancePrimitives.h> (MSL 4): the
// subset of mpp::tensor_ops that kernels use: matmul2d_descriptor, matmul2d
// on one or N SIMD-groups, run() into a tensor or a destination cooperative
// tensor, cooperative-tensor accessors, reduce_rows / reduce_columns.
// Semantics and their sources: ../../README.md, "MPP tensor ops", and
// /work/shared/notes/metal4-tensor-ops.md. The code is the emulator's own;
// Apple's real implementation is opaque (driver-supplied extern functions).
#pragma once
#include "base.h"
#include "tensor.h"
#include "mpp_layout.h"

#define FMEMU_MPP_SITE_PARAMS const char *file = __builtin_FILE(), int line = __builtin_LINE(), int col = __builtin_COLUMN()

namespace metal {
// The execution scopes of a tensor op.
struct execution_thread {
  static constexpr int simdgroups = 0;
  static constexpr bool multi = false;
};
struct execution_simdgroup {
  static constexpr int simdgroups = 1;
  static constexpr bool multi = false;  // each SIMD-group runs its own op
};
template <int N>
struct execution_simdgroups {
  static constexpr int simdgroups = N;
  static constexpr bool multi = true;  // the threadgroup's N SIMD-groups run one op together
};
// The macOS 26.0 SDK's spelling of a dynamic length.
template <class T>
constexpr T dynamic_length_v = T(-1);
}  // namespace metal

namespace mpp {
namespace tensor_ops {
enum class reduction_operation { sum, max, min };

template <class T>
struct reduction_operation_identity {
  static constexpr T sum_identity = T(0);
  static constexpr T max_identity = T(-__builtin_inff());
  static constexpr T min_identity = T(__builtin_inff());
};

struct matmul2d_descriptor {
  enum class mode { multiply, multiply_accumulate };
  int m, n, k;
  bool transpose_left, transpose_right, relaxed_precision;
  mode matmul_mode;
  constexpr matmul2d_descriptor(int m_, int n_, int k_ = -1, bool tl = false, bool tr = false, bool relaxed = false,
                                mode md = mode::multiply)
      : m(m_), n(n_), k(k_), transpose_left(tl), transpose_right(tr), relaxed_precision(relaxed), matmul_mode(md) {}
};

namespace fm_detail {
template <class T> inline T poison() { return T(__builtin_nanf("")); }
template <> inline int poison<int>() { return int(0x7fc00000); }
// A kind-0 cooperative tensor is an op's M x N destination; kind 1 its row
// reduction destination (M values), kind 2 its column reduction (N values).
// Kinds 3 and 4: the op's left (M x K) and right (K x N) input operands.
constexpr int kDest = 0, kRows = 1, kCols = 2, kLeft = 3, kRight = 4;
// relaxed_precision with float operands: the emulator rounds them to TF32
// (10 mantissa bits, to nearest even), the largest loss reported for an Apple
// matmul (MLX #3897, omlx #2135); Apple documents no bound. Half and bfloat
// operands are exact already.
inline float relax(float x) {
  unsigned b = __builtin_bit_cast(unsigned, x);
  if ((b & 0x7f800000u) == 0x7f800000u) return x;
  b += 0xfffu + ((b >> 13) & 1u);
  return __builtin_bit_cast(float, b & ~0x1fffu);
}
template <class T> inline float to_float(T v) { return float(v); }
}  // namespace fm_detail

template <class Elem, class Op, int Kind>
struct cooperative_tensor;

namespace fm_detail {
// A tensor operand of run(), read in place: x the column, y the row.
template <class T>
struct tensor_view {
  const T& t;
  int ext(int r) const { return int(t.get_extent(r)); }
  float get(int x, int y) const { return to_float(t.at(x, y)); }
};
// A cooperative-tensor operand of run(), gathered from the SIMD-group's lanes.
template <int R, int C>
struct tile_view {
  float v[R * C];
  int ext(int r) const { return r == 0 ? C : R; }
  float get(int x, int y) const { return v[y * C + x]; }
};
template <class E, class Op, int Kind>
void gather(const cooperative_tensor<E, Op, Kind>& ct, float* tile, const char* what, const char* file, int line,
            int col);
}  // namespace fm_detail

template <matmul2d_descriptor D, class Scope>
struct matmul2d {
  static_assert(Scope::simdgroups >= 1, "the emulator models SIMD-group scopes only (not execution_thread)");
  static_assert(D.m > 0 && D.n > 0, "the emulator needs static m and n in matmul2d_descriptor");
  static constexpr matmul2d_descriptor desc = D;
  static constexpr int M = D.m, N = D.n, K = D.k, S = Scope::simdgroups;
  static constexpr bool multi = Scope::multi;

  // The layout of this op's destination in the current dispatch.
  static ::fmemu::mpp::DestLayout dest_layout() {
    unsigned long long k = ::fmemu::mpp::mix(fm_rt_mpp.seed);
    const long long fields[] = {D.m, D.n, D.k, D.transpose_left, D.transpose_right, S, multi};
    for (long long f : fields) k = ::fmemu::mpp::mix(k ^ (unsigned long long)f);
    return ::fmemu::mpp::DestLayout{M, N, S, k, fm_rt_mpp.layout};
  }
  // The layout of a cooperative tensor of this op: reduction destinations
  // derive from the destination's; input operands (M x K, K x N) have their
  // own (scrambled: keyed apart from the destination's, so a slot-by-slot
  // copy between a destination and an input is wrong).
  static ::fmemu::mpp::DestLayout layout(int kind) {
    ::fmemu::mpp::DestLayout d = dest_layout();
    if (kind == fm_detail::kLeft || kind == fm_detail::kRight) {
      d.m = kind == fm_detail::kLeft ? M : K;
      d.n = kind == fm_detail::kLeft ? K : N;
      d.key = ::fmemu::mpp::mix(d.key ^ (unsigned long long)kind);
    }
    return d;
  }
  // This thread's index within the op's scope.
  static unsigned scope_thread() { return (multi ? fm_rt_simd_group_index() * 32u : 0u) + fm_rt_simd_lane(); }

  template <class L, class R, class E>
  cooperative_tensor<E, matmul2d, fm_detail::kDest> get_destination_cooperative_tensor() const { return {}; }
  // Input operands as cooperative tensors (later SDKs; one SIMD-group here,
  // static K): empty, or converted from another op's destination of the same
  // shape (a collective: the values move between lanes by the two layouts).
  template <class LE, class RE, class DE>
  cooperative_tensor<LE, matmul2d, fm_detail::kLeft> get_left_input_cooperative_tensor() const { return {}; }
  template <class LE, class RE, class DE>
  cooperative_tensor<RE, matmul2d, fm_detail::kRight> get_right_input_cooperative_tensor() const { return {}; }
  template <class LE, class RE, class DE, class E2, class Op2>
  cooperative_tensor<LE, matmul2d, fm_detail::kLeft> get_left_input_cooperative_tensor(
      const cooperative_tensor<E2, Op2, fm_detail::kDest>& src, FMEMU_MPP_SITE_PARAMS) const {
    static_assert(Op2::M == M && Op2::N == K, "get_left_input_cooperative_tensor: the source must be M x K");
    return convert<LE, fm_detail::kLeft>(src, "get_left_input_cooperative_tensor", file, line, col);
  }
  template <class LE, class RE, class DE, class E2, class Op2>
  cooperative_tensor<RE, matmul2d, fm_detail::kRight> get_right_input_cooperative_tensor(
      const cooperative_tensor<E2, Op2, fm_detail::kDest>& src, FMEMU_MPP_SITE_PARAMS) const {
    static_assert(Op2::M == K && Op2::N == N, "get_right_input_cooperative_tensor: the source must be K x N");
    return convert<RE, fm_detail::kRight>(src, "get_right_input_cooperative_tensor", file, line, col);
  }
  template <class E, int Kind, class Src>
  static cooperative_tensor<E, matmul2d, Kind> convert(const Src& src, const char* what, const char* file, int line,
                                                        int col) {
    cooperative_tensor<E, matmul2d, Kind> ct;
    float tile[Src::R * Src::C];
    fm_detail::gather(src, tile, what, file, line, col);
    for (int i = 0; i < ct.cap; ++i)
      if (ct.map[i] >= 0) ct.v[i] = E(tile[ct.map[i]]);
    return ct;
  }
  template <class L, class R, class E>
  cooperative_tensor<E, matmul2d, fm_detail::kRows> get_row_reduction_destination_cooperative_tensor() const { return {}; }
  template <class L, class R, class E>
  cooperative_tensor<E, matmul2d, fm_detail::kCols> get_column_reduction_destination_cooperative_tensor() const {
    return {};
  }

  // Every thread of the scope must call run() at the same call site: one
  // SIMD-group's lanes rendezvous like a SIMD collective, N SIMD-groups like
  // a threadgroup barrier that orders no memory (FMEMU_RENDEZVOUS_ONLY), so
  // operands written by other threads still need the kernel's own barrier.
  static void enter(const char* what, const char* file, int line, int col) {
    if (fm_rt_simd_width() != 32) fm_rt_fail("MPP tensor ops need full 32-lane SIMD-groups", file, line);
    if (multi) {
      if (fm_rt_simd_groups() != unsigned(S))
        fm_rt_fail("execution_simdgroups<N> run by a threadgroup with a different number of SIMD-groups "
                   "(undefined behaviour per Apple's header)", file, line);
      fm_rt_barrier(0, FMEMU_RENDEZVOUS_ONLY, file, line, col);
    } else {
      int zero = 0;
      fm_rt_simd_exchange(&zero, sizeof zero, what, file, line, col);
    }
  }

  // One count per scope per call (Library.dispatch's mpp_runs / mpp_flops),
  // by the scope's thread 0 after the rendezvous every thread reaches.
  static void count(int kk) {
    if (scope_thread() != 0) return;
    fm_rt_counts.mpp_runs++;
    fm_rt_counts.mpp_flops += 2ull * unsigned(M) * unsigned(N) * unsigned(kk);
  }

  // Operands: tensors are read in place, cooperative tensors (this op's
  // inputs) gathered from the SIMD-group first (a collective).
  template <class T, class X, class G>
  static fm_detail::tensor_view<metal::tensor<T, X, G>> view(const metal::tensor<T, X, G>& t, int, const char*, int,
                                                             int) {
    return {t};
  }
  template <class E, int Kind>
  static fm_detail::tile_view<cooperative_tensor<E, matmul2d, Kind>::R, cooperative_tensor<E, matmul2d, Kind>::C> view(
      const cooperative_tensor<E, matmul2d, Kind>& ct, int want, const char* file, int line, int col) {
    static_assert(Kind == fm_detail::kLeft || Kind == fm_detail::kRight,
                  "run(): a cooperative-tensor operand must be this op's left or right input");
    static_assert(S == 1, "the emulator takes cooperative-tensor operands on one SIMD-group only");
    if (Kind != want) fm_rt_fail("run(): a left-input cooperative tensor passed as the right operand or back", file, line);
    if (Kind == fm_detail::kLeft ? D.transpose_left : D.transpose_right)
      fm_rt_fail("run(): a transposed cooperative-tensor operand (not emulated)", file, line);
    fm_detail::tile_view<cooperative_tensor<E, matmul2d, Kind>::R, cooperative_tensor<E, matmul2d, Kind>::C> v;
    fm_detail::gather(ct, v.v, "matmul2d run (cooperative operand)", file, line, col);
    return v;
  }

  // Operand elements outside a tensor's extents read as zero and are not
  // touched (mtlattn runs tail key blocks with shorter extents than the
  // descriptor's; inferred, not documented).
  template <class L>
  static float left(const L& a, int m, int k) {
    int x = D.transpose_left ? m : k, y = D.transpose_left ? k : m;
    if (x >= a.ext(0) || y >= a.ext(1)) return 0.0f;
    float v = a.get(x, y);
    return D.relaxed_precision ? fm_detail::relax(v) : v;
  }
  template <class R>
  static float right(const R& b, int k, int n) {
    int x = D.transpose_right ? k : n, y = D.transpose_right ? n : k;
    if (x >= b.ext(0) || y >= b.ext(1)) return 0.0f;
    float v = b.get(x, y);
    return D.relaxed_precision ? fm_detail::relax(v) : v;
  }
  // Element (m, n) of A * B: products and sums in float, fma in k order from
  // `acc` (the order inside Apple's run() is not documented).
  template <class L, class R>
  static float dot(const L& a, const R& b, int m, int n, int kk, float acc) {
    for (int k = 0; k < kk; ++k) acc = __builtin_fmaf(left(a, m, k), right(b, k, n), acc);
    return acc;
  }

  // run(left, right, dest): left and right are tensors or this op's input
  // cooperative tensors; dest a destination cooperative tensor or a tensor.
  template <class L, class R, class Dst>
  void run(const L& a, const R& b, Dst&& d, FMEMU_MPP_SITE_PARAMS) const {
    enter("matmul2d run", file, line, col);
    const auto va = view(a, fm_detail::kLeft, file, line, col);
    const auto vb = view(b, fm_detail::kRight, file, line, col);
    const int kk = D.k >= 0 ? D.k : va.ext(D.transpose_left ? 1 : 0);  // a dynamic K: the left operand's
    count(kk);
    write(va, vb, kk, d);
  }
  // Into a destination cooperative tensor: this thread's slots only.
  template <class VA, class VB, class E>
  static void write(const VA& a, const VB& b, int kk, cooperative_tensor<E, matmul2d, fm_detail::kDest>& d) {
    const bool acc = D.matmul_mode == matmul2d_descriptor::mode::multiply_accumulate;
    for (int i = 0; i < d.cap; ++i) {
      int e = d.map[i];
      if (e < 0) continue;
      d.v[i] = E(dot(a, b, e / N, e % N, kk, acc ? fm_detail::to_float(d.v[i]) : 0.0f));
    }
  }
  // Into a tensor in memory: each element is computed and written by the
  // scope thread whose destination slot holds it in this layout.
  template <class VA, class VB, class T, class X, class G>
  static void write(const VA& a, const VB& b, int kk, const metal::tensor<T, X, G>& d) {
    const bool acc = D.matmul_mode == matmul2d_descriptor::mode::multiply_accumulate;
    const ::fmemu::mpp::DestLayout lay = dest_layout();
    const unsigned t = scope_thread();
    for (int i = 0, cap = lay.capacity(); i < cap; ++i) {
      int e = lay.element(t, i);
      if (e < 0) continue;
      int m = e / N, n = e % N;
      if (n >= int(d.get_extent(0)) || m >= int(d.get_extent(1))) continue;
      float c = acc ? fm_detail::to_float(d.at(n, m)) : 0.0f;
      d.at(n, m) = T(dot(a, b, m, n, kk, c));
    }
  }
};

template <class Elem, class Op, int Kind>
struct cooperative_tensor {
  static constexpr int M = Op::M, N = Op::N, S = Op::S;
  static constexpr bool kReduction = Kind == fm_detail::kRows || Kind == fm_detail::kCols;
  static_assert(!(Kind == fm_detail::kLeft || Kind == fm_detail::kRight) || Op::K > 0,
                "input cooperative tensors need a static k in the descriptor");
  // The matrix the slots cover: M x N (destinations and reductions), M x K
  // (left input), K x N (right input).
  static constexpr int R = Kind == fm_detail::kRight ? Op::K : M;
  static constexpr int C = Kind == fm_detail::kLeft ? Op::K : N;
  static constexpr int kDestCap = ::fmemu::mpp::dest_capacity_max(R, C, S);
  // A reduction destination holds at most the distinct rows (columns) of a
  // thread's destination slots, plus the scrambled layout's invalid slot.
  static constexpr int kCap = kReduction ? kDestCap + 1 : kDestCap;
  using index_array = metal::array<int, kReduction ? 1 : 2>;
  Elem v[kCap];
  int map[kCap];  // kDest: row * N + col; kRows: row; kCols: column; -1 invalid
  int cap = 0;

  // Every slot starts as NaN: Apple leaves a new cooperative tensor's values
  // undefined, so a kernel that accumulates into one without clearing it fails.
  cooperative_tensor() {
    const ::fmemu::mpp::DestLayout lay = Op::layout(Kind);
    const unsigned t = Op::scope_thread();
    for (int i = 0; i < kCap; ++i) {
      v[i] = fm_detail::poison<Elem>();
      map[i] = -1;
    }
    if (!kReduction) {
      cap = lay.capacity();
      for (int i = 0; i < cap; ++i) map[i] = lay.element(t, i);
      return;
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
      return;
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
  }

  int get_capacity() const { return cap; }
  bool is_valid_element(int i) const { return i >= 0 && i < cap && map[i] >= 0; }
  // [0] the column (innermost extent), [1] the row; a reduction destination
  // has one index, its row (column). -1 for an invalid slot.
  index_array get_multidimensional_index(int i) const {
    index_array r;
    int e = is_valid_element(i) ? map[i] : -1;
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
    cooperative_tensor* ct;
    int i;
    void skip() {
      while (i < ct->cap && !ct->is_valid_element(i)) ++i;
    }
    Elem& operator*() const { return ct->v[i]; }
    iterator& operator++() {
      ++i;
      skip();
      return *this;
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

  // Copy this thread's valid elements from / to memory (not reductions).
  template <class T, class X, class G>
  void load(const metal::tensor<T, X, G>& t) {
    static_assert(!kReduction, "load/store: destination or input cooperative tensors only");
    for (int i = 0; i < cap; ++i)
      if (map[i] >= 0) v[i] = Elem(t.at(map[i] % C, map[i] / C));
  }
  template <class T, class X, class G>
  void store(const metal::tensor<T, X, G>& t) const {
    static_assert(!kReduction, "load/store: destination or input cooperative tensors only");
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
template <class E, class Op, int Kind>
void gather(const cooperative_tensor<E, Op, Kind>& ct, float* tile, const char* what, const char* file, int line,
            int col) {
  static_assert(Op::S == 1, "the emulator moves cooperative tensors between lanes of one SIMD-group only");
  constexpr int kChunk = FMEMU_SIMD_SLOT_BYTES / 4;
  if (fm_rt_simd_width() != 32) fm_rt_fail("MPP tensor ops need full 32-lane SIMD-groups", file, line);
  const ::fmemu::mpp::DestLayout lay = Op::layout(Kind);
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
// Folds each of dst's rows (columns) of the gathered tile from `identity`
// in column (row) order. Apple's reduction order is not documented.
template <int Kind, class E1, class Op, class E2>
inline void reduce(const cooperative_tensor<E1, Op, kDest>& src, cooperative_tensor<E2, Op, Kind>& dst,
                   reduction_operation op, float identity, const char* what, const char* file, int line, int col) {
  static_assert(Op::S == 1, "reduce_rows / reduce_columns require a single SIMD group (as Apple's header asserts)");
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
    dst.v[i] = E2(acc);
  }
}
}  // namespace fm_detail

template <class E1, class Op, class E2>
inline void reduce_rows(const cooperative_tensor<E1, Op, fm_detail::kDest>& src,
                        cooperative_tensor<E2, Op, fm_detail::kRows>& dst,
                        reduction_operation op = reduction_operation::sum, E2 identity = E2(0), FMEMU_MPP_SITE_PARAMS) {
  fm_detail::reduce(src, dst, op, float(identity), "reduce_rows", file, line, col);
}
template <class E1, class Op, class E2>
inline void reduce_columns(const cooperative_tensor<E1, Op, fm_detail::kDest>& src,
                           cooperative_tensor<E2, Op, fm_detail::kCols>& dst,
                           reduction_operation op = reduction_operation::sum, E2 identity = E2(0),
                           FMEMU_MPP_SITE_PARAMS) {
  fm_detail::reduce(src, dst, op, float(identity), "reduce_columns", file, line, col);
}
}  // namespace tensor_ops
}  // namespace mpp
#undef FMEMU_MPP_SITE_PARAMS
