// The decode kernels' paged KV cache (fc_paged, function constant 12;
// issue 20): flash-attn's block-table layout, as vLLM's paged attention and
// flash-attn 2.6's kvcache kernels read it. The code is this project's own.
//
// The cache is (num_blocks, page_size, Hkv, D); the host binds it as k/v
// with k_batch_stride = the page stride and k_row_stride = the row stride
// inside a page (likewise v), so key r of sequence b is row r % page_size of
// page block_table[b * table_stride + r / page_size], and each sequence has
// its own key count cache_seqlens[b] (its causal edge and window bottom-right
// aligned to it, as flash-attn). Keys r >= cache_seqlens[b] are never read,
// nor the table entries past ceil(cache_seqlens[b] / page_size) (they may
// hold anything: flash-attn leaves them unchecked in its kernels too).
//
// Addressing without a runtime division in the block loop (Apple GPUs have
// no integer divider; tests/metal/test_metal_decode_source.py): a PageCursor walks
// the keys of a block one by one, stepping to the next table entry when its
// row reaches page_size; the first key of each block comes from the previous
// block's by a fixed step (KG * 32 keys = step_entries pages + step_rows
// rows), both divided once before the loop. The table is read only on
// entering a page (one int, the same for every lane) and only for a key that
// is about to be read, so never past the sequence's last page.
#pragma once

#include "attention_features.h"

namespace flash_metal {

// A key's place in the cache: table entry, row inside its page, and the page.
struct PageCursor {
  int entry;  // index into the sequence's row of block_table
  int row;    // 0 .. page_size - 1
  int page;   // block_table[entry]: the page (cache block) holding the key
};

// The cursor of the key at (entry, row): reads the table entry.
inline PageCursor page_cursor(device const int* table, int entry, int row) {
  PageCursor c;
  c.entry = entry;
  c.row = row;
  c.page = table[entry];
  return c;
}

// The next key's cursor; reads the table only on entering a new page.
inline void page_next(thread PageCursor& c, device const int* table, int page_size) {
  if (++c.row == page_size) {
    c.row = 0;
    c.page = table[++c.entry];
  }
}

// Element offset, from the kv head's base, of the cursor's key row.
inline int64_t page_offset(thread const PageCursor& c, int64_t page_stride, int64_t row_stride) {
  return int64_t(c.page) * page_stride + int64_t(c.row) * row_stride;
}

// (entry, row) of the key `key` blocks advance by, and of a block's first
// key: integers only, no table read (the block may lie past the sequence).
struct PageStep {
  int entry;
  int row;
};

inline PageStep page_split(int key, int page_size) {
  PageStep s;
  s.entry = key / page_size;  // once per call, outside the block loop
  s.row = key - s.entry * page_size;
  return s;
}

// at + by, with at.row and by.row in [0, page_size): one carry at most.
inline PageStep page_add(PageStep at, PageStep by, int page_size) {
  at.entry += by.entry;
  at.row += by.row;
  if (at.row >= page_size) {
    at.row -= page_size;
    ++at.entry;
  }
  return at;
}

// The view of sequence `batch` under fc_paged: its own key count, the
// window bounds aligned to it.
inline SeqView paged_sequence_view(constant AttentionParams& p, device const int* cache_seqlens, uint batch) {
  SeqView s;
  s.q_row0 = 0;
  s.k_row0 = 0;
  s.q_len = p.q_len;
  s.kv_len = cache_seqlens[batch];
  return with_window_bounds(s, p);
}

}  // namespace flash_metal
