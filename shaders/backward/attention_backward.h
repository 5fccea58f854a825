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
//   Head dims (issue 20 section 2, MLA-style): q and k have D = head_dim,
//   v, o, dO and grad_v have DV = head_dim_v (== D unless MLA-style); both
//   run in the wider one's bucket DMAX. Delta and dP = dO.V^T, dV = P^T.dO
//   are over DV features; S = Q.K^T, dQ = dS.K and dK = dS^T.Q over D. Each
//   tile is loaded at its tensor's own width (columns past it zero) and no
//   feature past a tensor's own width is stored.
//   flash_backward_dq    grid (ceil(Nq / BQ), Hq, B), 32 * WM threads
//     Delta_i = rowsum(dO_i * O_i) - grad_lse_i (float32: rowsum(P_i * dP_i)
//     of a first pass, and the rows renormalized, see backward_renormalizes),
//     written to a float32 scratch for the second kernel; then over the key
//     blocks the rows see:
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
//     same threadgroup memory (resident SIMD-groups per core). S and dP
//     (P^T, dP^T) are split-K: each part multiplies over its own features
//     only and the parts sum their partials through a threadgroup scratch
//     (backward_reduce_parts): no recomputed product, one more barrier per
//     streamed block, the scratch's bytes; K/V (and Q/dO) tiles are still
//     loaded once per threadgroup.
//
// The dK/dV kernel must run after the dQ kernel (it reads Delta); the host
// encodes them in that order on one serial compute encoder.
//
// The options of shaders/common/attention_features.h, each behind its function
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
// Both kernels share one layout (the forward's, shaders/prefill/attention_prefill.h,
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
//           + (DSPLIT > 1: WM * 2 * STREAM / 8 fragments of 256 bytes, the parts' partials)
//
// PAD is 16 bytes (the forward's bank-conflict padding), or 0 where the
// padded tiles would exceed Metal's 32 KiB (only float32 at DMAX 256 with
// 8 + 8 rows: 33,280 bytes padded, exactly 32,768 without); see
// backward_row_pad. The host (csrc/metal/plan_detail.h) computes the same.
// Separate K and V (Q and dO) tiles cost twice the streamed rows but need 2
// barriers per block instead of the forward's 4: the dK/dV kernel uses Q
// twice and dO twice per block, so a shared tile would be loaded twice.
#pragma once

#include "../common/attention_features.h"
#include "../prefill/attention_prefill.h"

