// The FlashAttention-2 backward on simdgroup_matrix: two kernels, no atomics.
//
// The split is metal-flash-attention's (philipturner/metal-flash-attention,
// "atomics-free backward"; Apple GPUs have no fast float atomics): one
// kernel is parallel over query blocks and accumulates dQ, the other is
// parallel over key blocks and accumulates dK and dV, each in float32
// registers, so no two threadgroups ever write the same element and the
// result is bitwise deterministic. The price is recomputing P (and dP) in
// both kernels: 7 matrix products per (query, key) block pair instead of 5.
// P is rebuilt from the forward's lse, never stored (FlashAttention-2).
//
//   flash_backward_dq    grid (ceil(Nq / BQ), Hq, B), 32 * WM threads
//     Delta_i = rowsum(dO_i * O_i) - grad_lse_i, written to a float32
//     scratch for the second kernel; then over the key blocks the rows see:
//     S = Q.K^T, P = exp2(S * scale * log2 e - lse_i * log2 e),
//     dP = dO.V^T, dS = P * (dP - Delta), dQ += dS.K; dQ * scale stored.
//   flash_backward_dkdv  grid (ceil(Nk / BK), Hkv, B), 32 * WM threads
//     over the GQA group's query heads and the query blocks that see the
//     key block: P^T (recomputed), dV += P^T.dO, dP^T = V.dO^T,
//     dS^T = P^T * (dP^T - Delta), dK += dS^T.Q; dK * scale and dV stored
//     (float32: added to grad_k / grad_v after each query head of the
//     group, so the group's sum rounds once per head, see the kernel).
//   Feature parts (DSPLIT, both kernels, issue 19): WM = (own rows / 8) x
//     DSPLIT SIMD-groups; the DSPLIT SIMD-groups of one 8-row group share
//     its rows and the threadgroup's tiles, and each keeps the dQ (dK, dV)
//     accumulators of 1 / DSPLIT of the features, so the accumulators fit
//     the register budget and a threadgroup runs more SIMD-groups on the
//     same threadgroup memory (resident SIMD-groups per core). The price:
//     each part recomputes its rows' S and dP (P^T, dP^T) over all features;
//     K/V (and Q/dO) tiles are still loaded once per threadgroup.
//
// The dK/dV kernel must run after the dQ kernel (it reads Delta); the host
// encodes them in that order on one serial compute encoder.
//
// The options of shaders/attention_features.h, each behind its function
// constant (a pipeline without it carries none of its code): P is rebuilt as
// the forward builds it, softcap, then mask, then window (a masked key has
// P = 0 exactly), and with softcap dS is multiplied by the cap's derivative
// 1 - tanh^2 before both dS products. Key blocks outside every row's window
// are never loaded by the dQ kernel, nor query blocks that see none of the
// key block by the dK/dV kernel (both bounds), so the cost grows with
// N * window. Varlen: each threadgroup works on one sequence of the packed
// tensors (SeqView: its lengths, first rows and window offsets); grad_q,
// grad_k, grad_v and Delta are then (1, H, total, ...) with total_q /
// total_k rows.
//
// Both kernels share one layout (the forward's, shaders/attention_prefill.h,
// whose loader, fragment reads and lane layout they reuse): each of the WM
// SIMD-groups "owns" 8 rows (queries in the dQ kernel, keys in the dK/dV
// kernel) and keeps its accumulators for them in 8x8 simdgroup_matrix<float>
// fragments, in registers; the other side streams through threadgroup
// memory a block at a time. Threadgroup memory, four tiles of rows of DMAX
// elements of T plus PAD bytes:
//
//   own tiles (2 x OWN rows) then streamed tiles (2 x STREAM rows)
//   dQ kernel:   Q, dO (OWN = BQ), then K, V (STREAM = BK)
//   dK/dV kernel: K, V (OWN = BK), then Q, dO (STREAM = BQ)
//   bytes = 2 * (OWN + STREAM) * (DMAX * sizeof(T) + PAD)
//
// PAD is 16 bytes (the forward's bank-conflict padding), or 0 where the
// padded tiles would exceed Metal's 32 KiB (only float32 at DMAX 256 with
// 8 + 8 rows: 33,280 bytes padded, exactly 32,768 without); see
// backward_row_pad. The host (csrc/metal_plan_detail.h) computes the same.
// Separate K and V (Q and dO) tiles cost twice the streamed rows but need 2
// barriers per block instead of the forward's 4: the dK/dV kernel uses Q
// twice and dO twice per block, so a shared tile would be loaded twice.
#pragma once

#include "attention_features.h"
#include "attention_prefill.h"

