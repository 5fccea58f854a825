// The backward's dQ kernel (flash_backward_dq): see attention_backward.h
// for the algorithm, the feature parts, the tile layout and the helpers it
// shares with the dK/dV kernel (attention_backward_dkdv.h).
#pragma once

#include "attention_backward.h"

namespace flash_metal {

// T, DMAX as in the forward. BQ: query rows per threadgroup (8 per row
// group of SIMD-groups, BQ * DSPLIT = 8 * WM). BK: keys per streamed block.
// DSPLIT: feature parts of dQ, a SIMD-group each (attention_backward.h). Launch: grid
// (ceil(Nq / BQ), Hq, B), threadgroup (32 * WM, 1, 1), threadgroup memory
// (attention_backward.h) at index 0, function constants fc_causal (0), fc_align_q
// (1: Nq % BQ == 0), fc_align_k (2: Nk % BK == 0), fc_has_grad_lse (3),
// fc_dense (10: the tile loader's path, attention_prefill.h).
// grad_lse is always bound (the host binds lse in its place when there is
// none; it is then never read).
template <typename T, int DMAX, int BQ, int BK, int WM, int DSPLIT>
[[kernel]] [[max_total_threads_per_threadgroup(kBackwardMaxThreads)]] void flash_backward_dq(
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
    uint tid [[thread_index_in_threadgroup]],
    uint sg [[simdgroup_index_in_threadgroup]],
    uint lane [[thread_index_in_simdgroup]]) {
  static_assert(BQ * DSPLIT == 8 * WM, "each SIMD-group owns 8 query rows and one feature part of their dQ");
  static_assert(BK % 8 == 0 && DMAX % (8 * DSPLIT) == 0, "tiles and parts are whole 8x8 fragments");
  constexpr int THREADS = 32 * WM;
  static_assert(THREADS <= kBackwardMaxThreads, "the declared threadgroup limit (params.h)");
  constexpr int PARTIALS = backward_partials_bytes<T, DMAX, 2 * (BQ + BK), WM, BK, DSPLIT>();
  constexpr int PAD = backward_row_pad<T, DMAX, 2 * (BQ + BK), PARTIALS>();
  constexpr int LD = DMAX + PAD / int(sizeof(T));  // tile row length, in elements
  constexpr int TK = BK / 8;                        // key fragments per block
  constexpr int TD = DMAX / 8;                      // feature fragments
  constexpr int TDP = TD / DSPLIT;                  // feature fragments of dQ this SIMD-group keeps
  constexpr int ROWG = BQ / 8;                      // 8-row groups; SIMD-group sg: group sg % ROWG, part sg / ROWG
  const int rg = int(sg) % ROWG;
  const int part = int(sg) / ROWG;
  const int col0 = part * (DMAX / DSPLIT);          // first feature of this part
  threadgroup T* q_tile = smem;
  threadgroup T* do_tile = q_tile + BQ * LD;
  threadgroup T* k_tile = do_tile + BQ * LD;
  threadgroup T* v_tile = k_tile + BK * LD;
  // The parts' partial S and dP (backward_reduce_parts), after the tiles.
  threadgroup float* partials = reinterpret_cast<threadgroup float*>(v_tile + BK * LD);

  // This threadgroup's sequence (the whole problem unless varlen). The
  // varlen grid covers the longest sequence: a block starting past this
  // one's rows has nothing to do and leaves at once (uniform, before any
  // barrier).
  const SeqView sv = sequence_view(p, cu_seqlens_q, cu_seqlens_k, group.z);
  const int q0 = int(group.x) * BQ;
  if (fc_varlen && q0 >= sv.q_len) return;
  const int q_len = sv.q_len;
  const int kv_len = sv.kv_len;

  const int D = p.head_dim;    // q's and k's features (S = Q.K^T, dQ = dS.K)
  const int DV = p.head_dim_v;  // v's, o's and dO's (Delta, dP = dO.V^T); == D unless MLA-style
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
  // grad_q and Delta are packed (B, Hq, Nq, ...), or (1, Hq, total_q, ...)
  // for varlen: packed_b is their batch index, packed_q their rows per head.
  const uint packed_b = fc_varlen ? 0u : group.z;
  const int packed_q = fc_varlen ? p.total_q : p.q_len;
  const int64_t mask_slice = fc_has_mask ? mask_head_offset(p, group.z, group.y) : 0;
  const int sg_row0 = q0 + rg * 8;
  const int fr = prefill_frag_row(lane);
  const int fc = prefill_frag_col(lane);
  const int row = sg_row0 + fr;  // this lane's query row (within the sequence)
  const bool row_real = fc_align_q || row < q_len;

  if (!fc_align_q && q0 + BQ > q_len) {
    prefill_load_tile<BQ, DMAX, LD, THREADS, true>(q_tile, q + h.q, p.q_row_stride, p.q_dim_stride, q0, D,
                                                   q_len - q0, tid);
    prefill_load_tile<BQ, DMAX, LD, THREADS, true>(do_tile, dout + do_head, p.do_row_stride, p.do_dim_stride, q0, DV,
                                                   q_len - q0, tid);
  } else {
    prefill_load_tile<BQ, DMAX, LD, THREADS, false>(q_tile, q + h.q, p.q_row_stride, p.q_dim_stride, q0, D, BQ, tid);
    prefill_load_tile<BQ, DMAX, LD, THREADS, false>(do_tile, dout + do_head, p.do_row_stride, p.do_dim_stride, q0,
                                                    DV, BQ, tid);
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);  // Q and dO written before the Delta reads (RAW)

  // Delta for this lane's row, in float32: the row's 4 lanes (l, l^1, l^8,
  // l^9) each take 2 of every 8 features, then two shuffles combine them
  // (the fragment layout's row reduction). O is read once, straight from
  // device memory: no other use, so no tile. Every lane reaches the
  // shuffles; rows past Nq contribute zeros. With parts, part 0 alone
  // reads O (once) and passes Delta on through threadgroup memory below.
  float dsum = 0.0f;
  if (row_real && part == 0) {
    device const T* orow = o + h.o + int64_t(row) * p.o_row_stride;
    FM_UNROLL for (int id = 0; id < TD; ++id) {
      FM_UNROLL for (int j = 0; j < 2; ++j) {
        const int c = id * 8 + fc + j;
        if (c < DV) dsum += float(do_tile[(rg * 8 + fr) * LD + c]) * float(orow[int64_t(c) * p.o_dim_stride]);
      }
    }
  }
  dsum += simd_shuffle_xor(dsum, 1);
  dsum += simd_shuffle_xor(dsum, 8);
  // The row's lse in base 2 (m2), and whether the row saw any key: the
  // forward stores lse = -inf for a row that saw none, whose P is all zero
  // (it contributes nothing and gets dQ = 0). Tested on the bits, as the
  // forward writes them: no floating-point comparison with an infinity,
  // which fast math may fold (attention_common.h, "Fast math").
  float row_delta = 0.0f, m2 = 0.0f, m2lo = 0.0f;
  bool row_live = false;
  if (row_real) {
    const float l = lse[h.lse + int64_t(row) * p.lse_row_stride];
    row_live = as_type<uint>(l) != kNegInfBits;
    m2 = row_live ? l * M_LOG2E_F : 0.0f;
    m2lo = row_live ? lse2_lo(l, m2) : 0.0f;
    row_delta = dsum;
    if (fc_has_grad_lse) row_delta -= dlse[glse_head + int64_t(row) * p.glse_row_stride];
    if (fc == 0 && part == 0) {
      const int64_t at = (int64_t(packed_b) * p.q_heads + group.y) * packed_q + sv.q_row0 + row;
      delta[at] = row_delta;
      if (backward_renormalizes<T>()) delta[backward_renorm_offset(p) + at] = 0.0f;  // no change (sinks: final)
    }
  }
  if (DSPLIT > 1) {
    // Part 0's Delta to the other parts of its rows, through the K tile's
    // first BQ floats (unused until the first key block, whose WAR barrier
    // follows these reads).
    threadgroup float* shared_delta = reinterpret_cast<threadgroup float*>(k_tile);
    if (part == 0 && fc == 0) shared_delta[rg * 8 + fr] = row_delta;
    threadgroup_barrier(mem_flags::mem_threadgroup);  // Delta written before the other parts read it (RAW)
    row_delta = shared_delta[rg * 8 + fr];
  }

  // Key blocks some row of the group can see: up to the last real row's
  // last key (causal or a right window: later blocks are all future for
  // every row; the forward's bound), from the first row's first key (a left
  // window: earlier blocks are behind every row's window). Uniform for the
  // group; empty when the window holds no key (the rows keep dQ = 0).
  const int last_row = (fc_align_q ? q0 + BQ : min(q0 + BQ, q_len)) - 1;
  const int kb_begin = fc_window_left ? first_visible_key(sv, q0) / BK : 0;
  const int kb_end = (visible_key_end(sv, last_row) + BK - 1) / BK;
  const int d_frags = (D + 7) / 8;
  const int dv_frags = (DV + 7) / 8;

  PrefillFrag dQ[TDP];
  FM_UNROLL for (int id = 0; id < TDP; ++id) dQ[id] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);