namespace flash_metal {

// [[function_constant(3)]]: a gradient flows into lse (grad_lse is bound and
// read). False: grad_lse is taken as zero and never read, so the common
// training case (only out is used) carries no extra load.
constant bool fc_has_grad_lse [[function_constant(3)]];

// Row padding of the backward's tiles, in bytes: the forward's 16 (see
// kPrefillRowPadBytes) unless the four padded tiles would not fit Metal's
// 32 KiB of threadgroup memory, then 0 (float32, DMAX 256: 8-row tiles are
// 33,280 bytes padded, 32,768 unpadded; the price is bank conflicts on that
// one configuration). Must match backward_threadgroup_memory in csrc/metal/plan_detail.h.
// EXTRA: the feature parts' partial-sum scratch after the tiles (backward_partials_bytes).
template <typename T, int DMAX, int ROWS, int EXTRA = 0>
constexpr int backward_row_pad() {
  return ROWS * (DMAX * int(sizeof(T)) + kPrefillRowPadBytes) + EXTRA <= 32768 ? kPrefillRowPadBytes : 0;
}

// Bytes of the feature parts' scratch (issue 19's split-K): with DSPLIT > 1
// each of the WM SIMD-groups writes its partial S and dP (2 x STREAM / 8
// fragments of 8 x 8 floats) after the tiles (ROWS rows of DMAX elements,
// unpadded here). 0 without parts, and 0 where the scratch does not fit
// 32 KiB beside the tiles (float32 at DMAX 256: its 8 + 8-row tiles take
// all 32 KiB): the parts then recompute S and dP over all features
// instead (the fallback; the planner states its price). Must match
// backward_threadgroup_memory in csrc/metal/plan_detail.h.
template <typename T, int DMAX, int ROWS, int WM, int STREAM, int DSPLIT>
constexpr int backward_partials_bytes() {
  return DSPLIT > 1 && ROWS * DMAX * int(sizeof(T)) + WM * 2 * (STREAM / 8) * 256 <= 32768
             ? WM * 2 * (STREAM / 8) * 256
             : 0;
}

// Split-K over the feature parts (issue 19): the DSPLIT SIMD-groups of a row
// group each computed S and dP over their own 1 / DSPLIT of the features
// (backward_products); each writes its partials to `scratch` (its slot:
// sg), one barrier, then each sums the DSPLIT partials of its row group
// (slots rg, rg + ROWG, ...) in part order, so every part holds the same
// whole S and dP, bit for bit. No matrix product is repeated; the price is
// the scratch, one barrier per streamed block and 2 x N x DSPLIT fragment
// reads per SIMD-group. `active` (uniform per row group) skips the writes
// and reads, never the barrier, which every thread of the threadgroup meets.
// The next block's writes come after its two tile barriers, which follow
// every read here (no WAR race).
template <int N, int ROWG, int DSPLIT>
FM_INLINE void backward_reduce_parts(thread PrefillFrag* S, thread PrefillFrag* dP, threadgroup float* scratch,
                                     int sg, int rg, int lane, bool active) {
  constexpr int SLOT = 2 * N * 64;  // floats per SIMD-group: N fragments of S, then N of dP
  if (active) {
    FM_UNROLL for (int t = 0; t < N; ++t) {
      FM_UNROLL for (int j = 0; j < 2; ++j) {
        scratch[sg * SLOT + t * 64 + lane * 2 + j] = S[t].thread_elements()[j];
        scratch[sg * SLOT + (N + t) * 64 + lane * 2 + j] = dP[t].thread_elements()[j];
      }
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);  // every part's partials written before the sums (RAW)
  if (!active) return;
  FM_UNROLL for (int t = 0; t < N; ++t) {
    FM_UNROLL for (int j = 0; j < 2; ++j) {
      float s = 0.0f, d = 0.0f;
      FM_UNROLL for (int q = 0; q < DSPLIT; ++q) {
        s += scratch[(rg + q * ROWG) * SLOT + t * 64 + lane * 2 + j];
        d += scratch[(rg + q * ROWG) * SLOT + (N + t) * 64 + lane * 2 + j];
      }
      S[t].thread_elements()[j] = s;
      dP[t].thread_elements()[j] = d;
    }
  }
}

// S = A.B^T and dP = A2.B2^T, the two products both kernels recompute (dQ
// kernel: Q.K^T and dO.V^T; dK/dV kernel: K.Q^T and V.dO^T), for one
// SIMD-group's 8 owned rows (row0 of the own tiles a and a2) against the
// N * 8 streamed rows of tiles b and b2, in one walk over the feature
// fragments that hold real features: d_frags of them for S (a, b: q's and
// k's D features), dv_frags for dP (a2, b2: v's and dO's DV features; equal
// unless MLA-style). The walk runs to the compile-time TD (DMAX / 8) with
// d_frags / dv_frags as uniform guards, so it unrolls (as the forward's
// Q.K^T does); each of S and dP sums its products in the same order
// whatever the other's guard. Inlined, so S and dP stay arrays of registers
// (constant indices after unrolling).
// With feature parts, TD is the part's fragment count and dd0 its first
// fragment: the result is then the part's partial sum (backward_reduce_parts);
// a part whose fragments are all past D (or DV) keeps a zero partial of S
// (or dP) and still takes part in the reduction.
// float32 (issue 40): S and dP are blocked sums of kBackwardChunk fragments
// (64 features), each chunk from zero and added to S (dP) once. One chain of
// simdgroup multiply-accumulates through all of D rounds at the running
// sum's magnitude D times (the emulator's MMA continues its fma chain from
// the accumulator; Apple documents no order); at D = 256 with large scores
// that put up to 1.4e-4 on a base-2 score and dQ at 3x PyTorch's error, 10x
// less as 64-feature blocks (PyTorch's GEMM sums in blocks too). The first
// chunk goes straight into S (dP), so D <= 64, and 16-bit inputs, are as before.
constant constexpr int kBackwardChunk = 8;

// Fragments [i0, i1) of backward_products' walk, added to S and dP.
template <int N, typename T>
FM_INLINE void backward_products_range(thread PrefillFrag* S, thread PrefillFrag* dP, threadgroup const T* a,
                                       threadgroup const T* a2, threadgroup const T* b, threadgroup const T* b2,
                                       int ld, int row0, int d_frags, int dv_frags, int fr, int fc, int dd0, int i0,
                                       int i1) {
  FM_UNROLL for (int i = i0; i < i1; ++i) {
    const int dd = dd0 + i;
    if (dd < d_frags) {  // else an all-padding fragment of q and k; uniform across the SIMD-group
      PrefillFrag af;
      prefill_read_frag(af, a, ld, row0, dd * 8, fr, fc);
      FM_UNROLL for (int t = 0; t < N; ++t) {
        PrefillFrag bf;
        prefill_read_frag_t(bf, b, ld, dd * 8, t * 8, fr, fc);
        prefill_mma(S[t], af, bf);
      }
    }
    if (dd < dv_frags) {  // else an all-padding fragment of v and dO
      PrefillFrag a2f;
      prefill_read_frag(a2f, a2, ld, row0, dd * 8, fr, fc);
      FM_UNROLL for (int t = 0; t < N; ++t) {
        PrefillFrag b2f;
        prefill_read_frag_t(b2f, b2, ld, dd * 8, t * 8, fr, fc);
        prefill_mma(dP[t], a2f, b2f);
      }
    }
  }
}

template <int N, int TD, typename T>
FM_INLINE void backward_products(thread PrefillFrag* S, thread PrefillFrag* dP, threadgroup const T* a,
                                 threadgroup const T* a2, threadgroup const T* b, threadgroup const T* b2, int ld,
                                 int row0, int d_frags, int dv_frags, int fr, int fc, int dd0 = 0) {
  constexpr int CH = sizeof(T) == 4 ? kBackwardChunk : TD;  // fragments per blocked sum
  FM_UNROLL for (int t = 0; t < N; ++t) {
    S[t] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
    dP[t] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
  }
  backward_products_range<N>(S, dP, a, a2, b, b2, ld, row0, d_frags, dv_frags, fr, fc, dd0, 0, min(CH, TD));
  FM_UNROLL for (int i0 = CH; i0 < TD; i0 += CH) {
    PrefillFrag cs[N], cd[N];
    FM_UNROLL for (int t = 0; t < N; ++t) {
      cs[t] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
      cd[t] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
    }
    backward_products_range<N>(cs, cd, a, a2, b, b2, ld, row0, d_frags, dv_frags, fr, fc, dd0, i0, min(i0 + CH, TD));
    FM_UNROLL for (int t = 0; t < N; ++t) {
      FM_UNROLL for (int j = 0; j < 2; ++j) {
        S[t].thread_elements()[j] += cs[t].thread_elements()[j];
        dP[t].thread_elements()[j] += cd[t].thread_elements()[j];
      }
    }
  }
}

// The packed (B, H, N, D) offset of row `row` of head `head` of batch
// `batch`: the layout of grad_q, grad_k (D = head_dim) and grad_v (D =
// head_dim_v) (allocate_gradients).
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
// With softcap the capped score softcap_log2 * t is taken as that product
// plus its rounding error (fma, exact), added after m2 is subtracted: the
// product is ~70 at large logits (softcap 50 in base 2), where its float32
// rounding (3.8e-6) would scale P by up to 2.6e-6, twice PyTorch's own
// rounding of the natural-log score (issue 40; the CPU's
// csrc/cpu/backward_precise.h does the same).
template <typename T>
FM_INLINE float backward_weight(constant AttentionParams& p, device const uchar* mask, int64_t mask_slice, int row,
                                int key, float S, float m2, float m2lo, bool keep, thread float* cap_grad) {
  *cap_grad = 1.0f;
  if (!fc_softcap && !fc_has_mask) return keep ? exp2(fma(S, p.scale_log2, -m2) - m2lo) : 0.0f;
  if (!keep) return 0.0f;
  float s2 = S * p.scale_log2, lo = 0.0f;
  if (fc_softcap) {
    float t;
    s2 = softcap_score(p, s2, &t);
    lo = fma(p.softcap_log2, t, -s2);
    *cap_grad = 1.0f - t * t;
  }
  if (fc_has_mask) {
    bool drop;
    s2 += mask_term<T>(p, mask, mask_slice, row, key, &drop);
    if (drop || s2 <= kMaskedScore) return 0.0f;
  }
  return exp2(((s2 - m2) + lo) - m2lo);
}

// float32 rows renormalized (issue 40): P rebuilt from the forward's lse
// carries lse's float32 rounding (half an ulp of |lse|, 1.9e-6 at |lse| ~
// 50) and any difference between the forward's and this kernel's scores,
// one factor on every P of the row, which PyTorch's softmax divides away;
// and Delta = rowsum(dO o O) takes O from the forward, whose P differs from
// the one rebuilt here, where PyTorch's softmax backward subtracts
// rowsum(P o dP) of its own P and dP. With the softcap's product rounding
// and the one-chain score sums (backward_weight, backward_products), float32
// dQ, dK and dV came out at up to 3.4x, 4.1x and 6.7x PyTorch's error on
// flash-attn's varlen test (tests/api/test_flash_attn_varlen_backward.py). The
// dQ kernel sees whole rows: a first pass over its key blocks (S and dP
// again, as the main pass makes them) sums each row's P and P * dP; log2 of
// the first joins the row's m2lo and Delta becomes the second over the
// first, both stored (log2 after Delta's rows in the scratch) for the dK/dV
// kernel, so every P of the row sums to one in both kernels. Not with sinks
// (the sink's P is part of the row's sum, and the dQ kernel does not read
// the sinks): those keep the forward's lse and Delta. 16-bit inputs skip it
// (their rounding is far above these terms). The cost: the dQ kernel's S
// and dP products twice (at D 256, +46% of the backward's MMAs).
template <typename T>
constexpr bool backward_renormalizes() {
  return sizeof(T) == 4;
}

// Where the row sums' log2 sit in the Delta scratch: after Delta's rows
// (the host sizes the scratch for both: csrc/metal/launch_backward.cpp).
FM_INLINE int64_t backward_renorm_offset(constant AttentionParams& p) {
  return int64_t(fc_varlen ? 1 : p.batch) * p.q_heads * (fc_varlen ? p.total_q : p.q_len);
}

// log2 of a row's sum of P, which is 1 up to rounding: the series of
// log2(1 + d) where |d| < 2^-10 (exact to 1e-13 there, whatever the GPU's
// log2 precision near 1), else log2.
FM_INLINE float backward_renorm_log2(float sum) {
  const float d = sum - 1.0f;
  return fabs(d) < 0.0009765625f ? (d - d * d * (0.5f - d * (1.0f / 3.0f))) * M_LOG2E_F : log2(sum);
}

}  // namespace flash_metal

// The two kernels, each in a file of its own.
#include "attention_backward_dq.h"
#include "attention_backward_dkdv.h"
