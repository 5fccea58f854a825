// The FlashAttention-2 forward ("prefill") kernel on simdgroup_matrix: the
// default for Nq > 8. One threadgroup owns BQ query rows of one (batch, head),
// or under fc_pack_gqa BQ packed rows of one (batch, kv head)'s GQA group;
// each of its WM SIMD-groups owns 8 of them. K and V stream through
// threadgroup memory BK keys at a time; S = Q.K^T and P.V run as 8x8
// simdgroup_matrix<float> products, and the online softmax works on whole
// blocks of BK keys, so the output accumulator is rescaled once per block
// (O = alpha * O + P.V).
//
// The design follows MLX's steel attention (ml-explore/mlx,
// mlx/backend/metal/kernels/steel/attn/kernels/steel_attention.h, mma.h,
// loader.h): 4 SIMD-groups of 8 rows, Q in threadgroup memory, one K/V tile
// shared by K and V in turn, rows padded by 16 bytes, tiles kept in the input
// dtype and converted to float fragment by fragment, P and O in registers,
// row max/sum by simd_shuffle_xor over the fragment lane layout, function
// constants for the ragged edges, and causal block skipping. The code here is
// written for this project (its own loader, masking and store); see the
// comments for where it differs.
//
// Threadgroup memory (bytes), sized by the host (csrc/metal/plan_detail.h):
//
//   tg_bytes(BQ, BK, DMAX, sizeof(T)) = (BQ + BK) * (DMAX * sizeof(T) + 16)
//
// the Q tile (BQ rows) then the K/V tile (BK rows), each row DMAX elements of
// T plus 16 bytes of padding. It is a multiple of 16 (every DMAX is a multiple
// of 8) and at most 25,600 bytes for the instantiations of
// attention.metal (float32, DMAX 96, BQ = BK = 32).
#pragma once

#include "../common/attention_features.h"
#include "attention_prefill_paged.h"