  // float32 (attention_backward.h, issue 40): a first pass over the same key
  // blocks (pass 0) sums each row's P and P * dP (this lane's share), then
  // the row's m2lo and Delta become those of the renormalized P, stored for
  // the dK/dV kernel; the second pass (pass 1) is the usual one. Not with
  // sinks (the first pass is skipped: the forward's lse and Delta as ever).
  const bool stats_pass = backward_renormalizes<T>() && !fc_has_sinks;
  float psum = 0.0f, pdp = 0.0f;
  for (int pass = stats_pass ? 0 : 1; pass < 2; ++pass) {
    if (pass == 1 && stats_pass) {
      psum += simd_shuffle_xor(psum, 1);  // the row's 4 lanes, as Delta's sum
      psum += simd_shuffle_xor(psum, 8);
      pdp += simd_shuffle_xor(pdp, 1);
      pdp += simd_shuffle_xor(pdp, 8);
      if (row_live && psum > 0.0f) {
        const float corr = backward_renorm_log2(psum);
        m2lo += corr;
        row_delta = pdp / psum;  // rowsum(P o dP) of this kernel's own P and dP, in place of rowsum(dO o O)
        if (fc_has_grad_lse) row_delta -= dlse[glse_head + int64_t(row) * p.glse_row_stride];
        if (fc == 0 && part == 0) {  // every part holds the same whole P and dP, so the same sums
          const int64_t at = (int64_t(packed_b) * p.q_heads + group.y) * packed_q + sv.q_row0 + row;
          delta[at] = row_delta;
          delta[backward_renorm_offset(p) + at] = corr;
        }
      }
    }
    for (int kb = kb_begin; kb < kb_end; ++kb) {
      const int k0 = kb * BK;
      const bool k_edge = !fc_align_k && k0 + BK > kv_len;
      // As in the forward: the SIMD-group has real rows that see some key of
      // the block (uniform across it: its last row's upper bound, its first
      // row's lower bound), and the block straddles its diagonal (some key
      // after a row's upper bound) or its left edge (some key before a row's
      // lower bound), where each element is tested.
      const bool active = (fc_align_q || sg_row0 < q_len) && (!fc_causal || k0 - sv.upper <= sg_row0 + 7) &&
                          (!fc_window_left || sg_row0 + sv.lower <= k0 + BK - 1);
      const bool diagonal = fc_causal && k0 + BK - 1 - sv.upper > sg_row0;
      const bool left_edge = fc_window_left && sg_row0 + 7 + sv.lower > k0;

      threadgroup_barrier(mem_flags::mem_threadgroup);  // last block's K/V reads done before overwriting (WAR)
      if (k_edge) {
        prefill_load_tile<BK, DMAX, LD, THREADS, true>(k_tile, k + h.k, p.k_row_stride, p.k_dim_stride, k0, D,
                                                       kv_len - k0, tid);
        prefill_load_tile<BK, DMAX, LD, THREADS, true>(v_tile, v + h.v, p.v_row_stride, p.v_dim_stride, k0, DV,
                                                       kv_len - k0, tid);
      } else {
        prefill_load_tile<BK, DMAX, LD, THREADS, false>(k_tile, k + h.k, p.k_row_stride, p.k_dim_stride, k0, D, BK,
                                                        tid);
        prefill_load_tile<BK, DMAX, LD, THREADS, false>(v_tile, v + h.v, p.v_row_stride, p.v_dim_stride, k0, DV, BK,
                                                        tid);
      }
      threadgroup_barrier(mem_flags::mem_threadgroup);  // K/V written before anyone reads them (RAW)

      // S = Q.K^T and dP = dO.V^T (8 x BK each); with parts, each over the
      // part's features, then summed across the parts (split-K).
      PrefillFrag S[TK];
      PrefillFrag dP[TK];
      if (PARTIALS == 0) {  // whole features, or the recomputing fallback (backward_partials_bytes)
        if (!active) continue;
        backward_products<TK, TD>(S, dP, q_tile, do_tile, k_tile, v_tile, LD, rg * 8, d_frags, dv_frags, fr, fc);
      } else {
        if (active)
          backward_products<TK, TDP>(S, dP, q_tile, do_tile, k_tile, v_tile, LD, rg * 8, d_frags, dv_frags, fr, fc,
                                     part * TDP);
        backward_reduce_parts<TK, ROWG, DSPLIT>(S, dP, partials, int(sg), rg, int(lane), active);
        if (!active) continue;
      }
      // P and dS = P * (dP - Delta), elementwise, into dP (times the
      // softcap's derivative). Weight 0 (so dS 0) for keys past Nk, keys
      // outside the row's window, masked keys and rows that saw no key, by
      // explicit tests (no exp2 of an infinity).
      FM_UNROLL for (int t = 0; t < TK; ++t) {
        FM_UNROLL for (int j = 0; j < 2; ++j) {
          const int key = k0 + t * 8 + fc + j;
          bool keep = row_live;
          if (k_edge && key >= kv_len) keep = false;
          if (diagonal && key - sv.upper > row) keep = false;
          if (left_edge && key < row + sv.lower) keep = false;
          float cap_grad;
          const float pw = backward_weight<T>(p, mask, mask_slice, row, key, S[t].thread_elements()[j], m2, m2lo,
                                              keep, &cap_grad);
          if (pass == 0) {
            psum += pw;
            pdp += pw * dP[t].thread_elements()[j];
            continue;
          }
          float ds = pw * (dP[t].thread_elements()[j] - row_delta);
          if (fc_softcap) ds *= cap_grad;
          dP[t].thread_elements()[j] = ds;
        }
      }
      if (pass == 0) continue;
      // dQ += dS.K over q's D features (a part whose features are all past D
      // skips it), the block's product summed from zero and added once (the
      // forward's blocked sum: one rounding of dQ per block, not per key).
      FM_UNROLL for (int id = 0; id < TDP; ++id) {
        if (col0 + id * 8 < D) {
          PrefillFrag acc = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
          FM_UNROLL for (int t = 0; t < TK; ++t) {
            PrefillFrag kf;
            prefill_read_frag(kf, k_tile, LD, t * 8, col0 + id * 8, fr, fc);
            prefill_mma(acc, dP[t], kf);
          }
          FM_UNROLL for (int j = 0; j < 2; ++j) dQ[id].thread_elements()[j] += acc.thread_elements()[j];
        }
      }
    }
  }  // pass

  // dQ * scale, packed, real rows and features only (zeros for a row that
  // sees no key).
  if (row_real) {
    device T* out = dq + packed_row(packed_b, group.y, p.q_heads, packed_q, sv.q_row0 + row, D);
    FM_UNROLL for (int id = 0; id < TDP; ++id) {
      FM_UNROLL for (int j = 0; j < 2; ++j) {
        const int c = col0 + id * 8 + fc + j;
        if (c < D) out[c] = static_cast<T>(dQ[id].thread_elements()[j] * p.scale);
      }
    }
  }
}

}  // namespace flash_metal
