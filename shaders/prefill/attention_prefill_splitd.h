// The split-D forward for head dims 512 and MLA's (576, 512) and (256, 512)
// (issue 20, sections 2 and 3): FlashAttention-2 with the head dimension
// blocked across SIMD-groups, for the calls the FA2 template
// (attention_prefill.h) cannot serve well. Routed by
// csrc/metal/families/prefill_splitd.cpp (splitd_takes: causal D_qk = D_v = 512
// forwards, the absorbed-MLA decode packed over its query heads, and
// impl='prefill' at the instantiated pairs), priced by
// benchmarks/model/families/splitd.py and benchmarks/model/families/splitd_mla.py.
//
// Why a kernel of its own. The template keeps the whole 512-wide Q block and
// a 512-wide K/V tile in threadgroup memory: 1,040 bytes per float16 row, so
// 32 KiB holds 8 query rows and 8 keys, and every 8 x 8 block pays a DRAM
// latency and four barriers; the model predicts that 2-3x slower than the
// unfused path (benchmarks/model/families/d512.py). Here D is blocked instead
// (the idea of metal-flash-attention, which blocks its head dimension and
// keeps operands in registers or device memory when they do not fit
// threadgroup memory; the code here is this project's own):
//
//   - A threadgroup owns 8 query rows (BQ) and runs WM SIMD-groups
//     ("parts"); part p owns features [p * F, (p + 1) * F) of Q and K,
//     F = DQK / WM (64 at 512 and 8 parts, 72 at 576, 32 at 256), and
//     [p * Fv, (p + 1) * Fv) of V and O, Fv = DV / WM (64 at 512), Q and O
//     in registers (F / 8 and Fv / 8 fragments: 16 values per lane per
//     matrix at 512, 18 for Q at 576).
//   - K and V: each part reads its own F features of each BK-key block
//     straight from device memory into fragments. With one 8-row group no
//     K/V element is read by two SIMD-groups of a threadgroup, so staging
//     through threadgroup memory would buy no reuse, only barriers and a
//     write and a read of every byte (metal-flash-attention likewise reads
//     K/V from device memory on M3 and later). The price: K/V are read once
//     per 8 query rows, which the model counts (on-GPU link bytes).
//   - S = Q.K^T: each part multiplies over its F features (split-K) and
//     writes its partial 8 x BK block to threadgroup memory.
//   - The softmax is shared, not repeated: part p finishes keys
//     [4p, 4p + 4) of the block, one (row, key) per lane (row lane / 4, key
//     lane % 4): it sums that score's WM partials in part order, scales it,
//     applies every option (option_score: softcap, mask; the window and the
//     sequence bounds), takes the row's max over its 4 keys and publishes
//     it. After a barrier each lane takes the row's block max from the WM
//     published maxima (max is exact, so every part agrees), writes its
//     weight P and publishes its row sum. After a third barrier each part
//     reads the whole P (8 x BK) and the WM row sums for its O update:
//     O = alpha * O + P.V over its own features. 2 exp2 per (row, key)
//     (weight and alpha) rather than WM, 3 barriers per block.
//   - No second scratch buffer: block kb + 1's partials are written after
//     block kb's third barrier, which every reader of block kb's scratch
//     passed after its reads (likewise the row maxima, P and the sums:
//     each is read between two barriers and rewritten after the next).
//
// Tile choices (the model in benchmarks/model/families/splitd.py; float16):
//   BQ = 8, one row group: the shared softmax maps 8 rows x 4 keys onto a
//     SIMD-group's 32 lanes, and with one row group no K/V element is read
//     twice per threadgroup (16 rows on 16 SIMD-groups were modelled
//     31-44% slower: 512 threads, one threadgroup per core).
//   WM = 8 parts: F = 64, so Q and O take 16 values each; live values
//     (DQK + DV) / 4 / WM + BK / 4 + 2 + 4 + 16 = 62 at 512 and BK 32 (63
//     with the second running max; 65 at (576, 512), 55 at (256, 512)),
//     within the planner's 72-value budget (csrc/metal/routing.cpp). 4
//     parts would need 32 + 32. float32 has the same counts: fragments are
//     float whatever T, and the scratch is float.
//   BK = 4 * WM = 32: one key per lane per part in the shared step; S is 4
//     fragments (8 values per lane), and a block's 256 MMAs per part cover
//     its two DRAM latencies (K, then V). 16 keys were modelled about the
//     same as the repeated-softmax variant, 64 would double S.
//   Threadgroup memory (floats): WM x 8 x BK partials + 8 x BK weights +
//     2 x WM x 8 row maxima and sums = 9,728 bytes at WM 8, BK 32:
//     three threadgroups per core on every named chip (registers bind
//     first; csrc/metal/families/prefill_splitd.cpp sizes it, splitd_threadgroup_bytes).
//
// Options, each from attention_features.h as the template applies them:
// causal (bottom-right) and the right window (fc_causal), the left window
// (fc_window_left: key blocks behind every row's window skipped), softcap
// and bool / additive masks (option_score), packed variable-length
// sequences (fc_varlen), attention sinks (fc_has_sinks: seed the running
// state), GQA (head_offsets), pack GQA (fc_pack_gqa, below). Not: a paged
// KV cache (attention_kvcache gathers wide calls into packed buffers
// first), head dims other than the instantiated (DQK, DV) (no padding
// columns: the host routes only those exactly), the backward. A row that
// sees no key stores zeros and lse = -inf, or the sink's logit with sinks.
//
// MSL subset: as attention_common.h.
#pragma once

