// The tensor-op (Metal 4 matmul2d) backward at head dim 256, split along D
// (issue 21, item 2: "the whole gradient grid"). MSL 4 only, in the library
// of shaders/attention_mpp.metal, beside attention_backward_mpp.h (D 64 / 96
// / 128), whose algorithm and atomics-free split it keeps: a dQ kernel over
// query blocks (Delta too), then a dK/dV kernel over key blocks; no atomics,
// deterministic.
//
// Why a kernel of its own: at D = 256 a SIMD-group owning whole rows holds
// a 16 x 256 float accumulator (dQ; dK and dV: two) and stages 16 x 256
// tiles of Q and dO (16 KiB per SIMD-group). The idea is the split-D forward's
// (attention_prefill_mpp_dsplit.h, after MLX's attention_nax_dsplit, PR
// #3842; ideas only): SIMD-groups work in pairs sharing rows (dQ) or keys
// (dK/dV), and half h of a pair owns features [128h, 128h + 128) of Q, K, V,
// dO, dQ, dK and dV. The products over D (S = Q.K^T and dP = dO.V^T, or
// their transposes) are partial per half: each half writes its float
// partials to its own slots of threadgroup memory, by (row, column) learnt
// from get_multidimensional_index, a threadgroup barrier, then each adds the
// other half's partial at the same place. IEEE addition commutes, so both
// halves hold bit-identical S and dP and compute the same P and dS; each
// writes its own copy of the 16-bit tile its products read (no second
// exchange). The products along keys or queries (dQ_h += dS.K_h, dV_h +=
// P^T.dO_h, dK_h += dS^T.Q_h) need no exchange: each half's output is its
// own features.
//
//   flash_backward_mpp_dsplit_dq    grid (ceil(Nq / 16), Hq, B), 64 threads:
//     one pair, 16 query rows. Delta = rowsum(dO * O) - grad_lse: each half
//     sums its features, the halves exchange (one barrier); then per block
//     of BK = 32 keys: partial S_h, dP_h (one 16 x 32 op, K = 128, run
//     twice), exchange, dS = P (dP - Delta), dQ_h += dS.K_h (16 x 128, K the
//     block's valid keys, at most 32: mpp_accumulate_descriptor).
//   flash_backward_mpp_dsplit_dkdv  grid (ceil(Nk / 32), Hkv, B), 128 threads:
//     two pairs, 16 keys each, over the GQA group's heads and the query
//     blocks of BQ = 16 rows that see the threadgroup's keys: the block's Q
//     and dO (16 x 256 each) staged once per threadgroup and shared by both
//     pairs, partial S^T_h = K_h.Q_h^T and dP^T_h = V_h.dO_h^T (one 16 x 16
//     op, K = 128, run twice), exchange, P^T and dS^T, dV_h += P^T.dO_h and
//     dK_h += dS^T.Q_h (16 x 128, K = 16).
//
// Tile choices, by Metal's 32 KiB of threadgroup memory (float16 /
// bfloat16; csrc/metal/plan_detail.h, tensor_ops_dsplit_backward_bytes,
// checks the same sums statically):
//   dQ, per SIMD-group: Q_h and dO_h (16 x 128 each, T) 8,192; dS (16 x 32,
//     T) 1,024; partial S and dP (16 x 32 floats each) 4,096; row stats 256;
//     partial Delta 64: 13,632, x 2 = 27,264 bytes. Why one pair: a second
//     would need 54,528 bytes. Q_h and dO_h are staged (read once) rather
//     than read by matmul2d every key block, as the D <= 128 dQ kernel.
//   dK/dV: the shared block, Q and dO (16 x 256 each, T) 16,384 and its
//     queries' stats 256; per SIMD-group partial S^T and dP^T (16 x 16
//     floats each) 2,048 and P^T, dS^T (16 x 16 each, T) 1,024: 3,072, x 4 =
//     12,288; total 28,928 bytes. Why BQ = 16 here, where the D <= 128
//     dK/dV kernel streams 32 queries: a 32-row block of Q and dO at D = 256
//     alone is 32 KiB. Why two pairs: they share each staged block (half the
//     staging traffic per key of one pair), and a third would not fit.
//   One slot of partials per half, so the dQ kernel takes two threadgroup
//   barriers per key block (partials written: RAW; read, before the next
//   block's write: WAR) and the dK/dV kernel three per query block (block
//   staged; partials written; everything read before the next stage).
//
// Uniform control flow: every thread of a threadgroup runs the same loops
// (bounds from the threadgroup's rows or keys), so every barrier is met by
// all; a pair whose keys (rows) the block does not reach skips its products
// but not the barriers. Nothing returns early but a whole threadgroup past
// its sequence (varlen), before any barrier.
//
// Options: every one of attention_backward_mpp.h's through the same helpers
// (mpp_weight, mpp_row_stats; attention_features.h): causal (bottom-right)
// and windows with block skipping, softcap, bool / additive masks, varlen,
// GQA, grad_lse; sinks need nothing here (lse includes them) and grad_sinks
// comes from flash_sinks_grad, which the host appends. Equal q/k and v head
// dims only.
//
// Not yet verified on Apple hardware: the emulator runs it under the
// published M5 layout and a scrambled one
// (tests/metal/test_metal_tensor_ops_backward_d256.py).
#pragma once