namespace flash_metal {

// [[function_constant(1)]]: Nq % BQ == 0, so no query block is ragged and the
// kernel carries no query-edge code (MLX's align_Q).
constant bool fc_align_q [[function_constant(1)]];
// [[function_constant(2)]]: Nk % BK == 0, so no key block is ragged and the
// kernel carries no key-edge code (MLX's align_K).
constant bool fc_align_k [[function_constant(2)]];
// [[function_constant(10)]]: the dense loader (prefill_load_tile_dense).
// The host (csrc/metal/launch.cpp, dense_loads) sets it when every tensor
// this kernel loads through prefill_load_tile has unit feature stride, D ==
// DV == DMAX (no padding columns in any tile: off when v has its own head
// dim, issue 20 section 2), and every row start 16-byte aligned (storage
// offset, batch, head and row strides all multiples of 16 bytes), with a
// tile's byte offsets within int32. False: the general per-element loader.
constant bool fc_dense [[function_constant(10)]];

// Padding at the end of every tile row, in bytes. Why 16: many bucket rows
// (DMAX 32, 64, 128, 256 in float; 64, 128, 256 in half) are a multiple of
// 128 bytes, one cycle of 32 four-byte banks (the usual GPU arrangement;
// Apple does not document its own), so without padding the 8 rows a fragment
// reads would start on the same bank and their reads would serialize; 16
// bytes shift each row by 4 banks (MLX's padding, PR #1899). 16 also keeps
// every row 16-byte aligned and tg_bytes a multiple of 16.
constant constexpr int kPrefillRowPadBytes = 16;

// Lane layout of an 8x8 simdgroup_matrix, as MLX's BaseMMAFrag::get_coord
// gives it: lane l holds the two adjacent elements (row, col) and
// (row, col + 1) of thread_elements(), with qid = l / 4,
// row = (qid & 4) + (l / 2) % 4, col = (qid & 2) * 2 + (l % 2) * 2.
// Apple does not document it; MLX and metal-flash-attention ("morton order")
// rely on it, and tests/metal/test_metal_prefill.py pins these two functions to it.
// The 4 lanes of one row are l, l ^ 1, l ^ 8, l ^ 9: a row reduction is a
// lane-local combine of the 2 elements, then simd_shuffle_xor by 1 and by 8.
inline int prefill_frag_row(uint lane) {
  const uint qid = lane / 4;
  return int((qid & 4) + (lane / 2) % 4);
}
inline int prefill_frag_col(uint lane) {
  const uint qid = lane / 4;
  return int((qid & 2) * 2 + (lane % 2) * 2);
}

typedef simdgroup_matrix<float, 8, 8> PrefillFrag;

// Key blocks per run of the two-level row sum (see l_run in the kernel). Why
// 16: at Nk = 8192 and BK = 32 (256 blocks) it balances the two chains, 16
// runs of 16, the split with the smallest longest chain; other sizes need no
// tuning, since any split shortens the single chain.
constant constexpr int kPrefillSumRun = 16;

// Bytes per load of the dense loader. Why 16: the widest load a Metal
// thread issues in one instruction (a uint4), 8 halves or 4 floats, the
// width MLX's steel loader reaches too; every bucket row (DMAX * sizeof(T),
// DMAX a multiple of 8) and every tile row (plus 16 bytes of padding, or 0)
// is a whole number of them.
constant constexpr int kDenseLoadBytes = 16;

// The dense loader (fc_dense): the same tile as prefill_load_tile's general
// path, copied as raw 16-byte chunks. Chunk i of the ROWS x DMAX block (row
// i / CPR, chunk i % CPR of it) goes to thread i % THREADS, so consecutive
// threads read consecutive 16 bytes of a row (coalesced) and each thread
// holds runs of kDenseLoadBytes contiguous features. The thread's row and
// chunk are divided out once per tile (constant divisor); then its 32-bit
// source and tile offsets, in chunks, are stepped by constants (THREADS / CPR
// rows and THREADS % CPR chunks, with one wrap test when CPR does not divide
// THREADS): no 64-bit multiply or division per chunk. (MLX's BlockLoader
// likewise gives each thread contiguous vector reads at unit stride; this
// loader is written for this project.) `src` points at the tile's first row.
// The host guarantees src and row_stride are whole chunks and that
// ROWS * row_stride bytes fit int32 (see fc_dense). EDGE: rows >=
// valid_rows are zero-filled and not read, as in the general path.
template <int ROWS, int DMAX, int LD, int THREADS, bool EDGE, typename T>
FM_INLINE void prefill_load_tile_dense(threadgroup T* tile, device const T* src, int row_stride, int valid_rows,
                                       uint tid) {
  constexpr int VEC = kDenseLoadBytes / int(sizeof(T));  // elements per chunk
  static_assert(DMAX % VEC == 0 && LD % VEC == 0, "rows are whole 16-byte chunks");
  constexpr int CPR = DMAX / VEC;  // chunks per row
  constexpr int TLD = LD / VEC;    // tile row length, in chunks (padding included)
  constexpr int CHUNKS = ROWS * CPR;
  constexpr int ITERS = (CHUNKS + THREADS - 1) / THREADS;
  constexpr int DR = THREADS / CPR;  // rows a thread steps per iteration
  constexpr int DC = THREADS % CPR;  // and chunks
  device const uint4* s = reinterpret_cast<device const uint4*>(src);
  threadgroup uint4* t = reinterpret_cast<threadgroup uint4*>(tile);
  const int rs = row_stride / VEC;  // exact: the host checked row_stride % VEC == 0
  int r = int(tid) / CPR;
  int c = int(tid) % CPR;
  int s_off = r * rs + c;
  int t_off = r * TLD + c;
  FM_UNROLL for (int it = 0; it < ITERS; ++it) {
    // Only the last iteration can run past the block (then r >= ROWS);
    // compiled out when THREADS divides CHUNKS.
    if (CHUNKS % THREADS == 0 || it + 1 < ITERS || r < ROWS) {
      uint4 x = uint4(0u);
      if (!EDGE || r < valid_rows) x = s[s_off];
      t[t_off] = x;
    }
    r += DR;
    c += DC;
    s_off += DR * rs + DC;
    t_off += DR * TLD + DC;
    if (DC != 0 && c >= CPR) {
      c -= CPR;
      r += 1;
      s_off += rs - CPR;
      t_off += TLD - CPR;
    }
  }
}

// Copies rows [first, first + ROWS) of one head's (N, D) matrix `src` into a
// tile of ROWS rows of LD elements of T. Under fc_dense, as 16-byte chunks
// (prefill_load_tile_dense). Otherwise as plain cooperative per-element
// loads: thread `tid` of THREADS takes elements tid, tid + THREADS, ... of the
// ROWS x DMAX block, so consecutive threads read consecutive features of a
// row (coalesced when the feature stride is 1). Any element stride works.
// Columns [D, DMAX) are written as zeros (the products below run over whole
// 8-wide fragments, and threadgroup memory starts as garbage); nothing past
// feature D is ever read. EDGE: rows >= valid_rows are past the end of the
// sequence: zero-filled, not read (MLX's load_safe). Without EDGE the row test
// is compiled out (the aligned case). The trip count ROWS * DMAX / THREADS is
// a compile-time constant, so the loop unrolls and i / DMAX is a multiply.
// The padding columns [DMAX, LD) are never written or read.
template <int ROWS, int DMAX, int LD, int THREADS, bool EDGE, typename T>
FM_INLINE void prefill_load_tile(threadgroup T* tile, device const T* src, int64_t row_stride, int64_t dim_stride,
                                 int first, int D, int valid_rows, uint tid) {
  if (fc_dense) {
    prefill_load_tile_dense<ROWS, DMAX, LD, THREADS, EDGE>(tile, src + int64_t(first) * row_stride, int(row_stride),
                                                           valid_rows, tid);
    return;
  }
  constexpr int kElems = ROWS * DMAX;
  static_assert(kElems % THREADS == 0, "every thread loads the same number of elements");
  FM_UNROLL for (int it = 0; it < kElems / THREADS; ++it) {
    const int i = it * THREADS + int(tid);
    const int r = i / DMAX;
    const int c = i % DMAX;
    T x = T(0.0f);
    if (c < D && (!EDGE || r < valid_rows)) x = src[int64_t(first + r) * row_stride + int64_t(c) * dim_stride];
    tile[r * LD + c] = x;
  }
}

}  // namespace flash_metal

