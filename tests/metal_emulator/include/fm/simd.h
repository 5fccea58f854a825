// SIMD-group collectives (metal_simdgroup) and simdgroup_matrix
// (metal_simdgroup_matrix).
//
// Every collective is a rendezvous of the whole SIMD-group at one call site:
// each lane deposits its operand, the runtime waits until all lanes of the
// SIMD-group arrive (reporting divergence or deadlock otherwise), and each
// lane then computes its own result from the 32 deposited operands. Results
// are therefore deterministic; reductions fold in lane order (lane 0 first),
// one rounding per operation in the operand type.
#pragma once
#include "base.h"

#define FMEMU_SITE_PARAMS const char *file = __builtin_FILE(), int line = __builtin_LINE(), int col = __builtin_COLUMN()
#define FMEMU_SITE file, line, col

namespace fmemu {
template <class T>
inline const unsigned char* exchange(const T& v, const char* what, const char* file, int line, int col) {
  static_assert(sizeof(T) <= FMEMU_SIMD_SLOT_BYTES, "SIMD collective operand too large");
  return fm_rt_simd_exchange(&v, sizeof(T), what, file, line, col);
}
template <class T>
inline T slot(const unsigned char* slots, unsigned lane) {
  return *reinterpret_cast<const T*>(slots + lane * FMEMU_SIMD_SLOT_BYTES);
}
// op: 0 sum, 1 product, 2 max, 3 min, 4 and, 5 or, 6 xor
template <int Op, class T>
inline T combine(T a, T b) {
  using E = typename vec_info<T>::elem;
  if constexpr (Op == 0) return a + b;
  else if constexpr (Op == 1) return a * b;
  else if constexpr (Op == 2) return metal::max(a, b);
  else if constexpr (Op == 3) return metal::min(a, b);
  else if constexpr (Op == 4) return a & b;
  else if constexpr (Op == 5) return a | b;
  else return a ^ b;
  (void)sizeof(E);
}
template <int Op, class T>
inline T reduce(const T& v, const char* what, const char* file, int line, int col) {
  const unsigned char* s = exchange(v, what, file, line, col);
  unsigned w = fm_rt_simd_width();
  T acc = slot<T>(s, 0);
  for (unsigned l = 1; l < w; ++l) acc = combine<Op>(acc, slot<T>(s, l));
  return acc;
}
template <int Op, bool Inclusive, class T>
inline T prefix(const T& v, const char* what, const char* file, int line, int col) {
  const unsigned char* s = exchange(v, what, file, line, col);
  unsigned me = fm_rt_simd_lane();
  T acc = Op == 0 ? T(0) : T(1);
  unsigned end = Inclusive ? me + 1 : me;
  if (end == 0) return acc;
  acc = slot<T>(s, 0);
  for (unsigned l = 1; l < end; ++l) acc = combine<Op>(acc, slot<T>(s, l));
  return acc;
}
// Value of lane `src`, or this lane's own value when `src` is outside the
// SIMD-group (Metal leaves those lanes' values unchanged).
template <class T>
inline T from_lane(const T& v, long src, const char* what, const char* file, int line, int col) {
  const unsigned char* s = exchange(v, what, file, line, col);
  if (src < 0 || src >= (long)fm_rt_simd_width()) return v;
  return slot<T>(s, (unsigned)src);
}
}  // namespace fmemu

