// The tensor-op (Metal 4 matmul2d) prefill at head dim 256, split along D
// (issue 21, item 1: "D 64/96/128, and 256 split along D"). MSL 4 only, in
// the library of shaders/attention_mpp.metal, as attention_prefill_mpp.h.
//
// Why a kernel of its own. attention_prefill_mpp.h gives each SIMD-group 16
// query rows and the whole head: at D = 256 its O accumulator is a 16 x 256
// float destination cooperative tensor (128 floats per lane), and its Q
// slice 16 x 256 halves (8 KiB per SIMD-group, 32 KiB for 4: no room left for
// P). The idea here is MLX's attention_nax_dsplit (ml-explore/mlx PR #3842,
// steel_attention_nax.h; ideas only, the code is this project's): the
// SIMD-groups work in pairs, and each half of a pair owns half of D.
//
//   - A threadgroup owns BQ = 32 query rows: WM = 2 row groups of 16, each
//     served by a pair of WN = 2 SIMD-groups (4 SIMD-groups, 128 threads).
//     SIMD-group sg is half h = sg % WN of row group sg / WN.
//   - Half h owns features [h * 128, (h + 1) * 128) of Q and of O (and of K
//     and V). Its partial S_h = Q[:, half] . K[block, half]^T is a matmul2d
//     with K = D / 2 into a float destination cooperative tensor (16 x BK).
//   - The exchange: each half writes its partial to its own slot of
//     threadgroup memory (by (row, key), learnt from
//     get_multidimensional_index, never from the lane layout), a threadgroup
//     barrier, then each adds the other half's partial at the same (row,
//     key). IEEE addition is commutative, so both halves hold bit-identical
//     scores S = S_0 + S_1 (float partials: one float rounding more than a
//     single K = 256 product, far below the inputs' 16-bit rounding).
//   - Both halves run the online softmax on their (identical) S, as MLX's
//     dsplit does. Why not one half computing P for both: that would need
//     a second exchange (P and the row's alpha) and a barrier, where the
//     repeated softmax costs each half the same exp2 work the pair would do
//     anyway, in parallel (the halves run side by side on the core). Each
//     half writes its own copy of P (T) and alpha for its own P.V, so P
//     needs no barrier beyond the SIMD-group's own.
//   - O_h = alpha * O_h + P . V[block, half]: matmul2d (16 x 128, K the
//     block's valid keys, dynamic: mpp_accumulate_descriptor) multiply_accumulate into
//     a float 16 x 128 destination cooperative tensor (64 floats per lane,
//     as the D = 128 kernel's O).
//
// Threadgroup memory: the 32 KiB budget decides where Q lives. Per
// threadgroup, float16 / bfloat16, BK = 32 (csrc/metal/plan_detail.h,
// tensor_ops_dsplit_threadgroup_bytes, checks the same sum statically):
//   P:         4 SIMD-groups x 16 x BK x 2        =  4,096
//   Q:         4 SIMD-groups x 16 x 128 x 2       = 16,384 (each half's 16 x 128 slice)
//   partial S: 2 row groups x 2 halves x 16 x BK x 4 = 8,192 (float)
//   row stats: 4 SIMD-groups x 16 x 4             =    256 (alpha, then 1 / l)
//   total                                          = 28,928 bytes
// Q is staged (each SIMD-group copies its 16 x 128 slice from device memory
// once, as attention_prefill_mpp.h does: a device Q operand would be read
// again every key block, which the model found made the D <= 128 kernel
// memory-bound). The price of staging is one slot of partial S per half: a
// second (double-buffered) slot would take the partials to 16 KiB and the
// total over 32 KiB, so the kernel takes two threadgroup barriers per key
// block instead of one (after the partials are written: RAW; after the
// block's P.V, once both halves have read the other's partial: WAR). BQ =
// 64 (MLX's, 8 SIMD-groups) would need 32 KiB for Q alone.
//
// The 64-row kernel (flash_attention_prefill_mpp_dsplit_wide, issue 21: the
// model finds the 32-row kernel memory-bound, each K/V block fetched once per
// 32 query rows). The choices, with the arithmetic (16-bit T):
//   - 4 pairs of 16-row SIMD-groups (8 SIMD-groups, 256 threads), not 2 pairs
//     of 32 rows: a 32-row SIMD-group's O would be 32 x 128 floats, 128 per
//     lane before anything else.
//   - Q in registers, not staged (64 x 256 x 2 = 32,768 bytes, the whole
//     budget) and not a device operand of every S run (64 x 256 x 2 bytes
//     requested per threadgroup and key block, as many as its K and V: the
//     bytes the 64 rows save would come back as Q's). Each SIMD-group reads
//     its 16 x 128 slice once into a left-input cooperative tensor of the S
//     op: 16 x 128 x 2 bytes / 32 lanes = 128 bytes, 32 registers of 32 bits.
//   - The register budget sets the key block: per lane O 64 + Q 32 + S
//     (16 x BK floats / 32) + 8 row values + 16 overhead = 136 at BK 32, over
//     the 128 registers a thread addresses; 128 at BK 16
//     (csrc/metal/plan_detail.h, tensor_ops_dsplit_live_registers).
//   - K / V not staged either: matmul2d reads them from device memory as in
//     the 32-row kernel (the SIMD-groups of a threadgroup that read one block
//     share it through the core's L1, the model's assumption; staging 16 keys
//     of K and V would add 16 KiB and two barriers per block).
//   - Threadgroup memory, BK 16: P 8 x 16 x 16 x 2 = 4,096, two slots of
//     partials 2 x 4 x 2 x 16 x 16 x 4 = 16,384, row floats 512: 20,992
//     bytes. The second slot lets each key block take ONE barrier (the slot a
//     half writes next was read by the other half before the barrier both
//     just passed), plus a SIMD-group barrier for P and alpha.
// MLX's attention_nax_dsplit also keeps Q in fragments at BQ 64 (there at BK
// 32: its count of live registers is Apple's compiler's, ours a model).
//
// Uniform control flow: threadgroup barriers must be reached by every
// thread of the threadgroup, so nothing here returns early except a whole
// threadgroup past its sequence (varlen), and the key loop's bounds are the
// threadgroup's: up to what its last real row sees (causal or a right
// window), from the block of its first row's first visible key (a left
// window). A row group with no real row (the ragged last block) runs the
// loop on zero Q rows and stores nothing; rows that see no key in a block
// keep weight 0 there (masked scores), as in attention_prefill_mpp.h.
//
// Options and conventions: every one of attention_prefill_mpp.h's, through
// the same attention_features.h helpers (causal bottom-right with block
// skipping, GQA via head_offsets, bool / additive masks, windows, softcap,
// sinks, varlen, lse); zeros and lse = -inf for a row that saw no key. lse
// is stored by half 0 alone (both halves hold the same m and l).
//
// What the emulator cannot tell: as attention_prefill_mpp.h (Apple's real
// layouts, run()'s accumulation order), and whether the halves stay in step
// on an M5 (the barrier cost). Not yet verified on Apple hardware.
#pragma once

