// The post's second kernel, generalized: still one query row per thread, but
// the threads of a group stage each tile of keys and values in threadgroup
// memory first, cooperatively, and then all read it from there. Each K/V
// element is fetched from device memory once per group instead of once per
// query.
#pragma once

#include "../common/attention_common.h"

namespace flash_metal {

// T: element type of q, k, v and the output (float, half or bfloat).
// DMAX: head_dim bucket; sizes the per-thread query row and accumulator
// (head_dim <= DMAX), the tile rows, and bounds every loop over a row.
// BK: keys per tile. THREADS: threads per group (= query rows per group).
// smem: dynamic threadgroup memory, sized by the host (csrc/metal/plan_detail.h):
// the K tile then the V tile, each BK rows of DMAX elements of T.
//
// Tiles in T, not float: the tiles are the kernel's only threadgroup memory,
// so half and bfloat inputs need half of it (2 * 16 * DMAX * 2 bytes), which
// leaves room for more resident threadgroups per core; each element becomes
// float when read, exactly (T -> float is exact), so results do not change.
// Rows padded to DMAX: the inner loops run to the compile-time DMAX with
// constant offsets into qrow, acc and the tile row (see "Registers, not
// stack" in attention_common.h), and read the padding columns without a
// bounds test. Those columns must hold zeros (threadgroup memory starts as
// garbage; the emulator fills it with NaN, and 0 * NaN is NaN), so they are
// zeroed once, before the first tile; the loads never touch them after that.
template <typename T, int DMAX, int BK, int THREADS>
[[kernel]] [[max_total_threads_per_threadgroup(kPostMaxThreads)]] void flash_attention_tiled(
    device const T* q [[buffer(0)]],
    device const T* k [[buffer(1)]],
    device const T* v [[buffer(2)]],
    device T* o [[buffer(3)]],
    device float* lse [[buffer(4)]],
    constant AttentionParams& p [[buffer(5)]],
    threadgroup T* smem [[threadgroup(0)]],
    uint3 group [[threadgroup_position_in_grid]],
    uint lane [[thread_index_in_threadgroup]]) {
  static_assert(THREADS <= kPostMaxThreads, "the declared threadgroup limit (params.h)");
  const int D = p.head_dim;
  const int first_row = int(group.x) * THREADS;
  const int row = first_row + int(lane);
  // Threads past the last query keep running: they help load every tile and
  // must reach every barrier. They only skip the math and the final store.
  const bool has_row = row < p.q_len;
  const HeadOffsets h = head_offsets(p, group.z, group.y);
  threadgroup T* k_tile = smem;
  threadgroup T* v_tile = smem + BK * DMAX;

  // Zero the padding columns [D, DMAX) of both tiles, once. No barrier of its
  // own: the first tile's barrier below orders these writes before any read,
  // and no load ever writes these columns.
  for (int i = int(lane); i < BK * DMAX; i += THREADS) {
    if (i % DMAX >= D) {
      k_tile[i] = T(0.0f);
      v_tile[i] = T(0.0f);
    }
  }

  float qrow[DMAX];
  float acc[DMAX];
  if (has_row) load_query_row<DMAX>(q, p, h, row, qrow, acc);

  OnlineSoftmax sm;  // "no key yet"
  const int my_keys = has_row ? visible_keys(p, row) : 0;
  // Early stop under causal masking: the group walks only as far as its
  // last row can see. Every thread computes the same bound, so all threads
  // take the same number of trips and meet at the same barriers.
  const int last_row = min(first_row + THREADS, p.q_len) - 1;
  const int group_keys = visible_keys(p, last_row);

  for (int start = 0; start < group_keys; start += BK) {
    // Cooperative load of the head_dim real columns: thread `lane` fetches
    // elements lane, lane + THREADS, ... Keys past the end are zero-filled;
    // no row ever reads them.
    for (int i = int(lane); i < BK * D; i += THREADS) {
      const int r = i / D;
      const int c = i % D;
      const int key = start + r;
      const bool in_range = key < p.kv_len;
      k_tile[r * DMAX + c] = in_range ? k[h.k + int64_t(key) * p.k_row_stride + int64_t(c) * p.k_dim_stride] : T(0.0f);
      v_tile[r * DMAX + c] = in_range ? v[h.v + int64_t(key) * p.v_row_stride + int64_t(c) * p.v_dim_stride] : T(0.0f);
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);  // tile written before anyone reads it (RAW)

    const int n = min(BK, my_keys - start);  // keys of this tile this row may see (<= 0: none)
    for (int j = 0; j < n; ++j) {
      threadgroup const T* kj = k_tile + j * DMAX;
      threadgroup const T* vj = v_tile + j * DMAX;
      float score = 0.0f;
      FM_UNROLL for (int c = 0; c < DMAX; ++c) score += qrow[c] * float(kj[c]);
      float w;
      const float alpha = sm.update(score, &w);
      FM_UNROLL for (int c = 0; c < DMAX; ++c) acc[c] = acc[c] * alpha + w * float(vj[c]);
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);  // everyone done reading before the next load (WAR)
  }

  if (!has_row) return;  // after the last barrier: safe
  store_output_row<DMAX>(o, lse, p, h, row, acc, sm);
}

}  // namespace flash_metal