#include "attention_backward_mpp.h"

namespace flash_metal {

// T: half or bfloat. D: 256 (q, k and v alike). BK: keys per block. WN: 2,
// the halves of a pair. Launch: grid (ceil(Nq / 16), Hq, B), threadgroup
// (32 * WN, 1, 1), threadgroup memory at index 0 (top of file), function
// constants and buffers as flash_backward_mpp_dq.
template <typename T, int D, int BK, int WN>
[[kernel]] [[max_total_threads_per_threadgroup(kPrefillMppMaxThreads)]] void flash_backward_mpp_dsplit_dq(
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
  constexpr int DH = D / WN;  // features each half owns
  static_assert(WN == 2, "pairs: each half adds the other's partial (commutative, so both agree bit for bit)");
  static_assert(32 * WN <= kPrefillMppMaxThreads, "the declared limit");
  const int half_id = int(sg);
  const int f0 = half_id * DH;
  // This SIMD-group's slice: Q_h, dO_h, dS (T); partial S, partial dP, stats,
  // partial Delta (float). The other half's partials at the same offsets of its slice.
  constexpr int SLICE = (2 * R * DH + R * BK) * int(sizeof(T)) + (2 * R * BK + R * kMppStats + R) * 4;  // bytes
  static_assert(SLICE % 4 == 0, "float-aligned slices");
  threadgroup uchar* base = reinterpret_cast<threadgroup uchar*>(smem);
  threadgroup T* q_tile = reinterpret_cast<threadgroup T*>(base + half_id * SLICE);
  threadgroup T* do_tile = q_tile + R * DH;
  threadgroup T* ds_tile = do_tile + R * DH;
  threadgroup float* s_mine = reinterpret_cast<threadgroup float*>(ds_tile + R * BK);
  threadgroup float* dp_mine = s_mine + R * BK;
  threadgroup float* stats = dp_mine + R * BK;
  threadgroup float* delta_mine = stats + R * kMppStats;
  const int other_off = ((1 - half_id) - half_id) * (SLICE / 4);  // floats from mine to the other half's
  threadgroup const float* s_other = s_mine + other_off;
  threadgroup const float* dp_other = dp_mine + other_off;
  threadgroup const float* delta_other = delta_mine + other_off;

  const SeqView seq = sequence_view(p, cu_seqlens_q, cu_seqlens_k, group.z);
  const int row0 = int(group.x) * R;
  if (row0 >= seq.q_len) return;  // uniform per threadgroup (one pair): before any barrier
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

  // This half's features of Q and dO (zeros past the sequence), read once.
  mpp_stage_rows<DH>(q_tile, q + h.q + int64_t(row0) * p.q_row_stride + int64_t(f0) * p.q_dim_stride, rows,
                     int(p.q_row_stride), int(p.q_dim_stride), lane);
  mpp_stage_rows<DH>(do_tile, dout + do_head + int64_t(row0) * p.do_row_stride + int64_t(f0) * p.do_dim_stride,
                     rows, int(p.do_row_stride), int(p.do_dim_stride), lane);
  simdgroup_barrier(mem_flags::mem_threadgroup);  // dO_h written before the Delta reads (RAW)

  // Delta: lanes 2r and 2r + 1 sum the even / odd features of this half of
  // row r (dO_h * O_h in float32), one shuffle adds them; the halves
  // exchange their sums, and each adds the other's (the same float in both).
  {
    const int r = int(lane) / 2;
    float dsum = 0.0f;
    if (r < rows) {
      device const T* orow = o + h.o + int64_t(row0 + r) * p.o_row_stride + int64_t(f0) * p.o_dim_stride;
      for (int c = int(lane) & 1; c < DH; c += 2) dsum += float(do_tile[r * DH + c]) * float(orow[c * p.o_dim_stride]);
    }
    dsum += simd_shuffle_xor(dsum, 1);
    if ((lane & 1) == 0) delta_mine[r] = dsum;
    threadgroup_barrier(mem_flags::mem_threadgroup);  // both halves' Delta sums written before they are added (RAW)
    if ((lane & 1) == 0) {
      float l = as_type<float>(kNegInfBits), dl = 0.0f;
      if (r < rows) {
        const int row = row0 + r;
        l = lse[h.lse + int64_t(row) * p.lse_row_stride];
        dl = dsum + delta_other[r];
        if (fc_mpp_has_grad_lse) dl -= dlse[glse_head + int64_t(row) * p.glse_row_stride];
        if (half_id == 0) delta[mpp_packed_row(packed_b, group.y, p.q_heads, packed_q, seq.q_row0 + row, 1)] = dl;
      }
      mpp_row_stats(stats + r * kMppStats, l, dl);
    }
  }
  simdgroup_barrier(mem_flags::mem_threadgroup);  // stats written before other lanes read them (RAW)

  const MppStaticTileTensor<T, DH, R> tq = mpp_static_tile<DH, R>(q_tile, DH);  // whole: zeros past the sequence
  const MppStaticTileTensor<T, DH, R> tdo = mpp_static_tile<DH, R>(do_tile, DH);
  device const T* k_half = k + h.k + int64_t(f0) * p.k_dim_stride;  // this half's features of each row
  device const T* v_half = v + h.v + int64_t(f0) * p.v_dim_stride;
  const MppDeviceTensor<T> k_seq = mpp_device_rows<DH>(k_half, seq.kv_len, p.k_row_stride, p.k_dim_stride);
  const MppDeviceTensor<T> v_seq = mpp_device_rows<DH>(v_half, seq.kv_len, p.v_row_stride, p.v_dim_stride);
  using QT = MppTileTensor<T>;
  using KT = MppDeviceTensor<T>;  // a key block's rows of K_h or V_h (below)
  using DST = MppTileTensor<T>;
  // The 16-row step at DH (attention_mpp_common.h): partial S_h = Q_h.K_h^T
  // and dP_h = dO_h.V_h^T (16 x BK, K = 128) and dQ_h += dS.K_h (16 x 128, K
  // the block's valid keys: mpp_accumulate_descriptor).
  typename MppRowStep<DH, BK, T>::Scores s_op;
  constexpr auto dq_desc = mpp_accumulate_descriptor(DH, mpp_relaxed(sizeof(T)));
  matmul2d<dq_desc, execution_simdgroup> dq_op;
  auto s = s_op.template get_destination_cooperative_tensor<QT, KT, float>();
  auto dp = s_op.template get_destination_cooperative_tensor<QT, KT, float>();
  auto acc = dq_op.template get_destination_cooperative_tensor<DST, KT, float>();
  mpp_clear(acc);
  // S's layout, once: row * BK + key per slot (attention_mpp_common.h).
  auto s_at = s_op.template get_destination_cooperative_tensor<QT, KT, float>();
  mpp_slot_codes<BK>(s_at);

  // The pair's key blocks (the same in both halves: uniform for the barriers).
  const int n_blocks = (visible_key_end(seq, row0 + rows - 1) + BK - 1) / BK;
  const int first_block = fc_window_left ? first_visible_key(seq, row0) / BK : 0;
  for (int kb = first_block; kb < n_blocks; ++kb) {
    const int k0 = kb * BK, keys = min(BK, seq.kv_len - k0);  // the block's valid keys (>= 1)
    // The block's rows of K_h and V_h: static slices on a full block, tensors
    // ending at its last valid key on the ragged one. Named: run() takes
    // lvalues (Apple declares no other overload).
    const bool full = keys == BK;
    if (full) {
      auto k_blk = k_seq.template static_slice<DH, BK>(0, k0);
      auto v_blk = v_seq.template static_slice<DH, BK>(0, k0);
      s_op.run(tq, k_blk, s);
      s_op.run(tdo, v_blk, dp);
    } else {
      auto k_blk = mpp_device_rows<DH>(k_half + int64_t(k0) * p.k_row_stride, keys, p.k_row_stride, p.k_dim_stride);
      auto v_blk = mpp_device_rows<DH>(v_half + int64_t(k0) * p.v_row_stride, keys, p.v_row_stride, p.v_dim_stride);
      s_op.run(tq, k_blk, s);
      s_op.run(tdo, v_blk, dp);
    }
    FM_UNROLL
    for (int i = 0; i < s.get_capacity(); ++i) {
      const int code = int(s_at[i]);  // row * BK + key within the block
      if (code < 0) continue;
      s_mine[code] = s[i];
      dp_mine[code] = dp[i];
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);  // both halves' partial S and dP written before they are added (RAW)
    const bool k_edge = !full;
    const bool diagonal = fc_causal && k0 + BK - 1 > row0 + seq.upper;
    const bool left_edge = fc_window_left && k0 < row0 + R - 1 + seq.lower;
    FM_UNROLL
    for (int i = 0; i < s.get_capacity(); ++i) {
      const int code = int(s_at[i]);
      if (code < 0) continue;
      const int r = code / BK, row = row0 + r, key = k0 + code % BK;
      const float s_full = s[i] + s_other[code];
      const float dp_full = dp[i] + dp_other[code];
      bool keep = !(k_edge && key >= seq.kv_len) && row < seq.q_len;
      if (diagonal && key > row + seq.upper) keep = false;
      if (left_edge && key < row + seq.lower) keep = false;
      threadgroup const float* st = stats + r * kMppStats;
      float cap_grad;
      const float pw = mpp_weight<T>(p, mask, mask_slice, row, key, st, s_full, keep, &cap_grad);
      ds_tile[code] = static_cast<T>(pw * (dp_full - st[2]) * cap_grad);
    }
    simdgroup_barrier(mem_flags::mem_threadgroup);  // dS written before other lanes' matmul2d reads it (RAW)
    if (full) {
      auto ds_blk = mpp_static_tile<BK, R>(ds_tile, BK);
      auto k_blk = k_seq.template static_slice<DH, BK>(0, k0);
      dq_op.run(ds_blk, k_blk, acc);
    } else {
      auto ds_blk = mpp_tile(ds_tile, keys, R, BK);  // dS's first `keys` columns: K_h's K extent
      auto k_blk = mpp_device_rows<DH>(k_half + int64_t(k0) * p.k_row_stride, keys, p.k_row_stride, p.k_dim_stride);
      dq_op.run(ds_blk, k_blk, acc);
    }
    // The other half has read this half's partials, and this SIMD-group's
    // lanes have read dS, before the next block rewrites them (WAR).
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }

  // This half's features of dQ * scale, packed, real rows only.
  FM_UNROLL
  for (int i = 0; i < acc.get_capacity(); ++i) {
    if (!acc.is_valid_element(i)) continue;
    const auto idx = acc.get_multidimensional_index(i);  // [0] the feature within the half, [1] the row
    const int row = row0 + idx[1];
    if (row < seq.q_len)
      dq[mpp_packed_row(packed_b, group.y, p.q_heads, packed_q, seq.q_row0 + row, D) + f0 + idx[0]] =
          static_cast<T>(acc[i] * p.scale);
  }
}

// T, D, WN as above. BKV = 16 * (SIMD-groups / WN) keys per threadgroup, BQ
// query rows per streamed block. Launch: grid (ceil(Nk / BKV), Hkv, B),
// threadgroup (32 * WN * BKV / 16, 1, 1), threadgroup memory at index 0 (top
// of file), constants and buffers as flash_backward_mpp_dkdv. Reads Delta
// as the dQ kernel wrote it (the host encodes the two in that order).
template <typename T, int D, int BKV, int BQ, int WN>
[[kernel]] [[max_total_threads_per_threadgroup(kPrefillMppMaxThreads)]] void flash_backward_mpp_dsplit_dkdv(
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
  constexpr int DH = D / WN;
  constexpr int PAIRS = BKV / R;
  constexpr int THREADS = 32 * WN * PAIRS;
  static_assert(WN == 2 && BKV % R == 0 && THREADS <= kPrefillMppMaxThreads, "pairs of 16 keys, the limit");
  static_assert(BQ <= THREADS, "one thread per streamed query fills the stats");
  const int half_id = int(sg) % WN, pair = int(sg) / WN;
  const int f0 = half_id * DH;
  // Threadgroup memory: the shared block (Q, dO: BQ x D each, T; stats: BQ x
  // 4 floats), then per SIMD-group its partial S^T and dP^T (R x BQ floats
  // each) and its P^T and dS^T (R x BQ each, T).
  constexpr int SLICE = 2 * R * BQ * 4 + 2 * R * BQ * int(sizeof(T));  // bytes
  threadgroup T* q_blk = smem;
  threadgroup T* do_blk = q_blk + BQ * D;
  threadgroup float* stats = reinterpret_cast<threadgroup float*>(do_blk + BQ * D);
  threadgroup uchar* slices = reinterpret_cast<threadgroup uchar*>(stats + BQ * kMppStats);
  threadgroup float* s_mine = reinterpret_cast<threadgroup float*>(slices + int(sg) * SLICE);
  threadgroup float* dp_mine = s_mine + R * BQ;
  threadgroup T* pt_tile = reinterpret_cast<threadgroup T*>(dp_mine + R * BQ);
  threadgroup T* dst_tile = pt_tile + R * BQ;
  const int other_off = ((1 - half_id) - half_id) * (SLICE / 4);  // floats from mine to the pair's other half
  threadgroup const float* s_other = s_mine + other_off;
  threadgroup const float* dp_other = dp_mine + other_off;

  const SeqView seq = sequence_view(p, cu_seqlens_q, cu_seqlens_k, group.z);
  const int tg_key0 = int(group.x) * BKV;
  if (tg_key0 >= seq.kv_len) return;  // uniform per threadgroup: before any barrier
  const int key0 = tg_key0 + pair * R;  // the pair's first key
  const bool active = key0 < seq.kv_len;  // uniform per pair
  const uint kv_head = group.y;
  const int64_t k_off = int64_t(group.z) * p.k_batch_stride + int64_t(kv_head) * p.k_head_stride +
                        seq.k_row0 * p.k_row_stride + int64_t(f0) * p.k_dim_stride;
  const int64_t v_off = int64_t(group.z) * p.v_batch_stride + int64_t(kv_head) * p.v_head_stride +
                        seq.k_row0 * p.v_row_stride + int64_t(f0) * p.v_dim_stride;
  const uint packed_b = fc_varlen ? 0u : group.z;
  const int packed_q = fc_varlen ? p.total_q : p.q_len;
  const int packed_k = fc_varlen ? p.total_k : p.kv_len;
  // This half's features of the pair's 16 keys of K and V (device; zeros past the sequence).
  // A pair whose 16 keys are all in the sequence takes them as static
  // slices; the ragged last pair as tensors ending at the sequence.
  const int own0 = active ? key0 : tg_key0;
  const bool full_keys = key0 + R <= seq.kv_len;  // uniform per pair
  const MppDeviceTensor<T> k_seq = mpp_device_rows<DH>(k + k_off, seq.kv_len, p.k_row_stride, p.k_dim_stride);
  const MppDeviceTensor<T> v_seq = mpp_device_rows<DH>(v + v_off, seq.kv_len, p.v_row_stride, p.v_dim_stride);
  const auto tkt = k_seq.slice(0, own0);
  const auto tvt = v_seq.slice(0, own0);
  // This half's features of the shared block: columns [f0, f0 + DH) of rows
  // of D; the staged tiles are whole (zeros past the sequence): static extents.
  const MppStaticTileTensor<T, DH, BQ> tq = mpp_static_tile<DH, BQ>(q_blk + f0, D);
  const MppStaticTileTensor<T, DH, BQ> tdo = mpp_static_tile<DH, BQ>(do_blk + f0, D);
  const MppStaticTileTensor<T, BQ, R> tpt = mpp_static_tile<BQ, R>(pt_tile, BQ);
  const MppStaticTileTensor<T, BQ, R> tdst = mpp_static_tile<BQ, R>(dst_tile, BQ);
  using KT = decltype(tkt);
  using QT = decltype(tq);
  using PT = decltype(tpt);
  // Keys as rows (attention_backward_mpp.h's dK/dV): partial S^T_h = K_h.Q_h^T
  // and dP^T_h = V_h.dO_h^T (16 x BQ, K = 128); dV_h += P^T.dO_h and dK_h +=
  // dS^T.Q_h (16 x 128, K = BQ).
  typename MppRowStep<DH, BQ, T>::Scores st_op;
  typename MppRowStep<DH, BQ, T>::Accumulate acc_op;

  // Query blocks that see some key of the threadgroup (every thread's loop)
  // and of this pair (the blocks it computes), as attention_backward_mpp.h.
  const MppQueryBlocks qbs = mpp_query_blocks<BQ>(seq, tg_key0, BKV, key0, R);

  auto dk_acc = acc_op.template get_destination_cooperative_tensor<PT, QT, float>();
  auto dv_acc = acc_op.template get_destination_cooperative_tensor<PT, QT, float>();
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
      // Whole rows of D: both halves of both pairs read the block.
      mpp_stage_query_block<T, D, D, BQ, THREADS>(hr, lse, p, q0, seq.q_len, tid, q_blk, do_blk, stats);
      threadgroup_barrier(mem_flags::mem_threadgroup);  // the block staged before any SIMD-group reads it (RAW)
      const bool compute = active && qb >= qbs.own_begin && qb < qbs.own_end;  // uniform per pair
      if (compute) {
        if (full_keys) {
          auto k_own = k_seq.template static_slice<DH, R>(0, key0);
          auto v_own = v_seq.template static_slice<DH, R>(0, key0);
          st_op.run(k_own, tq, s);
          st_op.run(v_own, tdo, dp);
        } else {
          auto k_own = tkt;
          auto v_own = tvt;
          st_op.run(k_own, tq, s);
          st_op.run(v_own, tdo, dp);
        }
        FM_UNROLL
        for (int i = 0; i < s.get_capacity(); ++i) {
          const int code = int(s_at[i]);  // key * BQ + query within the block
          if (code < 0) continue;
          s_mine[code] = s[i];
          dp_mine[code] = dp[i];
        }
      }
      threadgroup_barrier(mem_flags::mem_threadgroup);  // both halves' partial S^T and dP^T written (RAW)
      if (compute) {
        const bool diagonal = fc_causal && key0 + R - 1 > q0 + seq.upper;
        const bool left_edge = fc_window_left && key0 < q0 + BQ - 1 + seq.lower;
        FM_UNROLL
        for (int i = 0; i < s.get_capacity(); ++i) {
          const int code = int(s_at[i]);
          if (code < 0) continue;
          const int qi = code % BQ, key = key0 + code / BQ, row = q0 + qi;
          const float s_full = s[i] + s_other[code];
          const float dp_full = dp[i] + dp_other[code];
          bool keep = key < seq.kv_len && row < seq.q_len;
          if (diagonal && key > row + seq.upper) keep = false;
          if (left_edge && key < row + seq.lower) keep = false;
          threadgroup const float* st = stats + qi * kMppStats;
          float cap_grad;
          const float pw = mpp_weight<T>(p, mask, hr.mask_slice, row, key, st, s_full, keep, &cap_grad);
          pt_tile[code] = static_cast<T>(pw);
          dst_tile[code] = static_cast<T>(pw * (dp_full - st[2]) * cap_grad);
        }
        simdgroup_barrier(mem_flags::mem_threadgroup);  // P^T, dS^T written before matmul2d reads them (RAW)
        acc_op.run(tpt, tdo, dv_acc);
        acc_op.run(tdst, tq, dk_acc);
      }
      // The block, the partials and the tiles read before the next stage (WAR).
      threadgroup_barrier(mem_flags::mem_threadgroup);
    }
  }

  // This half's features of dK * scale and dV, packed (B, Hkv, Nk, D), real keys only.
  if (!active) return;
  FM_UNROLL
  for (int i = 0; i < dk_acc.get_capacity(); ++i) {
    if (!dk_acc.is_valid_element(i)) continue;
    const auto idx = dk_acc.get_multidimensional_index(i);  // [0] the feature within the half, [1] the key
    const int key = key0 + idx[1];
    if (key >= seq.kv_len) continue;
    const int64_t at = mpp_packed_row(packed_b, kv_head, p.kv_heads, packed_k, seq.k_row0 + key, D) + f0 + idx[0];
    dk[at] = static_cast<T>(dk_acc[i] * p.scale);
    dv[at] = static_cast<T>(dv_acc[i]);
  }
}

}  // namespace flash_metal
