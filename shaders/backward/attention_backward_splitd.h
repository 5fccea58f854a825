// The split-D backward for head dim 512 (issue 20, section 3): the
// FlashAttention-2 backward (recompute P from the forward's lse, dS =
// P * (dP - Delta)) with the head dimension blocked across SIMD-groups, as
// the split-D forward (attention_prefill_splitd.h) blocks it; the
// atomics-free split of attention_backward.h (a dQ kernel parallel over
// query blocks, then a dK/dV kernel parallel over key blocks; the split is
// metal-flash-attention's, and blocking along D is its idea too; the code
// here is this project's own). Routed by csrc/metal/families/backward_splitd.cpp
// (splitd_backward_takes), launched by csrc/metal/launch_backward.cpp,
// priced by benchmarks/model/families/splitd_backward.py.
//
// Why a kernel of its own. The simdgroup backward stages four tiles of
// DMAX-wide rows in threadgroup memory (Q, dO and K, V): at 512 even 8 + 8
// float16 rows take 32 KiB with no room for its split-K scratch, and float32
// does not fit at all. Here no operand tile is staged: as in the split-D
// forward, each of the WM SIMD-groups ("parts") owns F = DMAX / WM features
// (64 at 8 parts) and reads its own slice of every operand from device
// memory into fragments. With one 8-row group per threadgroup no element is
// read by two SIMD-groups of a threadgroup, so staging would buy no reuse.
//
//   flash_backward_splitd_dq     grid (ceil(Nq / 8), Hq, B), 32 * WM threads
//     Part p keeps Q (its 8 x F slice, read once) and the dQ accumulator
//     in registers, and re-reads its dO slice per key block. Delta = rowsum(dO * O) (- grad_lse): each
//     part sums its features, the parts' sums meet in threadgroup memory
//     (summed in part order) and Delta is stored for the dK/dV kernel and
//     flash_sinks_grad. Per key block of BK keys: partial S = Q_p.K_p^T and
//     dP = dO_p.V_p^T over the part's features to threadgroup memory
//     (split-K); the shared step: part p finishes keys [4p, 4p + 4) of the
//     block, one (row, key) per lane (row lane / 4), sums that element's WM
//     partials in part order, rebuilds P (backward_weight: every option as
//     the simdgroup backward applies it) and writes dS; then every part
//     reads the whole dS (8 x BK) and adds dS.K_p to its dQ slice.
//   flash_backward_splitd_dkdv   grid (ceil(Nk / 8), Hkv, B), 32 * WM threads
//     Part p keeps dK and dV of 8 keys x F features in registers; over the
//     GQA group's query heads (in order) and the query blocks of BQ rows
//     that see the keys (causal and window bounds skip the rest): partial
//     S^T = K_p.Q_p^T and dP^T = V_p.dO_p^T, the shared step as above
//     (key lane / 4, query 4p + lane % 4; lse and Delta of the query read
//     from device memory) writing P^T and dS^T, then dV_p += P^T.dO_p and
//     dK_p += dS^T.Q_p. float32 adds each head's sums to grad_k / grad_v
//     (one rounding per head, as attention_backward_dkdv.h does and says
//     why); 16-bit dtypes store the group's sum once.
//
// 2 barriers per block in both kernels (partials written; dS written). No
// second scratch: a block's partials are rewritten after its second
// barrier, which every reader of them passed first; its dS after the next
// block's first barrier, which every reader of dS passed first. No
// atomics, one writer per output element, every sum in a fixed order: the
// results are bitwise deterministic.
//
// Tile choices (the model in benchmarks/model/families/splitd_backward.py):
//   8 rows owned (queries in dQ, keys in dK/dV), WM = 8 parts of F = 64:
//     the shared step maps 8 rows x 4 elements onto a part's 32 lanes (the
//     forward's mapping), and one row group reads no operand twice.
//   Streamed block 32 (= 4 x WM): one element per lane per part in the
//     shared step; S and dP are 4 fragments each.
//   Registers (32-bit values per lane, the planner's count with 4 for the
//     fragments being read and 16 of overhead): dQ kernel Q and dQ, 16
//     each, plus one block of S (8) while it is written out, then dP's:
//     60; dK/dV kernel dK and dV, 16 each, plus S^T and dP^T (8 each): 68.
//     dO (dQ kernel) and K, V (dK/dV kernel) are re-read per block from
//     device memory, not kept: keeping them would need 76 and 100 values,
//     past the planner's 72-value budget; their 8 x 64 slices stay
//     cache-hot.
//   Threadgroup memory (floats): 2 x WM x 8 x 32 partials, 8 x 32 dS (the
//     dK/dV kernel: P^T and dS^T, 2 x 8 x 32), WM x 8 Delta partials (dQ
//     kernel): 17,664 bytes (dQ) and 18,432 (dK/dV): one threadgroup, 8
//     SIMD-groups, per 32 KiB core (csrc/metal/families/backward_splitd.cpp sizes it).
//
// Options, as the simdgroup backward takes them: causal (bottom-right) and
// the right window, the left window (blocks outside every row's window
// skipped), softcap and bool / additive masks (backward_weight), packed
// variable-length sequences (fc_varlen), GQA, grad_lse (fc_has_grad_lse);
// sinks need nothing here (lse includes the sink; flash_sinks_grad reads
// the Delta stored here). Not: D_v != D_qk, head dims other than DMAX (no
// padding columns), a paged KV cache (no backward).
//
// MSL subset: as attention_common.h.
#pragma once

