// Token-generation ("decode", Nq <= 8) attention kernels: a one-pass kernel
// and a two-pass split-KV pair ("flash decoding": partial results per block
// of keys, then a merge).
//
// Layout, after MLX's sdpa_vector kernels (ml-explore/mlx,
// mlx/backend/metal/kernels/sdpa_vector.h): keys are spread over SIMD-groups,
// and each lane holds a slice of the head dimension of q, K, V and the output
// accumulator, so a score is a lane-local partial dot product finished by
// simd_sum; a group of keys handled by different SIMD-groups is merged
// through threadgroup memory at the end; the split pass writes unnormalized
// partials with their (max, sum) and the merge pass rescales them by
// exp(m_s - M). Like MLX's duplication-free GQA variant, one threadgroup
// serves every query row of a GQA group (gqa_ratio heads x Nq rows), so each
// K/V element is loaded once per (batch, kv_head) for all of them (a group
// of more than 8 row groups is cut into row chunks, a threadgroup each:
// "Launch" below). Like MLX, under fc_dense (unit feature stride, D ==
// DMAX, aligned rows) each lane holds a contiguous run of features, read as
// vector loads; otherwise (any strides, padded D) the strided features lane,
// lane + 32, ... (decode_feature). Unlike MLX: the softmax runs per block of 32 keys (one block max and one rescale per
// block, a blocked sum for the output) rather than per key; masking uses the
// finite sentinel kMaskedScore (attention_common.h), base-2 scores, causal
// bottom-right alignment and any element strides. The code is this
// project's own.
//
// Names: R = gqa_ratio * Nq query rows of one GQA group, row rr -> query
// head kv_head * gqa_ratio + rr / Nq, query row rr % Nq. A SIMD-group owns
// RS = decode_rows_per_simd(DMAX) consecutive rows (a "row group") and one
// "key group" of the threadgroup's keys.
//
// Launch (the host, csrc/metal/launch.cpp, computes exactly this):
//
//   RS   = DMAX <= 64 ? 4 : DMAX <= 128 ? 2 : 1      rows per SIMD-group (attention_decode_rows.h)
//   R    = (Hq / Hkv) * Nq                            rows of one GQA group
//   RG   = ceil(R / RS)                               row groups
//   C    = ceil(RG / 8)                               row chunks: threadgroups per (batch, kv head[, split])
//   RGL  = ceil(RG / C)                               row groups per threadgroup (SIMD-groups per key group)
//   KG   = floor(8 / RGL)                             key groups (8, 4, 2, 2, then 1)
//   threadgroup (32, KG, RGL)                         KG * RGL <= 8 SIMD-groups: <= kDecodeMaxThreads = 256
//   DP32 = 32 * ceil(DMAX / 32)                       (96 for DMAX 72 and 80, else DMAX)
//   tg_bytes = KG > 1 ? round_up_16(KG * RGL * (RS + 1 + DP32) * 4)   key-group merge (floats)
//                     : 16                                            unused (the least length Metal takes)
//   at [[threadgroup(0)]].
// Why key groups up to 8 SIMD-groups: 256 threads keep enough K/V loads in
// flight per threadgroup when the GQA group is small (often a single row);
// each key group's row groups share its keys (their loads of one line count
// once), so the key groups are what keeps distinct lines in flight; the
// merge of 8 slots costs 8,256 bytes at most, and it splits the sum over
// keys KG ways. Why at most 8 row groups per threadgroup: the kernels declare
// [[max_total_threads_per_threadgroup(kDecodeMaxThreads)]] (256, params.h:
// what the register file holds at any allocation of the at most
// kDecodeRegisterBudget live values per lane); a bigger GQA group is cut
// into C row chunks, one threadgroup each, rather than a fatter threadgroup. split_keys need not be a multiple
// of 32 for these kernels (key blocks start at the split's first key).
//
//   flash_decode        grid (Hkv * C, B, 1)          threadgroup (32, KG, RGL)  tg_bytes
//   flash_decode_split  grid (Hkv * C, B, kv_splits)  threadgroup (32, KG, RGL)  tg_bytes
//   flash_decode_merge  grid (Nq, Hq, B)              threadgroup (32, 1, 1)     no threadgroup memory
//
// Threadgroup x of the grid serves kv head x / C and row chunk c = x % C
// (adjacent threadgroups share a kv head, so they read its K/V at about the
// same time); chunk c runs row groups c * RGL .. c * RGL + RGL - 1. The
// kernel finds C as threadgroups_per_grid.x / Hkv, so a launch with fewer
// chunks still covers every row group: the SIMD-groups then loop over them
// in rounds (round r, chunk c: row groups (r * C + c) * RGL + rgl).
//
// Function constants fc_causal (index 0), the options' 4-8
// (attention_features.h: mask, left window, softcap; fc_varlen is always
// false here, the planner sends varlen to prefill), fc_dense (10: the
// lanes' feature layout and vector loads, decode_feature) and fc_has_sinks
// (11: sinks at [[buffer(17)]]) and fc_paged (12: a paged KV cache,
// block_table at [[buffer(19)]] and cache_seqlens at 20;
// attention_decode_paged.h) for flash_decode and flash_decode_split;
// flash_decode_merge uses none. Buffers: flash_decode
// binds q 0, k 1, v 2, out 3, lse 4, params 5; flash_decode_split q 0, k 1,
// v 2, params 5, partial_o 6, partial_stats 7; both take the attn_mask at
// 14 (cu_seqlens 15 and 16 are never read); flash_decode_merge out 3,
// lse 4, params 5, partial_o 6, partial_stats 7. Scratch: partial_o
// B * Hq * Nq * kv_splits * D_v floats (head_dim_v), partial_stats B * Hq * Nq * kv_splits * 2.
//
// tg_bytes with KG * RGL = 8 slots (the most), per bucket: DMAX 32: 1,184;
// 64: 2,208; 72, 80, 96: 3,168; 128: 4,192; 192: 6,208; 256: 8,256. KG = 1
// uses none.
//
// Bytes: every K/V element is loaded from device memory once per
// threadgroup, i.e. once per (batch, kv_head[, split]) for all R rows
// whenever the GQA group fits one threadgroup (RG <= 8, R <= 8 * RS: 32
// rows up to DMAX 64, 16 up to 128, 8 at 192 and 256; in one-token decode, every
// GQA model of tests/metal/test_metal_plan_limits.py and MQA up to 16 heads at
// DMAX 128): each key group loads its own keys straight into registers, and
// when it has several row groups each of them loads the same keys, the
// siblings' loads counted as hits in the core's L1 (decode_attend: a
// modelling assumption; the emulator's unique-bytes count per threadgroup is
// what tests hold to once). A bigger group (say GQA 8 at DMAX 128 with Nq >= 3, or MQA)
// is read once per row chunk, C = ceil(RG / 8) times, by threadgroups that
// run side by side. q is loaded once per key group (8 times with RG == 1:
// 8 * R * D elements, small beside K/V). Under fc_paged the same holds per
// page: each page in use is read once per (kv head, row chunk[, split]),
// only its rows below cache_seqlens[b], and no other page at all.
#pragma once