#include "attention_prefill.h"

namespace flash_metal {

// [[function_constant(14)]] (13 is fc_pack_gqa, attention_prefill_pack.h):
// split along keys ("flash decoding" for the packed absorbed-MLA decode,
// issue 20). The grid's x runs over (key split, query block): threadgroup x
// serves query block x % (groups.x / kv_splits) and keys [split *
// split_keys, (split + 1) * split_keys) of every row it holds, and writes
// unnormalized partials in flash_decode_split's layout (attention_decode_split.h:
// partial_o [B][Hq][Nq][kv_splits][D_v], partial_stats [..][2] = (m, l),
// base 2; varlen: batch 0 and the packed row, Nq = total_q) for
// flash_decode_merge_<T>_d512 to merge. The sink seeds split 0 only (the
// merge adds the splits' sums). Why: a grid of 16 packed threadgroups (B 1
// x 128 heads) leaves most cores idle while each walks all Nk keys; splits
// give every core threadgroups (csrc/metal/families/prefill_splitd.cpp,
// splitd_kv_splits, chooses how many).
constant bool fc_split_kv [[function_constant(14)]];

// Fragment (row0.., col0..) of a row-major (rows, features) matrix in device
// memory, converted to float; rows >= valid are zeros and are not read. The
// lane's two elements are adjacent features of one row.
template <typename T>
FM_INLINE void splitd_frag(thread PrefillFrag& f, device const T* base, int64_t row_stride, int64_t dim_stride,
                           int row0, int col0, int valid, int fr, int fc) {
  const int r = row0 + fr;
  float a = 0.0f, b = 0.0f;
  if (r < valid) {
    device const T* s = base + int64_t(r) * row_stride + int64_t(col0 + fc) * dim_stride;
    a = float(s[0]);
    b = float(s[dim_stride]);
  }
  f.thread_elements()[0] = a;
  f.thread_elements()[1] = b;
}

// Fragment (row0 + fr, col0..) where the lane's row starts at `rowp` (its
// own address: under fc_pack_gqa a packed row's query row and head are a
// runtime division, done once by the caller); a row with !valid is zeros
// and is not read.
template <typename T>
FM_INLINE void splitd_frag_row(thread PrefillFrag& f, device const T* rowp, bool valid, int64_t dim_stride, int col0,
                               int fc) {
  float a = 0.0f, b = 0.0f;
  if (valid) {
    device const T* s = rowp + int64_t(col0 + fc) * dim_stride;
    a = float(s[0]);
    b = float(s[dim_stride]);
  }
  f.thread_elements()[0] = a;
  f.thread_elements()[1] = b;
}

// The transpose: element (r, c) is key key0 + c, feature col0 + r, of a
// row-major (keys, features) matrix (K^T for S = Q.K^T). The lane's two
// elements are one feature of two adjacent keys; keys >= valid are zeros
// and are not read.
template <typename T>
FM_INLINE void splitd_frag_t(thread PrefillFrag& f, device const T* base, int64_t row_stride, int64_t dim_stride,
                             int key0, int col0, int valid, int fr, int fc) {
  device const T* s = base + int64_t(key0 + fc) * row_stride + int64_t(col0 + fr) * dim_stride;
  f.thread_elements()[0] = key0 + fc < valid ? float(s[0]) : 0.0f;
  f.thread_elements()[1] = key0 + fc + 1 < valid ? float(s[row_stride]) : 0.0f;
}

// T: q, k, v, o's type. DQK: q and k's head dim, DV: v and o's (exactly:
// 512 / 512, and MLA's 576 / 512 and 256 / 512). BQ: query rows per
// threadgroup (8). BK: keys per block (4 x WM). WM: SIMD-groups, each owning
// DQK / WM features of Q and DV / WM of O (576 / 8 = 72: 9 fragments of Q;
// 256 / 8 = 32: 4).
// Launch: grid (ceil(Nq / BQ), Hq, B), or under fc_pack_gqa
// (ceil(Nq * G / BQ), Hkv, B), x times kv_splits under fc_split_kv (14:
// partials at buffers 6 and 7, always bound); threadgroup (32 * WM, 1, 1), threadgroup
// memory (WM * 8 * BK + 8 * BK + 2 * WM * 8) * 4 bytes at index 0; function
// constants fc_causal (0), the options' 4-9, fc_has_sinks (11) and
// fc_pack_gqa (13) and fc_split_kv (14) (the others are not read). AttentionParams at buffer 5
// with head_dim = DQK, head_dim_v = DV; mask, cu_seqlens and sinks at 14-17
// as the prefill's. Strides are in elements and each tensor has its own, so
// k and v may be overlapping views of one latent cache (v = k[..., :DV]).
//
// Pack GQA (fc_pack_gqa, attention_prefill_pack.h; FlashAttention-3's and
// FlashInfer's idea, the code this project's own): the threadgroup's 8
// rows are packed rows of one (batch, kv head)'s group, packed row m being
// query row m / G of query head kv * G + m % G, so every K/V fragment a part
// reads serves up to 8 query heads (absorbed-MLA decode: Hq heads on one
// latent kv head, Nq of 1 to a few rows, reads K/V ceil(Nq * G / 8) times per
// kv head instead of Hq times). Each lane's row has two views (its fragment
// row and its shared-step row), and each view its own (query row, head):
// the Q loads, the stores, the mask slice and the sink use them; the key
// bounds use the query rows of the threadgroup's first and last packed rows.
template <typename T, int DQK, int DV, int BQ, int BK, int WM>
[[kernel]] [[max_total_threads_per_threadgroup(kPrefillSplitDMaxThreads)]] void flash_attention_prefill_splitd(
    device const T* q [[buffer(0)]],
    device const T* k [[buffer(1)]],
    device const T* v [[buffer(2)]],
    device T* o [[buffer(3)]],
    device float* lse [[buffer(4)]],
    constant AttentionParams& p [[buffer(5)]],
    device float* partial_o [[buffer(6)]],
    device float* partial_stats [[buffer(7)]],
    device const uchar* mask [[buffer(14)]],
    device const int* cu_seqlens_q [[buffer(15)]],
    device const int* cu_seqlens_k [[buffer(16)]],
    device const float* sinks [[buffer(17)]],
    threadgroup float* smem [[threadgroup(0)]],
    uint3 group [[threadgroup_position_in_grid]],
    uint3 groups [[threadgroups_per_grid]],
    uint sg [[simdgroup_index_in_threadgroup]],
    uint lane [[thread_index_in_simdgroup]]) {
  constexpr int PARTS = WM;
  static_assert(BQ == 8, "one 8-row group per threadgroup: the shared softmax maps 8 rows x 4 keys to 32 lanes");
  static_assert(32 * WM <= kPrefillSplitDMaxThreads, "the declared threadgroup limit (params.h)");
  static_assert(BK == 4 * PARTS, "each part finishes 4 keys of the block, one (row, key) per lane");
  static_assert(DQK % (8 * PARTS) == 0 && DV % (8 * PARTS) == 0, "parts are whole 8x8 fragments");
  constexpr int TK = BK / 8;             // key fragments of S per block
  constexpr int TQ = DQK / 8 / PARTS;    // feature fragments of Q (and K) this part keeps
  constexpr int TF = DV / 8 / PARTS;     // feature fragments of O (and V) this part keeps
  constexpr int SLOT = 8 * BK;           // floats of one part's partial S, row-major (row * BK + key)
  threadgroup float* scratch = smem;                    // PARTS x 8 x BK partials
  threadgroup float* weights = scratch + PARTS * SLOT;  // 8 x BK: the block's P
  threadgroup float* row_max = weights + SLOT;          // PARTS x 8
  threadgroup float* row_sum = row_max + PARTS * 8;     // PARTS x 8
  const int part = int(sg);
  const int qcol0 = part * (DQK / PARTS);  // this part's first feature of Q and K
  const int col0 = part * (DV / PARTS);    // and of V and O

  // The threadgroup's sequence (varlen: group.z's, its rows from q_row0 /
  // k_row0) and rows: under fc_pack_gqa `rows` packed rows of its kv head's
  // group, else G = 1 and a packed row is a query row of head group.y. A
  // block past the sequence's rows leaves at once: uniform across the
  // threadgroup and before any barrier.
  const SeqView seq = sequence_view(p, cu_seqlens_q, cu_seqlens_k, group.z);
  const int G = fc_pack_gqa ? p.gqa_ratio : 1;
  const int rows = seq.q_len * G;
  const uint head0 = fc_pack_gqa ? group.y * uint(G) : group.y;  // the threadgroup's first query head
  // fc_split_kv: x = split * (query blocks) + query block.
  const int q_blocks = fc_split_kv ? int(groups.x) / p.kv_splits : int(groups.x);
  const int split = fc_split_kv ? int(group.x) / q_blocks : 0;
  const int q0 = (int(group.x) - split * q_blocks) * BQ;  // its first packed row
  if (fc_varlen && q0 >= rows) return;
  HeadOffsets h = head_offsets(p, group.z, head0);
  h.q += seq.q_row0 * p.q_row_stride;
  h.o += seq.q_row0 * p.o_row_stride;
  h.lse += seq.q_row0 * p.lse_row_stride;
  h.k += seq.k_row0 * p.k_row_stride;
  h.v += seq.k_row0 * p.v_row_stride;
  const int fr = prefill_frag_row(lane);
  const int fc = prefill_frag_col(lane);
  // The fragment view (Q, O, P.V): packed row q0 + fr, its query row and head.
  const int prow = q0 + fr;
  const int row = prow / G;
  const int hoff = prow - row * G;
  const bool row_real = prow < rows;
  // The shared step's view: packed row q0 + lane / 4, its key lane % 4 of this part's 4.
  const int b_row = int(lane) / 4;
  const int b_col = part * 4 + int(lane) % 4;
  const int b_prow = q0 + b_row;
  const int b_query = b_prow / G;
  const int b_hoff = b_prow - b_query * G;
  const int64_t mask_slice = fc_has_mask ? mask_head_offset(p, group.z, head0 + uint(b_hoff)) : 0;

  // Q: this part's 8 x DQK / WM slice, once, unscaled (scaled in float after
  // the product, as the template does).
  PrefillFrag Q[TQ];
  {
    device const T* qrow = q + h.q + int64_t(row) * p.q_row_stride + int64_t(hoff) * p.q_head_stride;
    FM_UNROLL for (int i = 0; i < TQ; ++i) splitd_frag_row(Q[i], qrow, row_real, p.q_dim_stride, qcol0 + i * 8, fc);
  }
  PrefillFrag O[TF];
  FM_UNROLL for (int i = 0; i < TF; ++i) O[i] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
  // Running state: m_frag is the fragment row's max (the O rescale), m_b the
  // shared step's row's (the weights): the same values per row in every lane
  // that holds the row. l: the settled row sum, l_run the current run's
  // (the template's two-level sum, kPrefillSumRun). With sinks, both maxima
  // start at their row's head's sink and l at 1 (seed_sink: the sink as a
  // first key).
  float m_frag = kMaskedScore;
  float l = 0.0f, l_run = 0.0f;
  float m_b = kMaskedScore, l_b = 0.0f;
  if (fc_has_sinks && split == 0) {  // split 0 only under fc_split_kv: the merge sums the splits' l
    seed_sink(m_frag, l, sinks, int(head0) + hoff);
    seed_sink(m_b, l_b, sinks, int(head0) + b_hoff);
  }

  // Key blocks: up to what the group's last real row sees (causal or a
  // right window), from the block holding the first row's first visible key
  // (a left window). Uniform: one row group.
  // Under fc_split_kv, cut to this split's blocks (split_keys is a whole
  // number of BK-key blocks: kSplitKeyQuantum == BK, csrc); a split past
  // them runs none and writes the "no key" partial (m = kMaskedScore, l = 0
  // and zeros, or the sink in split 0), which the merge weighs 0.
  const int last_row = (min(q0 + BQ, rows) - 1) / G;
  int n_blocks = (visible_key_end(seq, last_row) + BK - 1) / BK;
  int first_block = fc_window_left ? first_visible_key(seq, q0 / G) / BK : 0;
  if (fc_split_kv) {
    first_block = max(first_block, split * (p.split_keys / BK));
    n_blocks = min(n_blocks, (split + 1) * (p.split_keys / BK));
  }
  for (int kb = first_block; kb < n_blocks; ++kb) {
    const int k0 = kb * BK;
    PrefillFrag S[TK];
    FM_UNROLL for (int t = 0; t < TK; ++t) S[t] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
    FM_UNROLL for (int i = 0; i < TQ; ++i) {
      FM_UNROLL for (int t = 0; t < TK; ++t) {
        PrefillFrag kf;
        splitd_frag_t(kf, k + h.k, p.k_row_stride, p.k_dim_stride, k0 + t * 8, qcol0 + i * 8, seq.kv_len, fr, fc);
        prefill_mma(S[t], Q[i], kf);
      }
    }
    FM_UNROLL for (int t = 0; t < TK; ++t) {
      FM_UNROLL for (int j = 0; j < 2; ++j) scratch[part * SLOT + fr * BK + t * 8 + fc + j] = S[t].thread_elements()[j];
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);  // partials written before they are summed (RAW)

    // This lane's (row, key): its S summed in part order, to base 2, then
    // the options. Keys past the sequence or outside the window, and rows
    // past the sequence, are dropped first (the mask is never read for
    // them); every masked score becomes the finite sentinel.
    float s = 0.0f;
    FM_UNROLL for (int pp = 0; pp < PARTS; ++pp) s += scratch[pp * SLOT + b_row * BK + b_col];
    const int b_key = k0 + b_col;
    const bool keep = b_prow < rows && b_key < seq.kv_len && key_in_window(seq, b_query, b_key);
    s = option_score<T>(p, mask, mask_slice, b_query, b_key, s * p.scale_log2, keep);
    if (s <= kMaskedScore) s = kMaskedScore;
    float mx = max(s, simd_shuffle_xor(s, 1));  // lanes 4r..4r+3 hold row r's 4 keys of this part
    mx = max(mx, simd_shuffle_xor(mx, 2));
    if (int(lane) % 4 == 0) row_max[part * 8 + b_row] = mx;
    threadgroup_barrier(mem_flags::mem_threadgroup);  // row maxima written before they are read (RAW)

    float blk_b = m_b;
    FM_UNROLL for (int pp = 0; pp < PARTS; ++pp) blk_b = max(blk_b, row_max[pp * 8 + b_row]);
    const float w = s <= kMaskedScore ? 0.0f : exp2(s - blk_b);
    m_b = blk_b;
    weights[b_row * BK + b_col] = w;
    float ws = w + simd_shuffle_xor(w, 1);
    ws += simd_shuffle_xor(ws, 2);
    if (int(lane) % 4 == 0) row_sum[part * 8 + b_row] = ws;
    threadgroup_barrier(mem_flags::mem_threadgroup);  // P and row sums written before they are read (RAW)

    // The O update: the row's block max and sum from every part's (in part
    // order, so every part has the same l), P from the shared block.
    float blk = m_frag;
    FM_UNROLL for (int pp = 0; pp < PARTS; ++pp) blk = max(blk, row_max[pp * 8 + fr]);
    const float alpha = exp2(m_frag - blk);  // finite argument <= 0
    float block_sum = 0.0f;
    FM_UNROLL for (int pp = 0; pp < PARTS; ++pp) block_sum += row_sum[pp * 8 + fr];
    l *= alpha;
    l_run = l_run * alpha + block_sum;
    if (kb % kPrefillSumRun == kPrefillSumRun - 1) {
      l += l_run;
      l_run = 0.0f;
    }
    m_frag = blk;
    FM_UNROLL for (int t = 0; t < TK; ++t) prefill_read_frag(S[t], weights, BK, 0, t * 8, fr, fc);
    FM_UNROLL for (int i = 0; i < TF; ++i) {
      PrefillFrag pv = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
      FM_UNROLL for (int t = 0; t < TK; ++t) {
        PrefillFrag vf;
        splitd_frag(vf, v + h.v, p.v_row_stride, p.v_dim_stride, k0 + t * 8, col0 + i * 8, seq.kv_len, fr, fc);
        prefill_mma(pv, S[t], vf);
      }
      FM_UNROLL for (int j = 0; j < 2; ++j) {
        O[i].thread_elements()[j] = fma(O[i].thread_elements()[j], alpha, pv.thread_elements()[j]);
      }
    }
  }
  l += l_run;

  // fc_split_kv: this part's features of the unnormalized O and the row's
  // (m, l) into the partials, for the merge (decode_partial_index's layout;
  // varlen rows by their packed index in Nq = total_q rows of batch 0).
  if (fc_split_kv) {
    if (row_real) {
      const int64_t nrows = fc_varlen ? p.total_q : p.q_len;
      const int64_t qrow = fc_varlen ? int64_t(seq.q_row0) + row : int64_t(row);
      const int64_t bidx = fc_varlen ? 0 : int64_t(group.z);
      const int64_t idx = ((bidx * p.q_heads + int64_t(head0) + hoff) * nrows + qrow) * p.kv_splits + split;
      device float* po = partial_o + idx * p.head_dim_v;
      FM_UNROLL for (int i = 0; i < TF; ++i) {
        FM_UNROLL for (int j = 0; j < 2; ++j) po[col0 + i * 8 + fc + j] = O[i].thread_elements()[j];
      }
      if (fc == 0 && part == 0) {
        partial_stats[2 * idx] = m_frag;
        partial_stats[2 * idx + 1] = l;
      }
    }
    return;
  }

  // Store this part's features of O / l for real rows, and the row's lse
  // (m ln 2 + ln l in one fma, as the template) from one lane of part 0. A
  // row that saw no key (and no sink) stores zeros and -inf made from bits.
  if (row_real) {
    const bool has_key = l > 0.0f;
    const float inv = has_key ? 1.0f / l : 0.0f;
    device T* op = o + h.o + int64_t(row) * p.o_row_stride + int64_t(hoff) * p.o_head_stride;
    FM_UNROLL for (int i = 0; i < TF; ++i) {
      FM_UNROLL for (int j = 0; j < 2; ++j) {
        op[int64_t(col0 + i * 8 + fc + j) * p.o_dim_stride] = static_cast<T>(O[i].thread_elements()[j] * inv);
      }
    }
    if (fc == 0 && part == 0) {
      const uint bits = has_key ? as_type<uint>(fma(m_frag, M_LN2_F, log(l))) : kNegInfBits;
      lse[h.lse + int64_t(row) * p.lse_row_stride + int64_t(hoff) * p.lse_head_stride] = as_type<float>(bits);
    }
  }
}

}  // namespace flash_metal
