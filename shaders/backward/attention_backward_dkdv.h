// The backward's dK/dV kernel (flash_backward_dkdv): see attention_backward.h
// for the algorithm, the feature parts, the tile layout and the helpers it
// shares with the dQ kernel (attention_backward_dq.h). Runs after the dQ
// kernel, whose Delta it reads.
#pragma once

#include "attention_backward.h"

namespace flash_metal {

// This lane's dK * scale and dV (TD fragments, features c0 + id * 8 + j,
// c0 = the part's first feature plus the lane's fragment column) into the
// rows kout / vout, features below D (k's) and DV (v's) only: written, or
// with `add` added to what the rows hold (float32: the GQA group's running
// sum, see flash_backward_dkdv).
template <int TD, typename T>
FM_INLINE void store_dkdv(device T* kout, device T* vout, thread PrefillFrag* dK, thread PrefillFrag* dV,
                          int c0, int D, int DV, float scale, bool add) {
  FM_UNROLL for (int id = 0; id < TD; ++id) {
    FM_UNROLL for (int j = 0; j < 2; ++j) {
      const int c = c0 + id * 8 + j;
      if (c < D) {
        const float gk = dK[id].thread_elements()[j] * scale;
        kout[c] = static_cast<T>(add ? float(kout[c]) + gk : gk);
      }
      if (c < DV) {
        const float gv = dV[id].thread_elements()[j];
        vout[c] = static_cast<T>(add ? float(vout[c]) + gv : gv);
      }
    }
  }
}

// BK: keys per threadgroup (8 per row group of SIMD-groups, BK * DSPLIT =
// 8 * WM). BQ: query rows per streamed block. DSPLIT: feature parts of dK
// and dV, a SIMD-group each (attention_backward.h; dK and dV of 8 keys x 256
// features whole would be 128 floats per lane, a thread's every register).
// Launch: grid (ceil(Nk / BK), Hkv, B), threadgroup
// (32 * WM, 1, 1), threadgroup memory (attention_backward.h) at index 0, function
// constants fc_causal (0), fc_align_q (1: Nq % BQ == 0), fc_align_k
// (2: Nk % BK == 0). Reads Delta as the dQ kernel wrote it.
template <typename T, int DMAX, int BQ, int BK, int WM, int DSPLIT>
[[kernel]] [[max_total_threads_per_threadgroup(kBackwardMaxThreads)]] void flash_backward_dkdv(
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
    uint sg [[simdgroup_index_in_threadgroup]],
    uint lane [[thread_index_in_simdgroup]]) {
  static_assert(BK * DSPLIT == 8 * WM, "each SIMD-group owns 8 keys and one feature part of their dK and dV");
  static_assert(BQ % 8 == 0 && DMAX % 8 == 0, "tiles are whole 8x8 fragments");
  constexpr int THREADS = 32 * WM;
  static_assert(THREADS <= kBackwardMaxThreads, "the declared threadgroup limit (params.h)");
  constexpr int PARTIALS = backward_partials_bytes<T, DMAX, 2 * (BQ + BK), WM, BQ, DSPLIT>();
  constexpr int PAD = backward_row_pad<T, DMAX, 2 * (BQ + BK), PARTIALS>();
  constexpr int LD = DMAX + PAD / int(sizeof(T));
  static_assert(DMAX % (8 * DSPLIT) == 0, "each part is whole fragments");
  constexpr int TQ = BQ / 8;                // query fragments per streamed block
  constexpr int TD = DMAX / 8 / DSPLIT;     // feature fragments of dK and dV this SIMD-group keeps
  constexpr int ROWG = BK / 8;              // 8-key groups; SIMD-group sg: group sg % ROWG, part sg / ROWG
  const int rg = int(sg) % ROWG;
  threadgroup T* k_tile = smem;
  threadgroup T* v_tile = k_tile + BK * LD;
  threadgroup T* q_tile = v_tile + BK * LD;
  threadgroup T* do_tile = q_tile + BQ * LD;
  // The parts' partial S^T and dP^T (backward_reduce_parts), after the tiles.
  threadgroup float* partials = reinterpret_cast<threadgroup float*>(do_tile + BQ * LD);

  // This threadgroup's sequence; a key block past its keys (varlen: the
  // grid covers the longest sequence) leaves at once, uniformly, before any
  // barrier.
  const SeqView sv = sequence_view(p, cu_seqlens_q, cu_seqlens_k, group.z);
  const int k0 = int(group.x) * BK;
  if (fc_varlen && k0 >= sv.kv_len) return;
  const int q_len = sv.q_len;
  const int kv_len = sv.kv_len;

  const int D = p.head_dim;    // q's and k's features (S^T = K.Q^T, dK = dS^T.Q)
  const int DV = p.head_dim_v;  // v's and dO's (dP^T = V.dO^T, dV = P^T.dO); == D unless MLA-style
  const uint kv_head = group.y;
  int64_t k_off = int64_t(group.z) * p.k_batch_stride + int64_t(kv_head) * p.k_head_stride;
  int64_t v_off = int64_t(group.z) * p.v_batch_stride + int64_t(kv_head) * p.v_head_stride;
  if (fc_varlen) {  // the sequence's first keys (the planner zeroed the batch strides)
    k_off += sv.k_row0 * p.k_row_stride;
    v_off += sv.k_row0 * p.v_row_stride;
  }
  // Delta (B, Hq, Nq), grad_k and grad_v (B, Hkv, Nk, D) are packed, or
  // (1, Hq, total_q) and (1, Hkv, total_k, D) for varlen: packed_b is their
  // batch index, packed_q / packed_k their rows per head.
  const uint packed_b = fc_varlen ? 0u : group.z;
  const int packed_q = fc_varlen ? p.total_q : p.q_len;
  const int packed_k = fc_varlen ? p.total_k : p.kv_len;
  const int col0 = int(sg) / ROWG * (DMAX / DSPLIT);  // first feature of this part
  const int sg_key0 = k0 + rg * 8;
  const int fr = prefill_frag_row(lane);
  const int fc = prefill_frag_col(lane);
  const int key = sg_key0 + fr;  // this lane's key (its row of the P^T fragments)

  if (!fc_align_k && k0 + BK > kv_len) {
    prefill_load_tile<BK, DMAX, LD, THREADS, true>(k_tile, k + k_off, p.k_row_stride, p.k_dim_stride, k0, D,
                                                   kv_len - k0, tid);
    prefill_load_tile<BK, DMAX, LD, THREADS, true>(v_tile, v + v_off, p.v_row_stride, p.v_dim_stride, k0, DV,
                                                   kv_len - k0, tid);
  } else {
    prefill_load_tile<BK, DMAX, LD, THREADS, false>(k_tile, k + k_off, p.k_row_stride, p.k_dim_stride, k0, D, BK, tid);
    prefill_load_tile<BK, DMAX, LD, THREADS, false>(v_tile, v + v_off, p.v_row_stride, p.v_dim_stride, k0, DV, BK,
                                                    tid);
  }
  // No barrier of its own: the first streamed block's barrier orders these
  // writes before any read.

  // Query blocks that see some key of this block. Upper bound (causal or a
  // right window): query i sees key j only if i >= j - upper, so the first
  // row is k0 - upper. Left window: only if i <= j - lower, so the rows end
  // after k_last - lower (k_last the block's last real key). None when the
  // range is empty (the keys keep dK = dV = 0). Uniform.
  const int k_last = min(k0 + BK, kv_len) - 1;
  const int first_row = fc_causal ? max(0, k0 - sv.upper) : 0;
  const int row_end = !fc_window_left || k_last + 1 - q_len >= sv.lower ? q_len : k_last - sv.lower + 1;
  const int qb_begin = first_row / BQ;
  const int qb_end = first_row < row_end ? (row_end + BQ - 1) / BQ : qb_begin;
  const int d_frags = (D + 7) / 8;
  const int dv_frags = (DV + 7) / 8;

  // dK and dV go to grad_k (D wide) / grad_v (DV wide), packed, for real
  // keys and this part's real features only; a key no query sees (causal
  // with Nk > Nq, outside every window, a sequence with no query) stores
  // zeros.
  const bool real_key = fc_align_k || key < kv_len;
  device T* kout = dk + packed_row(packed_b, kv_head, p.kv_heads, packed_k, sv.k_row0 + key, D);
  device T* vout = dv + packed_row(packed_b, kv_head, p.kv_heads, packed_k, sv.k_row0 + key, DV);
  // GQA (issue 24): the group's query heads in a fixed order, so the sum
  // over the group is the same every run (no atomics, no race). One float32
  // register sum through every block of every head rounds group * Nq / BQ
  // times at the size of the whole sum: emulated, float32, N = 1024, D = 64,
  // 32 heads per kv head, dK and dV reached 2.6-4.0x PyTorch's float32
  // backward error. So float32 sums one head in registers and adds each
  // head's dK * scale and dV to grad_k / grad_v, which this lane alone owns
  // and reads back: `group` roundings, as per-head GEMMs and a sum over the
  // group, and no register more (the planner's budget counts dK and dV
  // once); at most 1.5x then. The traffic, the block's dK and dV read and
  // written once per head, is 2 * BK / Nq of the head's Q and dO reads.
  // 16-bit gradients keep the single sum: their rounding (2^-9, 2^-11)
  // dwarfs float32's.
  constexpr bool kGroupInMemory = sizeof(T) == 4;
  PrefillFrag dK[TD];
  PrefillFrag dV[TD];
  for (int g = 0; g < p.gqa_ratio; ++g) {
    if (g == 0 || kGroupInMemory) {
      FM_UNROLL for (int id = 0; id < TD; ++id) {
        dK[id] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
        dV[id] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
      }
    }
    const uint head = kv_head * uint(p.gqa_ratio) + uint(g);
    HeadOffsets h = head_offsets(p, group.z, head);
    int64_t do_head = int64_t(group.z) * p.do_batch_stride + int64_t(head) * p.do_head_stride;
    if (fc_varlen) {  // the sequence's first query rows
      h.q += sv.q_row0 * p.q_row_stride;
      h.lse += sv.q_row0 * p.lse_row_stride;
      do_head += sv.q_row0 * p.do_row_stride;
    }
    device const float* head_delta = delta + (int64_t(packed_b) * p.q_heads + head) * packed_q + sv.q_row0;
    const int64_t renorm_at = backward_renorm_offset(p);  // the dQ kernel's log2 row sums (attention_backward.h)
    const int64_t mask_slice = fc_has_mask ? mask_head_offset(p, group.z, head) : 0;
    for (int qb = qb_begin; qb < qb_end; ++qb) {
      const int q0 = qb * BQ;
      const bool q_edge = !fc_align_q && q0 + BQ > q_len;
      // The SIMD-group's keys are real and some of them are seen by some
      // row of the block (the last row's upper bound, the first row's lower
      // bound); each element is tested where some (key, query) pair of the
      // block is after the query's upper bound (diagonal) or before its
      // lower bound (left_edge). Uniform across the SIMD-group.
      const int q_last = min(q0 + BQ, q_len) - 1;
      const bool active = (fc_align_k || sg_key0 < kv_len) && (!fc_causal || sg_key0 - sv.upper <= q_last) &&
                          (!fc_window_left || q0 + sv.lower <= sg_key0 + 7);
      const bool diagonal = fc_causal && sg_key0 + 7 - sv.upper > q0;
      const bool left_edge = fc_window_left && q_last + sv.lower > sg_key0;

      threadgroup_barrier(mem_flags::mem_threadgroup);  // last block's Q/dO reads done (WAR)
      if (q_edge) {
        prefill_load_tile<BQ, DMAX, LD, THREADS, true>(q_tile, q + h.q, p.q_row_stride, p.q_dim_stride, q0, D,
                                                       q_len - q0, tid);
        prefill_load_tile<BQ, DMAX, LD, THREADS, true>(do_tile, dout + do_head, p.do_row_stride, p.do_dim_stride,
                                                       q0, DV, q_len - q0, tid);
      } else {
        prefill_load_tile<BQ, DMAX, LD, THREADS, false>(q_tile, q + h.q, p.q_row_stride, p.q_dim_stride, q0, D, BQ,
                                                        tid);
        prefill_load_tile<BQ, DMAX, LD, THREADS, false>(do_tile, dout + do_head, p.do_row_stride, p.do_dim_stride,
                                                        q0, DV, BQ, tid);
      }
      threadgroup_barrier(mem_flags::mem_threadgroup);  // Q/dO written before anyone reads them (RAW)

      // S^T = K.Q^T and dP^T = V.dO^T (8 keys x BQ queries each); with
      // parts, each over the part's features, then summed (split-K).
      PrefillFrag S[TQ];
      PrefillFrag dP[TQ];
      if (PARTIALS == 0) {  // whole features, or the recomputing fallback (backward_partials_bytes)
        if (!active) continue;
        backward_products<TQ, DMAX / 8>(S, dP, k_tile, v_tile, q_tile, do_tile, LD, rg * 8, d_frags, dv_frags, fr,
                                        fc);
      } else {
        if (active)
          backward_products<TQ, TD>(S, dP, k_tile, v_tile, q_tile, do_tile, LD, rg * 8, d_frags, dv_frags, fr, fc,
                                    int(sg) / ROWG * TD);
        backward_reduce_parts<TQ, ROWG, DSPLIT>(S, dP, partials, int(sg), rg, int(lane), active);
        if (!active) continue;
      }
      // P^T into S, dS^T = P^T * (dP^T - Delta) into dP (times the
      // softcap's derivative). Each element is (this lane's key, query
      // qrow); the query's lse and Delta are read from device memory (a few
      // floats per lane per block), and the mask element only for a real
      // key of the row's window.
      FM_UNROLL for (int t = 0; t < TQ; ++t) {
        FM_UNROLL for (int j = 0; j < 2; ++j) {
          const int qrow = q0 + t * 8 + fc + j;
          float pw = 0.0f, dl = 0.0f, cap_grad = 1.0f;
          if (!q_edge || qrow < q_len) {
            const float l = lse[h.lse + int64_t(qrow) * p.lse_row_stride];
            bool keep = as_type<uint>(l) != kNegInfBits;  // a row that saw no key has P = 0
            if (diagonal && key - sv.upper > qrow) keep = false;
            if (left_edge && key < qrow + sv.lower) keep = false;
            if (!fc_align_k && key >= kv_len) keep = false;
            const float m2 = keep ? l * M_LOG2E_F : 0.0f;
            float m2lo = keep ? lse2_lo(l, m2) : 0.0f;
            if (backward_renormalizes<T>() && keep) m2lo += head_delta[renorm_at + qrow];  // the row's log2(sum of P)
            pw = backward_weight<T>(p, mask, mask_slice, qrow, key, S[t].thread_elements()[j], m2, m2lo, keep,
                                    &cap_grad);
            dl = head_delta[qrow];
          }
          float ds = pw * (dP[t].thread_elements()[j] - dl);
          if (fc_softcap) ds *= cap_grad;
          S[t].thread_elements()[j] = pw;
          dP[t].thread_elements()[j] = ds;
        }
      }
      // dV += P^T.dO over v's DV features and dK += dS^T.Q over k's D,
      // each block's product summed from zero and added once (blocked sums,
      // as in the forward), over this part's features (uniform guards: a
      // part wholly past DV, or D, skips that product).
      FM_UNROLL for (int id = 0; id < TD; ++id) {
        const int c = col0 + id * 8;
        if (c < DV) {
          PrefillFrag av = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
          FM_UNROLL for (int t = 0; t < TQ; ++t) {
            PrefillFrag df;
            prefill_read_frag(df, do_tile, LD, t * 8, c, fr, fc);
            prefill_mma(av, S[t], df);
          }
          FM_UNROLL for (int j = 0; j < 2; ++j) dV[id].thread_elements()[j] += av.thread_elements()[j];
        }
        if (c < D) {
          PrefillFrag ak = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
          FM_UNROLL for (int t = 0; t < TQ; ++t) {
            PrefillFrag qf;
            prefill_read_frag(qf, q_tile, LD, t * 8, c, fr, fc);
            prefill_mma(ak, dP[t], qf);
          }
          FM_UNROLL for (int j = 0; j < 2; ++j) dK[id].thread_elements()[j] += ak.thread_elements()[j];
        }
      }
    }
    if (kGroupInMemory && real_key) store_dkdv<TD>(kout, vout, dK, dV, col0 + fc, D, DV, p.scale, g > 0);
  }

  // 16-bit dtypes: dK * scale and dV of the whole group stored once.
  if (!kGroupInMemory && real_key) store_dkdv<TD>(kout, vout, dK, dV, col0 + fc, D, DV, p.scale, false);
}

}  // namespace flash_metal