#include "../common/attention_decode_paged.h"
#include "attention_decode_rows.h"
#include "../common/attention_features.h"
#include "../prefill/attention_prefill.h"  // fc_dense [[function_constant(10)]], the prefill loader's, reused here

namespace flash_metal {

// Query rows per SIMD-group: decode_rows_per_simd (attention_decode_rows.h),
// sized by the register budget: each row costs a lane 3 * DMAX / 32 floats
// (its q slice, its accumulator, the block's partial product) plus 5
// scalars (7 with a mask); the host's live-value model
// (csrc/metal/plan_detail.h) holds the sum within kDecodeRegisterBudget.

// Keys per block: one per lane, so each lane holds one key's score per row.
// The softmax state is updated once per block of 32 keys.
constant constexpr int kDecodeBlock = 32;

// The rows one SIMD-group works on, and its online-softmax state, per lane.
// DPL = features per lane; which ones: decode_feature.
// (Static data members live in the constant address space, as MSL requires
// of every variable with static storage; Apple's headers write the same.)
template <int DMAX>
struct DecodeState {
  static constexpr constant int RS = decode_rows_per_simd(DMAX);
  static constexpr constant int DPL = (DMAX + 31) / 32;
  static constexpr constant int DP32 = DPL * 32;  // features per row including the lanes' padding
  float q[RS][DPL];    // query slice, pre-multiplied by scale * log2(e); 0 past head_dim and for dead rows
  float acc[RS][DPL];  // unnormalized output slice: sum of exp2(s - m) * v; 0 past head_dim_v
  float m[RS];         // running max of the base-2 scores (kMaskedScore: no key yet); same in every lane
  float l[RS];         // running sum of exp2(s - m); same in every lane
};

// The feature slot i of lane `lane` holds (of q, K, V, the accumulator and
// the output). dense (fc_dense, set by the host, csrc/metal/launch.cpp,
// decode_dense_loads, when K and V have unit feature stride, D == D_v == DMAX and
// 16-byte aligned rows): lane l holds the contiguous run [l * DPL, l * DPL +
// DPL), so a lane reads its slice of a K/V row with DPL / VW vector loads
// (decode_slice_dense; issue 19: 1 load per key at DMAX 64 and 128 instead
// of 2 and 4, 2 instead of 8 at 256), and the SIMD-group's loads together
// still cover the row's contiguous bytes. Otherwise the strided features l,
// l + 32, ..., l + 32 * (DPL - 1), one scalar load each through the element
// strides, consecutive lanes on consecutive features. (MLX's sdpa_vector
// gives each lane a contiguous run too; the code is this project's own.)
template <int DPL>
FM_INLINE int decode_feature(int i, uint lane, bool dense) {
  return dense ? int(lane) * DPL + i : i * 32 + int(lane);
}

// Where one query row of the group lives: its head and its row in q / out.
struct DecodeRow {
  int head;  // query head
  int row;   // query row, 0..Nq-1
};

inline DecodeRow decode_row(constant AttentionParams& p, int kv_head, int rr) {
  DecodeRow r;
  r.head = kv_head * p.gqa_ratio + rr / p.q_len;
  r.row = rr % p.q_len;
  return r;
}

// The SIMD-group's row group rg: loads q (zeros for rows past R) and resets
// the state; under fc_has_sinks, if `sink` (the one state of its rows the
// merges count the sink in: key group 0, of split 0), each live row's state
// starts from its head's sink (seed_sink). Never reads q past head_dim.
template <typename T, int DMAX>
FM_INLINE void decode_init(thread DecodeState<DMAX>& st, device const T* q, constant AttentionParams& p, int batch,
                           int kv_head, int rg, uint lane, device const float* sinks, bool sink) {
  constexpr int RS = DecodeState<DMAX>::RS;
  constexpr int DPL = DecodeState<DMAX>::DPL;
  const int R = p.gqa_ratio * p.q_len;
  const int D = p.head_dim;
  FM_UNROLL for (int r = 0; r < RS; ++r) {
    const int rr = rg * RS + r;
    const bool live = rr < R;
    const DecodeRow dr = decode_row(p, kv_head, live ? rr : 0);
    device const T* qp = q + int64_t(batch) * p.q_batch_stride + int64_t(dr.head) * p.q_head_stride +
                         int64_t(dr.row) * p.q_row_stride;
    FM_UNROLL for (int i = 0; i < DPL; ++i) {
      const int c = decode_feature<DPL>(i, lane, fc_dense);
      st.q[r][i] = (live && c < D) ? float(qp[int64_t(c) * p.q_dim_stride]) * p.scale_log2 : 0.0f;
      st.acc[r][i] = 0.0f;
    }
    st.m[r] = kMaskedScore;
    st.l[r] = 0.0f;
    if (fc_has_sinks && sink && live) seed_sink(st.m[r], st.l[r], sinks, dr.head);
  }
}

// The lane's slice of one K or V row as float (its features, decode_feature;
// zeros past head_dim): from device memory (decode_slice_device: under
// fc_dense as vector runs, decode_slice_dense; else through the element
// strides).

// Elements per vector load of a lane's run of DPL features: the widest of
// 4, 2, 1 that divides DPL. Why at most 4: vec<T, 4> is the widest vector
// type MSL has for every T (16 bytes of float, 8 of half or bfloat), so
// DPL 8 (DMAX 256) takes 2 loads, DPL 6 (DMAX 192) 3 of 2 elements; DPL 3 (DMAX 72, 80, 96) takes 3 scalar
// loads, as the strided path.
constexpr int decode_vector_width(int dpl) { return dpl % 4 == 0 ? 4 : (dpl % 2 == 0 ? 2 : 1); }

// VW consecutive elements of T as one load, converted to float.
template <int VW>
struct DecodeRun;
template <>
struct DecodeRun<1> {
  template <typename T>
  static FM_INLINE void device_load(thread float* x, device const T* s) { x[0] = float(s[0]); }
};
template <>
struct DecodeRun<2> {
  template <typename T>
  static FM_INLINE void device_load(thread float* x, device const T* s) {
    const vec<T, 2> w = *reinterpret_cast<device const vec<T, 2>*>(s);
    x[0] = float(w.x);
    x[1] = float(w.y);
  }
};
template <>
struct DecodeRun<4> {
  template <typename T>
  static FM_INLINE void device_load(thread float* x, device const T* s) {
    const vec<T, 4> w = *reinterpret_cast<device const vec<T, 4>*>(s);
    x[0] = float(w.x);
    x[1] = float(w.y);
    x[2] = float(w.z);
    x[3] = float(w.w);
  }
};

// fc_dense: the lane's run [lane * DPL, lane * DPL + DPL) of a row whose
// features are contiguous, D == DMAX (no padding to zero) and whose start is
// 16-byte aligned (so every run is aligned to its vector: VW * sizeof(T)
// divides the run's offset). DMAX 72 and 80 (DPL 3, VW 1): the 32 lanes'
// runs reach 96 features, so lanes past the row's end read nothing and hold
// zeros (a compile-time-true test for every other bucket).
template <int DMAX, int DPL, typename T>
FM_INLINE void decode_slice_dense(thread float* x, device const T* row, uint lane) {
  constexpr int VW = decode_vector_width(DPL);
  device const T* run = row + int(lane) * DPL;
  FM_UNROLL for (int i = 0; i < DPL; i += VW) {
    if (32 * DPL == DMAX || int(lane) * DPL + i < DMAX) {
      DecodeRun<VW>::device_load(x + i, run + i);
    } else {
      x[i] = 0.0f;  // VW == 1 here
    }
  }
}
template <int DMAX, int DPL, typename T>
FM_INLINE void decode_slice_device(thread float* x, device const T* row, int64_t dim_stride, int D, uint lane) {
  if (fc_dense) {
    decode_slice_dense<DMAX, DPL>(x, row, lane);
    return;
  }
  FM_UNROLL for (int i = 0; i < DPL; ++i) {
    const int c = i * 32 + int(lane);
    x[i] = c < D ? float(row[int64_t(c) * dim_stride]) : 0.0f;
  }
}
// A K or V cache in T, read through its element strides from the kv head's
// base (fc_paged: page 0's; else the batch's), D features wide.
template <typename T, int DMAX>
struct DecodeRows {
  device const T* base;
  int64_t batch_stride, row_stride, dim_stride;
  int D;
  FM_INLINE void load(thread float* x, thread const PageCursor& c, int key, uint lane) const {
    constexpr int DPL = (DMAX + 31) / 32;
    const int64_t at = fc_paged ? page_offset(c, batch_stride, row_stride) : int64_t(key) * row_stride;
    decode_slice_device<DMAX, DPL>(x, base + at, dim_stride, D, lane);
  }
};
template <typename T, int DMAX>
FM_INLINE DecodeRows<T, DMAX> decode_rows(device const T* t, int64_t bs, int64_t hs, int64_t rs, int64_t ds, int D,
                                          int batch, int kv_head) {
  DecodeRows<T, DMAX> r;
  r.base = t + (fc_paged ? 0 : int64_t(batch) * bs) + int64_t(kv_head) * hs;
  r.batch_stride = bs;
  r.row_stride = rs;
  r.dim_stride = ds;
  r.D = D;
  return r;
}
// Attends the SIMD-group's rows to the keys of its key group in
// [key_begin, key_end): blocks of 32 consecutive keys, block kg, kg + KG, ...
// (each key belongs to exactly one key group). Per block:
//  0. visibility: each lane decides, per row, whether its key may be seen
//     (window, causal, past R) and reads the mask's term for it; a block no
//     row of the SIMD-group may see is skipped before any K or V load
//     (llama.cpp's flash_attn_ext_vec skips fully masked blocks the same
//     way; issue 43);
//  1. scores: for each key j, every lane takes its slice of K row j, and
//     each row's score is simd_sum of the lane partials; lane j keeps the
//     score of key j (kMaskedScore if masked);
//  2. softmax: block max by simd_max, p = exp2(s - m_new) (0 if masked),
//     l = l * alpha + simd_sum(p), one rescale per block;
//  3. output: each lane takes its slice of V row j and accumulates
//     p_j (simd_shuffle from lane j) * v into a block partial that starts at
//     zero, then acc = acc * alpha + partial: a blocked sum, so acc takes
//     one rounding per block, not per key (FlashAttention-2's per-block
//     rescale; at Nk = 8192 float32 this is what keeps within 2x PyTorch's
//     error).
// Every SIMD-group reads its slices straight from device memory, with no
// barrier inside: the row groups of a key group all read the same rows of
// every block of its keys, in the
// same order and at the same pace, so that (a modelling assumption, not
// verified on Apple hardware) the first SIMD-group's load brings each line
// into the core's L1 and its siblings' loads hit it: DRAM sees each K/V
// byte once per threadgroup (the emulator's unique-bytes count). This
// replaced (issue 19) a staged path: 64-thread threadgroups copying each
// block to threadgroup memory with 4 barriers per 32 keys. What staging
// gave, many loads in flight, comes instead from more SIMD-groups (the
// split count) and unrolling: the K and V loops step UK =
// decode_keys_in_flight(DMAX) keys at a time (4 up to D 256), and a step
// issues all its UK rows' loads before the first product, so a SIMD-group
// has UK rows in flight (issue 43; before it, one key prefetched: 2 rows;
// the emulator's device_load_window counts prove it). The trip count is
// uniform across the SIMD-group, so every simd_* call is convergent.
//
// KR and VR read one K and one V row (DecodeRows below for a cache in T;
// attention_decode_quant.h's DecodeQuantRows for a quantized one, issue 44):
// load(x, cursor, key, lane) fills the lane's DPL features of key `key`
// (fc_paged: the key at `cursor`) as float, zeros past the row's width.
template <typename T, int DMAX, typename KR, typename VR>
FM_INLINE void decode_attend(thread DecodeState<DMAX>& st, thread const KR& kr, thread const VR& vr,
                             constant AttentionParams& p, thread const SeqView& seq, device const uchar* mask,
                             device const int* table, int batch, int kv_head, int rg, bool live, int key_begin,
                             int key_end, int kg, int KG, uint lane) {
  constexpr int RS = DecodeState<DMAX>::RS;
  constexpr int UK = decode_keys_in_flight(DMAX);
  constexpr int DPL = DecodeState<DMAX>::DPL;
  const int R = p.gqa_ratio * p.q_len;
  // fc_paged: rows are found through the table (attention_decode_paged.h),
  // `at` is the block's first key, and `step` what the loop advances it by
  // (divided here, once).
  const PageStep step = fc_paged ? page_split(KG * kDecodeBlock, p.page_size) : PageStep{0, 0};
  PageStep at = fc_paged ? page_split(key_begin + kg * kDecodeBlock, p.page_size) : PageStep{0, 0};

  // Per row, one value across the loop (the register model counts it):
  // its query head and query row packed as head * 8 + row (q_len <= 8,
  // kMaxDecodeRows: shifts and masks unpack it, no division in the loop),
  // or -1 for a row past R; the keys it may see come from its row per block
  // (first_visible_key / visible_key_end, a few adds). Each row has its own
  // query head (a GQA group's rows span gqa_ratio heads), so its own
  // attn_mask slice, whose offset is recomputed per block from the head (a
  // few multiply-adds; the register model counts only the block's mask term).
  int row_q[RS];
  FM_UNROLL for (int r = 0; r < RS; ++r) {
    const int rr = rg * RS + r;
    const bool real = live && rr < R;
    const DecodeRow dr = decode_row(p, kv_head, real ? rr : 0);
    row_q[r] = real ? dr.head * 8 + dr.row : -1;
  }

  for (int k0 = key_begin + kg * kDecodeBlock; k0 < key_end; k0 += KG * kDecodeBlock) {
    const int n = min(kDecodeBlock, key_end - k0);  // keys of this block (uniform)
    const int key = k0 + int(lane);                 // the key whose score this lane keeps

    // 0. Which rows may see this lane's key, and the mask's term for it
    // (bool False and additive terms at or below kMaskedScore: kMaskedScore,
    // which any finite score below 2^76 leaves masked after the add: the
    // same rule as option_score's, read before K instead of after).
    float mterm[RS];
    bool any = false;
    FM_UNROLL for (int r = 0; r < RS; ++r) {
      const int qrow = row_q[r] & 7;  // the query row (see row_q)
      bool keep = int(lane) < n && row_q[r] >= 0 && key < visible_key_end(seq, qrow) &&
                  (!fc_window_left || key >= first_visible_key(seq, qrow));
      mterm[r] = 0.0f;
      if (fc_has_mask && keep) {
        bool drop;
        const float t = mask_term<T>(p, mask, mask_head_offset(p, uint(batch), uint(row_q[r] >> 3)), qrow, key, &drop);
        if (drop || t <= kMaskedScore) keep = false;
        mterm[r] = t;
      }
      if (!keep) mterm[r] = kMaskedScore;
      any = any || keep;
    }
    // A block none of this SIMD-group's rows may see: skipped before its
    // loads (uniform: simd_any). Its state is unchanged, as the masked
    // block would leave it (alpha 1, no weight).
    if (!simd_any(any)) {
      if (fc_paged) at = page_add(at, step, p.page_size);
      continue;
    }

    float s[RS];
    FM_UNROLL for (int r = 0; r < RS; ++r) s[r] = kMaskedScore;
    // fc_paged: kc walks the block's keys (advanced only to a key that is read).
    PageCursor kc = fc_paged ? page_cursor(table, at.entry, at.row) : PageCursor{0, 0, 0};
    for (int j0 = 0; j0 < n; j0 += UK) {
      float kx[UK][DPL];  // the step's UK rows, every load issued before the first product
      FM_UNROLL for (int u = 0; u < UK; ++u) {
        const int j = j0 + u;
        if (j < n) {
          if (fc_paged && j > 0) page_next(kc, table, p.page_size);
          kr.load(kx[u], kc, k0 + j, lane);
        } else {
          FM_UNROLL for (int i = 0; i < DPL; ++i) kx[u][i] = 0.0f;
        }
      }
      FM_UNROLL for (int u = 0; u < UK; ++u) {
        if (j0 + u < n) {
          FM_UNROLL for (int r = 0; r < RS; ++r) {
            float part = 0.0f;
            FM_UNROLL for (int i = 0; i < DPL; ++i) part = fma(st.q[r][i], kx[u][i], part);
            const float score = simd_sum(part);
            if (int(lane) == j0 + u) s[r] = score;
          }
        }
      }
    }

    // Masking: keys outside this row's window (causal, left window, or
    // past R) or dropped by the mask were marked in step 0; the rest get
    // softcap, then the mask's term; scores that are -inf or below the
    // floor, from the inputs or an additive mask, become the finite
    // sentinel by comparisons fast math cannot fold.
    float pw[RS];
    float alpha[RS];
    FM_UNROLL for (int r = 0; r < RS; ++r) {
      const bool keep = mterm[r] > kMaskedScore;
      float sr = s[r];
      if (fc_softcap) {
        float t;
        sr = softcap_score(p, sr, &t);
      }
      sr += mterm[r];
      const bool masked = !keep || sr <= kMaskedScore;
      const float sc = masked ? kMaskedScore : sr;
      const float m_new = max(st.m[r], simd_max(sc));  // finite
      alpha[r] = exp2(st.m[r] - m_new);                // finite argument <= 0
      pw[r] = masked ? 0.0f : exp2(sc - m_new);
      st.l[r] = fma(st.l[r], alpha[r], simd_sum(pw[r]));
      st.m[r] = m_new;
    }

    float blk[RS][DPL];
    FM_UNROLL for (int r = 0; r < RS; ++r) {
      FM_UNROLL for (int i = 0; i < DPL; ++i) blk[r][i] = 0.0f;
    }
    PageCursor vc = fc_paged ? page_cursor(table, at.entry, at.row) : PageCursor{0, 0, 0};  // as kc
    for (int j0 = 0; j0 < n; j0 += UK) {
      float vx[UK][DPL];  // as kx
      FM_UNROLL for (int u = 0; u < UK; ++u) {
        const int j = j0 + u;
        if (j < n) {
          if (fc_paged && j > 0) page_next(vc, table, p.page_size);
          vr.load(vx[u], vc, k0 + j, lane);
        } else {
          FM_UNROLL for (int i = 0; i < DPL; ++i) vx[u][i] = 0.0f;
        }
      }
      FM_UNROLL for (int u = 0; u < UK; ++u) {
        if (j0 + u < n) {
          FM_UNROLL for (int r = 0; r < RS; ++r) {
            const float pj = simd_shuffle(pw[r], ushort(j0 + u));
            FM_UNROLL for (int i = 0; i < DPL; ++i) blk[r][i] = fma(pj, vx[u][i], blk[r][i]);
          }
        }
      }
    }
    FM_UNROLL for (int r = 0; r < RS; ++r) {
      FM_UNROLL for (int i = 0; i < DPL; ++i) st.acc[r][i] = fma(st.acc[r][i], alpha[r], blk[r][i]);
    }
    if (fc_paged) at = page_add(at, step, p.page_size);
  }
}

// Merges the KG key groups of each row group into key group 0, through
// threadgroup memory `smem` (RGL * KG * (RS + 1 + DP32) floats, DP32 =
// 32 * ceil(DMAX / 32): each lane writes its whole slice, padding included): every
// SIMD-group rescales its state to the common max M = max over key groups,
// then key group 0 sums the sums and the accumulators, one row at a time.
// Every thread of the threadgroup must call it (it has barriers); a
// SIMD-group without a live row group takes part with its "no key" state.
template <int DMAX>
FM_INLINE void decode_merge_key_groups(thread DecodeState<DMAX>& st, threadgroup float* smem, int kg, int KG, int rgl,
                                       int RGL, uint lane) {
  constexpr int RS = DecodeState<DMAX>::RS;
  constexpr int DPL = DecodeState<DMAX>::DPL;
  constexpr int DP32 = DecodeState<DMAX>::DP32;
  const int slot = rgl * KG + kg;  // this SIMD-group's slot
  const int nslots = RGL * KG;
  threadgroup float* tg_m = smem;                // [nslots][RS]
  threadgroup float* tg_l = tg_m + nslots * RS;  // [nslots]
  threadgroup float* tg_o = tg_l + nslots;       // [nslots][DP32]
  threadgroup_barrier(mem_flags::mem_threadgroup);  // a previous round's reads done before these writes (WAR)
  if (lane == 0) {
    FM_UNROLL for (int r = 0; r < RS; ++r) tg_m[slot * RS + r] = st.m[r];
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);  // every max written before any is read (RAW)
  FM_UNROLL for (int r = 0; r < RS; ++r) {
    float M = kMaskedScore;
    for (int g = 0; g < KG; ++g) M = max(M, tg_m[(rgl * KG + g) * RS + r]);
    const float f = exp2(st.m[r] - M);  // finite argument <= 0
    st.l[r] *= f;
    FM_UNROLL for (int i = 0; i < DPL; ++i) st.acc[r][i] *= f;
    st.m[r] = M;
  }
  FM_UNROLL for (int r = 0; r < RS; ++r) {
    FM_UNROLL for (int i = 0; i < DPL; ++i) tg_o[slot * DP32 + i * 32 + int(lane)] = st.acc[r][i];
    if (lane == 0) tg_l[slot] = st.l[r];
    threadgroup_barrier(mem_flags::mem_threadgroup);  // row r of every key group written before the sum (RAW)
    if (kg == 0) {
      float l = 0.0f;
      float a[DPL];
      FM_UNROLL for (int i = 0; i < DPL; ++i) a[i] = 0.0f;
      for (int g = 0; g < KG; ++g) {
        const int sl = rgl * KG + g;
        l += tg_l[sl];
        FM_UNROLL for (int i = 0; i < DPL; ++i) a[i] += tg_o[sl * DP32 + i * 32 + int(lane)];
      }
      st.l[r] = l;
      FM_UNROLL for (int i = 0; i < DPL; ++i) st.acc[r][i] = a[i];
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);  // sums read before the next row overwrites them (WAR)
  }
}

// The shape of the threadgroup, decoded from its launch (see the top of the
// file): its kv head and row chunk, key group kg of KG, row-group slot rgl
// of RGL.
struct DecodeShape {
  int kv_head, chunk, chunks;
  int kg, KG, rgl, RGL, rounds;
  // The row group this SIMD-group serves in round `round`.
  int row_group(int round) const { return (round * chunks + chunk) * RGL + rgl; }
};

inline DecodeShape decode_shape(constant AttentionParams& p, uint3 group, uint3 groups, uint3 tpos, uint3 tsize,
                                int RS) {
  DecodeShape s;
  s.chunks = max(1, int(groups.x) / p.kv_heads);
  s.kv_head = int(group.x) / s.chunks;
  s.chunk = int(group.x) - s.kv_head * s.chunks;
  s.kg = int(tpos.y);
  s.KG = int(tsize.y);
  s.rgl = int(tpos.z);
  s.RGL = int(tsize.z);
  const int RG = (p.gqa_ratio * p.q_len + RS - 1) / RS;
  s.rounds = (RG + s.RGL * s.chunks - 1) / (s.RGL * s.chunks);
  return s;
}

// The lane's slice of one output row (its head_dim_v features: v's width),
// normalized, and the row's lse (natural log): zeros and -inf (from bits, as store_output_row) for a row that saw no
// key. sm carries the row's (m, l).
template <typename T, int DMAX>
FM_INLINE void decode_store_row(device T* o, device float* lse, constant AttentionParams& p, int batch,
                                DecodeRow dr, thread const float* acc, OnlineSoftmax sm, uint lane, bool dense) {
  constexpr int DPL = (DMAX + 31) / 32;
  const float inv = sm.inv_sum();
  device T* op = o + int64_t(batch) * p.o_batch_stride + int64_t(dr.head) * p.o_head_stride +
                 int64_t(dr.row) * p.o_row_stride;
  FM_UNROLL for (int i = 0; i < DPL; ++i) {
    const int c = decode_feature<DPL>(i, lane, dense);
    if (c < p.head_dim_v) op[int64_t(c) * p.o_dim_stride] = static_cast<T>(acc[i] * inv);
  }
  if (lane == 0) {
    // lse = m ln 2 + ln l with one rounding for both (fma), as the prefill
    // kernel does; -inf from its bits for an empty row (see store_output_row).
    const uint bits = sm.has_key() ? as_type<uint>(fma(sm.m, M_LN2_F, log(sm.l))) : kNegInfBits;
    lse[int64_t(batch) * p.lse_batch_stride + int64_t(dr.head) * p.lse_head_stride +
        int64_t(dr.row) * p.lse_row_stride] = as_type<float>(bits);
  }
}

// One pass: the threadgroup (batch, kv_head) attends all of the group's rows
// to all keys and writes out and lse. T: q/k/v/out element type; DMAX: head_dim
// bucket. Launch: top of this file.
template <typename T, int DMAX>
[[kernel]] [[max_total_threads_per_threadgroup(kDecodeMaxThreads)]] void flash_decode(
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
    device const int* block_table [[buffer(19)]],
    device const int* cache_seqlens [[buffer(20)]],
    threadgroup float* smem [[threadgroup(0)]],
    uint3 group [[threadgroup_position_in_grid]],
    uint3 groups [[threadgroups_per_grid]],
    uint3 tpos [[thread_position_in_threadgroup]],
    uint3 tsize [[threads_per_threadgroup]],
    uint lane [[thread_index_in_simdgroup]]) {
  constexpr int RS = DecodeState<DMAX>::RS;
  const DecodeShape sh = decode_shape(p, group, groups, tpos, tsize, RS);
  const int kv_head = sh.kv_head;
  const int batch = int(group.y);
  const int R = p.gqa_ratio * p.q_len;
  // Decode never runs varlen (the planner routes it to prefill): the view
  // is the whole problem, with its window bounds, or under fc_paged the
  // batch's cache (its own key count; table: its row of block_table).
  const SeqView seq = fc_paged ? paged_sequence_view(p, cache_seqlens, uint(batch))
                               : sequence_view(p, cu_seqlens_q, cu_seqlens_k, uint(batch));
  device const int* table = block_table + (fc_paged ? int64_t(batch) * p.table_stride : 0);
  // Under causal masking no row sees past the last row's bound (rows before
  // it see fewer keys), and under a left window none sees before the first
  // row's first key (later rows start later), so keys outside
  // [key_begin, key_end) are never read.
  const int key_begin = first_visible_key(seq, 0);
  const int key_end = visible_key_end(seq, p.q_len - 1);
  const auto kr = decode_rows<T, DMAX>(k, p.k_batch_stride, p.k_head_stride, p.k_row_stride, p.k_dim_stride,
                                       p.head_dim, batch, kv_head);
  const auto vr = decode_rows<T, DMAX>(v, p.v_batch_stride, p.v_head_stride, p.v_row_stride, p.v_dim_stride,
                                       p.head_dim_v, batch, kv_head);
  for (int round = 0; round < sh.rounds; ++round) {
    const int rg = sh.row_group(round);
    const bool live = rg * RS < R;  // uniform per SIMD-group
    DecodeState<DMAX> st;
    // a dead row group: zeros, "no key"; the sink in key group 0 only (the key-group merge adds the sums)
    decode_init<T, DMAX>(st, q, p, batch, kv_head, rg, lane, sinks, sh.kg == 0);
    decode_attend<T, DMAX>(st, kr, vr, p, seq, mask, table, batch, kv_head, rg, live, key_begin, key_end, sh.kg,
                           sh.KG, lane);
    if (sh.KG > 1) decode_merge_key_groups<DMAX>(st, smem, sh.kg, sh.KG, sh.rgl, sh.RGL, lane);
    if (live && sh.kg == 0) {
      FM_UNROLL for (int r = 0; r < RS; ++r) {
        const int rr = rg * RS + r;
        if (rr < R) {
          OnlineSoftmax sm;
          sm.m = st.m[r];
          sm.l = st.l[r];
          decode_store_row<T, DMAX>(o, lse, p, batch, decode_row(p, kv_head, rr), st.acc[r], sm, lane, fc_dense);
        }
      }
    }
  }
}

}  // namespace flash_metal

// The split-KV pair (flash_decode_split, flash_decode_merge), on the helpers
// above: its own file to keep each under ~600 lines.
#include "attention_decode_split.h"