namespace metal {
template <class T> inline T simd_sum(T v, FMEMU_SITE_PARAMS) { return ::fmemu::reduce<0>(v, "simd_sum", FMEMU_SITE); }
template <class T> inline T simd_product(T v, FMEMU_SITE_PARAMS) { return ::fmemu::reduce<1>(v, "simd_product", FMEMU_SITE); }
template <class T> inline T simd_max(T v, FMEMU_SITE_PARAMS) { return ::fmemu::reduce<2>(v, "simd_max", FMEMU_SITE); }
template <class T> inline T simd_min(T v, FMEMU_SITE_PARAMS) { return ::fmemu::reduce<3>(v, "simd_min", FMEMU_SITE); }
template <class T> inline T simd_and(T v, FMEMU_SITE_PARAMS) { return ::fmemu::reduce<4>(v, "simd_and", FMEMU_SITE); }
template <class T> inline T simd_or(T v, FMEMU_SITE_PARAMS) { return ::fmemu::reduce<5>(v, "simd_or", FMEMU_SITE); }
template <class T> inline T simd_xor(T v, FMEMU_SITE_PARAMS) { return ::fmemu::reduce<6>(v, "simd_xor", FMEMU_SITE); }
template <class T> inline T simd_prefix_inclusive_sum(T v, FMEMU_SITE_PARAMS) {
  return ::fmemu::prefix<0, true>(v, "simd_prefix_inclusive_sum", FMEMU_SITE);
}
template <class T> inline T simd_prefix_exclusive_sum(T v, FMEMU_SITE_PARAMS) {
  return ::fmemu::prefix<0, false>(v, "simd_prefix_exclusive_sum", FMEMU_SITE);
}
template <class T> inline T simd_prefix_inclusive_product(T v, FMEMU_SITE_PARAMS) {
  return ::fmemu::prefix<1, true>(v, "simd_prefix_inclusive_product", FMEMU_SITE);
}
template <class T> inline T simd_prefix_exclusive_product(T v, FMEMU_SITE_PARAMS) {
  return ::fmemu::prefix<1, false>(v, "simd_prefix_exclusive_product", FMEMU_SITE);
}
template <class T> inline T simd_shuffle(T v, ushort lane, FMEMU_SITE_PARAMS) {
  return ::fmemu::from_lane(v, lane, "simd_shuffle", FMEMU_SITE);
}
template <class T> inline T simd_broadcast(T v, ushort lane, FMEMU_SITE_PARAMS) {
  return ::fmemu::from_lane(v, lane, "simd_broadcast", FMEMU_SITE);
}
template <class T> inline T simd_broadcast_first(T v, FMEMU_SITE_PARAMS) {
  return ::fmemu::from_lane(v, 0, "simd_broadcast_first", FMEMU_SITE);
}
template <class T> inline T simd_shuffle_xor(T v, ushort mask, FMEMU_SITE_PARAMS) {
  return ::fmemu::from_lane(v, (long)(fm_rt_simd_lane() ^ mask), "simd_shuffle_xor", FMEMU_SITE);
}
template <class T> inline T simd_shuffle_down(T v, ushort delta, FMEMU_SITE_PARAMS) {
  return ::fmemu::from_lane(v, (long)fm_rt_simd_lane() + delta, "simd_shuffle_down", FMEMU_SITE);
}
template <class T> inline T simd_shuffle_up(T v, ushort delta, FMEMU_SITE_PARAMS) {
  return ::fmemu::from_lane(v, (long)fm_rt_simd_lane() - delta, "simd_shuffle_up", FMEMU_SITE);
}
template <class T> inline T simd_shuffle_rotate_down(T v, ushort delta, FMEMU_SITE_PARAMS) {
  unsigned w = fm_rt_simd_width();
  return ::fmemu::from_lane(v, (long)((fm_rt_simd_lane() + delta) % w), "simd_shuffle_rotate_down", FMEMU_SITE);
}
template <class T> inline T simd_shuffle_rotate_up(T v, ushort delta, FMEMU_SITE_PARAMS) {
  unsigned w = fm_rt_simd_width();
  return ::fmemu::from_lane(v, (long)((fm_rt_simd_lane() + w - delta % w) % w), "simd_shuffle_rotate_up", FMEMU_SITE);
}
inline bool simd_all(bool b, FMEMU_SITE_PARAMS) { return ::fmemu::reduce<4>((int)b, "simd_all", FMEMU_SITE) != 0; }
inline bool simd_any(bool b, FMEMU_SITE_PARAMS) { return ::fmemu::reduce<5>((int)b, "simd_any", FMEMU_SITE) != 0; }
// simd_ballot: bit l set when lane l's predicate is true.
inline ulong simd_ballot(bool b, FMEMU_SITE_PARAMS) {
  const unsigned char* s = ::fmemu::exchange((int)b, "simd_ballot", FMEMU_SITE);
  ulong r = 0;
  for (unsigned l = 0; l < fm_rt_simd_width(); ++l)
    if (::fmemu::slot<int>(s, l)) r |= 1ul << l;
  return r;
}
inline bool simd_is_first(FMEMU_SITE_PARAMS) {
  ::fmemu::exchange(0, "simd_is_first", FMEMU_SITE);
  return fm_rt_simd_lane() == 0;
}

// ---- simdgroup_matrix<T, 8, 8> ------------------------------------------------
// Lane layout of thread_elements() (MLX steel/attn/mma.h, BaseMMAFrag): lane l
// holds row 4*bit4(l) + 2*bit2(l) + bit1(l), columns c and c+1 with
// c = 4*bit3(l) + 2*bit0(l). Apple does not document it; MLX relies on it.
inline uint fm_frag_row(uint lane) { return ((lane >> 4) & 1) * 4 + ((lane >> 2) & 1) * 2 + ((lane >> 1) & 1); }
inline uint fm_frag_col(uint lane) { return ((lane >> 3) & 1) * 4 + (lane & 1) * 2; }

template <class T, int Cols, int Rows>
struct simdgroup_matrix {
  static_assert(Cols == 8 && Rows == 8, "the emulator models 8x8 simdgroup matrices only");
  vec<T, 2> e;
  simdgroup_matrix() = default;
  // Metal: a diagonal matrix with `d` on the diagonal.
  explicit simdgroup_matrix(T d) {
    uint lane = fm_rt_simd_lane(), r = fm_frag_row(lane), c = fm_frag_col(lane);
    e[0] = r == c ? d : T(0);
    e[1] = r == c + 1 ? d : T(0);
  }
  thread vec<T, 2>& thread_elements() thread { return e; }
};
typedef simdgroup_matrix<float, 8, 8> simdgroup_float8x8;
typedef simdgroup_matrix<half, 8, 8> simdgroup_half8x8;
typedef simdgroup_matrix<bfloat, 8, 8> simdgroup_bfloat8x8;

template <class T, int C, int R>
inline simdgroup_matrix<T, C, R> make_filled_simdgroup_matrix(T v) {
  simdgroup_matrix<T, C, R> m;
  m.e[0] = v;
  m.e[1] = v;
  return m;
}

namespace fm_detail {
// All lanes of the SIMD-group must take part; the rendezvous checks it.
inline void whole_group(const char* what, const char* file, int line, int col) {
  if (fm_rt_simd_width() != FMEMU_SIMD_WIDTH) fm_rt_fail("simdgroup_matrix needs a full 32-lane SIMD-group", file, line);
  ::fmemu::exchange(0, what, file, line, col);
}
// Lane holding element (r, c): the inverse of fm_frag_row / fm_frag_col.
// One count per SIMD-group per call (Library.dispatch's simdgroup_* counts):
// lane 0 adds it, after the rendezvous that every lane reaches.
inline void count(unsigned long long& counter) {
#ifndef FMEMU_CHECK_MSL
  if (fm_rt_simd_lane() == 0) ++counter;
#endif
}
inline uint frag_lane(uint r, uint c) {
  return ((r >> 2) & 1) << 4 | ((c >> 2) & 1) << 3 | ((r >> 1) & 1) << 2 | (r & 1) << 1 | ((c >> 1) & 1);
}
// Element (r, c) of the matrix whose fragments are in `slots` at byte `off`.
template <class T>
inline float gather(const unsigned char* slots, unsigned off, uint r, uint c) {
  const T* p = reinterpret_cast<const T*>(slots + frag_lane(r, c) * FMEMU_SIMD_SLOT_BYTES + off);
  return (float)p[c & 1];
}
}  // namespace fm_detail

// Load the 8x8 block at matrix_origin (x = column, y = row) of a row-major
// matrix with `elements_per_row` elements per row; transposed when asked.
template <class T, int C, int R, class U>
inline void simdgroup_load(thread simdgroup_matrix<T, C, R>& d, const U* src, ulong elements_per_row = C,
                           ulong2 matrix_origin = 0, bool transpose_matrix = false, FMEMU_SITE_PARAMS) {
  fm_detail::whole_group("simdgroup_load", FMEMU_SITE);
  fm_detail::count(fm_rt_counts.simdgroup_loads);
  uint lane = fm_rt_simd_lane(), r = fm_frag_row(lane), c = fm_frag_col(lane);
  for (int j = 0; j < 2; ++j) {
    ulong row = transpose_matrix ? c + j : r, col = transpose_matrix ? r : c + j;
    d.e[j] = (T)src[(matrix_origin.y + row) * elements_per_row + matrix_origin.x + col];
  }
}
template <class T, int C, int R, class U>
inline void simdgroup_store(thread const simdgroup_matrix<T, C, R>& m, U* dst, ulong elements_per_row = C,
                            ulong2 matrix_origin = 0, bool transpose_matrix = false, FMEMU_SITE_PARAMS) {
  fm_detail::whole_group("simdgroup_store", FMEMU_SITE);
  fm_detail::count(fm_rt_counts.simdgroup_stores);
  uint lane = fm_rt_simd_lane(), r = fm_frag_row(lane), c = fm_frag_col(lane);
  for (int j = 0; j < 2; ++j) {
    ulong row = transpose_matrix ? c + j : r, col = transpose_matrix ? r : c + j;
    dst[(matrix_origin.y + row) * elements_per_row + matrix_origin.x + col] = (U)m.e[j];
  }
}

// d = a * b + c. Products and sums run in float in k order starting from
// c (fma per step), then one rounding to d's element type.
template <class TD, class TA, class TB, class TC>
inline void simdgroup_multiply_accumulate(thread simdgroup_matrix<TD, 8, 8>& d, thread const simdgroup_matrix<TA, 8, 8>& a,
                                          thread const simdgroup_matrix<TB, 8, 8>& b,
                                          thread const simdgroup_matrix<TC, 8, 8>& c, FMEMU_SITE_PARAMS) {
  if (fm_rt_simd_width() != FMEMU_SIMD_WIDTH) fm_rt_fail("simdgroup_matrix needs a full 32-lane SIMD-group", file, line);
  struct Frags {
    vec<TA, 2> a;
    vec<TB, 2> b;
    vec<TC, 2> c;
  } mine{a.e, b.e, c.e};
  const unsigned char* s = ::fmemu::exchange(mine, "simdgroup_multiply_accumulate", FMEMU_SITE);
  fm_detail::count(fm_rt_counts.simdgroup_mmas);
  uint lane = fm_rt_simd_lane(), r = fm_frag_row(lane), c0 = fm_frag_col(lane);
  for (uint j = 0; j < 2; ++j) {
    float acc = fm_detail::gather<TC>(s, __builtin_offsetof(Frags, c), r, c0 + j);
    for (uint k = 0; k < 8; ++k)
      acc = __builtin_fmaf(fm_detail::gather<TA>(s, __builtin_offsetof(Frags, a), r, k),
                           fm_detail::gather<TB>(s, __builtin_offsetof(Frags, b), k, c0 + j), acc);
    d.e[j] = (TD)acc;
  }
}
template <class TD, class TA, class TB>
inline void simdgroup_multiply(thread simdgroup_matrix<TD, 8, 8>& d, thread const simdgroup_matrix<TA, 8, 8>& a,
                               thread const simdgroup_matrix<TB, 8, 8>& b, FMEMU_SITE_PARAMS) {
  simdgroup_matrix<TD, 8, 8> zero = make_filled_simdgroup_matrix<TD, 8, 8>(TD(0));
  simdgroup_multiply_accumulate(d, a, b, zero, FMEMU_SITE);
}
}  // namespace metal
#undef FMEMU_SITE_PARAMS
#undef FMEMU_SITE