#include "attention_prefill_mpp.h"

namespace flash_metal {

// Threads the 64-row kernel declares (8 SIMD-groups; the 32-row one declares
// kPrefillMppMaxThreads, 128). A program-scope constant: the attribute may
// not depend on template parameters (the emulator reads it from the template).
constant constexpr int kPrefillMppDsplitWideMaxThreads = 256;

// Where a split-D instantiation keeps Q and how many slots of partial S it
// has: the 32 KiB budget decides (csrc/metal/plan_detail.h checks the same
// sums statically). Threadgroup memory, in order: P (NSG x R x BK, T), Q if
// staged (NSG x R x DH, T), the partials (kSlots x WM x WN x R x BK floats),
// a float per row (NSG x R).
//   - Q staged when its slices fit beside P, one slot of partials and the
//     row floats: BQ 32 (28,928 bytes, above). At BQ 64 Q alone is 64 x 256 x
//     2 = 32,768 bytes, the whole budget, so Q goes to registers: each
//     SIMD-group's 16 x 128 slice in a left-input cooperative tensor, read
//     from device memory once (not re-read per key block: as a device
//     operand of every S run Q would cost the threadgroup 32 KiB of requests
//     per block, as much as its K and V, undoing what the 64 rows save).
//   - Two slots (double-buffered partials) when they fit: then one
//     threadgroup barrier per key block (the next write to a slot comes two
//     blocks later, after a barrier every reader has passed), else one slot
//     and two barriers (above).
template <typename T, int D, int BQ, int BK, int WN>
struct MppDsplitShape {
  static constant constexpr int R = kMppRowsPerSimd;
  static constant constexpr int WM = BQ / R;   // row groups
  static constant constexpr int NSG = WM * WN; // SIMD-groups
  static constant constexpr int DH = D / WN;   // features each half owns
  static constant constexpr int kP = NSG * R * BK * int(sizeof(T));
  static constant constexpr int kQ = NSG * R * DH * int(sizeof(T));
  static constant constexpr int kSlot = WM * WN * R * BK * 4;
  static constant constexpr int kRows = NSG * R * 4;
  static constant constexpr bool kQStaged = kP + kQ + kSlot + kRows <= 32768;
  static constant constexpr int kSlots = kP + (kQStaged ? kQ : 0) + 2 * kSlot + kRows <= 32768 ? 2 : 1;
  static constant constexpr int kBytes = kP + (kQStaged ? kQ : 0) + kSlots * kSlot + kRows;
  static_assert(WN == 2, "pairs: each half adds the other's partial S (commutative, so both agree bit for bit)");
  static_assert(BQ % R == 0 && D % WN == 0 && kBytes <= 32768, "row groups of 16, within 32 KiB");
};

// What every SIMD-group of a split-D threadgroup knows before its key loop.
struct MppDsplitWork {
  SeqView seq;
  HeadOffsets h;
  int64_t mask_slice;
  int q0;       // the threadgroup's first row
  int row0;     // this row group's first row (may be past the sequence)
  int rg;       // row group
  int half_id;  // which half of D: features [f0, f0 + D / WN)
  int f0;
};

// The threadgroup's rows and this SIMD-group's part; false for a threadgroup
// past its sequence (varlen), which leaves whole: uniform, before any barrier.
template <int BQ, int WN, int DH>
FM_INLINE bool mpp_dsplit_begin(constant AttentionParams& p, device const int* cu_seqlens_q,
                                device const int* cu_seqlens_k, uint3 group, uint sg, thread MppDsplitWork& w) {
  w.seq = sequence_view(p, cu_seqlens_q, cu_seqlens_k, group.z);
  w.q0 = int(group.x) * BQ;
  if (w.q0 >= w.seq.q_len) return false;
  w.half_id = int(sg) % WN;
  w.rg = int(sg) / WN;
  w.row0 = w.q0 + w.rg * kMppRowsPerSimd;
  w.h = head_offsets(p, group.z, group.y);
  w.h.q += w.seq.q_row0 * p.q_row_stride;
  w.h.o += w.seq.q_row0 * p.o_row_stride;
  w.h.lse += w.seq.q_row0 * p.lse_row_stride;
  w.h.k += w.seq.k_row0 * p.k_row_stride;
  w.h.v += w.seq.k_row0 * p.v_row_stride;
  w.mask_slice = fc_has_mask ? mask_head_offset(p, group.z, group.y) : 0;
  w.f0 = w.half_id * DH;
  return true;
}

// The key loop and the epilogue, shared by both instantiations: `tq` is this
// half's Q slice (16 rows x DH), a tensor over threadgroup memory (staged) or
// a left-input cooperative tensor of the S op (registers).
template <typename T, int D, int BQ, int BK, int WN, typename QOp>
FM_INLINE void mpp_dsplit_blocks(thread QOp& tq, thread const MppDsplitWork& w, device const T* k,
                                 device const T* v, device T* o, device float* lse, constant AttentionParams& p,
                                 device const uchar* mask, device const float* sinks, threadgroup T* smem,
                                 uint3 group, uint sg) {
  using namespace mpp::tensor_ops;
  using Shape = MppDsplitShape<T, D, BQ, BK, WN>;
  constexpr int R = Shape::R, WM = Shape::WM, NSG = Shape::NSG, DH = Shape::DH;
  const SeqView seq = w.seq;
  const int rg = w.rg, half_id = w.half_id, row0 = w.row0, q0 = w.q0;
  threadgroup T* p_tile = smem + int(sg) * R * BK;
  threadgroup float* partials =
      reinterpret_cast<threadgroup float*>(smem + NSG * R * (BK + (Shape::kQStaged ? DH : 0)));
  threadgroup float* row_stat = partials + Shape::kSlots * WM * WN * R * BK + int(sg) * R;

  // This half's features of K and V start at feature f0 of each row: the
  // sequence's rows of them, whose static slices are the full key blocks'
  // operands, the ragged last block's rows as tensors of their own below
  // (extents innermost first, the row extent the block's valid keys).
  device const T* k_half = k + w.h.k + int64_t(w.f0) * p.k_dim_stride;
  device const T* v_half = v + w.h.v + int64_t(w.f0) * p.v_dim_stride;
  const MppDeviceTensor<T> k_seq = mpp_device_rows<DH>(k_half, seq.kv_len, p.k_row_stride, p.k_dim_stride);
  const MppDeviceTensor<T> v_seq = mpp_device_rows<DH>(v_half, seq.kv_len, p.v_row_stride, p.v_dim_stride);
  using QT = QOp;
  using KT = MppDeviceTensor<T>;
  using PT = MppTileTensor<T>;

  // S_h over this half's DH features (static K: Q's and K's features, never
  // ragged); O_h += P.V_h with K the block's valid keys (mpp_accumulate_descriptor).
  constexpr auto qk_desc = matmul2d_descriptor(R, BK, DH, false, true, mpp_relaxed(sizeof(T)),
                                               matmul2d_descriptor::mode::multiply);
  matmul2d<qk_desc, execution_simdgroup> qk;
  constexpr auto pv_desc = mpp_accumulate_descriptor(DH, mpp_relaxed(sizeof(T)));
  matmul2d<pv_desc, execution_simdgroup> pv;
  auto s = qk.template get_destination_cooperative_tensor<QT, KT, float>();
  auto acc = pv.template get_destination_cooperative_tensor<PT, KT, float>();
  auto o_r = pv.template get_row_reduction_destination_cooperative_tensor<PT, KT, float>();
  auto m_r = qk.template get_row_reduction_destination_cooperative_tensor<QT, KT, float>();
  auto l_r = qk.template get_row_reduction_destination_cooperative_tensor<QT, KT, float>();
  auto a_r = qk.template get_row_reduction_destination_cooperative_tensor<QT, KT, float>();
  auto b_r = qk.template get_row_reduction_destination_cooperative_tensor<QT, KT, float>();
  FM_UNROLL
  for (int j = 0; j < m_r.get_capacity(); ++j) {
    float m0 = kMaskedScore, l0 = 0.0f;
    if (fc_has_sinks) seed_sink(m0, l0, sinks, int(group.y));
    m_r[j] = m0;
    l_r[j] = l0;
  }
  mpp_clear(acc);
  // The layouts' coordinates, once (attention_prefill_mpp.h, mpp_softmax_block).
  auto s_at = qk.template get_destination_cooperative_tensor<QT, KT, float>();
  auto m_rows = qk.template get_row_reduction_destination_cooperative_tensor<QT, KT, float>();
  auto o_rows = pv.template get_row_reduction_destination_cooperative_tensor<PT, KT, float>();
  mpp_slot_codes<BK>(s_at);
  mpp_row_codes(m_rows);
  mpp_row_codes(o_rows);
  const bool alpha_in_registers = is_iterator_compatible(acc, a_r);

  // Key blocks, the threadgroup's (uniform: every SIMD-group meets every
  // barrier): up to what its last real row sees, from its first row's first
  // visible key's block under a left window.
  const int last_row = min(q0 + BQ, seq.q_len) - 1;
  const int n_blocks = (visible_key_end(seq, last_row) + BK - 1) / BK;
  const int first_block = fc_window_left ? first_visible_key(seq, q0) / BK : 0;

  for (int kb = first_block; kb < n_blocks; ++kb) {
    const int k0 = kb * BK;
    // This block's slot of partials (alternating when double-buffered).
    threadgroup float* slot = partials + (Shape::kSlots == 2 ? (kb & 1) : 0) * WM * WN * R * BK;
    threadgroup float* mine = slot + (rg * WN + half_id) * R * BK;
    threadgroup const float* other = slot + (rg * WN + (1 - half_id)) * R * BK;
    const int keys = min(BK, seq.kv_len - k0);  // the block's valid keys (>= 1)
    const bool full = keys == BK;  // uniform: static slices (attention_prefill_mpp.h)
    if (full) {
      auto k_blk = k_seq.template static_slice<DH, BK>(0, k0);
      qk.run(tq, k_blk, s);  // this half's partial S
    } else {
      auto k_blk = mpp_device_rows<DH>(k_half + int64_t(k0) * p.k_row_stride, keys, p.k_row_stride, p.k_dim_stride);
      qk.run(tq, k_blk, s);
    }
    FM_UNROLL
    for (int i = 0; i < s.get_capacity(); ++i) {
      const int code = int(s_at[i]);  // row * BK + key within the block
      if (code >= 0) mine[code] = s[i];
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);  // both halves' partials written before they are added (RAW)

    const bool k_edge = !full;
    const bool diagonal = fc_causal && k0 + BK - 1 > row0 + seq.upper;
    const bool left_edge = fc_window_left && k0 < row0 + R - 1 + seq.lower;
    FM_UNROLL
    for (int i = 0; i < s.get_capacity(); ++i) {
      const int code = int(s_at[i]);
      if (code < 0) continue;
      const int row = row0 + code / BK, key = k0 + code % BK;
      const float full_score = s[i] + other[code];  // S_h + S_other: the same float in both halves
      bool keep = true;
      if (k_edge && key >= seq.kv_len) keep = false;
      if (diagonal && key > row + seq.upper) keep = false;
      if (left_edge && key < row + seq.lower) keep = false;
      if (row >= seq.q_len) keep = false;  // a row past the sequence: never stored, the mask not read
      float sc = option_score<T>(p, mask, w.mask_slice, row, key, full_score * p.scale_log2, keep);
      if (sc <= kMaskedScore) sc = kMaskedScore;
      s[i] = sc;
    }

    // The online softmax, as attention_prefill_mpp.h (both halves alike).
    mpp_softmax_block<BK>(s, m_r, l_r, a_r, b_r, p_tile, row_stat, acc, o_r, s_at, m_rows, o_rows,
                          alpha_in_registers);
    if (full) {
      auto p_blk = mpp_static_tile<BK, R>(p_tile, BK);
      auto v_blk = v_seq.template static_slice<DH, BK>(0, k0);
      pv.run(p_blk, v_blk, acc);
    } else {
      auto p_blk = mpp_tile(p_tile, keys, R, BK);  // P's first `keys` columns: V's K extent
      auto v_blk = mpp_device_rows<DH>(v_half + int64_t(k0) * p.v_row_stride, keys, p.v_row_stride, p.v_dim_stride);
      pv.run(p_blk, v_blk, acc);
    }
    if (Shape::kSlots == 1) {
      // The other half has read this half's partial, and this SIMD-group's
      // lanes have read P and alpha, before the next block rewrites them
      // (WAR; one slot of partials, top of file).
      threadgroup_barrier(mem_flags::mem_threadgroup);
    } else {
      // Two slots: the next block's partials go to the other slot, and its
      // P and alpha are written after its barrier, which every thread
      // reaches only after this block's P.V; the epilogue's 1 / l, though,
      // rewrites row_stat with no barrier between: this SIMD-group's lanes
      // have read alpha first (WAR).
      simdgroup_barrier(mem_flags::mem_threadgroup);
    }
  }

  // Epilogue (mpp_store_rows, as attention_prefill_mpp.h): 1 / l per row to
  // this SIMD-group's row stats, lse from half 0, then this half's features of O.
  mpp_store_rows<BK>(m_r, l_r, acc, o_r, s_at, m_rows, o_rows, row_stat, row0, seq.q_len, half_id == 0,
                     lse + w.h.lse, p.lse_row_stride, o + w.h.o, p.o_row_stride, p.o_dim_stride, w.f0);
}

// T: half or bfloat. D: the head dim (256; q, k and v alike). BQ: query rows
// per threadgroup (16 per row group). BK: keys per block. WN: SIMD-groups
// per row group, each owning D / WN features (2: a pair).
// Launch: grid (ceil(Nq / BQ), Hq, B), threadgroup (32 * BQ / 16 * WN, 1,
// 1), threadgroup memory at index 0 (MppDsplitShape::kBytes), function
// constants and buffers as flash_attention_prefill_mpp.
// The 32-row kernel (BQ 32, 4 SIMD-groups): Q staged in threadgroup memory.
template <typename T, int D, int BQ, int BK, int WN>
[[kernel]] [[max_total_threads_per_threadgroup(kPrefillMppMaxThreads)]] void flash_attention_prefill_mpp_dsplit(
    device const T* q [[buffer(0)]],
    device const T* k [[buffer(1)]],
    device const T* v [[buffer(2)]],
    device T* o [[buffer(3)]],
    device float* lse [[buffer(4)]],
    constant AttentionParams& p [[buffer(5)]],
    device const uchar* mask [[buffer(14)]],
    device const int* cu_seqlens_q [[buffer(15)]],
    device const int* cu_seqlens_k [[buffer(16)]],
    device const float* sinks [[buffer(17)]],
    threadgroup T* smem [[threadgroup(0)]],
    uint3 group [[threadgroup_position_in_grid]],
    uint sg [[simdgroup_index_in_threadgroup]],
    uint lane [[thread_index_in_simdgroup]]) {
  using Shape = MppDsplitShape<T, D, BQ, BK, WN>;
  constexpr int R = Shape::R, NSG = Shape::NSG, DH = Shape::DH;
  static_assert(Shape::kQStaged && 32 * NSG <= kPrefillMppMaxThreads, "Q staged; the declared limit");
  MppDsplitWork w;
  if (!mpp_dsplit_begin<BQ, WN, DH>(p, cu_seqlens_q, cu_seqlens_k, group, sg, w)) return;

  // This half's Q slice (16 rows x DH features), read from device memory
  // once (as attention_prefill_mpp.h: consecutive lanes, consecutive
  // features; rows past the sequence zero-filled).
  threadgroup T* q_tile = smem + NSG * R * BK + int(sg) * R * DH;
  {
    const int rows = max(0, min(R, w.seq.q_len - w.row0));
    device const T* q_rows = q + w.h.q + int64_t(min(w.row0, w.seq.q_len - 1)) * p.q_row_stride;
    const int rs = int(p.q_row_stride), ds = int(p.q_dim_stride);
    for (int e = int(lane); e < R * DH; e += 32) {
      const int r = e / DH, c = e - r * DH;
      q_tile[e] = r < rows ? q_rows[r * rs + (w.f0 + c) * ds] : static_cast<T>(0.0f);
    }
  }
  simdgroup_barrier(mem_flags::mem_threadgroup);  // Q written before other lanes' matmul2d reads it (RAW)
  const MppStaticTileTensor<T, DH, R> tq = mpp_static_tile<DH, R>(q_tile, DH);  // whole: zeros past the sequence
  mpp_dsplit_blocks<T, D, BQ, BK, WN>(tq, w, k, v, o, lse, p, mask, sinks, smem, group, sg);
}

// The 64-row kernel (BQ 64, 8 SIMD-groups: 4 row groups, each a pair): Q in
// registers (MppDsplitShape: staged Q would be the whole 32 KiB), each
// SIMD-group's 16 x DH slice read from device memory once into a left-input
// cooperative tensor of the S op, element by element through the API (row
// and feature from get_multidimensional_index; rows past the sequence zero).
// Left-input cooperative tensors are the later SDKs' API (26.2 deployment
// target: the library's, setup.py), as MLX NAX keeps Q in fragments.
template <typename T, int D, int BQ, int BK, int WN>
[[kernel]] [[max_total_threads_per_threadgroup(kPrefillMppDsplitWideMaxThreads)]] void
flash_attention_prefill_mpp_dsplit_wide(
    device const T* q [[buffer(0)]],
    device const T* k [[buffer(1)]],
    device const T* v [[buffer(2)]],
    device T* o [[buffer(3)]],
    device float* lse [[buffer(4)]],
    constant AttentionParams& p [[buffer(5)]],
    device const uchar* mask [[buffer(14)]],
    device const int* cu_seqlens_q [[buffer(15)]],
    device const int* cu_seqlens_k [[buffer(16)]],
    device const float* sinks [[buffer(17)]],
    threadgroup T* smem [[threadgroup(0)]],
    uint3 group [[threadgroup_position_in_grid]],
    uint sg [[simdgroup_index_in_threadgroup]]) {
  using namespace mpp::tensor_ops;
  using Shape = MppDsplitShape<T, D, BQ, BK, WN>;
  constexpr int R = Shape::R, NSG = Shape::NSG, DH = Shape::DH;
  static_assert(!Shape::kQStaged && 32 * NSG <= kPrefillMppDsplitWideMaxThreads, "Q in registers; the limit");
  MppDsplitWork w;
  if (!mpp_dsplit_begin<BQ, WN, DH>(p, cu_seqlens_q, cu_seqlens_k, group, sg, w)) return;

  constexpr auto qk_desc = matmul2d_descriptor(R, BK, DH, false, true, mpp_relaxed(sizeof(T)),
                                               matmul2d_descriptor::mode::multiply);
  matmul2d<qk_desc, execution_simdgroup> qk;  // the S op of mpp_dsplit_blocks (same descriptor and scope)
  auto tq = qk.template get_left_input_cooperative_tensor<T, T, float>();
  {
    const int rows = max(0, min(R, w.seq.q_len - w.row0));
    device const T* q_rows = q + w.h.q + int64_t(min(w.row0, w.seq.q_len - 1)) * p.q_row_stride;
    const int rs = int(p.q_row_stride), ds = int(p.q_dim_stride);
    FM_UNROLL
    for (int i = 0; i < tq.get_capacity(); ++i) {
      if (!tq.is_valid_element(i)) continue;
      const auto idx = tq.get_multidimensional_index(i);  // [0] the feature within the half, [1] the row
      tq[i] = idx[1] < rows ? q_rows[idx[1] * rs + (w.f0 + idx[0]) * ds] : static_cast<T>(0.0f);
    }
  }
  mpp_dsplit_blocks<T, D, BQ, BK, WN>(tq, w, k, v, o, lse, p, mask, sinks, smem, group, sg);
}

}  // namespace flash_metal