#include "attention_backward.h"
#include "../prefill/attention_prefill_splitd.h"

namespace flash_metal {

// T: q, k, v, o, dO and dQ's type. DMAX: the head dim (q, k, v alike,
// exactly). BQ: query rows per threadgroup (8). BK: keys per block (4 x WM).
// WM: SIMD-groups, each owning DMAX / WM features.
// Launch: grid (ceil(Nq / BQ), Hq, B), threadgroup (32 * WM, 1, 1),
// threadgroup memory (2 * WM * 8 * BK + 8 * BK + WM * 8) * 4 bytes at index
// 0; function constants fc_causal (0), fc_has_grad_lse (3), the options'
// 4-9 (the others are not read). Buffers as flash_backward_dq's.
template <typename T, int DMAX, int BQ, int BK, int WM>
[[kernel]] [[max_total_threads_per_threadgroup(kBackwardMaxThreads)]] void flash_backward_splitd_dq(
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
    threadgroup float* smem [[threadgroup(0)]],
    uint3 group [[threadgroup_position_in_grid]],
    uint sg [[simdgroup_index_in_threadgroup]],
    uint lane [[thread_index_in_simdgroup]]) {
  constexpr int PARTS = WM;
  static_assert(BQ == 8, "one 8-row group per threadgroup: the shared step maps 8 rows x 4 keys to 32 lanes");
  static_assert(32 * WM <= kBackwardMaxThreads, "the declared threadgroup limit (params.h)");
  static_assert(BK == 4 * PARTS, "each part finishes 4 keys of the block, one (row, key) per lane");
  static_assert(DMAX % (8 * PARTS) == 0, "parts are whole 8x8 fragments");
  constexpr int TK = BK / 8;            // key fragments per block
  constexpr int TF = DMAX / 8 / PARTS;  // feature fragments of this part
  constexpr int SLOT = 8 * BK;          // floats of one part's partial block, row-major (row * BK + key)
  threadgroup float* part_s = smem;                      // PARTS x 8 x BK partial S
  threadgroup float* part_dp = part_s + PARTS * SLOT;    // PARTS x 8 x BK partial dP
  threadgroup float* ds_block = part_dp + PARTS * SLOT;  // 8 x BK: the block's dS
  threadgroup float* part_delta = ds_block + SLOT;       // PARTS x 8: rowsum(dO * O) per part
  const int part = int(sg);
  const int col0 = part * (DMAX / PARTS);

  // The threadgroup's sequence; a query block past its end leaves at once
  // (uniform, before any barrier).
  const SeqView sv = sequence_view(p, cu_seqlens_q, cu_seqlens_k, group.z);
  const int q0 = int(group.x) * BQ;
  if (fc_varlen && q0 >= sv.q_len) return;
  HeadOffsets h = head_offsets(p, group.z, group.y);
  int64_t do_head = int64_t(group.z) * p.do_batch_stride + int64_t(group.y) * p.do_head_stride;
  int64_t glse_head = int64_t(group.z) * p.glse_batch_stride + int64_t(group.y) * p.glse_head_stride;
  if (fc_varlen) {  // the sequence's first rows (the planner zeroed the batch strides)
    h.q += sv.q_row0 * p.q_row_stride;
    h.o += sv.q_row0 * p.o_row_stride;
    h.lse += sv.q_row0 * p.lse_row_stride;
    h.k += sv.k_row0 * p.k_row_stride;
    h.v += sv.k_row0 * p.v_row_stride;
    do_head += sv.q_row0 * p.do_row_stride;
    glse_head += sv.q_row0 * p.glse_row_stride;
  }
  // grad_q and Delta are packed (B, Hq, Nq, ...), or (1, Hq, total_q, ...) for varlen.
  const uint packed_b = fc_varlen ? 0u : group.z;
  const int packed_q = fc_varlen ? p.total_q : p.q_len;
  const int64_t mask_slice = fc_has_mask ? mask_head_offset(p, group.z, group.y) : 0;
  const int fr = prefill_frag_row(lane);
  const int fc = prefill_frag_col(lane);
  const int row = q0 + fr;                     // this lane's row in the fragments (Q, dO, dQ)
  const int b_row = int(lane) / 4;             // and in the shared step
  const int b_col = part * 4 + int(lane) % 4;  // its key there, within the block
  const int b_query = q0 + b_row;

  // Q: this part's 8 x F slice, once (rows past the sequence zero). dO's
  // slice is re-read per key block (cache-hot), not kept: Q, dO and dQ
  // together would be 48 values per lane, 76 with a block of S and the
  // overhead, past the 72-value budget.
  PrefillFrag Q[TF];
  FM_UNROLL for (int i = 0; i < TF; ++i) {
    splitd_frag(Q[i], q + h.q, p.q_row_stride, p.q_dim_stride, q0, col0 + i * 8, sv.q_len, fr, fc);
  }
  // Delta: this part's share of rowsum(dO * O) (dO and O read once, at the
  // fragment positions), the row's 4 lanes combined by two shuffles, then
  // the parts' shares through threadgroup memory, in part order.
  float dsum = 0.0f;
  if (row < sv.q_len) {
    device const T* orow = o + h.o + int64_t(row) * p.o_row_stride;
    device const T* drow = dout + do_head + int64_t(row) * p.do_row_stride;
    FM_UNROLL for (int i = 0; i < TF; ++i) {
      FM_UNROLL for (int j = 0; j < 2; ++j) {
        const int64_t c = col0 + i * 8 + fc + j;
        dsum += float(drow[c * p.do_dim_stride]) * float(orow[c * p.o_dim_stride]);
      }
    }
  }
  dsum += simd_shuffle_xor(dsum, 1);
  dsum += simd_shuffle_xor(dsum, 8);
  if (fc == 0) part_delta[part * 8 + fr] = dsum;
  threadgroup_barrier(mem_flags::mem_threadgroup);  // the parts' Delta shares written before they are summed (RAW)

  // The shared step's row state: Delta, the lse in base 2 and whether the
  // row saw any key (lse -inf, from its bits: P is then all zero).
  float row_delta = 0.0f, m2 = 0.0f, m2lo = 0.0f;
  bool row_live = false;
  if (b_query < sv.q_len) {
    FM_UNROLL for (int pp = 0; pp < PARTS; ++pp) row_delta += part_delta[pp * 8 + b_row];
    if (fc_has_grad_lse) row_delta -= dlse[glse_head + int64_t(b_query) * p.glse_row_stride];
    const float l = lse[h.lse + int64_t(b_query) * p.lse_row_stride];
    row_live = as_type<uint>(l) != kNegInfBits;
    m2 = row_live ? l * M_LOG2E_F : 0.0f;
    m2lo = row_live ? lse2_lo(l, m2) : 0.0f;
    if (part == 0 && int(lane) % 4 == 0) {
      delta[(int64_t(packed_b) * p.q_heads + group.y) * packed_q + sv.q_row0 + b_query] = row_delta;
    }
  }

  // Key blocks some row sees: up to the last real row's last key, from the
  // first row's first key (a left window). Uniform: one row group.
  const int last_row = min(q0 + BQ, sv.q_len) - 1;
  const int kb_begin = fc_window_left ? first_visible_key(sv, q0) / BK : 0;
  const int kb_end = (visible_key_end(sv, last_row) + BK - 1) / BK;
  PrefillFrag dQ[TF];
  FM_UNROLL for (int i = 0; i < TF; ++i) dQ[i] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);

