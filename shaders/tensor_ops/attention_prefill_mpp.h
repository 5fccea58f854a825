// The FlashAttention-2 forward ("prefill") on Metal 4 tensor operations:
// Metal Performance Primitives' mpp::tensor_ops::matmul2d, which Apple10 GPUs
// (M5) run on the per-core neural accelerators (issue 21). MSL 4 only: it is
// compiled into a library of its own (shaders/attention_mpp.metal), never
// into the MSL 3.1 attention.metal.
//
// Shape of the work, after MLX's steel_attention_nax (ml-explore/mlx,
// mlx/backend/metal/kernels/steel/attn/kernels/steel_attention_nax.h; ideas
// only, the code here is this project's): one threadgroup per (batch, query
// head, block of BQ = 64 query rows), WM = 4 SIMD-groups each owning 16 rows,
// keys in blocks of BK = 32. Each SIMD-group is independent (its own rows,
// its own slice of threadgroup memory), so the kernel has no threadgroup
// barrier at all; K and V are read by matmul2d straight from device memory,
// as MLX's NAX kernel reads them into registers (no staging tiles).
//
// Q is read from device memory once: each SIMD-group copies its 16 x D rows
// into its own slice of threadgroup memory before the key loop, and every
// S = Q.K^T takes that slice as its left operand. Before, S took Q as a
// tensor over device memory, so each SIMD-group asked for its Q rows again
// for every key block: 128x the Q traffic at Nk = 4096, which the model
// (benchmarks/model/families/accel.py) found made the kernel memory-bound, 1.5x
// over MLX's measured time. Why threadgroup memory and not registers (a left
// input cooperative tensor filled once, as MLX keeps Q in fragments):
//   - a tensor over threadgroup memory as matmul2d's left operand is in the
//     macOS 26.0 MPP headers (threadgroup loads in its Impl header) and is
//     what this kernel already does with P; input cooperative tensors
//     (get_left_input_cooperative_tensor) came with a later SDK, and their
//     lowering changed at a 26.2 deployment target (MLX #3622: through a
//     destination-tensor shim below it), where MLX's GEMM was miscompiled
//     (#3586) and PyTorch's kernel got another lane layout (#191794);
//   - no registers added per lane (O's 16 x D floats are already there;
//     mtlattn found a register-resident forward 3x slower for occupancy).
// Its price: 16 x D x sizeof(T) more threadgroup memory per SIMD-group
// (below), so fewer threadgroups fit a core by threadgroup memory, and
// matmul2d reads Q from threadgroup memory each block (on-core bandwidth,
// not device memory). Which way is faster on an M5 only a Mac can say.
//
// Per key block, per SIMD-group:
//   S = Q.K^T     matmul2d (16 x BK, K = D, K transposed) into a float
//                 destination cooperative tensor; Q from this SIMD-group's
//                 threadgroup slice (rows past the sequence zero-filled),
//                 K a tensor over device memory, the block's rows, whose
//                 row extent ends at the block's last valid key; scores
//                 past it are masked, never used (mpp_device_rows).
//   softmax       on the cooperative tensor: each element learns its (row,
//                 key) only from get_multidimensional_index (the lane layout
//                 is implementation defined and differs across GPU
//                 generations: PyTorch #182256, #191794), is scaled to base 2
//                 and masked; row max and row sum by reduce_rows into row
//                 reduction tensors, which also keep the running max m and
//                 sum l of the rows across blocks.
//   P             exp2(S - m) rounded to T (FlashAttention rounds P to the
//                 input dtype before P.V) and written to threadgroup memory,
//                 with each row's rescale factor alpha beside it: macOS 26
//                 has no conversion from a destination cooperative tensor to
//                 the next op's input for our shapes (WWDC26-330: direct
//                 chaining is new in macOS 27), and the rows of O's layout
//                 need not be those of S's, so alpha goes by row number too.
//   O = alpha*O + P.V   the rescale per element of O's own layout (alpha
//                 read from threadgroup memory once per row a thread holds,
//                 into a row reduction tensor of O's layout, not once per
//                 element: the model found those reads the largest on-core
//                 traffic), then matmul2d (16 x D) with
//                 multiply_accumulate into O, a float destination
//                 cooperative tensor per SIMD-group; K dynamic, read from P's
//                 and V's views of the block's valid keys (mpp_accumulate_descriptor:
//                 a static K would read past V's last row on a ragged
//                 block, undefined on Apple's GPUs).
// Epilogue: O / l stored element by element through the API, lse = m ln 2 +
// ln l (the convention of attention_prefill.h: zeros and lse = -inf for a
// row that saw no key).
//
// Threadgroup memory at [[threadgroup(0)]], sized by the host
// (csrc/metal/plan_detail.h, tensor_ops_threadgroup_memory):
//   WM * 16 * BK * sizeof(T)   P of each SIMD-group (16 rows of BK, row-major)
//   + WM * 16 * D * sizeof(T)  Q of each SIMD-group (16 rows of D, row-major)
//   + WM * 16 * 4              a float per row of each SIMD-group (alpha, then 1 / l)
// For float16 / bfloat16 at WM = 4, BK = 32: 12,544 bytes at D = 64, 16,640
// at D = 96, 20,736 at D = 128 and 28,928 at the MLA pair (D = 192, DV =
// 128: only Q is staged, so DV does not count), under Metal's 32 KiB per
// threadgroup (the host checks it statically; no D = 256 instantiation here).
//
// What the emulator cannot tell (tests/metal_emulator/README.md, "MPP tensor
// ops"): Apple's real layouts, whether its run() accumulates in another
// order, and whether Apple's compiler takes the kernel (the emulator's shim
// holds it to the rules of Apple's MPP headers, but Apple's compiler has
// never seen it). Not yet verified on Apple hardware.
#pragma once

