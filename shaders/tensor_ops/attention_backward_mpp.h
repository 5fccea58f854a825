// The FlashAttention-2 backward on Metal 4 tensor operations (MPP matmul2d,
// issue 21 item 2): the simdgroup backward's algorithm and atomics-free
// split (shaders/backward/attention_backward.h; metal-flash-attention's idea), with
// every matrix product on matmul2d. Two kernels, no atomics, deterministic:
//
//   flash_backward_mpp_dq    grid (ceil(Nq / BQ), Hq, B), 32 * BQ / 16 threads
//     per SIMD-group of 16 query rows: Delta = rowsum(dO * O) - grad_lse
//     (written to the float32 scratch for the second kernel), then over the
//     key blocks of BK keys the rows see: S = Q.K^T, dP = dO.V^T (two runs
//     of one 16 x BK op, K and V transposed from device memory),
//     P = exp2(S * scale * log2 e - lse * log2 e), dS = P * (dP - Delta),
//     dQ += dS.K (multiply_accumulate into a float destination); dQ * scale.
//   flash_backward_mpp_dkdv  grid (ceil(Nk / BKV), Hkv, B), 32 * BKV / 16 threads
//     per SIMD-group of 16 keys, over the GQA group's query heads and the
//     query blocks of BQ rows that see its keys: S^T = K.Q^T and
//     dP^T = V.dO^T (two runs of one 16 x BQ op), P^T, dS^T = P^T * (dP^T -
//     Delta), dV += P^T.dO, dK += dS^T.Q; dK * scale and dV stored.
//
// S^T and dP^T are computed transposed (keys as rows) rather than as Q.K^T
// transposed afterwards, so the products P^T.dO and dS^T.Q take P^T and dS^T
// as plain (untransposed) left operands: no transpose_left is needed.
//
// The lane layout of a cooperative tensor is the implementation's (PyTorch
// #182256, #191794): every element learns its (row, column) only through
// get_multidimensional_index. S and dP (S^T and dP^T) come from two runs of
// the same matmul2d type with operands of the same types, so their
// destination cooperative tensors have one type and hold the same element in
// the same slot: dS is formed slot by slot from the two (the layout is a
// function of the type and the thread, never of the instance: notes
// "Cooperative tensors"; the emulator keys its layouts by the op's descriptor
// and scope, and proves this use in test_emu_mpp.py).
//
// P and dS are rounded to T before their products: matmul2d's operand table
// pairs half with half and bfloat with bfloat (no float x half), as
// FlashAttention-2 on CUDA rounds them for its tensor cores. (The simdgroup
// backward keeps them float32: its 8x8 fragments are float. The 2x rule
// against PyTorch's attention in the same dtype, which rounds P too, holds
// for both.) Accumulation is float32: destination cooperative tensors of
// float, multiply_accumulate across blocks.
//
// The dQ kernel's SIMD-groups are independent, as in the forward
// (attention_prefill_mpp.h): each stages its own tiles in its own slice of
// threadgroup memory, so no threadgroup barrier is needed, only
// simdgroup_barrier between the phases that pass data through threadgroup
// memory (lane to lane). The dK/dV kernel's SIMD-groups share each streamed
// Q / dO block (and its queries' lse and Delta): the threadgroup stages it
// once, cooperatively, between two threadgroup barriers per block (the
// simdgroup dK/dV kernel's scheme). Threadgroup memory
// (csrc/metal/plan_detail.h, tensor_ops_backward_bytes):
//   dQ:    per SIMD-group Q and dO (16 x D each, T), dS (16 x BK, T), 4 floats per row
//   dK/dV: shared Q and dO (BQ x D each, T) and 4 floats per streamed query
//          (m2, m2lo, Delta, seen); per SIMD-group P^T and dS^T (16 x BQ
//          each, T); K and V from device memory (see the kernel)
// The host picks BQ (dQ) and BKV (dK/dV) as the most SIMD-groups (4, else 2)
// that fit Metal's 32 KiB.
//
// Options, as the simdgroup backward takes them (attention_features.h's
// helpers, each behind its function constant): causal (bottom-right) and
// windows, with block skipping in both kernels (the dK/dV kernel per 16
// keys); softcap (dS times the cap's derivative); bool and additive masks
// (read only for kept keys); varlen (each threadgroup one sequence of the
// packed tensors, packed gradients); GQA; sinks (the forward's lse includes
// them, so P needs nothing; grad_sinks by the simdgroup backward's
// flash_sinks_grad from Delta and lse, a dispatch the host appends).
//
// A v head dim of its own (MLA, DeepSeek's D = 192, DV = 128; issue 20
// section 2): S = Q.K^T reduces over D, dP = dO.V^T over DV, dQ and dK
// have D columns, dV DV. dS is still formed slot by slot from S's and dP's
// destinations, so the two runs must stay one matmul2d type: their shared
// op (MppScoresPair below) leaves K dynamic when D != DV. The destination
// is M x N whatever the reduction width; the MPP header's descriptor has
// K = dynamic as its default, read from the operands at run(), and the
// cooperative tensor's driver functions (MPPTensorOpsMatMul2dImpl.h,
// __tensorops_impl_matmul2d_op_cooperative_tensor_*) take the op's
// descriptor and element types, never an operand's extents: a dynamic-K op
// run on a D-wide and a DV-wide left operand of one tensor type gives
// destinations of one type, hence one layout (notes "matmul2d_descriptor"
// and "Cooperative tensors"; the emulator reads a dynamic K from the left
// operand and keys its layouts by the descriptor, so a static-K pair, two
// types, would fail under "scrambled").
//
// Not yet verified on Apple hardware: the emulator runs it under the
// published M5 layout and a scrambled one (tests/metal/test_metal_tensor_ops_backward.py).
#pragma once