  for (int kb = kb_begin; kb < kb_end; ++kb) {
    const int k0 = kb * BK;
    // Partial S = Q_p.K_p^T, written out, then partial dP = dO_p.V_p^T (one
    // block of 4 fragments live at a time).
    FM_UNROLL for (int pass = 0; pass < 2; ++pass) {
      PrefillFrag S[TK];
      FM_UNROLL for (int t = 0; t < TK; ++t) S[t] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
      FM_UNROLL for (int i = 0; i < TF; ++i) {
        PrefillFrag af = Q[i];
        if (pass == 1) {
          splitd_frag(af, dout + do_head, p.do_row_stride, p.do_dim_stride, q0, col0 + i * 8, sv.q_len, fr, fc);
        }
        FM_UNROLL for (int t = 0; t < TK; ++t) {
          PrefillFrag kf;
          if (pass == 0) {
            splitd_frag_t(kf, k + h.k, p.k_row_stride, p.k_dim_stride, k0 + t * 8, col0 + i * 8, sv.kv_len, fr, fc);
          } else {
            splitd_frag_t(kf, v + h.v, p.v_row_stride, p.v_dim_stride, k0 + t * 8, col0 + i * 8, sv.kv_len, fr, fc);
          }
          prefill_mma(S[t], af, kf);
        }
      }
      threadgroup float* out = pass == 0 ? part_s : part_dp;
      FM_UNROLL for (int t = 0; t < TK; ++t) {
        FM_UNROLL for (int j = 0; j < 2; ++j) out[part * SLOT + fr * BK + t * 8 + fc + j] = S[t].thread_elements()[j];
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);  // partials written before they are summed (RAW)

    // This lane's (row, key): S and dP summed in part order, P rebuilt as
    // the forward built it (0 for keys past the sequence, outside the
    // window, masked, or rows that saw no key), dS = P * (dP - Delta).
    float s = 0.0f, dp = 0.0f;
    FM_UNROLL for (int pp = 0; pp < PARTS; ++pp) {
      s += part_s[pp * SLOT + b_row * BK + b_col];
      dp += part_dp[pp * SLOT + b_row * BK + b_col];
    }
    const int b_key = k0 + b_col;
    const bool keep = row_live && b_key < sv.kv_len && key_in_window(sv, b_query, b_key);
    float cap_grad;
    const float pw = backward_weight<T>(p, mask, mask_slice, b_query, b_key, s, m2, m2lo, keep, &cap_grad);
    float ds = pw * (dp - row_delta);
    if (fc_softcap) ds *= cap_grad;
    ds_block[b_row * BK + b_col] = ds;
    threadgroup_barrier(mem_flags::mem_threadgroup);  // dS written before every part reads it (RAW)

    // dQ_p += dS.K_p, the block's product summed from zero and added once.
    PrefillFrag dS[TK];
    FM_UNROLL for (int t = 0; t < TK; ++t) prefill_read_frag(dS[t], ds_block, BK, 0, t * 8, fr, fc);
    FM_UNROLL for (int i = 0; i < TF; ++i) {
      PrefillFrag acc = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
      FM_UNROLL for (int t = 0; t < TK; ++t) {
        PrefillFrag kf;
        splitd_frag(kf, k + h.k, p.k_row_stride, p.k_dim_stride, k0 + t * 8, col0 + i * 8, sv.kv_len, fr, fc);
        prefill_mma(acc, dS[t], kf);
      }
      FM_UNROLL for (int j = 0; j < 2; ++j) dQ[i].thread_elements()[j] += acc.thread_elements()[j];
    }
  }

  // dQ * scale, packed, real rows only (zeros for a row that sees no key).
  if (row < sv.q_len) {
    device T* out = dq + packed_row(packed_b, group.y, p.q_heads, packed_q, sv.q_row0 + row, DMAX);
    FM_UNROLL for (int i = 0; i < TF; ++i) {
      FM_UNROLL for (int j = 0; j < 2; ++j) {
        out[col0 + i * 8 + fc + j] = static_cast<T>(dQ[i].thread_elements()[j] * p.scale);
      }
    }
  }
}

// BK: keys per threadgroup (8). BQ: query rows per block (4 x WM). WM:
// SIMD-groups, each owning DMAX / WM features of dK and dV.
// Launch: grid (ceil(Nk / BK), Hkv, B), threadgroup (32 * WM, 1, 1),
// threadgroup memory (2 * WM * BK * BQ + 2 * BK * BQ) * 4 bytes at index 0;
// function constants fc_causal (0), the options' 4-9. Buffers as
// flash_backward_dkdv's; reads Delta as the dQ kernel wrote it.
template <typename T, int DMAX, int BQ, int BK, int WM>
[[kernel]] [[max_total_threads_per_threadgroup(kBackwardMaxThreads)]] void flash_backward_splitd_dkdv(
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
    threadgroup float* smem [[threadgroup(0)]],
    uint3 group [[threadgroup_position_in_grid]],
    uint sg [[simdgroup_index_in_threadgroup]],
    uint lane [[thread_index_in_simdgroup]]) {
  constexpr int PARTS = WM;
  static_assert(BK == 8, "one 8-key group per threadgroup: the shared step maps 8 keys x 4 queries to 32 lanes");
  static_assert(32 * WM <= kBackwardMaxThreads, "the declared threadgroup limit (params.h)");
  static_assert(BQ == 4 * PARTS, "each part finishes 4 queries of the block, one (key, query) per lane");
  static_assert(DMAX % (8 * PARTS) == 0, "parts are whole 8x8 fragments");
  constexpr int TQ = BQ / 8;            // query fragments per block
  constexpr int TF = DMAX / 8 / PARTS;  // feature fragments of this part
  constexpr int SLOT = 8 * BQ;          // floats of one part's partial block, row-major (key * BQ + query)
  threadgroup float* part_s = smem;                       // PARTS x 8 x BQ partial S^T
  threadgroup float* part_dp = part_s + PARTS * SLOT;     // PARTS x 8 x BQ partial dP^T
  threadgroup float* p_block = part_dp + PARTS * SLOT;    // 8 x BQ: the block's P^T
  threadgroup float* ds_block = p_block + SLOT;           // 8 x BQ: the block's dS^T
  const int part = int(sg);
  const int col0 = part * (DMAX / PARTS);

  const SeqView sv = sequence_view(p, cu_seqlens_q, cu_seqlens_k, group.z);
  const int k0 = int(group.x) * BK;
  if (fc_varlen && k0 >= sv.kv_len) return;
  const uint kv_head = group.y;
  int64_t k_off = int64_t(group.z) * p.k_batch_stride + int64_t(kv_head) * p.k_head_stride;
  int64_t v_off = int64_t(group.z) * p.v_batch_stride + int64_t(kv_head) * p.v_head_stride;
  if (fc_varlen) {
    k_off += sv.k_row0 * p.k_row_stride;
    v_off += sv.k_row0 * p.v_row_stride;
  }
  const uint packed_b = fc_varlen ? 0u : group.z;
  const int packed_q = fc_varlen ? p.total_q : p.q_len;
  const int packed_k = fc_varlen ? p.total_k : p.kv_len;
  const int fr = prefill_frag_row(lane);
  const int fc = prefill_frag_col(lane);
  const int key = k0 + fr;                      // this lane's key in the fragments (K, V, dK, dV)
  const int b_key = k0 + int(lane) / 4;         // and in the shared step
  const int b_col = part * 4 + int(lane) % 4;   // its query there, within the block

  // Query blocks that see some key of this block (attention_backward_dkdv.h's
  // bounds): from the first row a causal / right-window bound lets see k0,
  // to past the last row a left window lets see the last real key.
  const int k_last = min(k0 + BK, sv.kv_len) - 1;
  const int first_row = fc_causal ? max(0, k0 - sv.upper) : 0;
  const int row_end = !fc_window_left || k_last + 1 - sv.q_len >= sv.lower ? sv.q_len : k_last - sv.lower + 1;
  const int qb_begin = first_row / BQ;
  const int qb_end = first_row < row_end ? (row_end + BQ - 1) / BQ : qb_begin;

  device T* kout = dk + packed_row(packed_b, kv_head, p.kv_heads, packed_k, sv.k_row0 + key, DMAX);
  device T* vout = dv + packed_row(packed_b, kv_head, p.kv_heads, packed_k, sv.k_row0 + key, DMAX);
  const bool real_key = key < sv.kv_len;
  // float32 adds each head's dK, dV to the outputs (one rounding per head);
  // 16-bit dtypes keep one register sum (attention_backward_dkdv.h says why).
  constexpr bool kGroupInMemory = sizeof(T) == 4;
  PrefillFrag dK[TF];
  PrefillFrag dV[TF];
  for (int g = 0; g < p.gqa_ratio; ++g) {
    if (g == 0 || kGroupInMemory) {
      FM_UNROLL for (int i = 0; i < TF; ++i) {
        dK[i] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
        dV[i] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
      }
    }
    const uint head = kv_head * uint(p.gqa_ratio) + uint(g);
    HeadOffsets h = head_offsets(p, group.z, head);
    int64_t do_head = int64_t(group.z) * p.do_batch_stride + int64_t(head) * p.do_head_stride;
    if (fc_varlen) {
      h.q += sv.q_row0 * p.q_row_stride;
      h.lse += sv.q_row0 * p.lse_row_stride;
      do_head += sv.q_row0 * p.do_row_stride;
    }
    device const float* head_delta = delta + (int64_t(packed_b) * p.q_heads + head) * packed_q + sv.q_row0;
    const int64_t mask_slice = fc_has_mask ? mask_head_offset(p, group.z, head) : 0;
    for (int qb = qb_begin; qb < qb_end; ++qb) {
      const int q0 = qb * BQ;
      // Partial S^T = K_p.Q_p^T, written out, then dP^T = V_p.dO_p^T.
      FM_UNROLL for (int pass = 0; pass < 2; ++pass) {
        PrefillFrag S[TQ];
        FM_UNROLL for (int t = 0; t < TQ; ++t) S[t] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
        FM_UNROLL for (int i = 0; i < TF; ++i) {
          PrefillFrag af;
          if (pass == 0) {
            splitd_frag(af, k + k_off, p.k_row_stride, p.k_dim_stride, k0, col0 + i * 8, sv.kv_len, fr, fc);
          } else {
            splitd_frag(af, v + v_off, p.v_row_stride, p.v_dim_stride, k0, col0 + i * 8, sv.kv_len, fr, fc);
          }
          FM_UNROLL for (int t = 0; t < TQ; ++t) {
            PrefillFrag bf;
            if (pass == 0) {
              splitd_frag_t(bf, q + h.q, p.q_row_stride, p.q_dim_stride, q0 + t * 8, col0 + i * 8, sv.q_len, fr, fc);
            } else {
              splitd_frag_t(bf, dout + do_head, p.do_row_stride, p.do_dim_stride, q0 + t * 8, col0 + i * 8, sv.q_len,
                            fr, fc);
            }
            prefill_mma(S[t], af, bf);
          }
        }
        threadgroup float* out = pass == 0 ? part_s : part_dp;
        FM_UNROLL for (int t = 0; t < TQ; ++t) {
          FM_UNROLL for (int j = 0; j < 2; ++j) out[part * SLOT + fr * BQ + t * 8 + fc + j] = S[t].thread_elements()[j];
        }
      }
      threadgroup_barrier(mem_flags::mem_threadgroup);  // partials written before they are summed (RAW)

      // This lane's (key, query): sums in part order, P^T rebuilt from the
      // query's lse, dS^T = P^T * (dP^T - Delta); both to threadgroup memory.
      float s = 0.0f, dpt = 0.0f;
      FM_UNROLL for (int pp = 0; pp < PARTS; ++pp) {
        s += part_s[pp * SLOT + (b_key - k0) * BQ + b_col];
        dpt += part_dp[pp * SLOT + (b_key - k0) * BQ + b_col];
      }
      const int qrow = q0 + b_col;
      float pw = 0.0f, ds = 0.0f;
      if (qrow < sv.q_len) {
        const float l = lse[h.lse + int64_t(qrow) * p.lse_row_stride];
        const bool keep = as_type<uint>(l) != kNegInfBits && b_key < sv.kv_len && key_in_window(sv, qrow, b_key);
        const float m2 = keep ? l * M_LOG2E_F : 0.0f;
        const float m2lo = keep ? lse2_lo(l, m2) : 0.0f;
        float cap_grad;
        pw = backward_weight<T>(p, mask, mask_slice, qrow, b_key, s, m2, m2lo, keep, &cap_grad);
        ds = pw * (dpt - head_delta[qrow]);
        if (fc_softcap) ds *= cap_grad;
      }
      p_block[(b_key - k0) * BQ + b_col] = pw;
      ds_block[(b_key - k0) * BQ + b_col] = ds;
      threadgroup_barrier(mem_flags::mem_threadgroup);  // P^T and dS^T written before every part reads them (RAW)

      // dV_p += P^T.dO_p and dK_p += dS^T.Q_p, each block's product summed
      // from zero and added once.
      PrefillFrag Pt[TQ];
      PrefillFrag dSt[TQ];
      FM_UNROLL for (int t = 0; t < TQ; ++t) {
        prefill_read_frag(Pt[t], p_block, BQ, 0, t * 8, fr, fc);
        prefill_read_frag(dSt[t], ds_block, BQ, 0, t * 8, fr, fc);
      }
      FM_UNROLL for (int i = 0; i < TF; ++i) {
        PrefillFrag av = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
        PrefillFrag ak = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
        FM_UNROLL for (int t = 0; t < TQ; ++t) {
          PrefillFrag df, qf;
          splitd_frag(df, dout + do_head, p.do_row_stride, p.do_dim_stride, q0 + t * 8, col0 + i * 8, sv.q_len, fr,
                      fc);
          prefill_mma(av, Pt[t], df);
          splitd_frag(qf, q + h.q, p.q_row_stride, p.q_dim_stride, q0 + t * 8, col0 + i * 8, sv.q_len, fr, fc);
          prefill_mma(ak, dSt[t], qf);
        }
        FM_UNROLL for (int j = 0; j < 2; ++j) {
          dV[i].thread_elements()[j] += av.thread_elements()[j];
          dK[i].thread_elements()[j] += ak.thread_elements()[j];
        }
      }
    }
    if (kGroupInMemory && real_key) store_dkdv<TF>(kout, vout, dK, dV, col0 + fc, DMAX, DMAX, p.scale, g > 0);
  }

  // 16-bit dtypes: dK * scale and dV of the whole group stored once; a key
  // no query sees stores zeros.
  if (!kGroupInMemory && real_key) store_dkdv<TF>(kout, vout, dK, dV, col0 + fc, DMAX, DMAX, p.scale, false);
}

}  // namespace flash_metal
