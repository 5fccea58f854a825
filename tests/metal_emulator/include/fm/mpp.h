// <MetalPerformancePrimitives/MetalPerformancePrimitives.h> (MSL 4): the
// subset of mpp::tensor_ops that kernels use: matmul2d_descriptor, matmul2d
// on one or N SIMD-groups, run() into a tensor or a destination cooperative
// tensor, cooperative-tensor accessors, reduce_rows / reduce_columns
// (mpp_coop.h). What it accepts is what Apple's header accepts, rule by rule
// with its source (mpp_rules.h); what it computes: ../../README.md, "MPP
// tensor ops", and /work/shared/notes/metal4-tensor-ops.md. The code is the
// emulator's own; Apple's real implementation is opaque (driver-supplied
// extern functions).
#pragma once
#include "base.h"
#include "tensor.h"
#include "mpp_layout.h"
#include "mpp_rules.h"

#define FMEMU_MPP_SITE_PARAMS const char *file = __builtin_FILE(), int line = __builtin_LINE(), int col = __builtin_COLUMN()

namespace mpp {
namespace tensor_ops {
enum class reduction_operation { sum, max, min };

// [H] MPPTensorOpsMatMul2d.h: the identities are numeric_limits' lowest and
// max (finite), not infinities.
template <class T>
struct reduction_operation_identity {
  static constexpr T sum_identity = T(0);
  static constexpr T max_identity = T(-3.40282346638528859811704183484516925e+38f);
  static constexpr T min_identity = T(3.40282346638528859811704183484516925e+38f);
};
template <>
struct reduction_operation_identity<half> {
  static constexpr half sum_identity = half(0);
  static constexpr half max_identity = half(-65504.0f);
  static constexpr half min_identity = half(65504.0f);
};
template <>
struct reduction_operation_identity<int32_t> {
  static constexpr int32_t sum_identity = 0;
  static constexpr int32_t max_identity = -2147483647 - 1;
  static constexpr int32_t min_identity = 2147483647;
};

// [H] the fields and the constructor's order and defaults (k dynamic, no
// transposes, exact, multiply).
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
// Kinds 3 and 4: the op's left and right input operands.
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
// A NaN the optimizer cannot see: under -ffast-math (no NaNs assumed) a
// branch that returns a constant NaN may be folded away, and with it the
// extent test that guards an operand read; a volatile load of the bits stays.
inline volatile unsigned opaque_nan_bits = 0x7fc00000u;
inline float opaque_nan() { return __builtin_bit_cast(float, (unsigned)opaque_nan_bits); }
}  // namespace fm_detail

// Elem: the element type; Op: the matmul2d whose layout it has; Kind: above;
// L, R: the operand types it was made for (Apple's layouts carry them, and
// reductions require them equal: [H] __reduce_rows).
template <class Elem, class Op, int Kind, class L, class R>
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
template <class CT>
void gather(const CT& ct, float* tile, const char* what, const char* file, int line, int col);
template <class T> constexpr bool is_coop = false;
template <class E, class Op, int Kind, class L, class R>
constexpr bool is_coop<cooperative_tensor<E, Op, Kind, L, R>> = true;
template <class T> using bare = typename ::metal::fm_tensor_detail::strip<typename ::metal::fm_tensor_detail::space<
    typename ::fmemu::remove_ref<T>::type>::type>::type;
}  // namespace fm_detail

template <matmul2d_descriptor D, class Scope, class... Args>
struct matmul2d {
  // [H] "Scope template argument should be of op_scope type".
  static_assert(::metal::is_execution_thread_v<Scope> || ::metal::is_execution_simdgroups_v<Scope>,
                "matmul2d<descriptor, Scope>: Scope must be metal::execution_thread, execution_simdgroup or "
                "execution_simdgroups<N> (Apple's MPPTensorOpsMatMul2d.h)");
  static_assert(Scope::simdgroups >= 1, "the emulator models SIMD-group scopes only (not execution_thread)");
  static_assert(D.m > 0 && D.n > 0, "the emulator needs static m and n in matmul2d_descriptor");
  static_assert(D.k > 0 || fm_rules::dynamic_k(D.k),
                "matmul2d_descriptor: k is a positive static K or dynamic (static_cast<int>(dynamic_extent), or "
                "26.0's dynamic_length_v<int>); the emulator refuses anything else rather than guess");
  static constexpr matmul2d_descriptor descriptor = D;
  using scope = Scope;
  static constexpr bool dynamic_k = fm_rules::dynamic_k(D.k);
  static constexpr int M = D.m, N = D.n, K = dynamic_k ? -1 : D.k, S = Scope::simdgroups;
  static constexpr bool multi = Scope::multi;