#include "attention_mpp_common.h"

namespace flash_metal {

// What a forward kernel learns of its cooperative tensors' layouts once,
// before its key loop (attention_mpp_common.h, "coordinate bookkeeping"),
// passed to the helpers below: s_at, S's code tensor (row * BK + key, -1
// for an invalid slot); m_rows, the rows of S's row reductions (m, l,
// alpha); o_rows, those of O's (o_r); and alpha_in_registers, whether
// alpha's reduction (of S's op) can serve O's elements directly:
// is_iterator_compatible(acc, a_r) (MSL specification 4, section 7.2.1).
// When it can, alpha stays in registers (a_r.map_iterator); when not, it
// goes by row number through threadgroup memory (row_stat), as Apple's
// header prescribes for incompatible layouts. Under the published M5 layout
// both 16-row destinations give a lane the same rows, so it can.

// One key block's online softmax on the scores' cooperative tensor `s`
// (scaled to base 2 and masked by the caller), shared by this forward and
// its split-D version (attention_prefill_mpp_dsplit.h): the rows' new max
// m_r and alpha a_r = exp2(old max - new max) (finite, <= 0 argument; a
// masked score never raises the max above kMaskedScore); P = exp2(S - max),
// weight 0 for a masked score by an explicit test, in T to the SIMD-group's
// p_tile (16 rows of BK, at the element's code), and, only where alpha
// cannot stay in registers, each row's alpha to row_stat from the one thread
// holding the row's first key (exactly one writer per row); the sum l_r;
// then, after the barrier, O's accumulator `acc` rescaled by alpha per
// element of its own layout. b_r is scratch; o_r is O's row reduction (the
// fallback's alpha). The caller runs O += P.V next. No coordinate query but
// O's map_iterator: the codes were learnt before the loop (above).
template <int BK, typename S, typename SR, typename T, typename A, typename AR>
FM_INLINE void mpp_softmax_block(thread S& s, thread SR& m_r, thread SR& l_r, thread SR& a_r, thread SR& b_r,
                                 threadgroup T* p_tile, threadgroup float* row_stat, thread A& acc, thread AR& o_r,
                                 thread const S& s_at, thread const SR& m_rows, thread const AR& o_rows,
                                 bool alpha_in_registers) {
  using namespace mpp::tensor_ops;
  reduce_rows(s, b_r, reduction_operation::max, float(kMaskedScore));  // one element type: float
  FM_UNROLL
  for (int j = 0; j < m_r.get_capacity(); ++j) {
    const float m_new = max(m_r[j], b_r[j]);
    a_r[j] = exp2(m_r[j] - m_new);
    m_r[j] = m_new;
  }
  FM_UNROLL
  for (int i = 0; i < s.get_capacity(); ++i) {
    const int code = int(s_at[i]);  // row * BK + key within the block
    if (code < 0) continue;
    const int row = code / BK;
    const float w = s[i] <= kMaskedScore ? 0.0f : exp2(s[i] - mpp_row_value(m_r, m_rows, row));
    s[i] = w;
    p_tile[code] = static_cast<T>(w);
    if (!alpha_in_registers && code % BK == 0) row_stat[row] = mpp_row_value(a_r, m_rows, row);
  }
  reduce_rows(s, b_r, reduction_operation::sum);
  FM_UNROLL
  for (int j = 0; j < l_r.get_capacity(); ++j) l_r[j] = l_r[j] * a_r[j] + b_r[j];
  simdgroup_barrier(mem_flags::mem_threadgroup);  // P (and alpha) written before other lanes read them (RAW)

  if (alpha_in_registers) {
    mpp_scale_rows(acc, a_r);
  } else {
    mpp_rows_from(o_r, o_rows, row_stat);
    mpp_scale_rows(acc, o_r);
  }
}

// The epilogue, shared likewise: each row's 1 / l (0 for a row that saw no
// key) to row_stat and, if `write_lse`, its lse to `lse_rows` (the head's
// first row) from the row's one first-key holder; then O / l by every
// element of O's layout, to `o_out` (the head's first row) at feature
// f0 + the element's column, for rows before `q_len`. row0: the
// SIMD-group's first row. lse = m ln 2 + ln l in one fma
// (attention_prefill.h); -inf made from bits for a row that saw no key
// (attention_common.h, fast math). Once per kernel: O's coordinates are
// asked here (O's code tensor would cost 16 x D / 32 registers).
template <int BK, typename T, typename S, typename SR, typename A, typename AR>
FM_INLINE void mpp_store_rows(thread const SR& m_r, thread const SR& l_r, thread A& acc, thread AR& o_r,
                              thread const S& s_at, thread const SR& m_rows, thread const AR& o_rows,
                              threadgroup float* row_stat, int row0,
                              int q_len, bool write_lse, device float* lse_rows, int64_t lse_row_stride,
                              device T* o_out, int64_t o_row_stride, int64_t o_dim_stride, int f0) {
  FM_UNROLL
  for (int i = 0; i < s_at.get_capacity(); ++i) {
    const int code = int(s_at[i]);
    if (code < 0 || code % BK != 0) continue;
    const int r = code / BK;
    const float m = mpp_row_value(m_r, m_rows, r), l = mpp_row_value(l_r, m_rows, r);
    row_stat[r] = l > 0.0f ? 1.0f / l : 0.0f;
    const int row = row0 + r;
    if (write_lse && row < q_len) {
      const uint bits = l > 0.0f ? as_type<uint>(fma(m, M_LN2_F, log(l))) : kNegInfBits;
      lse_rows[int64_t(row) * lse_row_stride] = as_type<float>(bits);
    }
  }
  simdgroup_barrier(mem_flags::mem_threadgroup);  // 1 / l written before other lanes read them (RAW)
  mpp_rows_from(o_r, o_rows, row_stat);
  FM_UNROLL
  for (int i = 0; i < acc.get_capacity(); ++i) {
    if (!acc.is_valid_element(i)) continue;
    const auto idx = acc.get_multidimensional_index(i);  // [0] the feature, [1] the row
    const int row = row0 + idx[1];
    if (row < q_len) {
      o_out[int64_t(row) * o_row_stride + int64_t(f0 + idx[0]) * o_dim_stride] =
          static_cast<T>(acc[i] * mpp_row_value(o_r, o_rows, idx[1]));
    }
  }
}

// T: half or bfloat (float32 stays on the simdgroup kernel). D: q's and
// k's head dim, DV: v's and o's, exactly (64, 96, 128 with DV = D, or
// DeepSeek's MLA pair D = 192, DV = 128: no padding). BQ = 16 * WM query
// rows, BK keys.
// Launch: grid (ceil(Nq / BQ), Hq, B), threadgroup (32 * WM, 1, 1),
// threadgroup memory at index 0 (top of file), function constants fc_causal
// (0) and the options' 4-9 and 11 (attention_features.h), buffers as the
// simdgroup prefill's (attention_prefill.h).
template <typename T, int D, int DV, int BQ, int BK>
[[kernel]] [[max_total_threads_per_threadgroup(kPrefillMppMaxThreads)]] void flash_attention_prefill_mpp(
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
  using namespace mpp::tensor_ops;
  constexpr int R = kMppRowsPerSimd;
  constexpr int WM = BQ / R;
  static_assert(BQ % R == 0 && 32 * WM <= kPrefillMppMaxThreads, "WM SIMD-groups of 16 rows, declared limit");
  threadgroup T* p_tile = smem + int(sg) * R * BK;  // this SIMD-group's P, R x BK
  threadgroup float* row_stat =
      reinterpret_cast<threadgroup float*>(smem + WM * R * (BK + D)) + int(sg) * R;  // a float per row, after P and Q

  const SeqView seq = sequence_view(p, cu_seqlens_q, cu_seqlens_k, group.z);
  const int row0 = int(group.x) * BQ + int(sg) * R;  // this SIMD-group's first query row
  // Rows past the sequence (the ragged last block, or varlen blocks past a
  // short sequence): nothing to do. Uniform across the SIMD-group, and no
  // collective spans SIMD-groups, so it may leave alone.
  if (row0 >= seq.q_len) return;
  HeadOffsets h = head_offsets(p, group.z, group.y);
  h.q += seq.q_row0 * p.q_row_stride;
  h.o += seq.q_row0 * p.o_row_stride;
  h.lse += seq.q_row0 * p.lse_row_stride;
  h.k += seq.k_row0 * p.k_row_stride;
  h.v += seq.k_row0 * p.v_row_stride;
  const int64_t mask_slice = fc_has_mask ? mask_head_offset(p, group.z, group.y) : 0;

  // This SIMD-group's Q rows, read from device memory once (top of file):
  // lane l copies elements l, l + 32, ... of the 16 x D row-major slice, so
  // consecutive lanes read consecutive features of a row; rows past the
  // sequence are zeros (S's rows there are never stored). Offsets within the
  // head in int32 (the host checked that a head's offsets fit).
  threadgroup T* q_tile = smem + WM * R * BK + int(sg) * R * D;
  mpp_stage_rows<D>(q_tile, q + h.q + int64_t(row0) * p.q_row_stride, min(R, seq.q_len - row0), int(p.q_row_stride),
                    int(p.q_dim_stride), lane);
  simdgroup_barrier(mem_flags::mem_threadgroup);  // Q written before other lanes' matmul2d reads it (RAW)

  // Q's slice as a tensor; K's and V's rows per key block (below): extents
  // innermost first (features, rows), strides in elements (int32: checked
  // as above), the row extent the block's valid keys.
  // Q's tile is whole (rows past the sequence are zeros): static extents.
  const MppStaticTileTensor<T, D, R> tq = mpp_static_tile<D, R>(q_tile, D);
  using QT = MppStaticTileTensor<T, D, R>;
  using KT = MppDeviceTensor<T>;
  using PT = MppTileTensor<T>;
  // The sequence's K and V rows, whose static slices are the full key
  // blocks' operands (mpp_static_tile's note, attention_mpp_common.h).
  const MppDeviceTensor<T> k_seq = mpp_device_rows<D>(k + h.k, seq.kv_len, p.k_row_stride, p.k_dim_stride);
  const MppDeviceTensor<T> v_seq = mpp_device_rows<DV>(v + h.v, seq.kv_len, p.v_row_stride, p.v_dim_stride);

  // The 16-row step (attention_mpp_common.h): S = Q.K^T (16 x BK, K = D)
  // and O += P.V (16 x DV, K the block's valid keys: mpp_accumulate_descriptor). DV != D
  // (MLA): S's op is D wide, O's DV wide (two op types either way; nothing
  // is combined slot by slot across them). A destination is asked for with
  // the dynamic operand types and run with the static slices too: Apple's
  // layouts are keyed by the operands' element types (the AIR of a
  // matmul2d kernel names its cooperative tensor's layout
  // __operand_layout<descriptor, index, scope, half, half, float, int>).
  typename MppRowStep<D, BK, T>::Scores qk;
  constexpr auto pv_desc = mpp_accumulate_descriptor(DV, mpp_relaxed(sizeof(T)));
  matmul2d<pv_desc, execution_simdgroup> pv;
  auto s = qk.template get_destination_cooperative_tensor<QT, KT, float>();
  auto acc = pv.template get_destination_cooperative_tensor<PT, KT, float>();
  // A factor per row of O's layout held by this thread (alpha where it
  // cannot stay in registers, then 1 / l).
  auto o_r = pv.template get_row_reduction_destination_cooperative_tensor<PT, KT, float>();
  // The rows' running max (base 2) and sum, "no key yet" (attention_common.h),
  // or the sink as if a first key; alpha and the block's max / sum beside them.
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
  // The layouts' coordinates, once (mpp_softmax_block's note above).
  auto s_at = qk.template get_destination_cooperative_tensor<QT, KT, float>();
  auto m_rows = qk.template get_row_reduction_destination_cooperative_tensor<QT, KT, float>();
  auto o_rows = pv.template get_row_reduction_destination_cooperative_tensor<PT, KT, float>();
  mpp_slot_codes<BK>(s_at);
  mpp_row_codes(m_rows);
  mpp_row_codes(o_rows);
  const bool alpha_in_registers = is_iterator_compatible(acc, a_r);

  // Key blocks this SIMD-group's rows can see: as far as its last real row
  // sees under causal masking or a right window (later blocks are wholly in
  // the future), and from the block of its first row's first visible key
  // under a left window. A SIMD-group that sees no key runs no block.
  const int last_row = min(row0 + R, seq.q_len) - 1;
  const int n_blocks = (visible_key_end(seq, last_row) + BK - 1) / BK;
  const int first_block = fc_window_left ? first_visible_key(seq, row0) / BK : 0;

  for (int kb = first_block; kb < n_blocks; ++kb) {
    const int k0 = kb * BK, keys = min(BK, seq.kv_len - k0);  // the block's valid keys (>= 1)
    // The block's K rows (N of S) and V rows (K of P.V): a full block's as
    // static slices (no edge checks), the ragged last block's as tensors
    // whose row extent ends at its last valid key (scores past it are
    // masked, never used; P.V's dynamic K reads that extent). Uniform per
    // SIMD-group. Named: run() takes lvalues (Apple declares no other overload).
    const bool full = keys == BK;
    if (full) {
      auto k_blk = k_seq.template static_slice<D, BK>(0, k0);
      qk.run(tq, k_blk, s);
    } else {
      auto k_blk = mpp_device_rows<D>(k + h.k + int64_t(k0) * p.k_row_stride, keys, p.k_row_stride, p.k_dim_stride);
      qk.run(tq, k_blk, s);
    }

    // Scores to base 2 after the product (in float, as attention_prefill.h),
    // then the options; a key past the sequence or outside the window is
    // dropped before the mask is read. Element tests only where the block
    // crosses an edge for some row of the SIMD-group.
    const bool k_edge = !full;
    const bool diagonal = fc_causal && k0 + BK - 1 > row0 + seq.upper;
    const bool left_edge = fc_window_left && k0 < row0 + R - 1 + seq.lower;
    FM_UNROLL
    for (int i = 0; i < s.get_capacity(); ++i) {
      const int code = int(s_at[i]);  // row * BK + key within the block
      if (code < 0) continue;
      const int row = row0 + code / BK, key = k0 + code % BK;
      bool keep = true;
      if (k_edge && key >= seq.kv_len) keep = false;
      if (diagonal && key > row + seq.upper) keep = false;
      if (left_edge && key < row + seq.lower) keep = false;
      if (fc_has_mask && row >= seq.q_len) keep = false;
      float sc = option_score<T>(p, mask, mask_slice, row, key, s[i] * p.scale_log2, keep);
      if (sc <= kMaskedScore) sc = kMaskedScore;  // -inf from the inputs or the mask: finite (fast math)
      s[i] = sc;
    }

    mpp_softmax_block<BK>(s, m_r, l_r, a_r, b_r, p_tile, row_stat, acc, o_r, s_at, m_rows, o_rows,
                          alpha_in_registers);
    if (full) {
      auto p_blk = mpp_static_tile<BK, R>(p_tile, BK);
      auto v_blk = v_seq.template static_slice<DV, BK>(0, k0);
      pv.run(p_blk, v_blk, acc);
    } else {
      // P's first `keys` columns: the same K extent as V's rows.
      auto p_blk = mpp_tile(p_tile, keys, R, BK);
      auto v_blk = mpp_device_rows<DV>(v + h.v + int64_t(k0) * p.v_row_stride, keys, p.v_row_stride, p.v_dim_stride);
      pv.run(p_blk, v_blk, acc);
    }
    simdgroup_barrier(mem_flags::mem_threadgroup);  // P and alpha read before the next block rewrites them (WAR)
  }

  // Epilogue: 1 / l and lse per row, then O / l (mpp_store_rows).
  mpp_store_rows<BK>(m_r, l_r, acc, o_r, s_at, m_rows, o_rows, row_stat, row0, seq.q_len, true, lse + h.lse,
                     p.lse_row_stride, o + h.o, p.o_row_stride, p.o_dim_stride, 0);
}

}  // namespace flash_metal
