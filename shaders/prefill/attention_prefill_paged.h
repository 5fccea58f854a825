// The prefill kernel's paged K/V loader (fc_paged, issue 20 section 4):
// flash-attn's block-table layout, as the decode kernels read it
// (attention_decode_paged.h: PageStep, page_split, page_add). The kernel
// (attention_prefill.h, prefill_load_kv) loads a tile that lies inside one
// page through its ordinary loaders, from the page's base; this loader
// serves the tiles that may cross pages.
#pragma once

#include "../common/attention_decode_paged.h"

namespace flash_metal {

// The view of sequence `batch` under fc_paged: its own key count,
// cache_seqlens[batch], and its queries either the whole Nq rows
// (attention_kvcache) or, under fc_varlen (flash_attn_varlen_func with
// block_table), rows cu_seqlens_q[batch] .. cu_seqlens_q[batch + 1] - 1 of
// the packed q, o and lse. Causal and the window are bottom-right aligned
// to the sequence's own lengths, as in the varlen and paged views. Its keys
// have no packed row (k_row0 0): the table finds them.
inline SeqView prefill_paged_sequence_view(constant AttentionParams& p, device const int* cu_seqlens_q,
                                           device const int* cache_seqlens, uint batch) {
  SeqView s;
  s.k_row0 = 0;
  s.kv_len = cache_seqlens[batch];
  if (fc_varlen) {
    s.q_row0 = cu_seqlens_q[batch];
    s.q_len = cu_seqlens_q[batch + 1] - int(s.q_row0);
  } else {
    s.q_row0 = 0;
    s.q_len = p.q_len;
  }
  return with_window_bounds(s, p);
}

// fc_paged, tiles that may cross pages (page_size neither a multiple of BK
// nor the whole table row): the general loader's element order, each tile
// row r found through the table. Key k0 + r of the sequence is row
// cur.row of page table[cur.entry]; `at` is the tile's first key (entry,
// row), computed by the caller's stepping, and each thread walks its own
// rows forward from it one at a time (its rows only grow with `it`; at most
// ROWS steps per tile, an add and a compare each: no division, which Apple
// GPUs lack). The table is read only for a row about to be read (r <
// valid_rows, so never past the sequence's last page), and only when the
// row's page differs from the thread's previous one. `src` is the kv
// head's base in page 0; page_stride is k/v's batch stride. Never with
// fc_dense (the host turns it off: a 16-byte chunk's rows may lie on two
// pages). (vLLM's paged kernels look up a page per key the same way; this
// code is the project's own.)
template <int ROWS, int DMAX, int LD, int THREADS, bool EDGE, typename T>
FM_INLINE void prefill_load_tile_paged(threadgroup T* tile, device const T* src, device const int* table,
                                       PageStep at, int page_size, int64_t page_stride, int64_t row_stride,
                                       int64_t dim_stride, int D, int valid_rows, uint tid) {
  constexpr int kElems = ROWS * DMAX;
  static_assert(kElems % THREADS == 0, "every thread loads the same number of elements");
  PageStep cur = at;  // (entry, row) of tile row r_cur
  int r_cur = 0;
  int entry = -1;  // the table entry page_base belongs to (none yet)
  device const T* page_base = src;
  FM_UNROLL for (int it = 0; it < kElems / THREADS; ++it) {
    const int i = it * THREADS + int(tid);
    const int r = i / DMAX;
    const int c = i % DMAX;
    for (; r_cur < r; ++r_cur) {
      if (++cur.row == page_size) {
        cur.row = 0;
        ++cur.entry;
      }
    }
    T x = T(0.0f);
    if (c < D && (!EDGE || r < valid_rows)) {
      if (cur.entry != entry) {
        entry = cur.entry;
        page_base = src + int64_t(table[entry]) * page_stride;
      }
      x = page_base[int64_t(cur.row) * row_stride + int64_t(c) * dim_stride];
    }
    tile[r * LD + c] = x;
  }
}

}  // namespace flash_metal