  // The layout of this op's destination in the current dispatch (a dynamic
  // K keys alike in either spelling).
  static ::fmemu::mpp::DestLayout dest_layout() {
    unsigned long long k = ::fmemu::mpp::mix(fm_rt_mpp.seed);
    const long long fields[] = {D.m, D.n, K, D.transpose_left, D.transpose_right, S, multi};
    for (long long f : fields) k = ::fmemu::mpp::mix(k ^ (unsigned long long)f);
    return ::fmemu::mpp::DestLayout{M, N, S, k, fm_rt_mpp.layout};
  }
  // The matrix an input cooperative tensor covers: the operand as stored,
  // so transposed when the descriptor transposes it (MLX's nax.h fills a
  // transposed right input with fragments of B as stored, N x K).
  static constexpr int rows_of(int kind) {
    if (kind == fm_detail::kLeft) return D.transpose_left ? K : M;
    if (kind == fm_detail::kRight) return D.transpose_right ? N : K;
    return M;
  }
  static constexpr int cols_of(int kind) {
    if (kind == fm_detail::kLeft) return D.transpose_left ? M : K;
    if (kind == fm_detail::kRight) return D.transpose_right ? K : N;
    return N;
  }
  // The layout of a cooperative tensor of this op: reduction destinations
  // derive from the destination's; input operands have their own (scrambled:
  // keyed apart from the destination's, so a slot-by-slot copy between a
  // destination and an input is wrong).
  static ::fmemu::mpp::DestLayout layout(int kind) {
    ::fmemu::mpp::DestLayout d = dest_layout();
    if (kind == fm_detail::kLeft || kind == fm_detail::kRight) {
      d.m = rows_of(kind);
      d.n = cols_of(kind);
      d.key = ::fmemu::mpp::mix(d.key ^ (unsigned long long)kind);
    }
    return d;
  }
  // This thread's index within the op's scope.
  static unsigned scope_thread() { return (multi ? fm_rt_simd_group_index() * 32u : 0u) + fm_rt_simd_lane(); }