namespace flash_metal {

// [[function_constant(3)]]: a gradient flows into lse (grad_lse is bound and
// read). False: grad_lse is taken as zero and never read, so the common
// training case (only out is used) carries no extra load.
constant bool fc_has_grad_lse [[function_constant(3)]];

// Row padding of the backward's tiles, in bytes: the forward's 16 (see
// kPrefillRowPadBytes) unless the four padded tiles would not fit Metal's
// 32 KiB of threadgroup memory, then 0 (float32, DMAX 256: 8-row tiles are
// 33,280 bytes padded, 32,768 unpadded; the price is bank conflicts on that
// one configuration). Must match backward_threadgroup_memory in csrc/metal_plan_detail.h.
template <typename T, int DMAX, int ROWS>
constexpr int backward_row_pad() {
  return ROWS * (DMAX * int(sizeof(T)) + kPrefillRowPadBytes) <= 32768 ? kPrefillRowPadBytes : 0;
}

// S = A.B^T and dP = A2.B2^T, the two products both kernels recompute (dQ
// kernel: Q.K^T and dO.V^T; dK/dV kernel: K.Q^T and V.dO^T), for one
// SIMD-group's 8 owned rows (row0 of the own tiles a and a2) against the
// N * 8 streamed rows of tiles b and b2, in one walk over the d_frags
// feature fragments that hold real features. The walk runs to the
// compile-time TD (DMAX / 8) with d_frags as a uniform guard, so it unrolls
// (as the forward's Q.K^T does). Inlined, so S and dP stay arrays of
// registers (constant indices after unrolling).
template <int N, int TD, typename T>
FM_INLINE void backward_products(thread PrefillFrag* S, thread PrefillFrag* dP, threadgroup const T* a,
                                 threadgroup const T* a2, threadgroup const T* b, threadgroup const T* b2, int ld,
                                 int row0, int d_frags, int fr, int fc) {
  FM_UNROLL for (int t = 0; t < N; ++t) {
    S[t] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
    dP[t] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
  }
  FM_UNROLL for (int dd = 0; dd < TD; ++dd) {
    if (dd >= d_frags) continue;  // all-padding fragment; uniform across the SIMD-group
    PrefillFrag af, a2f;
    prefill_read_frag(af, a, ld, row0, dd * 8, fr, fc);
    prefill_read_frag(a2f, a2, ld, row0, dd * 8, fr, fc);
    FM_UNROLL for (int t = 0; t < N; ++t) {
      PrefillFrag bf, b2f;
      prefill_read_frag_t(bf, b, ld, dd * 8, t * 8, fr, fc);
      prefill_mma(S[t], af, bf);
      prefill_read_frag_t(b2f, b2, ld, dd * 8, t * 8, fr, fc);
      prefill_mma(dP[t], a2f, b2f);
    }
  }
}

// The packed (B, H, N, D) offset of row `row` of head `head` of batch
// `batch`: the layout of grad_q, grad_k and grad_v (allocate_gradients).
// Varlen: (1, H, total, D), batch 0, n = total rows, row counted from the
// start of the packed axis (the sequence's first row plus its own row).
inline int64_t packed_row(uint batch, uint head, int heads, int n, int64_t row, int D) {
  return ((int64_t(batch) * heads + int64_t(head)) * n + row) * D;
}

// The row's lse in base 2 as m2 + lo, m2 = l * log2 e in float32 (issue
// 24): m2 alone is off by up to half an ulp of |l| * 1.44 (2.4e-7 at
// l ~ 5), an error every P of the row would carry. lo is that product's
// rounding error (exact, by fma) plus l times log2 e's own float32
// remainder, kLog2eLo = log2 e - (float)log2 e. Computed once per row in
// the dQ kernel, once per element in the dK/dV kernel (an fma and a
// multiply beside the exp2).
constant float kLog2eLo = 1.925963e-08f;
FM_INLINE float lse2_lo(float l, float m2) { return fma(l, M_LOG2E_F, -m2) + l * kLog2eLo; }

// P of one recomputed element: S is the raw q.k, m2 + m2lo the row's lse in base 2 (lse2_lo),
// `keep` false for keys past the sequence, outside the window, or rows that
// saw no key (then nothing is read and P = 0). With fc_softcap or
// fc_has_mask the forward's order is followed (attention_features.h):
// softcap on the base-2 score, then the mask (a dropped key, or a score at
// or below kMaskedScore, gives exactly 0); *cap_grad gets the softcap's
// derivative 1 - t^2 (t = tanh(s / softcap), recomputed), else 1. Without
// either option this is the plain fused exp2(S * scale * log2 e - m2 - m2lo).
template <typename T>
FM_INLINE float backward_weight(constant AttentionParams& p, device const uchar* mask, int64_t mask_slice, int row,
                                int key, float S, float m2, float m2lo, bool keep, thread float* cap_grad) {
  *cap_grad = 1.0f;
  if (!fc_softcap && !fc_has_mask) return keep ? exp2(fma(S, p.scale_log2, -m2) - m2lo) : 0.0f;
  if (!keep) return 0.0f;
  float s2 = S * p.scale_log2;
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
  return exp2((s2 - m2) - m2lo);
}

// T, DMAX as in the forward. BQ: query rows per threadgroup (8 per row
// group of SIMD-groups, BQ * DSPLIT = 8 * WM). BK: keys per streamed block.
// DSPLIT: feature parts of dQ, a SIMD-group each (top of file). Launch: grid
// (ceil(Nq / BQ), Hq, B), threadgroup (32 * WM, 1, 1), threadgroup memory
// (top of file) at index 0, function constants fc_causal (0), fc_align_q
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
  constexpr int PAD = backward_row_pad<T, DMAX, 2 * (BQ + BK)>();
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

