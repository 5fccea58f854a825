// Cooperative-tensor lane layouts of the MPP shim (mpp.h): which element of an
// M x N destination (or which row / column of a reduction destination) the
// slot i of scope thread t holds. Apple leaves the layout implementation
// defined (it depends on op, dtypes, scope and GPU generation), so it is a
// parameter of every dispatch (fm_rt_mpp, Library.dispatch(mpp_layout=)):
//  - FMEMU_MPP_LAYOUT_M5: the Apple10 (M5) map that MLX's nax.h hard-codes and
//    PyTorch's Attention.mm describes (notes/metal4-tensor-ops.md, "What an
//    emulator has to match"), extended by a rule of the emulator's own.
//  - FMEMU_MPP_LAYOUT_SCRAMBLED: a seeded permutation of (thread, slot) ->
//    element with invalid slots, so only kernels that go through
//    get_multidimensional_index / is_valid_element get right results.
#pragma once
#include "base.h"

namespace fmemu {
namespace mpp {
// The published map covers 16 x 16 fragments: 8 slots per lane.
constexpr int kFrag = 16;
constexpr int kFragSlots = 8;
// Invalid slots the scrambled layout adds to every thread's capacity, so a
// kernel that ignores is_valid_element reads or writes garbage there.
constexpr int kScrambleSlack = 2;

constexpr int ceil_div(int a, int b) { return (a + b - 1) / b; }
// Slots a thread of an S-SIMD-group scope may need for an M x N destination,
// under either layout (the scrambled one needs ceil(M*N / (32 S)) + slack).
constexpr int dest_capacity_max(int m, int n, int s) {
  return kFragSlots * ceil_div(ceil_div(m, kFrag) * ceil_div(n, kFrag), s) + kScrambleSlack;
}

inline unsigned long long mix(unsigned long long x) {  // splitmix64's finalizer
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ull;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// A seeded bijection of [0, n): a 4-round Feistel network on the smallest
// even-width power of two >= n, cycle-walked back into range.
inline unsigned permute(unsigned x, unsigned n, unsigned long long key) {
  unsigned bits = 2;
  while ((1u << bits) < n) bits += 2;
  const unsigned half = bits / 2, mask = (1u << half) - 1;
  do {
    unsigned l = x >> half, r = x & mask;
    for (unsigned round = 0; round < 4; ++round) {
      unsigned f = (unsigned)mix(key + round * 0x9e3779b97f4a7c15ull + r) & mask;
      unsigned nl = r;
      r = l ^ f;
      l = nl;
    }
    x = (l << half) | r;
  } while (x >= n);
  return x;
}

// Element (row, col) of lane `lane`'s slot q (0..7) in a 16 x 16 fragment:
// MLX BaseNAXFrag::get_coord's formula (qid = lane / 4; row = (qid & 4) |
// ((lane / 2) & 3); col = ((qid & 2) | (lane & 1)) * 4), slot q at
// (row + 8 (q / 4), col + q % 4).
inline void m5_frag(unsigned lane, unsigned q, int& row, int& col) {
  unsigned qid = lane >> 2;
  row = int((qid & 4) | ((lane >> 1) & 3)) + 8 * int(q / 4);
  col = int(((qid & 2) | (lane & 1)) * 4) + int(q % 4);
}

// The layout of one op's destination: M x N over S SIMD-groups, keyed by the
// op (scrambled layouts differ between ops and from dispatch to dispatch).
struct DestLayout {
  int m, n, s;
  unsigned long long key;
  int layout;
  int capacity() const {
    if (layout == FMEMU_MPP_LAYOUT_M5) return kFragSlots * ceil_div(ceil_div(m, kFrag) * ceil_div(n, kFrag), s);
    return ceil_div(m * n, 32 * s) + kScrambleSlack;
  }
  // Element row * n + col held by slot i of scope thread t, or -1 (invalid).
  int element(unsigned t, int i) const {
    if (layout == FMEMU_MPP_LAYOUT_M5) {
      // Generic rule (the emulator's own beyond 16 x 16 / 16 x 32 / 32 x 16):
      // 16 x 16 blocks in row-major block order, block b to SIMD-group b % S
      // as its (b / S)-th block, slots 8j..8j+7 of that thread for its j-th
      // block; positions past M or N are invalid slots.
      unsigned simd = t / 32, lane = t % 32;
      int j = i / kFragSlots, q = i % kFragSlots;
      int b = j * s + int(simd), bc = ceil_div(n, kFrag);
      if (b >= ceil_div(m, kFrag) * bc) return -1;
      int r, c;
      m5_frag(lane, (unsigned)q, r, c);
      r += (b / bc) * kFrag;
      c += (b % bc) * kFrag;
      return r < m && c < n ? r * n + c : -1;
    }
    int cap = capacity();
    unsigned total = 32u * unsigned(s) * unsigned(cap);
    unsigned e = permute(t * unsigned(cap) + unsigned(i), total, key);
    return e < unsigned(m * n) ? int(e) : -1;
  }
};
}  // namespace mpp
}  // namespace fmemu