  // [H] get_destination_cooperative_tensor<Left, Right, Element, Coord = int>:
  // float / half / int32 elements, an integral coordinate type (here int
  // only: the kernels' indices are int). Left and Right are the operand
  // types (tensors; input cooperative tensors in later SDKs, as MLX's nax.h).
  template <class L, class R, class E, class Coord = int>
  cooperative_tensor<E, matmul2d, fm_detail::kDest, fm_detail::bare<L>, fm_detail::bare<R>>
  get_destination_cooperative_tensor() const {
    check_created<L, R, E, Coord>();
    return {};
  }
  template <class L, class R, class E, class Coord = int>
  cooperative_tensor<E, matmul2d, fm_detail::kRows, fm_detail::bare<L>, fm_detail::bare<R>>
  get_row_reduction_destination_cooperative_tensor() const {
    check_created<L, R, E, Coord>();
    return {};
  }
  template <class L, class R, class E, class Coord = int>
  cooperative_tensor<E, matmul2d, fm_detail::kCols, fm_detail::bare<L>, fm_detail::bare<R>>
  get_column_reduction_destination_cooperative_tensor() const {
    check_created<L, R, E, Coord>();
    return {};
  }
  template <class L, class R, class E, class Coord>
  static constexpr void check_created() {
    static_assert(fm_rules::coop_element<E>,
                  "a destination or reduction cooperative tensor's element type can only be float, half or int32_t "
                  "(Apple's MPPTensorOpsMatMul2dImpl.h)");
    static_assert(fm_rules::is_integral<Coord>::value, "the coordinate type must be integral (Apple's header)");
    static_assert(fm_rules::is_same<Coord, int>::value, "the emulator takes int coordinates only");
    static_assert((fm_rules::is_tensor<fm_detail::bare<L>> || fm_detail::is_coop<fm_detail::bare<L>>) &&
                      (fm_rules::is_tensor<fm_detail::bare<R>> || fm_detail::is_coop<fm_detail::bare<R>>),
                  "the Left and Right template arguments are the operands' tensor (or input cooperative tensor) types");
  }
  // Input operands as cooperative tensors (later SDKs; one SIMD-group here,
  // static K): empty, or converted from another op's destination of the same
  // shape (a collective: the values move between lanes by the two layouts).
  template <class LE, class RE, class DE>
  cooperative_tensor<LE, matmul2d, fm_detail::kLeft, LE, RE> get_left_input_cooperative_tensor() const {
    static_assert(fm_rules::supported_types<LE, RE, DE>(), "get_left_input_cooperative_tensor: an element-type "
                  "combination Apple's matmul2d does not take (mpp_rules.h, supported_types)");
    return {};
  }
  template <class LE, class RE, class DE>
  cooperative_tensor<RE, matmul2d, fm_detail::kRight, LE, RE> get_right_input_cooperative_tensor() const {
    static_assert(fm_rules::supported_types<LE, RE, DE>(), "get_right_input_cooperative_tensor: an element-type "
                  "combination Apple's matmul2d does not take (mpp_rules.h, supported_types)");
    return {};
  }
  template <class LE, class RE, class DE, class E2, class Op2, class L2, class R2>
  cooperative_tensor<LE, matmul2d, fm_detail::kLeft, LE, RE> get_left_input_cooperative_tensor(
      const cooperative_tensor<E2, Op2, fm_detail::kDest, L2, R2>& src, FMEMU_MPP_SITE_PARAMS) const {
    static_assert(Op2::M == M && Op2::N == K, "get_left_input_cooperative_tensor: the source must be M x K");
    static_assert(!D.transpose_left, "the emulator converts a destination into an untransposed input only");
    return convert<cooperative_tensor<LE, matmul2d, fm_detail::kLeft, LE, RE>>(src, "get_left_input_cooperative_tensor",
                                                                               file, line, col);
  }
  template <class LE, class RE, class DE, class E2, class Op2, class L2, class R2>
  cooperative_tensor<RE, matmul2d, fm_detail::kRight, LE, RE> get_right_input_cooperative_tensor(
      const cooperative_tensor<E2, Op2, fm_detail::kDest, L2, R2>& src, FMEMU_MPP_SITE_PARAMS) const {
    static_assert(Op2::M == K && Op2::N == N, "get_right_input_cooperative_tensor: the source must be K x N");
    static_assert(!D.transpose_right, "the emulator converts a destination into an untransposed input only");
    return convert<cooperative_tensor<RE, matmul2d, fm_detail::kRight, LE, RE>>(
        src, "get_right_input_cooperative_tensor", file, line, col);
  }
  template <class CT, class Src>
  static CT convert(const Src& src, const char* what, const char* file, int line, int col) {
    CT ct;
    float tile[Src::R * Src::C];
    fm_detail::gather(src, tile, what, file, line, col);
    for (int i = 0; i < ct.cap; ++i)
      if (ct.map[i] >= 0) ct.v[i] = typename CT::value_type(tile[ct.map[i]]);
    return ct;
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
  static void count(int kk, bool checked) {
    if (scope_thread() != 0) return;
    fm_rt_counts.mpp_runs++;
    fm_rt_counts.mpp_flops += 2ull * unsigned(M) * unsigned(N) * unsigned(kk);
    if (checked) fm_rt_counts.mpp_checked_runs++;
    if (D.relaxed_precision) fm_rt_counts.mpp_relaxed_runs++;
  }
  // Whether an operand has a dynamic extent the op checks its tile against
  // (a tensor of dextents, or a slice of one; not a static slice, not a
  // cooperative tensor).
  template <class T>
  static constexpr bool dynamic_extents() {
    using B = fm_detail::bare<T>;
    if constexpr (fm_rules::is_tensor<B>) {
      for (int r = 0; r < B::rank_v; ++r)
        if (B::extents_type::static_extent(r) == ::metal::dynamic_extent) return true;
      return false;
    } else {
      return false;
    }
  }

  // Operands: tensors are read in place, cooperative tensors (this op's
  // inputs) gathered from the SIMD-group first (a collective).
  template <class T, class X, class G>
  static fm_detail::tensor_view<metal::tensor<T, X, G>> view(const metal::tensor<T, X, G>& t, int, const char*, int,
                                                             int) {
    return {t};
  }
  template <class E, int Kind, class L, class R>
  static fm_detail::tile_view<rows_of(Kind), cols_of(Kind)> view(const cooperative_tensor<E, matmul2d, Kind, L, R>& ct,
                                                                 int want, const char* file, int line, int col) {
    static_assert(Kind == fm_detail::kLeft || Kind == fm_detail::kRight,
                  "run(): a cooperative-tensor operand must be this op's left or right input");
    static_assert(S == 1, "the emulator takes cooperative-tensor operands on one SIMD-group only");
    if (Kind != want)
      fm_rt_fail("run(): a left-input cooperative tensor passed as the right operand or back", file, line);
    fm_detail::tile_view<rows_of(Kind), cols_of(Kind)> v;
    fm_detail::gather(ct, v.v, "matmul2d run (cooperative operand)", file, line, col);
    return v;
  }

  // Operand elements outside a tensor's extents. With a dynamic K the op
  // derives K from the operands and edge-checks the tile against their
  // extents ([H]: "edge checking for all thread groups against extents of
  // original tensor", of its K = dynamic examples; llama.cpp PR #27450: "the
  // dynamic-K op derives K from the operand extents and edge-checks the tile
  // against the tensor extents"): zeros, nothing read. With a static K the op
  // does not check K, and a read past an operand's K extent is undefined
  // (NaN or stale data on M5s: ggml-org/llama.cpp PR #27450,
  // NVIDIA/NeMo-Speech.cpp PR #20, both fixed by a dynamic K); whether it
  // checks M and N then is not documented. So here, under a static K, every
  // read past an operand's extents (M, N or K) is NaN: a kernel may run a
  // static-K op over a ragged tile only if it never uses what lies past the
  // extents (masked scores), and never if K itself is ragged.
  static float edge() { return dynamic_k ? 0.0f : fm_detail::opaque_nan(); }
  template <class L>
  static float left(const L& a, int m, int k) {
    int x = D.transpose_left ? m : k, y = D.transpose_left ? k : m;
    if (x >= a.ext(0) || y >= a.ext(1)) return edge();
    float v = a.get(x, y);
    return D.relaxed_precision ? fm_detail::relax(v) : v;
  }
  template <class R>
  static float right(const R& b, int k, int n) {
    int x = D.transpose_right ? k : n, y = D.transpose_right ? n : k;
    if (x >= b.ext(0) || y >= b.ext(1)) return edge();
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

  // The operand types run() takes, as Apple's __run checks them.
  template <class T, int Kind>
  static constexpr void check_input() {
    using B = fm_detail::bare<T>;
    if constexpr (fm_detail::is_coop<B>) {
      static_assert(B::kKind == Kind, "run(): a cooperative-tensor operand must be this op's input of that side");
      static_assert(fm_rules::is_same<typename B::op_type, matmul2d>::value,
                    "run(): an input cooperative tensor must come from this op's "
                    "get_left/right_input_cooperative_tensor (its layout is that op's)");
    } else {
      static_assert(fm_rules::is_tensor<B>, "matmul2d run(): left and right must be tensors (or, in later SDKs, "
                    "this op's input cooperative tensors): Apple's __run");
      fm_rules::check_tensor_operand<B>();
    }
  }
  template <class T>
  static constexpr void check_destination() {
    using B = fm_detail::bare<T>;
    if constexpr (!fm_detail::is_coop<B>) {
      static_assert(fm_rules::is_tensor<B>, "matmul2d run(): the destination is a tensor or a cooperative tensor");
      fm_rules::check_tensor_operand<B>();
    } else {
      static_assert(B::kKind == fm_detail::kDest, "matmul2d run(): a cooperative destination must be a destination "
                    "cooperative tensor (get_destination_cooperative_tensor)");
    }
  }
  template <class T> using value_of = typename fm_detail::bare<T>::value_type;

  // run(left, right, dest) ([H]: `run(thread L &left, thread R &right,
  // thread D &destination)`, the one overload): left and right are tensors
  // or this op's input cooperative tensors; dest a destination cooperative
  // tensor or a tensor. Non-const lvalue references, so a temporary (a
  // prvalue slice, `op.run(a, t.slice(0, k0), c)`) does not bind: name it first.
  template <class L, class R, class Dst>
  void run(L& a, R& b, Dst& d, FMEMU_MPP_SITE_PARAMS) const {
    check_input<L, fm_detail::kLeft>();
    check_input<R, fm_detail::kRight>();
    check_destination<Dst>();
    // [H26.4] __run: "At least one of M or N must be a multiple of 16".
    static_assert(D.m % 16 == 0 || D.n % 16 == 0, "matmul2d: at least one of M or N must be a multiple of 16 "
                  "(Apple's MPPTensorOpsMatMul2dImpl.h, macOS 26.4; llama.cpp PR #21048)");
    static_assert(fm_rules::supported_types<value_of<L>, value_of<R>, value_of<Dst>>(),
                  "matmul2d run(): an element-type combination Apple's __run has no branch for (\"Unsupported "
                  "type\"; mpp_rules.h, supported_types)");
    enter("matmul2d run", file, line, col);
    const auto va = view(a, fm_detail::kLeft, file, line, col);
    const auto vb = view(b, fm_detail::kRight, file, line, col);
    const int kk = !dynamic_k ? K : va.ext(D.transpose_left ? 1 : 0);  // a dynamic K: the left operand's extent
    count(kk, dynamic_extents<L>() || dynamic_extents<R>() || dynamic_extents<Dst>());
    write(va, vb, kk, d);
  }
  // Any operand a temporary: Apple declares no overload that takes one.
  template <class L, class R, class Dst>
  void run(L&& a, R&& b, Dst&& d, FMEMU_MPP_SITE_PARAMS) const {
    static_assert(sizeof(L) == 0, "matmul2d run() takes non-const lvalue references (Apple declares only "
                  "run(thread L &, thread R &, thread D &)): name each operand (a slice too) before passing it");
  }
  // Into a destination cooperative tensor: this thread's slots only.
  template <class VA, class VB, class E, class L, class R>
  static void write(const VA& a, const VB& b, int kk, cooperative_tensor<E, matmul2d, fm_detail::kDest, L, R>& d) {
    const bool acc = D.matmul_mode == matmul2d_descriptor::mode::multiply_accumulate;
    for (int i = 0; i < d.cap; ++i) {
      int e = d.map[i];
      if (e < 0) continue;
      d.v[i] = E(dot(a, b, e / N, e % N, kk, acc ? fm_detail::to_float(d.v[i]) : 0.0f));
    }
  }
  template <class VA, class VB, class E, class Op2, int Kind, class L, class R>
  static void write(const VA&, const VB&, int, cooperative_tensor<E, Op2, Kind, L, R>&) {
    static_assert(sizeof(E) == 0, "matmul2d run(): the destination cooperative tensor belongs to another op (its "
                  "layout is that op's: get it from this op's get_destination_cooperative_tensor)");
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
}  // namespace tensor_ops
}  // namespace mpp

#include "mpp_coop.h"
#undef FMEMU_MPP_SITE_PARAMS