  // This threadgroup's sequence (the whole problem unless varlen). The
  // varlen grid covers the longest sequence: a block starting past this
  // one's rows has nothing to do and leaves at once (uniform, before any
  // barrier).
  const SeqView sv = sequence_view(p, cu_seqlens_q, cu_seqlens_k, group.z);
  const int q0 = int(group.x) * BQ;
  if (fc_varlen && q0 >= sv.q_len) return;
  const int q_len = sv.q_len;
  const int kv_len = sv.kv_len;

  const int D = p.head_dim;
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
    prefill_load_tile<BQ, DMAX, LD, THREADS, true>(do_tile, dout + do_head, p.do_row_stride, p.do_dim_stride, q0, D,
                                                   q_len - q0, tid);
  } else {
    prefill_load_tile<BQ, DMAX, LD, THREADS, false>(q_tile, q + h.q, p.q_row_stride, p.q_dim_stride, q0, D, BQ, tid);
    prefill_load_tile<BQ, DMAX, LD, THREADS, false>(do_tile, dout + do_head, p.do_row_stride, p.do_dim_stride, q0,
                                                    D, BQ, tid);
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
        if (c < D) dsum += float(do_tile[(rg * 8 + fr) * LD + c]) * float(orow[int64_t(c) * p.o_dim_stride]);
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
    if (fc == 0 && part == 0) delta[(int64_t(packed_b) * p.q_heads + group.y) * packed_q + sv.q_row0 + row] = row_delta;
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

  PrefillFrag dQ[TDP];
  FM_UNROLL for (int id = 0; id < TDP; ++id) dQ[id] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);

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
      prefill_load_tile<BK, DMAX, LD, THREADS, true>(v_tile, v + h.v, p.v_row_stride, p.v_dim_stride, k0, D,
                                                     kv_len - k0, tid);
    } else {
      prefill_load_tile<BK, DMAX, LD, THREADS, false>(k_tile, k + h.k, p.k_row_stride, p.k_dim_stride, k0, D, BK, tid);
      prefill_load_tile<BK, DMAX, LD, THREADS, false>(v_tile, v + h.v, p.v_row_stride, p.v_dim_stride, k0, D, BK, tid);
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);  // K/V written before anyone reads them (RAW)
    if (!active) continue;

    // S = Q.K^T and dP = dO.V^T (8 x BK each).
    PrefillFrag S[TK];
    PrefillFrag dP[TK];
    backward_products<TK, TD>(S, dP, q_tile, do_tile, k_tile, v_tile, LD, rg * 8, d_frags, fr, fc);
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
        float ds = pw * (dP[t].thread_elements()[j] - row_delta);
        if (fc_softcap) ds *= cap_grad;
        dP[t].thread_elements()[j] = ds;
      }
    }
    // dQ += dS.K, the block's product summed from zero and added once (the
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

// This lane's dK * scale and dV (TD fragments, features c0 + id * 8 + j,
// c0 = the part's first feature plus the lane's fragment column) into the
// rows kout / vout, features below D only: written, or with `add` added to
// what the rows hold (float32: the GQA group's running sum, see
// flash_backward_dkdv).
template <int TD, typename T>
FM_INLINE void store_dkdv(device T* kout, device T* vout, thread PrefillFrag* dK, thread PrefillFrag* dV,
                          int c0, int D, float scale, bool add) {
  FM_UNROLL for (int id = 0; id < TD; ++id) {
    FM_UNROLL for (int j = 0; j < 2; ++j) {
      const int c = c0 + id * 8 + j;
      if (c < D) {
        const float gk = dK[id].thread_elements()[j] * scale;
        const float gv = dV[id].thread_elements()[j];
        kout[c] = static_cast<T>(add ? float(kout[c]) + gk : gk);
        vout[c] = static_cast<T>(add ? float(vout[c]) + gv : gv);
      }
    }
  }
}