// fc_pack_gqa (13) and the packed Q tile's loader, prefill_load_q_packed:
// after fc_dense and kDenseLoadBytes, which the loader uses.
#include "attention_prefill_pack.h"

namespace flash_metal {

// Fragment (row0.., col0..) of a row-major tile, converted to float: the
// lane's two elements are adjacent in the row. (Metal's simdgroup_load cannot
// convert T to float; MLX reads thread_elements() the same way.)
template <typename T>
FM_INLINE void prefill_read_frag(thread PrefillFrag& f, threadgroup const T* tile, int ld, int row0, int col0, int fr,
                                 int fc) {
  threadgroup const T* s = tile + (row0 + fr) * ld + col0 + fc;
  f.thread_elements()[0] = float(s[0]);
  f.thread_elements()[1] = float(s[1]);
}

// The transpose of fragment (col0.., row0..) of a row-major tile: element
// (r, c) of the result is tile[col0 + c][row0 + r]. K stays row-major in its
// tile (one loader and one layout for K and V; MLX stores K transposed
// instead): the lane's two elements come from adjacent rows. With 16-byte row
// padding the 8 rows of a fragment fall on different banks.
template <typename T>
FM_INLINE void prefill_read_frag_t(thread PrefillFrag& f, threadgroup const T* tile, int ld, int row0, int col0, int fr,
                                   int fc) {
  threadgroup const T* s = tile + (col0 + fc) * ld + row0 + fr;
  f.thread_elements()[0] = float(s[0]);
  f.thread_elements()[1] = float(s[ld]);
}

// d += a * b on fragments, through local copies. d is usually an element of
// a fragment array (S[t]) and a one too (P = S[t]); passing an array element
// by reference to a call that is not inlined pins the whole array in memory
// (it happens in the emulator, whose simdgroup_multiply_accumulate is a real
// function, and would hide from private_arrays() whether the kernel's arrays
// can live in registers). On a GPU the MMA is an intrinsic and the copies
// vanish.
FM_INLINE void prefill_mma(thread PrefillFrag& d, PrefillFrag a, PrefillFrag b) {
  PrefillFrag c = d;
  simdgroup_multiply_accumulate(c, a, b, c);
  d = c;
}

// One K or V tile of BK keys from k0 (valid: the sequence's keys from k0;
// k_edge: the ragged last block). Not paged: rows k0.. of the head at
// `base`. Under fc_paged, `base` is the kv head in page 0: with page_tiles
// (every tile inside one page: page_size a multiple of BK, or one page per
// sequence) rows at.row.. of page `page` (the caller's one table read per
// block), through the same loaders (fc_dense included); otherwise row by
// row through the table (prefill_load_tile_paged).
template <int BK, int DMAX, int LD, int THREADS, typename T>
FM_INLINE void prefill_load_kv(threadgroup T* tile, device const T* base, int64_t page_stride, int64_t row_stride,
                               int64_t dim_stride, int k0, int D, int valid, bool k_edge, device const int* table,
                               PageStep at, bool page_tiles, int page, int page_size, uint tid) {
  if (fc_paged && !page_tiles) {
    if (k_edge) {
      prefill_load_tile_paged<BK, DMAX, LD, THREADS, true>(tile, base, table, at, page_size, page_stride, row_stride,
                                                           dim_stride, D, valid, tid);
    } else {
      prefill_load_tile_paged<BK, DMAX, LD, THREADS, false>(tile, base, table, at, page_size, page_stride,
                                                            row_stride, dim_stride, D, BK, tid);
    }
    return;
  }
  device const T* src = fc_paged ? base + int64_t(page) * page_stride : base;
  const int first = fc_paged ? at.row : k0;
  if (k_edge) {
    prefill_load_tile<BK, DMAX, LD, THREADS, true>(tile, src, row_stride, dim_stride, first, D, valid, tid);
  } else {
    prefill_load_tile<BK, DMAX, LD, THREADS, false>(tile, src, row_stride, dim_stride, first, D, BK, tid);
  }
}

// T: element type of q, k, v and the output (float, half or bfloat).
// DMAX: head_dim bucket (head_dim <= DMAX, zero padded). BQ: query rows per
// threadgroup, 8 per SIMD-group. BK: keys per block. WM: SIMD-groups.
// Launch: grid (ceil(Nq / BQ), Hq, B), or under fc_pack_gqa (13: packed
// GQA rows, above) (ceil(Nq * G / BQ), Hkv, B), threadgroup (32 * WM, 1, 1),
// threadgroup memory tg_bytes (top of this file) at index 0, function
// constants fc_causal (0), fc_align_q (1), fc_align_k (2), the options'
// 4-9 (attention_features.h), fc_dense (10: the loader's path) and
// fc_has_sinks (11: sinks at [[buffer(17)]], seed_sink) and fc_paged (12: a
// paged KV cache, block_table at [[buffer(19)]] and cache_seqlens at
// [[buffer(20)]], attention_decode_paged.h; the same meaning as the decode
// kernels': key j of sequence b is row j % page_size of page
// block_table[b][j / page_size], k/v's batch stride is the page stride, the
// sequence's key count is cache_seqlens[b] with causal and window aligned to
// it; with fc_varlen its queries are packed at cu_seqlens_q[b], and
// cu_seqlens_k is not read; fc_align_k then false). Varlen:
// Nq is max_seqlen_q and B the number of sequences; the align constants are
// then false.
//
// Barriers per key block: 4, as in MLX (K written -> read, K read -> V
// written, V written -> read, V read -> next K written), because K and V
// share one tile. Separate K and V tiles would need 2, but cost BK more rows
// of threadgroup memory: float32 DMAX 96 would need 38,400 bytes, over the
// 32 KiB limit, and every other instantiation would run fewer threadgroups per
// core.
template <typename T, int DMAX, int BQ, int BK, int WM>
[[kernel]] [[max_total_threads_per_threadgroup(kPrefillMaxThreads)]] void flash_attention_prefill(
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
    threadgroup T* smem [[threadgroup(0)]],
    uint3 group [[threadgroup_position_in_grid]],
    uint tid [[thread_index_in_threadgroup]],
    uint sg [[simdgroup_index_in_threadgroup]],
    uint lane [[thread_index_in_simdgroup]]) {
  // Feature parts (issue 19): WM = BQ / 8 row groups x PARTS SIMD-groups.
  // The PARTS SIMD-groups of a row group share its 8 query rows and the
  // tiles; each computes S over its own 1 / PARTS of the features, the
  // parts sum those partials through a threadgroup scratch after the tiles
  // (split-K: no product repeated; PARTS > 1 only, WM * BK / 8 fragments of
  // 256 bytes, written before the K tile's WAR barrier and read after it,
  // so no barrier of its own), then each runs the rows' softmax on the
  // whole S (the same values in the same order, so the same row max and
  // sum) and keeps O for 1 / PARTS of the features, so O fits the register
  // budget at D = 256 (and float32 D = 128) while the threadgroup runs more
  // SIMD-groups on the same threadgroup memory.
  static_assert((8 * WM) % BQ == 0, "each SIMD-group owns 8 query rows and one feature part of their O");
  constexpr int PARTS = 8 * WM / BQ;
  static_assert(BK % 8 == 0 && DMAX % (8 * PARTS) == 0, "tiles and parts are whole 8x8 fragments");
  constexpr int THREADS = 32 * WM;
  static_assert(THREADS <= kPrefillMaxThreads, "the declared threadgroup limit (params.h)");
  constexpr int LD = DMAX + kPrefillRowPadBytes / int(sizeof(T));  // tile row length, in elements
  constexpr int TK = BK / 8;    // key fragments per block: S and P are 8 x BK per SIMD-group
  constexpr int TD = DMAX / 8;  // feature fragments of a row
  constexpr int TDP = TD / PARTS;  // feature fragments of O this SIMD-group keeps
  constexpr int ROWG = BQ / 8;     // SIMD-group sg: row group sg % ROWG, part sg / ROWG
  const int rg = int(sg) % ROWG;
  const int part = int(sg) / ROWG;
  const int col0 = part * (DMAX / PARTS);  // first feature of this part
  threadgroup T* q_tile = smem;
  threadgroup T* kv_tile = smem + BQ * LD;
  threadgroup float* partials = reinterpret_cast<threadgroup float*>(kv_tile + BK * LD);  // PARTS > 1
  constexpr int SLOT = TK * 64;  // floats of one SIMD-group's partial S

  // D: q's and k's features (the Q.K^T product); DV: v's and o's (the P.V
  // product and the stores), which MLA-style calls give a width of its own
  // (issue 20 section 2). DMAX is the wider's bucket; each tile zero-fills
  // the columns past its own tensor's width, so either may be the narrower.
  const int D = p.head_dim;
  const int DV = p.head_dim_v;
  // The threadgroup's sequence: the whole (Nq, Nk) problem, or under
  // fc_varlen sequence group.z of the packed batch, whose rows start at
  // q_row0 / k_row0 (the planner zeroes the batch strides then).
  // Under fc_paged, sequence group.z of the cache: its own key count (and
  // with fc_varlen its packed queries, prefill_paged_sequence_view).
  const SeqView seq = fc_paged ? prefill_paged_sequence_view(p, cu_seqlens_q, cache_seqlens, group.z)
                               : sequence_view(p, cu_seqlens_q, cu_seqlens_k, group.z);
  // Rows: under fc_pack_gqa the threadgroup's rows are packed rows of its
  // kv head's group (G per query row, fc_pack_gqa above); without it G = 1
  // and a packed row is a query row of query head group.y. `rows`: the
  // sequence's packed rows. The row-axis tests below (edges, the varlen
  // exit, stores) run on packed rows; the key bounds on query rows (m / G).
  const int G = fc_pack_gqa ? p.gqa_ratio : 1;
  const int rows = seq.q_len * G;
  const uint head0 = fc_pack_gqa ? group.y * uint(G) : group.y;  // the threadgroup's first query head
  const int q0 = int(group.x) * BQ;       // first packed row of the threadgroup
  // Varlen: the grid covers max_seqlen_q (times G); a block past this
  // sequence's end has nothing to do. Uniform across the threadgroup and
  // before any barrier, so every thread leaves together.
  if (fc_varlen && q0 >= rows) return;
  HeadOffsets h = head_offsets(p, group.z, head0);
  h.q += seq.q_row0 * p.q_row_stride;
  h.o += seq.q_row0 * p.o_row_stride;
  h.lse += seq.q_row0 * p.lse_row_stride;
  h.k += seq.k_row0 * p.k_row_stride;
  h.v += seq.k_row0 * p.v_row_stride;
  // fc_paged: k/v's batch stride is the page stride, so K and V start at the
  // kv head in page 0; pages are found through the sequence's table row.
  device const int* table = block_table + (fc_paged ? int64_t(group.z) * p.table_stride : 0);
  if (fc_paged) {
    const uint kv_head = head0 / uint(p.gqa_ratio);
    h.k = int64_t(kv_head) * p.k_head_stride;
    h.v = int64_t(kv_head) * p.v_head_stride;
  }
  // Tiles inside one page: page_size a multiple of BK (pages start at
  // multiples of BK, as tiles do), or one page per sequence (a plain cache's
  // identity table: kv_len, the table's capacity, is one page). Uniform.
  const bool page_tiles = fc_paged && (p.page_size % BK == 0 || p.kv_len <= p.page_size);
  const int sg_row0 = q0 + rg * 8;        // first packed row of this SIMD-group
  const int fr = prefill_frag_row(lane);  // this lane's row within the SIMD-group's 8
  const int fc = prefill_frag_col(lane);  // this lane's first column within a fragment
  const int prow = sg_row0 + fr;          // this lane's packed row
  const int row = prow / G;               // its query row (the causal and window bounds, the mask)
  const int hoff = prow - row * G;        // its head within the group (0 unpacked)
  // The SIMD-group's first and last query rows (its 8 packed rows span
  // these; equal to sg_row0 and sg_row0 + 7 unpacked), for block bounds.
  const int sg_qfirst = sg_row0 / G;
  const int sg_qlast = (sg_row0 + 7) / G;
  // The attn_mask slice of (batch, this lane's query head); read only under fc_has_mask.
  const int64_t mask_slice = fc_has_mask ? mask_head_offset(p, group.z, head0 + uint(hoff)) : 0;

  // Q once, unscaled, in T. No barrier of its own: the first key block's
  // barrier orders these writes before any read.
  if (fc_pack_gqa) {
    prefill_load_q_packed<BQ, DMAX, LD, THREADS>(q_tile, q + h.q, p.q_row_stride, p.q_head_stride, p.q_dim_stride,
                                                 q0, G, D, min(BQ, rows - q0), tid);
  } else if (!fc_align_q && q0 + BQ > seq.q_len) {
    prefill_load_tile<BQ, DMAX, LD, THREADS, true>(q_tile, q + h.q, p.q_row_stride, p.q_dim_stride, q0, D,
                                                   seq.q_len - q0, tid);
  } else {
    prefill_load_tile<BQ, DMAX, LD, THREADS, false>(q_tile, q + h.q, p.q_row_stride, p.q_dim_stride, q0, D, BQ, tid);
  }

  // Key blocks: all of them, or under causal masking (or a right window) as
  // far as the group's last real row can see (later blocks are entirely in
  // the future for every row, so they are never loaded; MLX's kb_lim), and
  // under a left window from the block holding the first row's first
  // visible key (earlier blocks are entirely behind the window of every
  // row: the bound only grows with the row). The same bounds for every
  // thread, so all meet at the same barriers. A group whose rows see no key
  // at all (Nk < Nq, or an empty sequence) runs no block and stores zeros
  // and -inf.
  const int last_row = ((fc_align_q ? q0 + BQ : min(q0 + BQ, rows)) - 1) / G;  // query row of the last packed row
  const int n_blocks = (visible_key_end(seq, last_row) + BK - 1) / BK;
  const int first_block = fc_window_left ? first_visible_key(seq, q0 / G) / BK : 0;
  // Q.K^T runs over the 8-wide feature fragments that hold real features;
  // those past ceil(D / 8) are all zero padding. The loop runs to the
  // compile-time TD with this uniform guard (as the P.V loop does), so it
  // unrolls and the fragment reads can be scheduled ahead of the MMAs.
  const int d_frags = (D + 7) / 8;

  PrefillFrag O[TDP];
  FM_UNROLL for (int id = 0; id < TDP; ++id) O[id] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
  OnlineSoftmax sm;  // this lane's row: running max (base 2) and sum, "no key yet"
  if (fc_has_sinks) seed_sink(sm.m, sm.l, sinks, int(head0) + hoff);  // or the row's head's sink, as a first key
  // The row sum l in two parts: sm.l holds the runs of kPrefillSumRun blocks
  // already settled, l_run the current run's sum (both rescaled by each
  // block's alpha, exactly 1 unless the max grew). Each key block's sum
  // enters a chain of at most kPrefillSumRun additions, and each run one of
  // Nk / (BK * kPrefillSumRun), instead of all blocks entering one chain of
  // Nk / BK: a plain two-level sum, which no fast-math reassociation can
  // undo (unlike a compensated one). It is margin, not a necessity: at
  // Nk = 8192 in float32 (12 seeded cases in the emulator) the worst error
  // falls from 0.89 to 0.68 of the strict 2x rule's tolerance.
  float l_run = 0.0f;
  // fc_paged: (entry, row) of each block's first key, stepped by BK keys per
  // block (one division each, here, before the loop; none inside it).
  const PageStep page_step = fc_paged ? page_split(BK, p.page_size) : PageStep{0, 0};
  PageStep at = fc_paged ? page_split(first_block * BK, p.page_size) : PageStep{0, 0};

  for (int kb = first_block; kb < n_blocks; ++kb) {
    const int k0 = kb * BK;
    const bool k_edge = !fc_align_k && k0 + BK > seq.kv_len;  // the ragged last block
    // The SIMD-group has work in this block: false when all its 8 rows are
    // past Nq (the ragged last query block; compiled out when aligned), or
    // under causal masking when the block is in the future of all of them
    // (its later blocks are too), or under a left window when it is behind
    // the window of all of them. Uniform across the SIMD-group, so its
    // collectives below stay convergent; the group still loads and meets
    // every barrier.
    const bool active = (fc_align_q || sg_row0 < rows) && (!fc_causal || k0 <= sg_qlast + seq.upper) &&
                        (!fc_window_left || k0 + BK - 1 >= sg_qfirst + seq.lower);
    // The block straddles the diagonal for this SIMD-group: some key is in
    // the future of some row. Only then are element masks applied.
    const bool diagonal = fc_causal && k0 + BK - 1 > sg_qfirst + seq.upper;
    // Likewise the left window's edge: some key is behind some row's window.
    const bool left_edge = fc_window_left && k0 < sg_qlast + seq.lower;

    // page_tiles: the block's page, one table read for K and V (every block
    // run holds a key below kv_len, so its entry is in use).
    const int page = page_tiles ? table[at.entry] : 0;
    threadgroup_barrier(mem_flags::mem_threadgroup);  // last block's V reads done before K overwrites it (WAR)
    prefill_load_kv<BK, DMAX, LD, THREADS>(kv_tile, k + h.k, p.k_batch_stride, p.k_row_stride, p.k_dim_stride, k0, D,
                                           seq.kv_len - k0, k_edge, table, at, page_tiles, page, p.page_size, tid);
    threadgroup_barrier(mem_flags::mem_threadgroup);  // K written before anyone reads it (RAW)

    // S = Q.K^T (8 x BK), float32 products of the T inputs converted
    // exactly to float.
    PrefillFrag S[TK];
    if (active) {
      FM_UNROLL for (int t = 0; t < TK; ++t) S[t] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
      FM_UNROLL for (int i = 0; i < TDP; ++i) {
        const int dd = part * TDP + i;  // this part's features only (all of them without parts)
        if (dd < d_frags) {  // uniform: D is the same for every lane
          PrefillFrag qf;
          prefill_read_frag(qf, q_tile, LD, rg * 8, dd * 8, fr, fc);
          FM_UNROLL for (int t = 0; t < TK; ++t) {
            PrefillFrag kf;
            prefill_read_frag_t(kf, kv_tile, LD, dd * 8, t * 8, fr, fc);
            prefill_mma(S[t], qf, kf);
          }
        }
      }
      if (PARTS > 1) {  // this part's partial S, for the other parts of the row group
        FM_UNROLL for (int t = 0; t < TK; ++t) {
          FM_UNROLL for (int j = 0; j < 2; ++j) partials[int(sg) * SLOT + t * 64 + int(lane) * 2 + j] =
              S[t].thread_elements()[j];
        }
      }
    }

    threadgroup_barrier(mem_flags::mem_threadgroup);  // all K reads done before V overwrites the tile (WAR)
    prefill_load_kv<BK, DMAX, LD, THREADS>(kv_tile, v + h.v, p.v_batch_stride, p.v_row_stride, p.v_dim_stride, k0,
                                           DV, seq.kv_len - k0, k_edge, table, at, page_tiles, page, p.page_size, tid);

    if (active) {
      // The parts' partials, summed in part order (the barrier above made
      // them visible; the next block writes them only after its own two
      // barriers, which follow these reads: no WAR race).
      if (PARTS > 1) {
        FM_UNROLL for (int t = 0; t < TK; ++t) {
          FM_UNROLL for (int j = 0; j < 2; ++j) {
            float sum = 0.0f;
            FM_UNROLL for (int q = 0; q < PARTS; ++q) {
              sum += partials[(rg + q * ROWG) * SLOT + t * 64 + int(lane) * 2 + j];
            }
            S[t].thread_elements()[j] = sum;
          }
        }
      }
      // Scores to base 2, in float32 after the product (MLX PR #3119 moved
      // its scaling there from Q in the input dtype, for precision), then
      // the options (softcap, then the mask: option_score). Keys past the
      // sequence or outside the window are dropped first, so the mask is
      // never read for them (nor for rows past the sequence). Masked keys
      // get the finite sentinel (see kMaskedScore); so does a score that is
      // -inf from the inputs or from an additive mask, by a comparison the
      // compiler cannot fold under fast math.
      FM_UNROLL for (int t = 0; t < TK; ++t) {
        FM_UNROLL for (int j = 0; j < 2; ++j) {
          const int key = k0 + t * 8 + fc + j;
          bool keep = true;
          if (k_edge && key >= seq.kv_len) keep = false;
          if (diagonal && key > row + seq.upper) keep = false;
          if (left_edge && key < row + seq.lower) keep = false;
          if (fc_has_mask && !fc_align_q && prow >= rows) keep = false;
          float sc = option_score<T>(p, mask, mask_slice, row, key, S[t].thread_elements()[j] * p.scale_log2, keep);
          if (sc <= kMaskedScore) sc = kMaskedScore;
          S[t].thread_elements()[j] = sc;
        }
      }
    }

    // Online softmax over the whole block (FlashAttention-2): the row's new
    // max, then P = exp2(S - max) in place of S, the row sum, and one
    // rescale of l and O by alpha = exp2(old max - new max) per block, not
    // per key. Everything stays finite (attention_common.h, "Fast math"): a
    // masked score gets weight 0 by an explicit test, and a row that saw
    // only masked keys keeps m = kMaskedScore and l = 0.
    float alpha = 1.0f;  // this block's rescale factor for l and O
    if (active) {
      float block_max = sm.m;
      FM_UNROLL for (int t = 0; t < TK; ++t) {
        block_max = max(block_max, max(S[t].thread_elements()[0], S[t].thread_elements()[1]));
      }
      block_max = max(block_max, simd_shuffle_xor(block_max, 1));
      block_max = max(block_max, simd_shuffle_xor(block_max, 8));
      alpha = exp2(sm.m - block_max);  // finite argument <= 0
      float block_sum = 0.0f;
      FM_UNROLL for (int t = 0; t < TK; ++t) {
        FM_UNROLL for (int j = 0; j < 2; ++j) {
          const float s = S[t].thread_elements()[j];
          const float w = s <= kMaskedScore ? 0.0f : exp2(s - block_max);
          S[t].thread_elements()[j] = w;
          block_sum += w;
        }
      }
      block_sum += simd_shuffle_xor(block_sum, 1);
      block_sum += simd_shuffle_xor(block_sum, 8);
      sm.l *= alpha;
      l_run = l_run * alpha + block_sum;
      if (kb % kPrefillSumRun == kPrefillSumRun - 1) {
        sm.l += l_run;
        l_run = 0.0f;
      }
      sm.m = block_max;
    }

    threadgroup_barrier(mem_flags::mem_threadgroup);  // V written before anyone reads it (RAW)

    // O = alpha * O + P.V: the block's product is accumulated from zero and
    // added to the rescaled O once, so O takes one rounding per block rather
    // than one per key (a blocked sum: its rounding error grows with
    // BK + Nk / BK terms, not Nk). MLX accumulates into O directly; at
    // Nk = 8192 in float32 that lands at 3.4-5.4x PyTorch's error in the
    // emulator, this at 0.8-1.3x, within the strict 2x rule
    // (tests/metal/test_metal_prefill.py). The cost is one fma per element of O
    // per block. (On a GPU the MMA's internal rounding is not documented;
    // the emulator rounds after every product, see its README.) Feature fragments that are all padding (past
    // v's DV features) are skipped (uniform: DV is the same for every lane); O's index id stays a compile-time
    // constant, so O lives in registers.
    if (active) {
      FM_UNROLL for (int id = 0; id < TDP; ++id) {
        if (col0 + id * 8 < DV) {
          PrefillFrag pv = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
          FM_UNROLL for (int t = 0; t < TK; ++t) {
            PrefillFrag vf;
            prefill_read_frag(vf, kv_tile, LD, t * 8, col0 + id * 8, fr, fc);
            prefill_mma(pv, S[t], vf);
          }
          FM_UNROLL for (int j = 0; j < 2; ++j) {
            O[id].thread_elements()[j] = fma(O[id].thread_elements()[j], alpha, pv.thread_elements()[j]);
          }
        }
      }
    }
    if (fc_paged) at = page_add(at, page_step, p.page_size);
  }

  sm.l += l_run;

  // Store O / l for real rows (and only the DV real features of v and o), and the row's
  // lse from one lane of the 4 that share it. A row that saw no key stores
  // zeros and -inf made from bits, exactly as store_output_row does.
  if (fc_align_q || prow < rows) {
    const float inv = sm.inv_sum();
    device T* op = o + h.o + int64_t(row) * p.o_row_stride + int64_t(hoff) * p.o_head_stride;
    FM_UNROLL for (int id = 0; id < TDP; ++id) {
      FM_UNROLL for (int j = 0; j < 2; ++j) {
        const int c = col0 + id * 8 + fc + j;
        if (c < DV) op[int64_t(c) * p.o_dim_stride] = static_cast<T>(O[id].thread_elements()[j] * inv);
      }
    }
    if (fc == 0 && part == 0) {
      // lse = m ln 2 + ln l, with one rounding for the product and the sum
      // (fma) instead of OnlineSoftmax::lse()'s three ((m + log2 l), then
      // * ln 2): at Nk = 8192 in float32 it halves the lse error, well
      // inside the strict 2x rule. Same value otherwise.
      const uint bits = sm.has_key() ? as_type<uint>(fma(sm.m, M_LN2_F, log(sm.l))) : kNegInfBits;
      lse[h.lse + int64_t(row) * p.lse_row_stride + int64_t(hoff) * p.lse_head_stride] = as_type<float>(bits);
    }
  }
}

}  // namespace flash_metal