#include "attention_mpp_common.h"

namespace flash_metal {

// [[function_constant(3)]], as the simdgroup backward's fc_has_grad_lse (the
// host sets the same index): a gradient flows into lse (grad_lse is read).
constant bool fc_mpp_has_grad_lse [[function_constant(3)]];

// log2 e's float32 remainder, (log2 e) - (float)(log2 e), as
// attention_backward.h's kLog2eLo: the row's base-2 lse is m2 + m2lo, m2 =
// lse * log2 e rounded, m2lo its rounding error plus lse times this.
constant float kMppLog2eLo = 1.925963e-08f;

// Floats per row (dQ) or streamed query (dK/dV) in a SIMD-group's stats:
// m2, m2lo, Delta, and 1 / 0 for a row that saw some key / none.
constant constexpr int kMppStats = 4;

// The scores op of both kernels, run twice per block (S over D, dP over DV;
// top of file): 16 x BK, right operand transposed, K = D when D == DV (the
// 16-row step's own scores op: the equal-dims kernels are unchanged), else
// dynamic (MPP's static_cast<int>(metal::dynamic_extent), 26.0's
// dynamic_length_v<int>): K comes from each run's left operand, and the
// two runs stay one type. Both widths are multiples of 32 (reported: a
// static K that is not was truncated by Xcode 26.1; not a concern here).
template <int D, int DV, int BK, typename T>
struct MppScoresPair {
  static constant constexpr int kReduction = D == DV ? D : static_cast<int>(metal::dynamic_extent);
  // The descriptor in place, not a static member (MppRowStep says why).
  using Op = mpp::tensor_ops::matmul2d<
      mpp::tensor_ops::matmul2d_descriptor(kMppRowsPerSimd, BK, kReduction, false, true, mpp_relaxed(sizeof(T)),
                                           mpp::tensor_ops::matmul2d_descriptor::mode::multiply),
      metal::execution_simdgroup>;
};

// The packed (B, H, N, D) offset of row `row` of head `head` (grad_q,
// grad_k, grad_v and, with D = 1, Delta).
inline int64_t mpp_packed_row(uint batch, uint head, int heads, int n, int64_t row, int D) {
  return ((int64_t(batch) * heads + int64_t(head)) * n + row) * D;
}

// A row's stats from its lse (and Delta): m2 + m2lo = lse * log2 e, and
// whether it saw a key (the forward's -inf, tested on the bits: fast math).
FM_INLINE void mpp_row_stats(threadgroup float* st, float l, float dl) {
  const bool seen = as_type<uint>(l) != kNegInfBits;
  const float m2 = seen ? l * M_LOG2E_F : 0.0f;
  st[0] = m2;
  st[1] = seen ? fma(l, M_LOG2E_F, -m2) + l * kMppLog2eLo : 0.0f;
  st[2] = dl;
  st[3] = seen ? 1.0f : 0.0f;
}

// The query blocks (BQ rows each) a dK/dV threadgroup walks, for keys
// [tg_key0, tg_key0 + tg_keys): [begin, end) see some of them (the loop
// every thread runs, for the barriers); [own_begin, own_end) see some of
// keys [key0, key0 + keys), the ones a SIMD-group (or a split-D pair)
// computes. Causal (or a right window): query i sees key j only if i >= j -
// upper; a left window, only if i <= j - lower. Shared by the dK/dV kernels
// here and in attention_backward_mpp_dsplit.h.
struct MppQueryBlocks {
  int begin, end, own_begin, own_end;
};
template <int BQ>
FM_INLINE MppQueryBlocks mpp_query_blocks(SeqView seq, int tg_key0, int tg_keys, int key0, int keys) {
  const int tg_last_key = min(tg_key0 + tg_keys, seq.kv_len) - 1, own_last_key = min(key0 + keys, seq.kv_len) - 1;
  const int tg_first_row = fc_causal ? clamp(tg_key0 - seq.upper, 0, seq.q_len) : 0;
  const int own_first_row = fc_causal ? clamp(key0 - seq.upper, 0, seq.q_len) : 0;
  const int tg_row_end = fc_window_left ? clamp(tg_last_key - seq.lower + 1, 0, seq.q_len) : seq.q_len;
  const int own_row_end = fc_window_left ? clamp(own_last_key - seq.lower + 1, 0, seq.q_len) : seq.q_len;
  MppQueryBlocks b;
  b.begin = tg_first_row / BQ;
  b.end = (tg_row_end + BQ - 1) / BQ;
  b.own_begin = own_first_row / BQ;
  b.own_end = (own_row_end + BQ - 1) / BQ;
  return b;
}

// One query head's rows as a dK/dV kernel streams them: Q and dO of the
// sequence (element strides), the offset of its lse, its Delta (packed) and
// its mask slice. Shared as mpp_query_blocks is.
template <typename T>
struct MppHeadRows {
  device const T* q;
  device const T* dout;
  device const float* delta;
  int64_t lse;
  int64_t mask_slice;
  int qs, qd, ds, dd;
};
template <typename T>
FM_INLINE MppHeadRows<T> mpp_head_rows(constant AttentionParams& p, SeqView seq, uint batch, uint head, uint packed_b,
                                       int packed_q, device const T* q, device const T* dout,
                                       device const float* delta) {
  HeadOffsets h = head_offsets(p, batch, head);
  MppHeadRows<T> r;
  r.q = q + h.q + seq.q_row0 * p.q_row_stride;
  r.dout = dout + int64_t(batch) * p.do_batch_stride + int64_t(head) * p.do_head_stride + seq.q_row0 * p.do_row_stride;
  r.delta = delta + mpp_packed_row(packed_b, head, p.q_heads, packed_q, seq.q_row0, 1);
  r.lse = h.lse + seq.q_row0 * p.lse_row_stride;
  r.mask_slice = fc_has_mask ? mask_head_offset(p, batch, head) : 0;
  r.qs = int(p.q_row_stride);
  r.qd = int(p.q_dim_stride);
  r.ds = int(p.do_row_stride);
  r.dd = int(p.do_dim_stride);
  return r;
}

// Stages query block [q0, q0 + BQ) of one head into threadgroup memory for
// all the threadgroup's SIMD-groups: Q (BQ x D) and dO (BQ x DV) rows, zeros
// past the sequence, thread t copying elements t, t + THREADS, ...
// (consecutive threads, consecutive features; offsets within the head in
// int32, checked by the host), and each query's stats from one thread. The
// caller's barrier follows; the previous block's reads ended at its own.
template <typename T, int D, int DV, int BQ, int THREADS>
FM_INLINE void mpp_stage_query_block(MppHeadRows<T> hr, device const float* lse, constant AttentionParams& p, int q0,
                                     int q_len, uint tid, threadgroup T* q_blk, threadgroup T* do_blk,
                                     threadgroup float* stats) {
  for (int e = int(tid); e < BQ * D; e += THREADS) {
    const int r = e / D, c = e - r * D;  // D a template constant: no division at run time
    const int row = q0 + r;
    const bool in = row < q_len;
    q_blk[e] = in ? hr.q[row * hr.qs + c * hr.qd] : static_cast<T>(0.0f);
    if (DV == D) do_blk[e] = in ? hr.dout[row * hr.ds + c * hr.dd] : static_cast<T>(0.0f);
  }
  if (DV != D) {  // dO at its own width (MLA): a loop of its own
    for (int e = int(tid); e < BQ * DV; e += THREADS) {
      const int r = e / DV, c = e - r * DV;
      const int row = q0 + r;
      do_blk[e] = row < q_len ? hr.dout[row * hr.ds + c * hr.dd] : static_cast<T>(0.0f);
    }
  }
  if (int(tid) < BQ) {
    const int row = q0 + int(tid);
    float l = as_type<float>(kNegInfBits), dl = 0.0f;
    if (row < q_len) {
      l = lse[hr.lse + int64_t(row) * p.lse_row_stride];
      dl = hr.delta[row];
    }
    mpp_row_stats(stats + int(tid) * kMppStats, l, dl);
  }
}

// P of one element from its raw score s and its row's stats (0 where the
// key is dropped or the row saw none), the simdgroup backward's
// exp2(fma(S, scale_log2, -m2) - m2lo). With fc_softcap or fc_has_mask the
// forward's order (attention_features.h): softcap on the base-2 score, then
// the mask (a dropped key, or a score at or below kMaskedScore, gives 0),
// read only for a kept key; *cap_grad gets softcap's derivative 1 - t^2 (t
// = tanh(s / softcap), recomputed), which scales dS, else 1. The simdgroup
// backward's backward_weight (attention_backward.h), over the stats layout
// of this file; sinks need nothing here (the forward's lse includes them).
template <typename T>
FM_INLINE float mpp_weight(constant AttentionParams& p, device const uchar* mask, int64_t mask_slice, int row, int key,
                           threadgroup const float* st, float s, bool keep, thread float* cap_grad) {
  *cap_grad = 1.0f;
  if (!keep || st[3] == 0.0f) return 0.0f;
  if (!fc_softcap && !fc_has_mask) return exp2(fma(s, p.scale_log2, -st[0]) - st[1]);
  float s2 = s * p.scale_log2;
  if (fc_softcap) {
    float t;
    s2 = softcap_score(p, s2, &t);
    *cap_grad = 1.0f - t * t;
  }
  if (fc_has_mask) {
    bool drop;
    s2 += mask_term<T>(p, mask, mask_slice, row, key, &drop);
    if (drop || s2 <= kMaskedScore) return 0.0f;
  }
  return exp2((s2 - st[0]) - st[1]);
}

// T: half or bfloat. D: q's and k's head dim, DV: v's (64, 96, 128 with
// DV = D, or D = 192, DV = 128), exactly. BQ = 16 * WM query rows per
// threadgroup, BK keys per block. Launch: grid (ceil(Nq / BQ), Hq, B),
// threadgroup (32 * WM, 1, 1), threadgroup memory at index 0 (top of file),
// function constants fc_causal (0), fc_mpp_has_grad_lse (3) and the
// options' 4-9 (attention_features.h), their buffers at 14-16.
template <typename T, int D, int DV, int BQ, int BK>
[[kernel]] [[max_total_threads_per_threadgroup(kPrefillMppMaxThreads)]] void flash_backward_mpp_dq(
    device const T* q [[buffer(0)]],
    device const T* k [[buffer(1)]],
    device const T* v [[buffer(2)]],
    device const T* o [[buffer(3)]],
    device const float* lse [[buffer(4)]],
    constant AttentionParams& p [[buffer(5)]],
    device const T* dout [[buffer(8)]],
    device T* dq [[buffer(9)]],
    device const float* dlse [[buffer(12)]],
    device float* delta [[buffer(13)]],
    device const uchar* mask [[buffer(14)]],
    device const int* cu_seqlens_q [[buffer(15)]],
    device const int* cu_seqlens_k [[buffer(16)]],
    threadgroup T* smem [[threadgroup(0)]],
    uint3 group [[threadgroup_position_in_grid]],
    uint sg [[simdgroup_index_in_threadgroup]],
    uint lane [[thread_index_in_simdgroup]]) {
  using namespace mpp::tensor_ops;
  constexpr int R = kMppRowsPerSimd;
  constexpr int WM = BQ / R;
  static_assert(BQ % R == 0 && 32 * WM <= kPrefillMppMaxThreads, "WM SIMD-groups of 16 rows, declared limit");
  // This SIMD-group's slice: Q (16 x D), dO (16 x DV), dS, then its rows' stats.
  constexpr int SLICE = R * (D + DV) + R * BK + R * kMppStats * 4 / int(sizeof(T));
  threadgroup T* q_tile = smem + int(sg) * SLICE;
  threadgroup T* do_tile = q_tile + R * D;
  threadgroup T* ds_tile = do_tile + R * DV;
  threadgroup float* stats = reinterpret_cast<threadgroup float*>(ds_tile + R * BK);

  const SeqView seq = sequence_view(p, cu_seqlens_q, cu_seqlens_k, group.z);
  const int row0 = int(group.x) * BQ + int(sg) * R;
  if (row0 >= seq.q_len) return;  // uniform per SIMD-group; no collective spans SIMD-groups
  // The sequence's first rows (0 unless varlen: the planner zeroed the batch
  // strides); packed outputs (grad_q, Delta) are (1, H, total, ...) then.
  HeadOffsets h = head_offsets(p, group.z, group.y);
  h.q += seq.q_row0 * p.q_row_stride;
  h.o += seq.q_row0 * p.o_row_stride;
  h.lse += seq.q_row0 * p.lse_row_stride;
  h.k += seq.k_row0 * p.k_row_stride;
  h.v += seq.k_row0 * p.v_row_stride;
  const int64_t do_head = int64_t(group.z) * p.do_batch_stride + int64_t(group.y) * p.do_head_stride +
                          seq.q_row0 * p.do_row_stride;
  const int64_t glse_head = int64_t(group.z) * p.glse_batch_stride + int64_t(group.y) * p.glse_head_stride +
                            seq.q_row0 * p.glse_row_stride;
  const uint packed_b = fc_varlen ? 0u : group.z;
  const int packed_q = fc_varlen ? p.total_q : p.q_len;
  const int64_t mask_slice = fc_has_mask ? mask_head_offset(p, group.z, group.y) : 0;
  const int rows = min(R, seq.q_len - row0);

  // Q and dO rows to threadgroup memory (zeros past the sequence), lane l
  // copying elements l, l + 32, ... (consecutive lanes, consecutive features).
  mpp_stage_rows<D>(q_tile, q + h.q + int64_t(row0) * p.q_row_stride, rows, int(p.q_row_stride),
                    int(p.q_dim_stride), lane);
  mpp_stage_rows<DV>(do_tile, dout + do_head + int64_t(row0) * p.do_row_stride, rows, int(p.do_row_stride),
                    int(p.do_dim_stride), lane);
  simdgroup_barrier(mem_flags::mem_threadgroup);  // dO written before the Delta reads (RAW)

  // Delta = rowsum(dO * O) - grad_lse in float32: lanes 2r and 2r + 1 take
  // the even / odd features of row r, one shuffle adds the halves. O is read
  // once, from device memory (no other use). Then the row's stats, from the
  // even lane; Delta to the scratch for the dK/dV kernel.
  {
    const int r = int(lane) / 2;
    float dsum = 0.0f;
    if (r < rows) {
      device const T* orow = o + h.o + int64_t(row0 + r) * p.o_row_stride;
      for (int c = int(lane) & 1; c < DV; c += 2) dsum += float(do_tile[r * DV + c]) * float(orow[c * p.o_dim_stride]);
    }
    dsum += simd_shuffle_xor(dsum, 1);
    if ((lane & 1) == 0) {
      float l = as_type<float>(kNegInfBits), dl = 0.0f;
      if (r < rows) {
        const int row = row0 + r;
        l = lse[h.lse + int64_t(row) * p.lse_row_stride];
        dl = dsum;
        if (fc_mpp_has_grad_lse) dl -= dlse[glse_head + int64_t(row) * p.glse_row_stride];
        delta[mpp_packed_row(packed_b, group.y, p.q_heads, packed_q, seq.q_row0 + row, 1)] = dl;
      }
      mpp_row_stats(stats + r * kMppStats, l, dl);
    }
  }
  simdgroup_barrier(mem_flags::mem_threadgroup);  // stats written before other lanes read them (RAW)

  // Q's and dO's tiles are whole (zeros past the sequence): static extents.
  const MppStaticTileTensor<T, D, R> tq = mpp_static_tile<D, R>(q_tile, D);
  const MppStaticTileTensor<T, DV, R> tdo = mpp_static_tile<DV, R>(do_tile, DV);
  using QT = MppTileTensor<T>;
  using KT = MppDeviceTensor<T>;  // a key block's rows of K or V (below)
  using DST = MppTileTensor<T>;
  // The sequence's K and V rows: full key blocks take static slices of them.
  const MppDeviceTensor<T> k_seq = mpp_device_rows<D>(k + h.k, seq.kv_len, p.k_row_stride, p.k_dim_stride);
  const MppDeviceTensor<T> v_seq = mpp_device_rows<DV>(v + h.v, seq.kv_len, p.v_row_stride, p.v_dim_stride);
  // The 16-row step (attention_mpp_common.h): S = Q.K^T and dP = dO.V^T,
  // one op type (16 x BK, right transposed; K = D, or dynamic when DV != D:
  // MppScoresPair) run twice; dQ += dS.K (16 x D, accumulating, K the
  // block's valid keys: mpp_accumulate_descriptor). S and dP are asked for
  // with one pair of operand types, so they are one destination type (the
  // static slices they run on are the same element types: Apple keys the
  // layout by those, attention_prefill_mpp.h).
  typename MppScoresPair<D, DV, BK, T>::Op s_op;
  constexpr auto dq_desc = mpp_accumulate_descriptor(D, mpp_relaxed(sizeof(T)));
  matmul2d<dq_desc, execution_simdgroup> dq_op;
  auto s = s_op.template get_destination_cooperative_tensor<QT, KT, float>();
  auto dp = s_op.template get_destination_cooperative_tensor<QT, KT, float>();
  auto acc = dq_op.template get_destination_cooperative_tensor<DST, KT, float>();
  mpp_clear(acc);
  // S's layout, once: row * BK + key per slot (attention_mpp_common.h).
  auto s_at = s_op.template get_destination_cooperative_tensor<QT, KT, float>();
  mpp_slot_codes<BK>(s_at);

  // Key blocks the rows see: up to the last real row's last visible key
  // (causal or a right window: later blocks are wholly in the future, as in
  // the forward), and from the first row's first visible key (a left window).
  const int n_blocks = (visible_key_end(seq, row0 + rows - 1) + BK - 1) / BK;
  const int first_block = fc_window_left ? first_visible_key(seq, row0) / BK : 0;
  for (int kb = first_block; kb < n_blocks; ++kb) {
    const int k0 = kb * BK, keys = min(BK, seq.kv_len - k0);  // the block's valid keys (>= 1)
    // The block's rows of K and V: static slices on a full block, tensors
    // ending at its last valid key on the ragged one (uniform). Named:
    // run() takes lvalues (Apple declares no other overload).
    const bool full = keys == BK;
    if (full) {
      auto k_blk = k_seq.template static_slice<D, BK>(0, k0);
      auto v_blk = v_seq.template static_slice<DV, BK>(0, k0);
      s_op.run(tq, k_blk, s);
      s_op.run(tdo, v_blk, dp);
    } else {
      auto k_blk = mpp_device_rows<D>(k + h.k + int64_t(k0) * p.k_row_stride, keys, p.k_row_stride, p.k_dim_stride);
      auto v_blk = mpp_device_rows<DV>(v + h.v + int64_t(k0) * p.v_row_stride, keys, p.v_row_stride, p.v_dim_stride);
      s_op.run(tq, k_blk, s);
      s_op.run(tdo, v_blk, dp);
    }
    // dS = P * (dP - Delta) into threadgroup memory, rounded to T; each of
    // the 16 x BK elements is held by exactly one valid slot, so the whole
    // tile is written (zeros where dropped).
    const bool k_edge = !full;
    const bool diagonal = fc_causal && k0 + BK - 1 > row0 + seq.upper;
    const bool left_edge = fc_window_left && k0 < row0 + R - 1 + seq.lower;
    FM_UNROLL
    for (int i = 0; i < s.get_capacity(); ++i) {
      const int code = int(s_at[i]);  // row * BK + key within the block
      if (code < 0) continue;
      const int r = code / BK, row = row0 + r, key = k0 + code % BK;
      bool keep = !(k_edge && key >= seq.kv_len) && row < seq.q_len;
      if (diagonal && key > row + seq.upper) keep = false;
      if (left_edge && key < row + seq.lower) keep = false;
      threadgroup const float* st = stats + r * kMppStats;
      float cap_grad;
      const float pw = mpp_weight<T>(p, mask, mask_slice, row, key, st, s[i], keep, &cap_grad);
      ds_tile[code] = static_cast<T>(pw * (dp[i] - st[2]) * cap_grad);
    }
    simdgroup_barrier(mem_flags::mem_threadgroup);  // dS written before other lanes' matmul2d reads it (RAW)
    if (full) {
      auto ds_blk = mpp_static_tile<BK, R>(ds_tile, BK);
      auto k_blk = k_seq.template static_slice<D, BK>(0, k0);
      dq_op.run(ds_blk, k_blk, acc);
    } else {
      auto ds_blk = mpp_tile(ds_tile, keys, R, BK);  // dS's first `keys` columns: K's K extent
      auto k_blk = mpp_device_rows<D>(k + h.k + int64_t(k0) * p.k_row_stride, keys, p.k_row_stride, p.k_dim_stride);
      dq_op.run(ds_blk, k_blk, acc);
    }
    simdgroup_barrier(mem_flags::mem_threadgroup);  // dS read before the next block rewrites it (WAR)
  }

  // dQ * scale, packed, real rows only (zeros for a row that saw no key).
  FM_UNROLL
  for (int i = 0; i < acc.get_capacity(); ++i) {
    if (!acc.is_valid_element(i)) continue;
    const auto idx = acc.get_multidimensional_index(i);  // [0] the feature, [1] the row
    const int row = row0 + idx[1];
    if (row < seq.q_len)
      dq[mpp_packed_row(packed_b, group.y, p.q_heads, packed_q, seq.q_row0 + row, D) + idx[0]] =
          static_cast<T>(acc[i] * p.scale);
  }
}

// T, D, DV as above. BKV = 16 * WM keys per threadgroup, BQ query rows per
// streamed block. Launch: grid (ceil(Nk / BKV), Hkv, B), threadgroup
// (32 * WM, 1, 1), threadgroup memory at index 0 (top of file), function
// constants fc_causal (0) and the options' 4-9, their buffers at 14-16.
// Reads Delta as the dQ kernel wrote it (the host encodes the two in that
// order).
template <typename T, int D, int DV, int BKV, int BQ>
[[kernel]] [[max_total_threads_per_threadgroup(kPrefillMppMaxThreads)]] void flash_backward_mpp_dkdv(
    device const T* q [[buffer(0)]],
    device const T* k [[buffer(1)]],
    device const T* v [[buffer(2)]],
    device const float* lse [[buffer(4)]],
    constant AttentionParams& p [[buffer(5)]],
    device const T* dout [[buffer(8)]],
    device T* dk [[buffer(10)]],
    device T* dv [[buffer(11)]],
    device const float* delta [[buffer(13)]],
    device const uchar* mask [[buffer(14)]],
    device const int* cu_seqlens_q [[buffer(15)]],
    device const int* cu_seqlens_k [[buffer(16)]],
    threadgroup T* smem [[threadgroup(0)]],
    uint3 group [[threadgroup_position_in_grid]],
    uint tid [[thread_index_in_threadgroup]],
    uint sg [[simdgroup_index_in_threadgroup]]) {
  using namespace mpp::tensor_ops;
  constexpr int R = kMppRowsPerSimd;
  constexpr int WM = BKV / R;
  constexpr int THREADS = 32 * WM;
  static_assert(BKV % R == 0 && THREADS <= kPrefillMppMaxThreads, "WM SIMD-groups of 16 keys, declared limit");
  static_assert(BQ <= THREADS, "one thread per streamed query fills the stats");
  // Threadgroup memory: the streamed block, shared by the SIMD-groups (Q and
  // dO, BQ x D each, and the block's query stats), then each SIMD-group's
  // P^T and dS^T (16 x BQ each). The block is read from device memory once
  // per threadgroup, cooperatively, as the simdgroup dK/dV kernel loads its
  // Q / dO tiles (attention_backward_dkdv.h): before, each SIMD-group's
  // matmul2d asked for Q and dO itself, twice per block each, and the model
  // found the kernel bound by that traffic (benchmarks/model/families/accel.py).
  // K and V are not staged: matmul2d reads the SIMD-group's 16 rows of each
  // from device memory (the same rows every block, an L1 hit after the first).
  threadgroup T* q_blk = smem;
  threadgroup T* do_blk = q_blk + BQ * D;  // BQ x DV
  threadgroup float* stats = reinterpret_cast<threadgroup float*>(do_blk + BQ * DV);
  threadgroup T* pt_tile = reinterpret_cast<threadgroup T*>(stats + BQ * kMppStats) + int(sg) * 2 * R * BQ;
  threadgroup T* dst_tile = pt_tile + R * BQ;

  const SeqView seq = sequence_view(p, cu_seqlens_q, cu_seqlens_k, group.z);
  const int tg_key0 = int(group.x) * BKV;  // the threadgroup's first key
  if (tg_key0 >= seq.kv_len) return;  // uniform per threadgroup: before any barrier
  const int key0 = tg_key0 + int(sg) * R;  // this SIMD-group's first key
  // A SIMD-group past the sequence (the ragged last threadgroup) computes
  // nothing but still stages its share and meets every barrier.
  const bool active = key0 < seq.kv_len;
  const uint kv_head = group.y;
  // The sequence's first rows (0 unless varlen: the planner zeroed the batch
  // strides); packed outputs (grad_k, grad_v; Delta read) are (1, H, total, ...) then.
  const int64_t k_off = int64_t(group.z) * p.k_batch_stride + int64_t(kv_head) * p.k_head_stride +
                        seq.k_row0 * p.k_row_stride;
  const int64_t v_off = int64_t(group.z) * p.v_batch_stride + int64_t(kv_head) * p.v_head_stride +
                        seq.k_row0 * p.v_row_stride;
  const uint packed_b = fc_varlen ? 0u : group.z;
  const int packed_q = fc_varlen ? p.total_q : p.q_len;
  const int packed_k = fc_varlen ? p.total_k : p.kv_len;
  // The SIMD-group's 16 keys of K and V as device tensors from key0, their
  // row extents ending at the sequence (M of S^T: rows past it never used).
  // A SIMD-group whose 16 keys are all in the sequence (every one but the
  // ragged last) takes them as static slices (no edge checks: Apple's
  // static_slice for inside tiles); the ragged one as tensors whose row
  // extent ends at the sequence. The staged tiles are whole (zeros past the
  // sequence): static extents.
  const int own0 = active ? key0 : tg_key0;
  const bool full_keys = key0 + R <= seq.kv_len;  // uniform per SIMD-group
  const MppDeviceTensor<T> k_seq = mpp_device_rows<D>(k + k_off, seq.kv_len, p.k_row_stride, p.k_dim_stride);
  const MppDeviceTensor<T> v_seq = mpp_device_rows<DV>(v + v_off, seq.kv_len, p.v_row_stride, p.v_dim_stride);
  const auto tkt = k_seq.slice(0, own0);
  const auto tvt = v_seq.slice(0, own0);
  const MppStaticTileTensor<T, D, BQ> tq = mpp_static_tile<D, BQ>(q_blk, D);
  const MppStaticTileTensor<T, DV, BQ> tdo = mpp_static_tile<DV, BQ>(do_blk, DV);
  const MppStaticTileTensor<T, BQ, R> tpt = mpp_static_tile<BQ, R>(pt_tile, BQ);
  const MppStaticTileTensor<T, BQ, R> tdst = mpp_static_tile<BQ, R>(dst_tile, BQ);
  using KT = decltype(tkt);
  using QT = decltype(tq);
  using PT = decltype(tpt);
  // The 16-row step (attention_mpp_common.h), keys as rows: S^T = K.Q^T and
  // dP^T = V.dO^T, one op type (16 x BQ, right transposed; K = D, or
  // dynamic when DV != D: MppScoresPair); dV += P^T.dO (16 x DV, K = BQ)
  // and dK += dS^T.Q (16 x D, K = BQ), one op type when DV = D. dK's and
  // dV's destinations are never combined, so two types are fine.
  typename MppScoresPair<D, DV, BQ, T>::Op st_op;
  typename MppRowStep<D, BQ, T>::Accumulate dk_op;
  typename MppRowStep<DV, BQ, T>::Accumulate dv_op;

  // Query blocks that see some key of the threadgroup (the loop every
  // thread runs, for the barriers), and of this SIMD-group (the blocks it
  // computes).
  const MppQueryBlocks qbs = mpp_query_blocks<BQ>(seq, tg_key0, BKV, key0, R);

  // The group's query heads in a fixed order, summed in the float32
  // registers of the accumulators (16-bit gradients: their rounding dwarfs
  // the sum's, as in the simdgroup backward's 16-bit path).
  auto dk_acc = dk_op.template get_destination_cooperative_tensor<PT, QT, float>();
  auto dv_acc = dv_op.template get_destination_cooperative_tensor<PT, QT, float>();
  mpp_clear(dk_acc);
  mpp_clear(dv_acc);
  auto s = st_op.template get_destination_cooperative_tensor<KT, QT, float>();
  auto dp = st_op.template get_destination_cooperative_tensor<KT, QT, float>();
  // S^T's layout, once: key * BQ + query per slot (attention_mpp_common.h).
  auto s_at = st_op.template get_destination_cooperative_tensor<KT, QT, float>();
  mpp_slot_codes<BQ>(s_at);
  for (int g = 0; g < p.gqa_ratio; ++g) {
    const uint head = kv_head * uint(p.gqa_ratio) + uint(g);
    const MppHeadRows<T> hr = mpp_head_rows(p, seq, group.z, head, packed_b, packed_q, q, dout, delta);
    for (int qb = qbs.begin; qb < qbs.end; ++qb) {
      const int q0 = qb * BQ;
      mpp_stage_query_block<T, D, DV, BQ, THREADS>(hr, lse, p, q0, seq.q_len, tid, q_blk, do_blk, stats);
      threadgroup_barrier(mem_flags::mem_threadgroup);  // the block staged before any SIMD-group reads it (RAW)
      if (active && qb >= qbs.own_begin && qb < qbs.own_end) {  // uniform per SIMD-group
        if (full_keys) {
          auto k_own = k_seq.template static_slice<D, R>(0, key0);
          auto v_own = v_seq.template static_slice<DV, R>(0, key0);
          st_op.run(k_own, tq, s);
          st_op.run(v_own, tdo, dp);
        } else {
          auto k_own = tkt;
          auto v_own = tvt;
          st_op.run(k_own, tq, s);
          st_op.run(v_own, tdo, dp);
        }
        // P^T and dS^T = P^T * (dP^T - Delta) into threadgroup memory,
        // rounded to T, every element of both tiles by its one valid slot.
        const bool diagonal = fc_causal && key0 + R - 1 > q0 + seq.upper;
        const bool left_edge = fc_window_left && key0 < q0 + BQ - 1 + seq.lower;
        FM_UNROLL
        for (int i = 0; i < s.get_capacity(); ++i) {
          const int code = int(s_at[i]);  // key * BQ + query within the block
          if (code < 0) continue;
          const int qi = code % BQ, key = key0 + code / BQ, row = q0 + qi;
          bool keep = key < seq.kv_len && row < seq.q_len;
          if (diagonal && key > row + seq.upper) keep = false;
          if (left_edge && key < row + seq.lower) keep = false;
          threadgroup const float* st = stats + qi * kMppStats;
          float cap_grad;
          const float pw = mpp_weight<T>(p, mask, hr.mask_slice, row, key, st, s[i], keep, &cap_grad);
          pt_tile[code] = static_cast<T>(pw);
          dst_tile[code] = static_cast<T>(pw * (dp[i] - st[2]) * cap_grad);
        }
        simdgroup_barrier(mem_flags::mem_threadgroup);  // P^T, dS^T written before matmul2d reads them (RAW)
        // Queries past the sequence are zero rows of Q and dO; P^T is 0 there.
        dv_op.run(tpt, tdo, dv_acc);
        dk_op.run(tdst, tq, dk_acc);
      }
      threadgroup_barrier(mem_flags::mem_threadgroup);  // the block and the tiles read before the next stage (WAR)
    }
  }

  // dK * scale, packed (B, Hkv, Nk, D), and dV, packed (B, Hkv, Nk, DV),
  // real keys only (zeros for a key no query sees). One loop when the two
  // are one type (same slot, same element); each by its own layout else.
  if (!active) return;
  FM_UNROLL
  for (int i = 0; i < dk_acc.get_capacity(); ++i) {
    if (!dk_acc.is_valid_element(i)) continue;
    const auto idx = dk_acc.get_multidimensional_index(i);  // [0] the feature, [1] the key
    const int key = key0 + idx[1];
    if (key >= seq.kv_len) continue;
    const int64_t at = mpp_packed_row(packed_b, kv_head, p.kv_heads, packed_k, seq.k_row0 + key, D) + idx[0];
    dk[at] = static_cast<T>(dk_acc[i] * p.scale);
    if (DV == D) dv[at] = static_cast<T>(dv_acc[i]);
  }
  if (DV == D) return;
  FM_UNROLL
  for (int i = 0; i < dv_acc.get_capacity(); ++i) {
    if (!dv_acc.is_valid_element(i)) continue;
    const auto idx = dv_acc.get_multidimensional_index(i);  // [0] the feature, [1] the key
    const int key = key0 + idx[1];
    if (key < seq.kv_len)
      dv[mpp_packed_row(packed_b, kv_head, p.kv_heads, packed_k, seq.k_row0 + key, DV) + idx[0]] =
          static_cast<T>(dv_acc[i]);
  }
}

}  // namespace flash_metal
