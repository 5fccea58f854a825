// Split decode on the CPU: the keys of one work item spread over several
// threads, each producing a partial output and lse, merged at the end.
//
// Why: a decode step (a few query rows) has one work item per (sequence, KV
// head): Llama-3-8B at batch 1 has 8 of them, so 16 threads left half the
// cores idle while the step, memory-bound, wanted every core's share of the
// bandwidth (issue 39, measured on the 16-core AMX Xeon: bfloat16 decode at
// 4k keys ran 0.77x of SDPA's speed). The same idea as split-KV "flash
// decoding" (Dao et al.) and our Metal split decode: each split sees a range
// of keys, writes O_s (normalised by its own sum) and lse_s, and
// out = sum_s exp(lse_s - lse) O_s with lse = log sum_s exp(lse_s).
//
// Splits cut an item's key range (the window's, after causal and the left
// bound) into runs of whole key blocks, so every block, mask and softcap is
// handled exactly as without splits; a sink joins split 0 only. The last
// split of an item to finish merges it (a per-item counter), so no second
// pass over the rows and no barrier. Extra memory: S x rows x D_v floats for
// decode-like calls only (rows = B x Hq x Nq): O(N) in the query count.
#pragma once

#include "common.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <vector>

namespace flash_metal {
namespace cpu {

// Fewest keys a split is given by the automatic rule: below this the merge
// and the per-item setup (Q load, one partial write) outweigh the keys' work.
constexpr int64_t kMinKeysPerSplit = 512;
constexpr int64_t kMaxKeySplits = 32;

// FLASH_METAL_CPU_KEY_SPLITS: unset or "0" = the automatic rule; n in
// [1, 32] forces n splits on decode-like calls (a test seam: 2 cores cannot
// reach the automatic rule's many-thread cases). A bad value is an error.
inline int64_t key_splits_override() {
  const char* e = std::getenv("FLASH_METAL_CPU_KEY_SPLITS");
  if (e == nullptr || *e == '\0') return 0;
  char* end = nullptr;
  const long v = std::strtol(e, &end, 10);
  TORCH_CHECK_VALUE(*end == '\0' && v >= 0 && v <= kMaxKeySplits,
                    "FLASH_METAL_CPU_KEY_SPLITS must be 0 (automatic) or a split count in [1, ", kMaxKeySplits,
                    "]; got '", e, "'");
  return v;
}

// Splits for a call with `items` work items of which each lane has exactly
// one (decode-like: q_items == 1). Automatic: enough splits that every
// thread has an item (items x S a multiple of the thread count where the
// keys allow), none shorter than kMinKeysPerSplit keys.
inline int64_t choose_key_splits(bool decode_like, int64_t items, int64_t threads, int64_t kv_len) {
  if (!decode_like) return 1;
  const int64_t forced = key_splits_override();
  if (forced > 0) return forced;
  if (items >= threads) return 1;
  const int64_t want = (threads + items - 1) / items;
  const int64_t most = std::max<int64_t>(1, std::min(kMaxKeySplits, kv_len / kMinKeysPerSplit));
  return std::min(want, most);
}

// One item's part in a split call.
struct KeySplit {
  int64_t splits = 1;                  // S
  int64_t s = 0;                       // this item's split, 0 .. S-1
  int64_t rows = 0;                    // R = B x Hq x q.size(2): rows of the partial buffers
  int64_t qdim = 0;                    // q.size(2) (varlen: the packed total)
  float* o = nullptr;                  // S x R x D_v partial outputs
  float* lse = nullptr;                // S x R partial lse (natural log; -inf: no key in the split)
  std::atomic<int64_t>* done = nullptr;  // this item's finished splits
};

// Narrows [*begin, *end) to split s's run of whole blocks (block keys each,
// counted from *begin). A split past the end gets an empty range.
inline void key_split_clip(const KeySplit& ks, int64_t block, int64_t* begin, int64_t* end) {
  const int64_t n = std::max<int64_t>(0, *end - *begin);
  const int64_t blocks = (n + block - 1) / block;
  const int64_t per = (blocks + ks.splits - 1) / ks.splits;
  const int64_t b0 = *begin + std::min(n, ks.s * per * block);
  const int64_t b1 = *begin + std::min(n, (ks.s + 1) * per * block);
  *begin = b0;
  *end = b1;
}

// The calls' buffers for S splits (empty when S == 1).
struct KeySplitBuffers {
  std::vector<float> o, lse;
  std::unique_ptr<std::atomic<int64_t>[]> done;
  KeySplitBuffers(int64_t splits, int64_t rows, int64_t dv, int64_t items) {
    if (splits <= 1) return;
    o.resize(splits * rows * dv);
    lse.resize(splits * rows);
    done.reset(new std::atomic<int64_t>[items]);
    for (int64_t i = 0; i < items; ++i) done[i].store(0, std::memory_order_relaxed);
  }
};

// Merges row `row` of every split into dst (stride od) and *lse_dst.
template <typename T>
void merge_key_split_row(const KeySplit& ks, int64_t row, int64_t dv, T* dst, int64_t od, float* lse_dst) {
  float m = kNegInf;
  for (int64_t s = 0; s < ks.splits; ++s) m = std::max(m, ks.lse[s * ks.rows + row]);
  if (m == kNegInf) {  // no split saw a key (nor a sink)
    for (int64_t d = 0; d < dv; ++d) dst[d * od] = static_cast<T>(0.0f);
    *lse_dst = m;
    return;
  }
  float acc[kMaxHeadDim];
  std::fill(acc, acc + dv, 0.0f);
  float w_sum = 0.0f;
  for (int64_t s = 0; s < ks.splits; ++s) {
    const float ls = ks.lse[s * ks.rows + row];
    if (ls == kNegInf) continue;
    const float w = std::exp(ls - m);
    w_sum += w;
    const float* src = ks.o + (s * ks.rows + row) * dv;
    for (int64_t d = 0; d < dv; ++d) acc[d] += w * src[d];
  }
  const float inv = 1.0f / w_sum;
  for (int64_t d = 0; d < dv; ++d) dst[d * od] = static_cast<T>(acc[d] * inv);
  *lse_dst = m + std::log(w_sum);
}


// The rows of one split item: columns c = 0 .. nrows-1 of its state are row
// q0 + c % nq of head h0 + c / nq in sequence bi; O's element d of column c
// sits at o[c * col_stride + d * d_stride] (row form: rows of D_v padded;
// column form: O^T, columns of kBlockQ).
struct KeySplitRows {
  int64_t bi, q0, h0, nq, nrows, q_heads, d_stride, col_stride;
};

// Writes this split's rows (O / den, lse = ln 2 (m + log2 l)); the split
// that finishes its item last merges all splits into out and lse.
template <typename T>
void write_key_split(const KeySplit& ks, const KeySplitRows& r, int64_t dv, const float* o, const float* m,
                     const float* l, const float* den, T* out, const int64_t* o_stride, float* lse,
                     const int64_t* lse_stride) {
  const auto row_id = [&](int64_t c) { return (r.bi * r.q_heads + r.h0 + c / r.nq) * ks.qdim + r.q0 + c % r.nq; };
  for (int64_t c = 0; c < r.nrows; ++c) {
    const int64_t row = row_id(c);
    float* dst = ks.o + (ks.s * ks.rows + row) * dv;
    const float* src = o + c * r.col_stride;
    if (l[c] > 0.0f && den[c] > 0.0f) {
      const float inv = 1.0f / den[c];
      for (int64_t d = 0; d < dv; ++d) dst[d] = src[d * r.d_stride] * inv;
      ks.lse[ks.s * ks.rows + row] = kLn2 * (m[c] + std::log2(l[c]));
    } else {
      std::fill(dst, dst + dv, 0.0f);
      ks.lse[ks.s * ks.rows + row] = kNegInf;
    }
  }
  // acq_rel: the last split sees every other split's rows.
  if (ks.done->fetch_add(1, std::memory_order_acq_rel) + 1 != ks.splits) return;
  for (int64_t c = 0; c < r.nrows; ++c) {
    const int64_t h = r.h0 + c / r.nq, i = r.q0 + c % r.nq;
    T* dst = out + r.bi * o_stride[0] + h * o_stride[1] + i * o_stride[2];
    float* lrow = lse + r.bi * lse_stride[0] + h * lse_stride[1] + i * lse_stride[2];
    merge_key_split_row(ks, row_id(c), dv, dst, o_stride[3], lrow);
  }
}

}  // namespace cpu
}  // namespace flash_metal