// BK: keys per threadgroup (8 per row group of SIMD-groups, BK * DSPLIT =
// 8 * WM). BQ: query rows per streamed block. DSPLIT: feature parts of dK
// and dV, a SIMD-group each (top of file; dK and dV of 8 keys x 256
// features whole would be 128 floats per lane, a thread's every register).
// Launch: grid (ceil(Nk / BK), Hkv, B), threadgroup
// (32 * WM, 1, 1), threadgroup memory (top of file) at index 0, function
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
  constexpr int PAD = backward_row_pad<T, DMAX, 2 * (BQ + BK)>();
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

  // This threadgroup's sequence; a key block past its keys (varlen: the
  // grid covers the longest sequence) leaves at once, uniformly, before any
  // barrier.
  const SeqView sv = sequence_view(p, cu_seqlens_q, cu_seqlens_k, group.z);
  const int k0 = int(group.x) * BK;
  if (fc_varlen && k0 >= sv.kv_len) return;
  const int q_len = sv.q_len;
  const int kv_len = sv.kv_len;

  const int D = p.head_dim;
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
    prefill_load_tile<BK, DMAX, LD, THREADS, true>(v_tile, v + v_off, p.v_row_stride, p.v_dim_stride, k0, D,
                                                   kv_len - k0, tid);
  } else {
    prefill_load_tile<BK, DMAX, LD, THREADS, false>(k_tile, k + k_off, p.k_row_stride, p.k_dim_stride, k0, D, BK, tid);
    prefill_load_tile<BK, DMAX, LD, THREADS, false>(v_tile, v + v_off, p.v_row_stride, p.v_dim_stride, k0, D, BK, tid);
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

  // dK and dV go to grad_k / grad_v, packed, for real keys and this part's
  // real features only; a key no query sees (causal with Nk > Nq, outside
  // every window, a sequence with no query) stores zeros.
  const bool real_key = fc_align_k || key < kv_len;
  device T* kout = dk + packed_row(packed_b, kv_head, p.kv_heads, packed_k, sv.k_row0 + key, D);
  device T* vout = dv + packed_row(packed_b, kv_head, p.kv_heads, packed_k, sv.k_row0 + key, D);
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
                                                       q0, D, q_len - q0, tid);
      } else {
        prefill_load_tile<BQ, DMAX, LD, THREADS, false>(q_tile, q + h.q, p.q_row_stride, p.q_dim_stride, q0, D, BQ,
                                                        tid);
        prefill_load_tile<BQ, DMAX, LD, THREADS, false>(do_tile, dout + do_head, p.do_row_stride, p.do_dim_stride,
                                                        q0, D, BQ, tid);
      }
      threadgroup_barrier(mem_flags::mem_threadgroup);  // Q/dO written before anyone reads them (RAW)
      if (!active) continue;

      // S^T = K.Q^T and dP^T = V.dO^T (8 keys x BQ queries each).
      PrefillFrag S[TQ];
      PrefillFrag dP[TQ];
      backward_products<TQ, DMAX / 8>(S, dP, k_tile, v_tile, q_tile, do_tile, LD, rg * 8, d_frags, fr, fc);
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
            const float m2lo = keep ? lse2_lo(l, m2) : 0.0f;
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
      // dV += P^T.dO and dK += dS^T.Q, each block's product summed from
      // zero and added once (blocked sums, as in the forward), over this
      // part's features.
      FM_UNROLL for (int id = 0; id < TD; ++id) {
        if (col0 + id * 8 < D) {
          PrefillFrag av = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
          PrefillFrag ak = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
          FM_UNROLL for (int t = 0; t < TQ; ++t) {
            PrefillFrag df, qf;
            prefill_read_frag(df, do_tile, LD, t * 8, col0 + id * 8, fr, fc);
            prefill_mma(av, S[t], df);
            prefill_read_frag(qf, q_tile, LD, t * 8, col0 + id * 8, fr, fc);
            prefill_mma(ak, dP[t], qf);
          }
          FM_UNROLL for (int j = 0; j < 2; ++j) {
            dV[id].thread_elements()[j] += av.thread_elements()[j];
            dK[id].thread_elements()[j] += ak.thread_elements()[j];
          }
        }
      }
    }
    if (kGroupInMemory && real_key) store_dkdv<TD>(kout, vout, dK, dV, col0 + fc, D, p.scale, g > 0);
  }

  // 16-bit dtypes: dK * scale and dV of the whole group stored once.
  if (!kGroupInMemory && real_key) store_dkdv<TD>(kout, vout, dK, dV, col0 + fc, D, p.scale, false);
}

}  // namespace flash_metal
